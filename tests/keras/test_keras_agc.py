"""Adaptive gradient clipping: the original's rank rules, the clip itself against NumPy, and the
choice of excluded variables in the wrappers."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops
from keras_helpers import BACKEND, data, flat, make_inner, mlp, rel_diff

from gradient_accumulator.keras import (
    GradientAccumulateOptimizer,
    adaptive_clip_grad,
    compute_norm,
    unitwise_norm,
)

SHAPES = [(), (5,), (4, 3), (3, 4, 2), (3, 3, 2, 4), (2, 3, 3, 2, 4)]
AXES = {0: None, 1: None, 2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def _np_unitwise(x):
    axes = AXES[x.ndim]
    if axes is None:
        return np.sqrt(np.sum(x.astype(np.float64) ** 2))
    return np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=axes, keepdims=True))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"rank{len(s)}")
def test_unitwise_norm_rank_rules(shape):
    """The original's test_unitwise_norm, with values: rank ≤ 1 whole tensor, 2–3 axis 0,
    4 axes 0–2, 5 axes 0–3 (keepdims)."""
    x = np.random.default_rng(len(shape)).normal(size=shape).astype("float32")
    got = np.asarray(ops.convert_to_numpy(unitwise_norm(ops.convert_to_tensor(x))))
    ref = _np_unitwise(x)
    assert got.shape == np.shape(ref)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_unitwise_norm_rank6_raises():
    with pytest.raises(ValueError, match="rank"):
        unitwise_norm(ops.zeros((1, 1, 1, 1, 1, 1)))


def test_compute_norm():
    x = ops.convert_to_tensor(np.array([[3.0, 4.0], [6.0, 8.0]], "float32"))
    np.testing.assert_allclose(ops.convert_to_numpy(compute_norm(x, 1, False)), [5.0, 10.0])


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: f"rank{len(s)}")
def test_adaptive_clip_grad_matches_numpy(shape):
    rng = np.random.default_rng(10 + len(shape))
    w = rng.normal(size=shape).astype("float32")
    g = (rng.normal(size=shape) * rng.choice([0.001, 10.0], size=shape)).astype("float32")
    (got,) = adaptive_clip_grad(
        [ops.convert_to_tensor(w)], [ops.convert_to_tensor(g)], clip_factor=0.05, eps=1e-3
    )
    max_norm = np.maximum(_np_unitwise(w), 1e-3) * 0.05
    g_norm = _np_unitwise(g)
    ref = np.where(g_norm < max_norm, g, g * max_norm / np.maximum(g_norm, 1e-6))
    np.testing.assert_allclose(ops.convert_to_numpy(got), ref, rtol=1e-5, atol=1e-7)
    assert not np.allclose(ref, g)  # some unit was clipped


def test_adaptive_clip_grad_errors():
    with pytest.raises(ValueError, match="same length"):
        adaptive_clip_grad([ops.ones(2)], [])
    with pytest.raises(ValueError, match="clip_factor"):
        adaptive_clip_grad([ops.ones(2)], [ops.ones(2)], clip_factor=0.0)
    with pytest.raises(TypeError, match="eps"):
        adaptive_clip_grad([ops.ones(2)], [ops.ones(2)], eps=None)


def _train(agc_exclude, use_core=None):
    x, y = data(32)
    inputs, outputs = mlp()
    model = keras.Model(inputs, outputs)
    opt = GradientAccumulateOptimizer(
        make_inner("SGD"), accum_steps=2, use_agc=True, agc_exclude=agc_exclude, use_core=use_core
    )
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def test_agc_exclusions():
    """ "final" leaves the last Dense alone; a layer or a pattern picks it the same way."""
    final = _train("final")
    assert final.optimizer._agc_mask == [True, True, False, False]
    everything = _train(None)
    assert everything.optimizer._agc_mask == [True, True, True, True]
    assert rel_diff(flat(everything), flat(final)) > 1e-4
    by_pattern = _train([r"dense_\d+/(kernel|bias)$"])
    # The pattern matches both Dense layers' paths: nothing clipped by AGC at all.
    assert by_pattern.optimizer._agc_mask == [False, False, False, False]
    last_layer = keras.Model(*mlp()).layers[-1]
    assert last_layer.name  # the layer form is resolved by identity on its weights
    inputs, outputs = mlp()
    model = keras.Model(inputs, outputs)
    opt = GradientAccumulateOptimizer(
        "sgd", accum_steps=2, use_agc=True, agc_exclude=[model.layers[-1]]
    )
    opt.build(model.trainable_variables)
    assert opt._agc_mask == [True, True, False, False]


@pytest.mark.parametrize("use_core", [None, False])
def test_use_agc_switched_on_after_build(use_core):
    """AGC switched on after the build clips as if it had been on from the start (the mask of
    clipped variables was built empty when AGC was off at the build, and AGC did nothing)."""
    x, y = data(32)

    def run(at_build, after_build):
        inputs, outputs = mlp()
        model = keras.Model(inputs, outputs)
        opt = GradientAccumulateOptimizer(
            make_inner("SGD"), accum_steps=2, use_agc=at_build, use_core=use_core
        )
        opt.build(model.trainable_variables)
        opt.use_agc = after_build
        model.compile(opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return flat(model)

    on_from_start = run(True, True)
    assert rel_diff(run(False, True), on_from_start) <= 1e-7
    assert rel_diff(run(False, False), on_from_start) > 1e-4  # AGC changed the weights


@pytest.mark.skipif(BACKEND != "torch", reason="the C++ core path exists on the torch backend")
def test_core_and_ops_agc_agree():
    assert (
        rel_diff(flat(_train("final", use_core=True)), flat(_train("final", use_core=False)))
        <= 1e-6
    )
