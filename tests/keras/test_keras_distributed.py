"""Data-parallel training on two devices gives the single-device big-batch weights.

TensorFlow: ``tf.distribute.MirroredStrategy`` over two logical CPUs; each replica accumulates
its own gradients (replica-local accumulators) and they are all-reduced once per cycle.
JAX: ``keras.distribution.DataParallel`` over two host devices (the original's
test_model_distribute and test_distributed_optimizer_invariance, with weight assertions).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND, TOL, data, flat, make_inner, mirrored, mlp, rel_diff

from gradient_accumulator.keras import GradientAccumulateModel, GradientAccumulateOptimizer
from gradient_accumulator.nonfinite import NonFiniteGradientWarning

if BACKEND == "torch":
    pytest.skip(
        "Keras has no multi-device distribution on the torch backend", allow_module_level=True
    )

ACCUM, MICRO = 4, 4


def _reference(name, use_agc):
    x, y = data()
    inputs, outputs = mlp()
    model = keras.Model(inputs, outputs)
    opt = GradientAccumulateOptimizer(make_inner(name), accum_steps=1, use_agc=use_agc)
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=ACCUM * MICRO, epochs=2, shuffle=False, verbose=0)
    return flat(model)


def _build(wrapper, name, use_agc):
    inputs, outputs = mlp()
    if wrapper == "model":
        model = GradientAccumulateModel(
            accum_steps=ACCUM, use_agc=use_agc, inputs=inputs, outputs=outputs
        )
        model.compile(make_inner(name), loss="mse")
    else:
        model = keras.Model(inputs, outputs)
        model.compile(
            GradientAccumulateOptimizer(make_inner(name), accum_steps=ACCUM, use_agc=use_agc),
            loss="mse",
        )
    return model


def _scope():
    if BACKEND == "tensorflow":
        strategy = mirrored(2)
        return strategy, strategy.scope()
    import contextlib

    import jax

    devices = jax.devices()
    assert len(devices) == 2
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    return None, contextlib.nullcontext()


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_two_replicas_global_clipnorm_matches_keras_on_the_big_batch(name):
    """The wrapper's global_clipnorm clips the cycle's gradient summed over the replicas: Keras's
    own global_clipnorm on the big batch, one device."""
    if BACKEND != "tensorflow":
        pytest.skip("the replicas' reduction at the boundary is tf.distribute's")
    clip = 0.05  # below the gradients' global norm: every update is clipped
    x, y = data()

    def big_batch(global_clipnorm):
        inputs, outputs = mlp()
        model = keras.Model(inputs, outputs)
        inner = make_inner(name)
        inner.global_clipnorm = global_clipnorm  # Keras's own clipping
        model.compile(inner, loss="mse")
        model.fit(x, y, batch_size=ACCUM * MICRO, epochs=2, shuffle=False, verbose=0)
        return flat(model)

    ref = big_batch(clip)
    assert rel_diff(big_batch(None), ref) > 100 * TOL  # the clipping changes the result
    _, scope = _scope()
    with scope:
        inputs, outputs = mlp()
        model = keras.Model(inputs, outputs)
        model.compile(
            GradientAccumulateOptimizer(make_inner(name), accum_steps=ACCUM, global_clipnorm=clip),
            loss="mse",
        )
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(flat(model), ref) <= TOL
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 8


@pytest.mark.parametrize("use_agc", [False, True], ids=["plain", "agc"])
@pytest.mark.parametrize("name", ["SGD", "Adam"])
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_two_replicas_match_single_device_big_batch(wrapper, name, use_agc):
    ref = _reference(name, use_agc)
    x, y = data()
    _, scope = _scope()
    with scope:
        model = _build(wrapper, name, use_agc)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(flat(model), ref) <= TOL
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 8


@pytest.mark.skipif(BACKEND != "tensorflow", reason="replica-local state is tf.distribute's")
def test_no_reduction_before_the_boundary():
    """Mid-cycle, each replica's accumulator holds its own shard's sum: nothing was reduced."""
    x, y = data(8)
    strategy, scope = _scope()
    with scope:
        model = _build("model", "SGD", False)
    model.optimizer.leftover = "carry"
    before = flat(model)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    opt = model.optimizer
    assert opt.pending() == 2 and int(keras.ops.convert_to_numpy(opt.iterations)) == 0
    np.testing.assert_array_equal(flat(model), before)
    first, second = (
        np.asarray(v) for v in strategy.experimental_local_results(opt.accumulators[0].value)
    )
    assert np.abs(first - second).max() > 1e-3 * np.abs(first).max()
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 1


def test_save_and_load_under_distribution(tmp_path):
    """The original's test_model_distribute: train, save, load, same predictions."""
    x, y = data()
    _, scope = _scope()
    with scope:
        model = _build("model", "SGD", False)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "dist.keras")
    loaded = keras.models.load_model(tmp_path / "dist.keras")
    assert loaded.get_config()["accum_steps"] == ACCUM
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_two_replicas_flush_a_short_last_cycle_like_the_big_batch(name):
    """56 samples: three full cycles and a short one of two micro-batches, which the model
    wrapper's FlushAccumulation applies at the end of each epoch, outside the strategy's scope.
    Before the fix that flush read the replica-local accumulators outside the scope (their mean
    over replicas) and applied half the short cycle's gradient."""
    x, y = data()
    x, y = x[:56], y[:56]
    inputs, outputs = mlp()
    ref = keras.Model(inputs, outputs)
    ref.compile(make_inner(name), loss="mse")
    ref.fit(x, y, batch_size=ACCUM * MICRO, epochs=2, shuffle=False, verbose=0)
    _, scope = _scope()
    with scope:
        model = _build("model", name, False)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(flat(model), flat(ref)) <= TOL
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 8


