"""The Keras entry points check their arguments with the shared validation module: the same
error type for the same mistake as in PyTorch (``tests/test_validation.py``), the argument named,
NumPy scalars accepted and normalised — on every backend.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from gradient_accumulator.accumulators import GradientAccumulateModel as OriginalModelName
from gradient_accumulator.keras import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    adaptive_clip_grad,
    replace_batchnorm_layers,
)

BAD_COUNTS = [
    ("4", TypeError),
    (4.0, TypeError),
    (True, TypeError),
    (None, TypeError),
    (np.float32(4), TypeError),
    (0, ValueError),
    (-3, ValueError),
    (2**31, ValueError),
    (10**12, ValueError),
]
BAD_POSITIVE = [
    ("1", TypeError),
    (True, TypeError),
    (0.0, ValueError),
    (-1.0, ValueError),
    (math.nan, ValueError),
    (math.inf, ValueError),
]


def _model(cls=GradientAccumulateModel, **kwargs):
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(keras.layers.BatchNormalization()(inputs))
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def _replace(n):
    inputs = keras.Input((3,))
    outputs = keras.layers.BatchNormalization()(inputs)
    return replace_batchnorm_layers(keras.Model(inputs, outputs), accum_steps=n)


COUNT_SITES = {
    "GradientAccumulateOptimizer": lambda n: GradientAccumulateOptimizer("SGD", accum_steps=n),
    "GradientAccumulateModel": lambda n: _model(accum_steps=n),
    "accumulators.GradientAccumulateModel": lambda n: _model(OriginalModelName, accum_steps=n),
    "AccumBatchNormalization": lambda n: AccumBatchNormalization(accum_steps=n),
    "replace_batchnorm_layers": _replace,
}


@pytest.mark.parametrize("site", list(COUNT_SITES))
@pytest.mark.parametrize(("value", "error"), BAD_COUNTS)
def test_accum_steps_same_error_everywhere(site, value, error):
    with pytest.raises(error, match="accum_steps"):
        COUNT_SITES[site](value)


@pytest.mark.parametrize(
    "site", ["GradientAccumulateOptimizer", "GradientAccumulateModel", "AccumBatchNormalization"]
)
def test_numpy_integer_accum_steps_is_an_int(site):
    made = COUNT_SITES[site](np.int64(4))
    assert type(made.accum_steps) is int and made.accum_steps == 4


@pytest.mark.parametrize(("value", "error"), BAD_POSITIVE)
def test_agc_arguments(value, error):
    with pytest.raises(error, match="clip_factor"):
        GradientAccumulateOptimizer("SGD", 2, use_agc=True, clip_factor=value)
    with pytest.raises(error, match="clip_factor"):
        _model(accum_steps=2, use_agc=True, clip_factor=value)
    w, g = keras.ops.ones((2, 2)), keras.ops.ones((2, 2))
    with pytest.raises(error, match="clip_factor"):
        adaptive_clip_grad([w], [g], clip_factor=value)
    if not (isinstance(value, float) and value == 0.0):  # eps may be 0
        with pytest.raises(error, match="eps"):
            GradientAccumulateOptimizer("SGD", 2, use_agc=True, eps=value)


def test_choices_and_bools():
    opt = GradientAccumulateOptimizer("SGD", 2, reduction="running_mean", leftover="CARRY")
    assert (opt.reduction, opt.leftover) == ("RUNNING_MEAN", "carry")
    with pytest.raises(ValueError, match="reduction"):
        GradientAccumulateOptimizer("SGD", 2, reduction="median")
    with pytest.raises(TypeError, match="reduction"):
        GradientAccumulateOptimizer("SGD", 2, reduction=None)
    with pytest.raises(TypeError, match="mixed_precision"):
        GradientAccumulateOptimizer("SGD", 2, mixed_precision="yes")
    with pytest.raises(TypeError, match="use_agc"):
        _model(accum_steps=2, use_agc=2)
    assert GradientAccumulateOptimizer("SGD", 2, use_agc=np.bool_(True)).use_agc is True
    with pytest.raises(ValueError, match="initial_scale"):
        GradientAccumulateOptimizer("SGD", 2, initial_scale=-1.0)
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
        GradientAccumulateOptimizer("SGD", 2, dynamic_growth_steps=0)


def test_counter_names_its_argument_and_returns_the_cycle_variable():
    """``counter(name)`` (what the model wrapper and callbacks use to reach the cycle's
    variables): an unknown name or an unbuilt optimizer is a ValueError; a known name is the
    very variable among ``variables`` that a micro-step moves (on JAX, an element of one of
    them: the scalars are packed), and ``reset_cycle`` zeroes it."""
    opt = GradientAccumulateOptimizer("SGD", 3)
    with pytest.raises(ValueError, match="not built"):
        opt.counter("micro_step")
    w = keras.Variable(np.ones((2,), "float32"))
    opt.build([w])
    with pytest.raises(ValueError, match="name must be one of"):
        opt.counter("micro_steps")
    step = opt.counter("micro_step")
    assert any(v is getattr(step, "packed", step) for v in opt.variables)
    opt.counter("batch_weight").assign(4.0)
    opt.apply([keras.ops.ones((2,))], [w])
    assert int(keras.ops.convert_to_numpy(step)) == 1
    assert float(keras.ops.convert_to_numpy(opt.counter("total_weight"))) == 4.0
    opt.reset_cycle()
    assert opt.pending() == 0
    assert float(keras.ops.convert_to_numpy(opt.counter("total_weight"))) == 0.0
