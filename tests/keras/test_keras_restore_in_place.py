"""A mid-cycle state written back into the *same* wrapper takes effect.

``model.load_weights`` or an assignment to ``optimizer.variables`` restores a checkpoint into
the wrapper that is already training. On the PyTorch backend the eager engine keeps the cycle's
position in Python and mirrors it into the wrapper's variables; it must notice that someone
else wrote them (a restore, ``fit`` resetting the cycle) and take their values, or it would go
on from where it was before the restore. The reference is the same run without the detour.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from gradient_accumulator.keras import GradientAccumulateOptimizer


def _grads(n, seed):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(3, 2)).astype("float32"), rng.normal(size=(2,)).astype("float32"))
        for _ in range(n)
    ]


def _setup(inner):
    opt = GradientAccumulateOptimizer(inner, accum_steps=4)
    w = keras.Variable(np.arange(6, dtype="float32").reshape(3, 2) / 10, name="w")
    b = keras.Variable(np.ones(2, "float32"), name="b")
    opt.build([w, b])
    return opt, [w, b]


def _step(opt, variables, g, weight=None):
    if weight is not None:
        opt._batch_weight.assign(weight)
    opt.apply([ops.convert_to_tensor(x) for x in g], variables)


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_a_restore_mid_cycle_into_the_same_wrapper_takes_effect(inner):
    """Checkpoint after 2 micro-steps (weights 3, 5), run 3 more (the cycle's boundary among
    them), restore the checkpoint into the same wrapper and variables, and run the same 3
    again: the weights must equal a run that never took the detour (rtol 1e-6)."""

    def make():
        if inner == "sgd":
            return keras.optimizers.SGD(0.1)
        return keras.optimizers.Adam(0.01)

    grads = _grads(5, seed=1)
    detour = _grads(3, seed=2)
    weights = [3.0, 5.0, 2.0, 7.0, 1.0]

    ref, ref_vars = _setup(make())
    for g, w in zip(grads, weights):
        _step(ref, ref_vars, g, w)

    opt, variables = _setup(make())
    for g, w in zip(grads[:2], weights[:2]):
        _step(opt, variables, g, w)
    saved_opt = [np.array(ops.convert_to_numpy(v)) for v in opt.variables]
    saved_model = [np.array(ops.convert_to_numpy(v)) for v in variables]
    for g, w in zip(detour, [4.0, 4.0, 4.0]):
        _step(opt, variables, g, w)
    assert int(ops.convert_to_numpy(opt.inner_optimizer.iterations)) == 1  # the detour updated
    for v, value in zip(opt.variables, saved_opt):
        v.assign(value)
    for v, value in zip(variables, saved_model):
        v.assign(value)
    for g, w in zip(grads[2:], weights[2:]):
        _step(opt, variables, g, w)

    for ours, theirs in zip(variables, ref_vars):
        np.testing.assert_allclose(
            ops.convert_to_numpy(ours), ops.convert_to_numpy(theirs), rtol=1e-6, atol=1e-7
        )
    assert int(ops.convert_to_numpy(opt.inner_optimizer.iterations)) == 1
    assert opt.pending() == 1