@pytest.mark.skipif(BACKEND != "tensorflow", reason="replica-local state is tf.distribute's")
def test_flush_outside_the_scope_applies_what_the_boundary_applies():
    """Two micro-steps of G on each replica: a flush (called outside the strategy's scope)
    gives the same update as a cycle of two reaching its boundary: the inner optimizer sums
    the replicas' mean gradients, 2G."""
    import tensorflow as tf

    strategy = mirrored(2)
    g = tf.constant([0.5, -0.25, 1.0])
    out = []
    for accum, flush in ((2, False), (4, True)):
        with strategy.scope():
            a = keras.Variable(np.ones(3, "float32"))
            opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=accum)
            opt.build([a])
        step = tf.function(lambda: strategy.run(lambda: opt.apply([g], [a])))  # noqa: B023
        step()
        step()
        if flush:
            assert opt.flush()
        out.append(a.numpy())
    np.testing.assert_allclose(out[0], 1.0 - 0.1 * 2 * g.numpy(), rtol=1e-6)
    np.testing.assert_allclose(out[1], out[0], rtol=1e-6)


def _nan_case(use_agc=False):
    """The data with a NaN that replica 1 sees in the second cycle, the indices of the samples
    outside that cycle, and the big-batch reference trained on those alone."""
    x, y = data()
    bad = ACCUM * MICRO + 1  # second cycle, first micro-batch, second sample: replica 1
    keep = np.r_[0 : ACCUM * MICRO, 2 * ACCUM * MICRO : len(x)]
    ref_inputs, ref_outputs = mlp()
    ref = keras.Model(ref_inputs, ref_outputs)
    ref.compile(
        GradientAccumulateOptimizer(make_inner("Adam"), accum_steps=1, use_agc=use_agc),
        loss="mse",
    )
    ref.fit(x[keep], y[keep], batch_size=ACCUM * MICRO, shuffle=False, verbose=0)
    x = x.copy()
    x[bad, 0] = np.nan
    return x, y, keep, ref


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["on_nonfinite", "loss_scale"])
def test_a_nan_on_one_replica_drops_the_cycle_on_every_replica(mixed_precision):
    """A NaN sample seen by one replica only: every replica skips the same cycle, so the result
    is the run without that cycle's samples (and under loss scaling the scale halves once)."""
    x, y, keep, ref = _nan_case()
    _, scope = _scope()
    with scope:
        inputs, outputs = mlp()
        model = GradientAccumulateModel(
            accum_steps=ACCUM, mixed_precision=mixed_precision, inputs=inputs, outputs=outputs
        )
        model.compile(make_inner("Adam"), loss="mse")
    if mixed_precision:
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    else:
        with pytest.warns(NonFiniteGradientWarning, match="1 cycle skipped"):
            model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    opt = model.optimizer
    if BACKEND == "jax":
        model.jax_state_sync()
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == len(keep) // (ACCUM * MICRO)
    assert opt.nonfinite_skipped == (0 if mixed_precision else 1)
    if mixed_precision:
        assert float(keras.ops.convert_to_numpy(opt.loss_scale)) == opt.initial_scale / 2
    assert rel_diff(flat(model), flat(ref)) <= TOL


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute's merge_call")
@pytest.mark.parametrize("use_agc", [False, True], ids=["plain", "agc"])
def test_a_nan_on_one_replica_without_merge_call(monkeypatch, use_agc):
    """A strategy that runs the step without ``merge_call`` (TensorFlow does so under XLA when
    every device is a GPU: ``strategy_supports_no_merge_call``): the replicas agree on the
    verdict by one all-reduce at the boundary, and every replica skips the same cycle. The
    scenario above, with merge_call switched off on the two CPUs; with AGC the cycle's gradient
    is summed over the replicas in the update's branch. Before, the inner optimizer's count
    (a first-replica variable, whose update needs a merge_call) failed inside the branch."""
    from gradient_accumulator.keras import _replica_shell

    strategy = mirrored(2)
    monkeypatch.setattr(strategy.extended, "_use_merge_call", lambda: False)
    agreed = []

    def summed(at, verdict):
        agreed.append(at)
        return _summed_over_replicas(at, verdict)

    _summed_over_replicas = _replica_shell._summed_over_replicas
    monkeypatch.setattr(_replica_shell, "_summed_over_replicas", summed)
    x, y, keep, ref = _nan_case(use_agc)
    with strategy.scope():
        inputs, outputs = mlp()
        model = GradientAccumulateModel(
            accum_steps=ACCUM, use_agc=use_agc, inputs=inputs, outputs=outputs
        )
        model.compile(make_inner("Adam"), loss="mse")
    with pytest.warns(NonFiniteGradientWarning, match="1 cycle skipped"):
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    opt = model.optimizer
    assert agreed, "the no-merge_call agreement was not traced"
    updates = len(keep) // (ACCUM * MICRO)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == updates
    assert int(keras.ops.convert_to_numpy(opt.optimizer.iterations)) == updates
    assert opt.nonfinite_skipped == 1
    assert rel_diff(flat(model), flat(ref)) <= TOL
