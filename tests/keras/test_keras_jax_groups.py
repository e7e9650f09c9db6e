"""The JAX step's inner update split into one conditional per variable's slots on a CPU (XLA's
CPU runtime hands a branch of more than eight operations to other threads): which outputs group
together, read off a jaxpr, and the split step's results, bit for bit those of one conditional
(within an ulp for Nadam).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND, data, mlp

from gradient_accumulator.keras import GradientAccumulateOptimizer

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="the split is JAX's")


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


cpu_only = pytest.mark.skipif(
    BACKEND != "jax" or not _on_cpu(), reason="the step is split on a CPU only"
)


def _conds(jaxpr) -> list[str]:
    """The names of the conditionals anywhere inside ``jaxpr`` (nested jaxprs included)."""
    from jax.extend.core import subjaxprs

    found = [eqn.primitive.name for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
    for sub in subjaxprs(jaxpr):
        found += _conds(sub)
    return found


def _groups(fn, read, state, most=16):
    import jax
    import jax.numpy as jnp

    from gradient_accumulator.keras import _jax_groups

    args = [jnp.zeros(s, "float32") for s in read + state]
    jaxpr = jax.make_jaxpr(fn)(*args)
    sizes = [int(np.prod(s)) for s in read + state]
    return _jax_groups.write_groups(jaxpr, sizes[: len(read)], sizes[len(read) :], most)


def test_per_variable_update_groups_each_variable_with_its_slots():
    # read: g0, g1, scale; state: w0, w1, it, lr, m0, m1 (an Adam-like layout).
    def fn(g0, g1, scale, w0, w1, it, lr, m0, m1):
        n0, n1 = m0 * 0.9 + g0 * scale, m1 * 0.9 + g1 * scale
        step = lr * (it + 1.0)  # scalars read by every group
        return [w0 - step * n0, w1 - step * n1, it + 1.0, lr, n0, n1]

    groups = _groups(fn, [(4, 3), (3,), ()], [(4, 3), (3,), (), (), (4, 3), (3,)])
    # lr passes through unchanged: in no group. The counter is a group of its own.
    assert groups == [[0, 4], [1, 5], [2]]


def test_global_norm_keeps_the_update_whole():
    import jax.numpy as jnp

    def fn(g0, g1, w0, w1):
        norm = jnp.sqrt(jnp.sum(g0 * g0) + jnp.sum(g1 * g1))
        return [w0 - g0 / norm, w1 - g1 / norm]

    assert _groups(fn, [(4,), (3,)], [(4,), (3,)]) is None


def test_an_update_with_effects_stays_whole():
    import jax

    def fn(g0, g1, w0, w1):
        jax.debug.print("{}", g0[0])  # would print once per conditional
        return [w0 - g0, w1 - g1]

    assert _groups(fn, [(4,), (3,)], [(4,), (3,)]) is None
    assert _groups(lambda g0, g1, w0, w1: [w0 - g0, w1 - g1], [(4,), (3,)], [(4,), (3,)]) == [
        [0],
        [1],
    ]


def test_a_shared_array_joins_the_groups_that_read_it():
    # w1's update reads w0 (a non-scalar another group writes): one group, not two.
    def fn(g0, g1, w0, w1, it):
        return [w0 - g0, w1 - g1 * w0[:3], it + 1.0]

    assert _groups(fn, [(4,), (3,)], [(4,), (3,), ()]) == [[0, 1], [2]]


def test_more_groups_than_the_cap_keep_one_conditional():
    def fn(*args):
        grads, weights = args[:20], args[20:]
        return [w - g for g, w in zip(grads, weights)]

    shapes = [(5,)] * 20
    assert _groups(fn, shapes, shapes, most=20) == [[i] for i in range(20)]
    assert _groups(fn, shapes, shapes, most=19) is None


def test_a_jaxpr_with_other_inputs_keeps_one_conditional():
    import jax
    import jax.numpy as jnp

    from gradient_accumulator.keras import _jax_groups

    jaxpr = jax.make_jaxpr(lambda a, b: [a + b])(jnp.zeros(2), jnp.zeros(2))
    assert _jax_groups.write_groups(jaxpr, [2], [2, 2]) is None


def _update_conditionals(opt, variables):
    import jax

    grads = [keras.ops.ones_like(v.value) for v in variables]
    jaxpr = jax.make_jaxpr(opt.stateless_apply)(
        [v.value for v in opt.variables], grads, [v.value for v in variables]
    ).jaxpr
    return [e for e in jaxpr.eqns if e.primitive.name == "cond"]


@cpu_only
def test_adam_step_has_one_update_conditional_per_variable():
    variables = [keras.Variable(np.zeros(s, "float32")) for s in [(5, 3), (3,), (3, 2)]]
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), accum_steps=4)
    opt.build(variables)
    conds = _update_conditionals(opt, variables)
    # The verdict (one scalar), then per variable its value and two moments, then the counter.
    assert [len(e.outvars) for e in conds] == [1, 3, 3, 3, 1]
    for eqn in conds:
        for branch in eqn.params["branches"]:
            assert _conds(branch.jaxpr) == []  # nothing nested, the called update included


@cpu_only
def test_a_global_clipnorm_keeps_the_variables_in_one_conditional():
    variables = [keras.Variable(np.zeros(s, "float32")) for s in [(5, 3), (3,)]]
    opt = GradientAccumulateOptimizer(
        keras.optimizers.Adam(0.1, global_clipnorm=1.0), accum_steps=4
    )
    opt.build(variables)
    # The verdict, then both variables and their 4 moments in one conditional (each reads the
    # norm of both gradients), then the counter (which reads no gradient).
    assert [len(e.outvars) for e in _update_conditionals(opt, variables)] == [1, 6, 1]


INNER = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd-nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "global-clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
    "adam-agc": lambda: keras.optimizers.Adam(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
}


@cpu_only
@pytest.mark.parametrize("name", sorted(INNER))
def test_split_step_matches_one_conditional_bit_for_bit(monkeypatch, name):
    """Five epochs of ``fit`` (k = 3, a short last cycle each epoch), split and whole: the
    same weights and optimizer state, bit for bit. Nadam within a few ulp: every group
    recomputes its product of momentum factors, which XLA fuses differently per branch."""
    from gradient_accumulator.keras import _jax_groups

    x, y = data(40)
    results, found = [], []
    real = _jax_groups.write_groups

    def recorded(*args, **kwargs):
        found.append(real(*args, **kwargs))
        return found[-1]

    for split in (True, False):
        monkeypatch.setattr(
            _jax_groups, "write_groups", recorded if split else (lambda *a, **k: None)
        )
        inputs, outputs = mlp(seed=3)
        model = keras.Model(inputs, outputs)
        agc = dict(use_agc=True, clip_factor=0.02) if name == "adam-agc" else {}
        opt = GradientAccumulateOptimizer(INNER[name](), accum_steps=3, **agc)
        model.compile(opt, loss="mse")
        model.fit(x, y, batch_size=6, epochs=5, shuffle=False, verbose=0)
        results.append(
            [v.numpy() for v in model.trainable_variables] + [v.numpy() for v in opt.variables]
        )
    # The split run was split: per variable (4 of them, the counter apart; Nadam's product of
    # momentum factors apart too), or with a global norm the variables together.
    expected = {"global-clipnorm": 2, "nadam": 6}.get(name, 5)
    assert found and all(g is not None and len(g) == expected for g in found), found
    split, whole = results
    assert len(split) == len(whole)
    for a, b in zip(split, whole):
        if name == "nadam":
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(a, b)
    # And the run moved the weights (the comparison is not between two untouched models).
    inputs, outputs = mlp(seed=3)
    assert (
        max(
            float(np.max(np.abs(a - b.numpy())))
            for a, b in zip(split, keras.Model(inputs, outputs).trainable_variables)
        )
        > 1e-3
    )


def test_an_update_closing_over_a_traced_value_keeps_one_conditional(monkeypatch):
    """A learning-rate schedule that reads a value traced in the caller's own ``jax.jit``:
    the update's jaxpr then has that value as an input of its own. It used to raise while
    reading the groups; it keeps one conditional, with the same results as before."""
    import jax

    from gradient_accumulator.keras import _jax_groups

    holder = {}

    class HeldRate(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return holder["lr"] * 1.0

    real = _jax_groups.write_groups
    results = []
    for split in (True, False):
        monkeypatch.setattr(_jax_groups, "write_groups", real if split else (lambda *a, **k: None))
        rng = np.random.default_rng(0)
        variables = [
            keras.Variable(rng.normal(size=s).astype("float32")) for s in [(6, 8), (8,), (8, 3)]
        ]
        opt = GradientAccumulateOptimizer(keras.optimizers.Adam(HeldRate()), accum_steps=1)
        opt.build(variables)

        @jax.jit
        def step(ov, grads, tv, lr, opt=opt):
            holder["lr"] = lr  # closed over by the schedule, inside this trace
            return opt.stateless_apply(ov, grads, tv)

        ov, tv = [v.value for v in opt.variables], [v.value for v in variables]
        for s in range(3):
            grads = [rng.normal(size=v.shape).astype("float32") for v in variables]
            tv, ov = step(ov, grads, tv, np.float32(0.01 * (s + 1)))
        results.append([np.asarray(t) for t in tv] + [np.asarray(o) for o in ov])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert float(np.max(np.abs(results[0][0] - np.asarray(variables[0].value)))) > 1e-3
