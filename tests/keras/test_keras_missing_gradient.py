"""A variable without a gradient for a whole cycle (an unused branch, a frozen head).

Plain Keras leaves such a variable alone: ``apply`` drops ``None`` gradients, so neither momentum
nor weight decay moves it. The wrapper does the same at the boundary, for the variables with no
gradient in any micro-step of the cycle (before the fix it updated them with a zero gradient:
SGD with momentum 0.9 moved one from 0.95 to 0.905, AdamW's decay from 0.850 to 0.740). A
variable with a gradient in only some micro-steps is updated with the cycle's mean, the missing
micro-steps counting as zero (the PyTorch adapter's rule). Every backend and path: eager
``apply``, compiled functions (``tf.function``, ``jax.jit`` of ``stateless_apply``), ``fit``
and ``flush``.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND
from keras_helpers import mirrored

from gradient_accumulator.keras import GradientAccumulateOptimizer

ACCUM = 2
# The repeated micro-batch gradient averages to itself; the fused AdamW (torch backend's core
# path) computes Adam's bias correction in float64, Keras in float32, where 1 - 0.999 is off by
# 1.3e-5 relative: steps of lr = 0.1 then differ by ~1e-6 each (measured 1.7e-6 after two).
TOL = 5e-6
PATHS = [{}] + ([{"use_core": False}] if BACKEND == "torch" else [])
INNERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "adamw": lambda: keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5),
}
G = np.array([0.5, -0.25, 1.0], "float32")


def _np(x) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(x))


def _pair() -> tuple:
    return keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones(3, "float32"))


def _plain(inner: str, cycles: list[list]) -> tuple[np.ndarray, np.ndarray]:
    """Plain Keras, one ``apply`` per cycle with that cycle's gradients (None: no gradient)."""
    a, b = _pair()
    opt = INNERS[inner]()
    opt.build([a, b])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Gradients do not exist")
        for grads in cycles:
            opt.apply(
                [None if g is None else keras.ops.convert_to_tensor(g) for g in grads], [a, b]
            )
    return _np(a), _np(b)


def _calls(micro_steps: list[list], apply) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Gradients do not exist")
        for grads in micro_steps:
            apply([None if g is None else keras.ops.convert_to_tensor(g) for g in grads])


def _ours(inner: str, micro_steps: list[list], path: dict, compiled: bool = False, **kwargs):
    """The wrapper, one ``apply`` per micro-step (compiled per None pattern if asked)."""
    a, b = _pair()
    opt = GradientAccumulateOptimizer(INNERS[inner](), accum_steps=ACCUM, **path, **kwargs)
    opt.build([a, b])
    if not compiled:
        _calls(micro_steps, lambda grads: opt.apply(grads, [a, b]))
        return _np(a), _np(b), opt
    functions = {}

    def apply(grads):
        key = tuple(g is None for g in grads)
        if key not in functions:
            functions[key] = _compile(opt, [a, b], key)
        functions[key]([g for g in grads if g is not None])

    _calls(micro_steps, apply)
    return _np(a), _np(b), opt


def _compile(opt, variables: list, missing: tuple):
    """A compiled micro-step in which the variables flagged ``missing`` have no gradient."""

    def full(present: list) -> list:
        it = iter(present)
        return [None if m else next(it) for m in missing]

    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda present: opt.apply(full(present), variables))
    import jax

    @jax.jit
    def step(opt_values, tv, present):
        return opt.stateless_apply(opt_values, full(present), tv)

    def run(present):
        tv, ov = step([v.value for v in opt.variables], [v.value for v in variables], present)
        for var, value in zip(variables, tv):
            var.assign(value)
        for var, value in zip(opt.variables, ov):
            var.assign(value)

    return run


COMPILED = [False] + ([True] if BACKEND in ("tensorflow", "jax") else [])


def _ids(p) -> str:
    return "generic" if p else "default"


@pytest.mark.parametrize("compiled", COMPILED, ids=lambda c: "compiled" if c else "eager")
@pytest.mark.parametrize("path", PATHS, ids=_ids)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_variable_without_gradient_for_a_cycle_is_not_updated(inner, path, compiled):
    """Cycle 1: both variables have gradients; cycle 2: only ``a``."""
    a_ref, b_ref = _plain(inner, [[G, G], [G, None]])
    a, b, _ = _ours(inner, [[G, G]] * ACCUM + [[G, None]] * ACCUM, path, compiled)
    assert np.abs(a - a_ref).max() <= TOL
    assert np.abs(b - b_ref).max() <= TOL
    assert np.abs(a - 1.0).max() > 0.1  # a did move


@pytest.mark.parametrize("compiled", COMPILED, ids=lambda c: "compiled" if c else "eager")
@pytest.mark.parametrize("path", PATHS, ids=_ids)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_gradient_in_part_of_a_cycle_counts_the_missing_micro_step_as_zero(inner, path, compiled):
    """``b`` has a gradient in the first micro-step only (under compilation: from another
    compiled function than the boundary's): it is updated with (G + 0) / 2."""
    a_ref, b_ref = _plain(inner, [[G, G / 2]])
    a, b, _ = _ours(inner, [[G, G], [G, None]], path, compiled)
    assert np.abs(a - a_ref).max() <= TOL
    assert np.abs(b - b_ref).max() <= TOL
    assert np.abs(b - 1.0).max() > 0.04  # b did move


