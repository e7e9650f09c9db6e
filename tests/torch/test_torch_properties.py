"""The PyTorch wrapper's settings and read-outs are plain properties of its class."""

from __future__ import annotations

import pytest
import torch

from gradient_accumulator.torch import GradientAccumulateOptimizer

READ_OUTS = ("update_applied", "last_grad_norm", "micro_step", "collectives", "num_buckets")
SETTINGS = {
    "accum_steps": 3,
    "reduction": "sum",
    "max_grad_norm": 2.0,
    "clip_factor": 0.02,
    "eps": 1e-4,
    "leftover": "carry",
    "on_nonfinite": "raise",
}


def _wrapper() -> GradientAccumulateOptimizer:
    model = torch.nn.Linear(2, 1)
    return GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)


def test_properties_are_written_out_not_built_from_paths():
    """Each property's getter is a function of the class itself (refactoring tools follow
    it), not one made by a factory from a string path."""
    props = {n: v for n, v in vars(GradientAccumulateOptimizer).items() if isinstance(v, property)}
    assert set(READ_OUTS) | set(SETTINGS) <= set(props)
    made = [n for n, p in props.items() if "<locals>" in p.fget.__qualname__]
    assert made == [n for n in ("param_groups", "state", "defaults") if n in props]


def test_read_outs_cannot_be_assigned():
    opt = _wrapper()
    for name in READ_OUTS:
        with pytest.raises(AttributeError):
            setattr(opt, name, getattr(opt, name))


def test_settings_round_trip_and_reach_the_cycle():
    opt = _wrapper()
    for name, value in SETTINGS.items():
        setattr(opt, name, value)
        assert getattr(opt, name) == value
    assert opt._loop.cycle.accum_steps == 3 and opt._loop.cycle.reduction == "sum"
    opt.max_grad_norm = None
    opt.use_agc = True
    assert opt.use_agc and opt.max_grad_norm is None
    with pytest.raises(ValueError, match="exclusive"):
        opt.max_grad_norm = 1.0
    with pytest.raises(ValueError, match="accum_steps"):
        opt.accum_steps = 0
    assert opt.accum_steps == 3
