"""The wrapper's options changed between cycles take effect on the next call.

``accum_steps`` and ``on_nonfinite`` are plain attributes a user (or a callback) may set after
training started; the PyTorch backend's eager engine used to copy them at its first call, so a
changed ``accum_steps`` kept the old cycle length and a switch to ``on_nonfinite="skip"`` still
applied an inf cycle. Eager ``apply`` calls, so that every backend reads them afresh.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
from keras import ops

from gradient_accumulator import NonFiniteGradientWarning
from gradient_accumulator.keras import GradientAccumulateOptimizer


def _setup(**kwargs):
    v = keras.Variable(np.zeros(2, "float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=2, **kwargs)
    opt.build([v])
    return opt, v


def test_accum_steps_changed_between_cycles():
    """Cycle 1 of 2 micro-steps, then accum_steps=4: two more micro-steps leave the update
    pending; the 4th applies the mean of all four (gradients 1, 1, 3, 5: mean 2.5)."""
    opt, v = _setup()
    for g in (1.0, 1.0):
        opt.apply([ops.full((2,), g)], [v])
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-1.0, -1.0])
    opt.accum_steps = 4
    for g in (1.0, 1.0):
        opt.apply([ops.full((2,), g)], [v])
    assert opt.pending() == 2
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-1.0, -1.0])
    for g in (3.0, 5.0):
        opt.apply([ops.full((2,), g)], [v])
    assert opt.pending() == 0
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-3.5, -3.5])


def test_on_nonfinite_changed_between_cycles():
    """A clean cycle under "apply", then "skip": an inf cycle is dropped (the weights stay
    finite and where they were) and reported."""
    opt, v = _setup(on_nonfinite="apply")
    for g in (1.0, 3.0):
        opt.apply([ops.full((2,), g)], [v])
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-2.0, -2.0])
    opt.on_nonfinite = "skip"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NonFiniteGradientWarning)
        opt.apply([ops.full((2,), np.inf)], [v])
        opt.apply([ops.full((2,), 1.0)], [v])
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-2.0, -2.0])
    assert opt.nonfinite_skipped == 1
    assert any(issubclass(w.category, NonFiniteGradientWarning) for w in caught)


def test_use_agc_turned_off_between_cycles():
    """Cycle 1 with AGC (λ = 0.01 clips these gradients hard), then use_agc=False: cycle 2 is
    plain SGD on the mean gradient, exactly (the torch backend's core path kept clipping)."""
    w0 = np.array([[1.0, -2.0], [0.5, 3.0]], "float32")
    v = keras.Variable(w0)
    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(1.0), accum_steps=2, use_agc=True, clip_factor=0.01, agc_exclude=None
    )
    opt.build([v])
    g1, g2 = np.full((2, 2), 4.0, "float32"), np.full((2, 2), 2.0, "float32")
    for g in (g1, g2):
        opt.apply([ops.convert_to_tensor(g)], [v])
    after_1 = ops.convert_to_numpy(v).copy()
    assert np.abs(after_1 - (w0 - 3.0)).max() > 1.0  # clipped: far from the plain step
    opt.use_agc = False
    for g in (g1, g2):
        opt.apply([ops.convert_to_tensor(g)], [v])
    np.testing.assert_allclose(ops.convert_to_numpy(v), after_1 - 3.0, rtol=1e-6, atol=1e-6)