@pytest.mark.parametrize("path", PATHS, ids=_ids)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_a_cycle_without_any_gradient_moves_nothing(inner, path):
    """Every gradient None for a whole cycle: no update at all (the inner optimizer's step
    count included), and the next cycle is a normal one."""
    _, _, opt = _ours(inner, [[None, None]] * ACCUM, path)
    assert int(_np(opt.inner_optimizer.iterations)) == 0
    assert int(_np(opt.micro_steps)) == ACCUM
    a_ref, b_ref = _plain(inner, [[G, G]])
    a, b, _ = _ours(inner, [[None, None]] * ACCUM + [[G, G]] * ACCUM, path)
    assert np.abs(a - a_ref).max() <= TOL and np.abs(b - b_ref).max() <= TOL


@pytest.mark.parametrize("path", PATHS, ids=_ids)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_flush_leaves_a_variable_without_gradient_alone(inner, path):
    """A short cycle (3 of 4 micro-steps) flushed: ``b`` never had a gradient."""
    a, b = _pair()
    opt = GradientAccumulateOptimizer(INNERS[inner](), accum_steps=4, **path)
    _calls([[G, None]] * 3, lambda grads: opt.apply(grads, [a, b]))
    assert opt.flush()
    a_ref, b_ref = _plain(inner, [[G, None]])
    assert np.abs(_np(a) - a_ref).max() <= TOL
    assert np.abs(_np(b) - b_ref).max() <= TOL


class TwoHeads(keras.Model):
    """``out`` trains; ``unused`` is built and called but outside the loss."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(3)
        self.out = keras.layers.Dense(1)
        self.unused = keras.layers.Dense(2)

    def call(self, x):
        h = self.hidden(x)
        self.unused(h)
        return self.out(h)


def _replicas(count: int):
    """A two-replica scope (MirroredStrategy on two logical CPUs, JAX data parallel)."""
    import contextlib

    if count == 1:
        return contextlib.nullcontext()
    if BACKEND == "tensorflow":
        return mirrored(2).scope()
    import jax

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    return contextlib.nullcontext()


@pytest.mark.parametrize(
    "replicas", [1] + ([2] if BACKEND in ("tensorflow", "jax") else []), ids=lambda r: f"x{r}"
)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_fit_with_a_layer_outside_the_loss_matches_plain_keras(inner, replicas):
    """``fit`` (compiled on TensorFlow and JAX, on one or two replicas): every weight matches
    plain Keras on the big batch, on one device. The unused layer's gradient is None on
    TensorFlow and PyTorch, so its weights stay as built (AdamW's decay would move them were
    they updated); ``jax.grad`` gives it zeros, so there plain Keras and the wrapper both decay
    it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    shapes = [(4, 3), (3,), (3, 1), (1,), (3, 2), (2,)]  # hidden, out, unused: as built
    weights = [
        np.random.default_rng(i).normal(size=s).astype("float32") for i, s in enumerate(shapes)
    ]
    start = weights[4:]
    results = []
    for wrapped in (False, True):
        batch = 16 // ACCUM if wrapped else 16
        with _replicas(replicas if wrapped else 1):
            opt = INNERS[inner]()
            if wrapped:
                opt = GradientAccumulateOptimizer(opt, accum_steps=ACCUM)
            model = TwoHeads()
            model(x[:1])
            model.set_weights(weights)
            model.compile(optimizer=opt, loss="mse")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Gradients do not exist")
            model.fit(x, y, batch_size=batch, epochs=3, shuffle=False, verbose=0)
        results.append([_np(w) for w in model.trainable_weights])
        if BACKEND != "jax":
            for now, then in zip(model.unused.weights, start):
                np.testing.assert_array_equal(_np(now), then)
    plain, ours = results
    assert len(plain) == 6
    for p, o in zip(plain, ours):
        assert np.abs(o - p).max() <= 1e-5


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute exists on TensorFlow only")
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_two_replicas_take_a_gradient_from_another_compiled_function(inner):
    """Two replicas, two compiled steps: ``b`` has a gradient only in the first micro-step
    (another function than the boundary's), then in no micro-step of the second cycle. The
    inner optimizer sums the replicas' gradients: a gets 2G, b (G + 0) / 2 · 2 = G, then b is
    left alone."""
    import tensorflow as tf

    strategy = mirrored(2)
    with strategy.scope():
        a, b = _pair()
        opt = GradientAccumulateOptimizer(INNERS[inner](), accum_steps=ACCUM)
        opt.build([a, b])
    g = tf.constant(G)
    both = tf.function(lambda: strategy.run(lambda: opt.apply([g, g], [a, b])))
    only_a = tf.function(lambda: strategy.run(lambda: opt.apply([g], [a])))
    for step in (both, only_a, only_a, only_a):
        step()
    a_ref, b_ref = _plain(inner, [[2 * G, G], [2 * G, None]])
    assert np.abs(_np(a) - a_ref).max() <= TOL
    assert np.abs(_np(b) - b_ref).max() <= TOL
    assert np.abs(_np(b) - 1.0).max() > 0.04
