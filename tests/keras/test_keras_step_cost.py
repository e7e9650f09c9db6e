"""What one micro-step costs, counted rather than timed: the ops of TensorFlow's step graph and the
Keras variable writes of the torch backend's eager path (benchmarks/keras_step.py times them).

TensorFlow without a strategy: a micro-step adds each weighted gradient in place in one op (no
multiply, no select, no conditional around it), with the same rounding as ``acc + w·g``; the
boundary is one conditional that TensorFlow calls; fit's epoch clock is one read and a
countdown. The torch backend's core
path mirrors the cycle's counters into the variables in place, with no Keras ``assign`` per
micro-step. JAX run eagerly: a warm step compiles nothing; traced, the update's conditional
follows the verdict's instead of nesting in it.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND

from gradient_accumulator.keras import GradientAccumulateOptimizer

SHAPES = [(5, 3), (3,)]


def _setup(accum_steps=4, reduction="MEAN"):
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1), accum_steps=accum_steps, reduction=reduction
    )
    opt.build(variables)
    return opt, variables


def _grads(seed):
    rng = np.random.default_rng(seed)
    return [keras.ops.convert_to_tensor(rng.normal(size=s).astype("float32")) for s in SHAPES]


def _step_graph(opt, variables, grads):
    """The graph of ``opt.apply(grads, variables)`` traced in a ``tf.function`` (not run)."""
    import tensorflow as tf

    @tf.function
    def step():
        opt.apply(grads, variables)

    return step.get_concrete_function().graph


def _branches(graph):
    """The op types of each function in ``graph``'s library, by name."""
    return {
        f.signature.name: [n.op for n in f.node_def] for f in graph.as_graph_def().library.function
    }


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's step graph")
def test_tf_step_folds_in_place_outside_one_called_boundary():
    """A micro-step adds each weighted gradient in place in the step's own graph (no multiply,
    no select, no conditional around it); the boundary is one conditional that TensorFlow
    calls, not lowers, and it zeroes the accumulators for the next cycle."""
    opt, variables = _setup()
    graph = _step_graph(opt, variables, _grads(0))
    outer = [op.type for op in graph.get_operations()]
    assert outer.count("ResourceApplyGradientDescent") == len(SHAPES)
    assert "Mul" not in outer and "SelectV2" not in outer and "If" not in outer
    (case,) = [op for op in graph.get_operations() if op.type == "Case"]
    assert case.get_attr("_lower_using_switch_merge") is False
    branches = _branches(graph)
    (end,) = [ops for name, ops in branches.items() if "_branch1_" in name]
    (idle,) = [ops for name, ops in branches.items() if "_branch0_" in name]
    assert "AssignVariableOp" not in idle and "ResourceApplyGradientDescent" not in idle
    # The four counters it writes (micro-step, total weight, non-finite flag, dropped cycles)
    # and one zeroing per accumulator; the SGD update sits in the verdict's conditional.
    assert end.count("AssignVariableOp") == 4 + len(SHAPES)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's step graph")
def test_tf_epoch_clock_is_one_read_and_a_countdown():
    """The epoch clock of a TensorFlow step counts down the current epoch: one read of its
    counter, no read of the epoch's length, no modulo (the whole fit's count took three reads
    of the counter, one of the length and eight ops)."""
    opt, variables = _setup()
    graph = _step_graph(opt, variables, _grads(0))
    inner = {id(internal): external for external, internal in graph.captures}

    def reads_of(variable):
        handle = variable.value.handle
        return [
            op
            for op in graph.get_operations()
            if op.type == "ReadVariableOp" and inner.get(id(op.inputs[0])) is handle
        ]

    assert len(reads_of(opt._steps_left)) == 1
    assert reads_of(opt._epoch_steps) == []
    outer = [op.type for op in graph.get_operations()]
    assert "FloorMod" not in outer and "LogicalAnd" not in outer


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's step graph")
def test_tf_train_step_hands_the_batch_size_to_the_fold():
    """The model wrapper's step on TensorFlow without a strategy hands the batch's size to the
    fold as a tensor of the step: its graph neither writes nor reads ``counter("batch_weight")``
    (it wrote the size there and the fold read it back), and a short batch still weighs its
    size."""
    import tensorflow as tf

    from gradient_accumulator.keras import GradientAccumulateModel

    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = GradientAccumulateModel(
        accum_steps=4, inputs=inputs, outputs=keras.layers.Dense(2)(inputs)
    )
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)
    opt = model.optimizer
    step = tf.function(lambda x, y: model.train_step((x, y)))
    rng = np.random.default_rng(0)
    for n in (8, 5):  # a full batch, then a short one: both in the cycle's total weight
        x = rng.normal(size=(n, 3)).astype("float32")
        step(tf.constant(x), tf.constant(np.zeros((n, 2), "float32")))
    assert float(opt.counter("total_weight").numpy()) == 13.0
    assert float(opt.counter("batch_weight").numpy()) == 1.0
    graph = step.get_concrete_function(
        tf.TensorSpec((None, 3), "float32"), tf.TensorSpec((None, 2), "float32")
    ).graph
    inner = {id(internal): external for external, internal in graph.captures}
    handle = opt.counter("batch_weight").value.handle
    touching = [
        op.type
        for op in graph.get_operations()
        if op.inputs and inner.get(id(op.inputs[0])) is handle
    ]
    assert touching == []


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's step graph")
def test_tf_step_size_is_not_captured_by_a_nested_function():
    """The step's batch size (``callbacks.weighing``'s stash, a tensor of the step's graph) is
    used only in that graph: an ``apply`` from a ``tf.function`` nested in the step reads
    ``counter("batch_weight")`` instead. A capture would stay in the nested function's
    cached trace and, once the step retraced for another batch size, be a tensor of a dead
    graph (it raised "out of scope" at the second shape). Two micro-steps of 3 and 5 samples,
    the counter at 1: a total weight of 2 (exact), the stash unused; then the counter written
    (4, 2) gives the nested apply those weights."""
    import tensorflow as tf

    from gradient_accumulator.keras.callbacks import weighing

    opt, variables = _setup(accum_steps=8)
    model = keras.Model()
    model.optimizer = opt
    nested = tf.function(lambda grads: opt.apply(grads, variables))

    @tf.function
    def step(x):
        with weighing(model, x):
            nested(_grads(0))

    for n in (3, 5):  # the second shape retraces the step, not the nested function
        step(tf.zeros((n, 2)))
    assert float(opt.counter("total_weight").numpy()) == 2.0
    for n in (4, 2):
        opt.counter("batch_weight").assign(float(n))
        step(tf.zeros((n, 2)))
    assert float(opt.counter("total_weight").numpy()) == 8.0
    assert int(opt.micro_steps.numpy()) == 4


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's in-place weighted add")
def test_tf_in_place_weighted_add_rounds_as_multiply_then_add():
    """Weights that make ``w·g`` inexact: the accumulator after three micro-steps equals the
    float32 sum ``((w1·g1) + w2·g2) + w3·g3`` computed by NumPy, bit for bit."""
    import tensorflow as tf

    opt, variables = _setup(accum_steps=8)
    weights = [3.0, 0.7, 1.3]
    steps = [_grads(i) for i in range(3)]

    @tf.function
    def step(grads, weight):
        opt.apply(grads, variables, weight=weight)

    for grads, w in zip(steps, weights):
        step(grads, tf.constant(w))
    steps = [[g.numpy() for g in grads] for grads in steps]
    for i in range(len(SHAPES)):
        expected = steps[0][i] * np.float32(weights[0])
        for grads, w in zip(steps[1:], weights[1:]):
            expected = expected + grads[i] * np.float32(w)
        np.testing.assert_array_equal(opt.accumulators[i].numpy(), expected)
    assert float(opt.counter("total_weight").numpy()) == np.float32(
        sum(np.float32(w) for w in weights)
    )
    assert int(opt.counter("micro_step").numpy()) == 3
    assert int(opt.micro_steps.numpy()) == 3


@pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's eager core path")
def test_torch_core_micro_step_writes_no_keras_variable(monkeypatch):
    opt, variables = _setup()
    opt.apply(_grads(0), variables)  # builds the core path
    writes = []
    original = keras.Variable.assign

    def counting(self, value):
        writes.append(self.path)
        return original(self, value)

    monkeypatch.setattr(keras.Variable, "assign", counting)
    for seed in (1, 2):  # middle micro-steps
        opt.apply(_grads(seed), variables)
    assert writes == []
    assert int(opt.counter("micro_step").numpy()) == 3
    assert int(opt.micro_steps.numpy()) == 3
    assert float(opt.counter("total_weight").numpy()) == 3.0


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's conditional outside a trace")
def test_jax_eager_step_compiles_nothing_once_warm():
    # run_eagerly=True: each step used to compile a lax.cond over the whole cycle end (its
    # branches are new closures every step): 0.2 s a step on a CPU, minutes for one test on an
    # H200. Once the first cycles have compiled the eager ops' kernels, nothing compiles.
    import logging

    import jax

    from gradient_accumulator.keras import GradientAccumulateModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 5)).astype("float32")
    y = rng.normal(size=(4, 1)).astype("float32")
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(3, activation="relu")(inputs))
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    model.compile(keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
    for _ in range(4):
        model.train_on_batch(x, y)

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level=logging.DEBUG)
    root = logging.getLogger("jax")
    root.addHandler(handler)
    try:
        with jax.log_compiles(True):
            for _ in range(4):
                model.train_on_batch(x, y)
    finally:
        root.removeHandler(handler)
    compiles = [m for m in messages if "ompil" in m]
    assert compiles == [], compiles[:3]
    assert int(model.optimizer.iterations) == 4


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's traced step")
def test_jax_update_conditional_follows_the_verdicts_not_inside_it():
    # The boundary's non-finite verdict is one lax.cond returning a scalar, the inner update a
    # second one after it. Nested (the update's conditional inside the boundary's), XLA copied
    # the optimizer slots the untaken branch passed through on every step (benchmarks/README.md).
    import jax

    opt, variables = _setup()
    assert opt.on_nonfinite == "skip"  # the default, which checks
    trainable = [v.value for v in variables]
    jaxpr = jax.make_jaxpr(opt.stateless_apply)(
        [v.value for v in opt.variables], _grads(0), trainable
    ).jaxpr
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    # The verdict first (one scalar), then the update: on a CPU one conditional per variable
    # and one for the counter (test_keras_jax_groups.py), elsewhere one for all.
    outputs = [len(e.outvars) for e in conds]
    assert outputs == ([1, 1, 1, 1] if jax.default_backend() == "cpu" else [1, 3]), outputs

    def nested(jaxpr) -> list[str]:  # conditionals anywhere inside, called jaxprs included
        from jax.extend.core import subjaxprs

        names = [q.primitive.name for q in jaxpr.eqns if q.primitive.name == "cond"]
        return names + [n for sub in subjaxprs(jaxpr) for n in nested(sub)]

    for eqn in conds:
        for branch in eqn.params["branches"]:
            assert nested(branch.jaxpr) == []
