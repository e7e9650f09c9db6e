"""The options record both wrappers share (gradient_accumulator._options)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from gradient_accumulator._options import (
    EXCLUSIVE_CLIPPING,
    Options,
    check_agc_exclude,
    keras_reduction,
)


def test_fields_normalised():
    o = Options(accum_steps=4, reduction="Running_Mean", leftover="CARRY", use_agc=1)
    assert (o.accum_steps, o.reduction, o.leftover, o.use_agc) == (4, "running_mean", "carry", True)
    assert keras_reduction(o.reduction) == "RUNNING_MEAN"


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"accum_steps": 0}, ValueError, "accum_steps must be >= 1, got 0"),
        ({"reduction": "bogus"}, ValueError, "reduction must be one of"),
        ({"clip_factor": -1.0}, ValueError, "clip_factor must be finite and > 0, got -1.0"),
        ({"eps": float("inf")}, ValueError, "eps must be finite and >= 0"),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be finite and > 0"),
        ({"on_nonfinite": "ignore"}, ValueError, "on_nonfinite must be one of"),
        ({"dynamic_growth_steps": 1.5}, TypeError, "dynamic_growth_steps must be an int"),
        ({"use_agc": True, "max_grad_norm": 1.0}, ValueError, EXCLUSIVE_CLIPPING),
        ({"gradient_as_view": True, "reduction": "running_mean"}, ValueError, "gradient_as_view"),
        ({"accum_step": 2}, TypeError, "unknown option"),
    ],
)
def test_bad_replace_refused_record_unchanged(changes, error, message):
    o = Options(accum_steps=2, clip_factor=0.5)
    before = dataclasses.astuple(o)
    with pytest.raises(error, match=message):
        o.replace(**changes)
    assert dataclasses.astuple(o) == before


def test_rule_checked_against_current_settings():
    """max_grad_norm set, then use_agc: refused (and the other way round)."""
    with pytest.raises(ValueError, match="exclusive"):
        Options(max_grad_norm=1.0).replace(use_agc=True)
    with pytest.raises(ValueError, match="exclusive"):
        Options(use_agc=True).replace(max_grad_norm=1.0)
    assert Options(use_agc=True).replace(use_agc=False, max_grad_norm=1.0).max_grad_norm == 1.0


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().accum_steps = 3  # type: ignore[misc]


def test_agc_exclude():
    assert check_agc_exclude("final") == "final"
    assert check_agc_exclude("dense.*") == ("dense.*",)
    assert check_agc_exclude(None) is None
    with pytest.raises(TypeError, match="agc_exclude"):
        check_agc_exclude(3)


def test_imports_no_framework():
    code = (
        "import sys, gradient_accumulator._options; "
        "print([m for m in ('torch', 'keras', 'tensorflow', 'jax') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
