"""One check per kind of argument, the same error for the same mistake in every entry point.

``gradient_accumulator._validation`` is checked directly, then table-driven through every PyTorch
entry point that takes such an argument (the Keras ones are in
``tests/keras/test_keras_validation.py``, run once per backend): a wrong type is always a
``TypeError``, a value out of range always a ``ValueError``, the message names the argument, and
NumPy scalars are accepted and normalised to Python numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradient_accumulator import _validation as v

BAD_COUNTS = [
    ("4", TypeError),
    (4.0, TypeError),
    (True, TypeError),
    (None, TypeError),
    (np.float32(4), TypeError),
    (0, ValueError),
    (-3, ValueError),
    (np.int64(0), ValueError),
    (2**31, ValueError),
    (10**12, ValueError),
]
GOOD_COUNTS = [1, 4, np.int64(4), np.int32(7), np.uint8(3), 2**31 - 1]
BAD_POSITIVE = [
    ("1", TypeError),
    (None, TypeError),
    (True, TypeError),
    (0.0, ValueError),
    (-1.0, ValueError),
    (math.nan, ValueError),
    (math.inf, ValueError),
    (np.float32("nan"), ValueError),
    (np.float64(-2), ValueError),
]


@pytest.mark.parametrize(("value", "error"), BAD_COUNTS)
def test_accum_steps_refused_with_one_error_per_mistake(value, error):
    with pytest.raises(error, match="accum_steps"):
        v.check_accum_steps(value)


@pytest.mark.parametrize("value", GOOD_COUNTS)
def test_accum_steps_accepts_any_integral_number_and_returns_int(value):
    out = v.check_accum_steps(value)
    assert type(out) is int and out == int(value)


@pytest.mark.parametrize(("value", "error"), BAD_POSITIVE)
def test_positive_reals(value, error):
    with pytest.raises(error, match="max_grad_norm"):
        v.check_positive(value, "max_grad_norm")


def test_positive_reals_accept_numpy_and_zero_when_allowed():
    assert v.check_positive(np.float32(0.5), "x") == 0.5
    assert type(v.check_positive(np.int64(2), "x")) is float
    assert v.check_positive(0, "eps", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match="eps"):
        v.check_positive(0, "eps")


@pytest.mark.parametrize(
    ("value", "error"), [(1.0, TypeError), ("yes", TypeError), (2, TypeError), (None, TypeError)]
)
def test_bools(value, error):
    with pytest.raises(error, match="use_agc"):
        v.check_bool(value, "use_agc")
    assert v.check_bool(np.bool_(True), "use_agc") is True and v.check_bool(0, "x") is False


def test_choices_any_case_returned_as_spelled():
    assert v.check_choice("RUNNING_mean", "reduction", ("mean", "running_mean")) == "running_mean"
    assert v.check_choice("mean", "reduction", ("MEAN", "SUM")) == "MEAN"
    with pytest.raises(ValueError, match="reduction"):
        v.check_choice("median", "reduction", ("mean",))
    with pytest.raises(TypeError, match="reduction"):
        v.check_choice(None, "reduction", ("mean",))


# ----------------------------------------------------------------------------- PyTorch entry points

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    AccumBatchNorm2d,
    AccumBatchNorm3d,
    GradientAccumulateOptimizer,
    adaptive_clip_grad,
    convert_batchnorm,
)


def _opt(**kwargs):
    model = nn.Linear(3, 2)
    kwargs.setdefault("accum_steps", 2)
    return GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


COUNT_SITES = {
    "GradientAccumulateOptimizer": lambda n: _opt(accum_steps=n),
    "convert_batchnorm": lambda n: convert_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), n),
    "AccumBatchNorm1d": lambda n: AccumBatchNorm1d(2, accum_steps=n),
    "AccumBatchNorm2d": lambda n: AccumBatchNorm2d(2, accum_steps=n),
    "AccumBatchNorm3d": lambda n: AccumBatchNorm3d(2, accum_steps=n),
}


@pytest.mark.parametrize("site", list(COUNT_SITES))
@pytest.mark.parametrize(("value", "error"), BAD_COUNTS)
def test_torch_accum_steps_same_error_everywhere(site, value, error):
    with pytest.raises(error, match="accum_steps"):
        COUNT_SITES[site](value)


@pytest.mark.parametrize("site", list(COUNT_SITES))
def test_torch_accum_steps_numpy_integer_is_an_int(site):
    made = COUNT_SITES[site](np.int64(4))
    layer = made[0] if isinstance(made, nn.Sequential) else made
    assert type(layer.accum_steps) is int and layer.accum_steps == 4


REAL_SITES = {
    "max_grad_norm": lambda x: _opt(max_grad_norm=x),
    "clip_factor": lambda x: _opt(use_agc=True, clip_factor=x),
    "bucket_cap_mb": lambda x: _opt(bucket_cap_mb=x),
    "reduce_timeout": lambda x: _opt(reduce_timeout=x),
}


@pytest.mark.parametrize("name", list(REAL_SITES))
@pytest.mark.parametrize(("value", "error"), BAD_POSITIVE)
def test_torch_positive_reals_same_error_everywhere(name, value, error):
    if value is None and name in ("max_grad_norm", "reduce_timeout"):
        REAL_SITES[name](value)  # None switches them off
        return
    with pytest.raises(error, match=name):
        REAL_SITES[name](value)


@pytest.mark.parametrize(
    ("value", "error"),
    [("x", TypeError), (-0.5, ValueError), (math.inf, ValueError), (True, TypeError)],
)
def test_torch_agc_eps_and_step_weight(value, error):
    with pytest.raises(error, match="eps"):
        _opt(use_agc=True, eps=value)
    p = nn.Parameter(torch.ones(2, 2))
    p.grad = torch.ones(2, 2)
    with pytest.raises(error, match="eps"):
        adaptive_clip_grad([p], eps=value)
    opt = _opt()
    with pytest.raises(error, match="weight"):
        opt.step(weight=value)
    assert opt.micro_step == 0  # refused before anything was counted


def test_torch_reduction_and_leftover_any_case():
    opt = _opt(reduction="RUNNING_MEAN", leftover="Carry")
    assert (opt.reduction, opt.leftover) == ("running_mean", "carry")
    with pytest.raises(ValueError, match="reduction"):
        _opt(reduction="median")
    with pytest.raises(TypeError, match="leftover"):
        _opt(leftover=1)
    with pytest.raises(TypeError, match="use_agc"):
        _opt(use_agc="yes")
    assert _opt(max_grad_norm=np.float32(1.5)).max_grad_norm == 1.5
