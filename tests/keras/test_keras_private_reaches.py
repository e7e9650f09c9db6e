"""Every private part of Keras the package relies on is still there (on this backend), and the
JAX and TensorFlow internals the JAX and TensorFlow steps rely on.

Each record of ``keras/_compat.py``'s ``REACHES`` has a probe here that exercises it as the
package does; a probe that fails names the record, the installed Keras and the version it was
checked against.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import keras
import numpy as np
import pytest

from gradient_accumulator._reaches import Reach, moved
from gradient_accumulator.keras import (
    FlushAccumulation,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    _compat,
)


def _mlp() -> tuple:
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="relu")(inputs)
    return inputs, keras.layers.Dense(1)(hidden)


def _tracking() -> None:
    from keras.src.utils.tracking import no_automatic_dependency_tracking

    class Holder(keras.layers.Layer):
        @no_automatic_dependency_tracking
        def keep(self) -> None:
            self.kept = [keras.Variable(1.0)]

    holder = Holder()
    holder.keep()
    assert not holder.weights, "an untracked container's variable was tracked"


def _optimizer() -> None:
    opt = keras.optimizers.SGD(0.1, weight_decay=0.01)
    v = keras.Variable(np.ones(2, "float32"))
    opt.build([v])
    for name in (
        "_iterations",
        "_variables",
        "_trainable_variables",
        "_track_variable",
        "_get_variable_index",
        "_check_variables_are_known",
        "_clip_gradients",
    ):
        assert hasattr(opt, name), f"keras.optimizers.Optimizer has no {name}"
    assert opt._get_variable_index(v) == 0
    assert opt._use_weight_decay(v) is True
    opt.exclude_from_weight_decay(var_names=[v.name])
    assert opt._use_weight_decay(v) is False


def _build_shapes() -> None:
    layer = keras.layers.BatchNormalization()
    layer.build((None, 3))
    assert tuple(layer._build_shapes_dict["input_shape"]) == (None, 3)


def _flatten_layers() -> None:
    model = keras.Model(*_mlp())
    layers = list(model._flatten_layers(include_self=False))
    assert model not in layers
    assert sum(isinstance(layer, keras.layers.Dense) for layer in layers) == 2


def _jax_state() -> None:
    if keras.backend.backend() != "jax":
        return  # JAX only: the JAX run of the Keras tests probes it
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            seen.append(getattr(self._model, "_jax_state", None))

    model = keras.Model(*_mlp())
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[Probe()])
    assert seen and all(s and "optimizer_variables" in s for s in seen)


def _callback_model() -> None:
    callback = keras.callbacks.Callback()
    model = keras.Model(*_mlp())
    callback.set_model(model)
    assert callback._model is model


def _fit_hook() -> None:
    model = keras.Model(*_mlp())
    model.compile(GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2), "mse")
    other = keras.callbacks.Callback()
    x, y = np.ones((6, 3), "float32"), np.ones((6, 1), "float32")
    order = []

    class First(keras.callbacks.Callback):
        def on_train_begin(self, logs: object = None) -> None:
            order.append("user")

    model.fit(x, y, batch_size=2, verbose=0, callbacks=[First(), other])  # 3 batches
    assert int(model.optimizer.iterations) == 2, "fit's short last cycle was not applied"
    callbacks = keras.callbacks.CallbackList([other], model=model)
    assert isinstance(callbacks.callbacks[0], FlushAccumulation)


def _clone_frame() -> None:
    inputs, outputs = _mlp()
    model = GradientAccumulateModel(accum_steps=3, leftover="carry", inputs=inputs, outputs=outputs)
    clone = keras.models.clone_model(model)
    assert type(clone) is GradientAccumulateModel
    assert (clone.accum_steps, clone.leftover) == (3, "carry"), "the clone lost its settings"


def _loss_scale_frame() -> None:
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    keras.optimizers.LossScaleOptimizer(opt, initial_scale=32.0, dynamic_growth_steps=7)
    assert opt.mixed_precision, "the wrapper did not learn that a LossScaleOptimizer wraps it"
    assert (opt.initial_scale, opt.dynamic_growth_steps) == (32.0, 7)


def _apply_parts() -> None:
    # apply_uncounted is Keras's apply without the count: the same update bit for bit (with a
    # loss-scale factor, a missing gradient and a constraint), iterations left alone.
    from gradient_accumulator.keras._compat import apply_uncounted

    def setup() -> tuple:
        opt = keras.optimizers.Adam(0.1, loss_scale_factor=4.0)
        vs = [
            keras.Variable(np.linspace(-1, 1, 6, dtype="float32").reshape(2, 3)),
            keras.Variable(np.full(3, 0.05, "float32")),
            keras.Variable(np.ones(2, "float32")),
        ]
        vs[1].constraint = keras.constraints.NonNeg()
        opt.build(vs)
        return opt, vs

    grads = [
        keras.ops.convert_to_tensor(np.full((2, 3), 0.3, "float32")),
        keras.ops.convert_to_tensor(np.full(3, 9.0, "float32")),
        None,
    ]
    counted, a = setup()
    uncounted, b = setup()
    for _ in range(2):
        with warnings.catch_warnings():  # both warn of the missing gradient alike
            warnings.filterwarnings("ignore", message="Gradients do not exist")
            counted.apply(grads, a)
            apply_uncounted(uncounted, grads, b)
        assert int(uncounted.iterations) == int(counted.iterations) - 1, "it counted"
        uncounted.iterations.assign_add(1)  # as the caller does, after the conditional
    for x, y in zip(a, b):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(x), keras.ops.convert_to_numpy(y))
    assert float(keras.ops.convert_to_numpy(a[1]).min()) == 0.0, "the constraint did not run"


def _jaxpr() -> None:
    if keras.backend.backend() != "jax":
        pytest.skip("the JAX step's reach")
    import jax
    import jax.numpy as jnp

    from gradient_accumulator.keras import _jax_groups

    def update(g0, g1, w0, w1, it, lr):
        return [w0 - lr * g0, w1 - lr * g1 * 2.0, it + 1, lr]

    found = []

    @jax.jit
    def step(*values):  # traced on the values of an enclosing trace, as the JAX step does
        jaxpr = jax.jit(update).trace(*values).jaxpr
        found.append(_jax_groups.write_groups(jaxpr, [3, 2], [3, 2, 1, 1]))
        return update(*values)

    step(jnp.ones(3), jnp.ones(2), jnp.zeros(3), jnp.zeros(2), jnp.int32(0), jnp.float32(0.1))
    assert found == [[[0], [1], [2]]]


def _switch_case() -> None:
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow step's reach")
    import tensorflow as tf

    v = tf.Variable(0.0)

    @tf.function
    def step(i):
        _compat.switch_case(
            i, [lambda: v.assign_add(1.0), lambda: v.assign_add(10.0)], lowered=False
        )

    graph = step.get_concrete_function(tf.TensorSpec([], tf.int32)).graph
    (case,) = [op for op in graph.get_operations() if op.type in ("Case", "StatelessCase")]
    # The attribute TensorFlow's lowering pass reads: False keeps the op a call.
    assert case.get_attr("_lower_using_switch_merge") is False
    step(tf.constant(1))
    step(tf.constant(0))
    assert float(v.numpy()) == 11.0


def _tensorflow() -> object:
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow step's reach")
    import tensorflow as tf

    return tf


def _no_merge_call() -> None:
    tf = _tensorflow()
    assert isinstance(tf.__internal__.distribute.strategy_supports_no_merge_call(), bool)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert isinstance(tf.__internal__.distribute.strategy_supports_no_merge_call(), bool)


def _device_util() -> None:
    tf = _tensorflow()
    from tensorflow.python.distribute import device_util

    with tf.device("/device:CPU:0"):
        current = device_util.current()
    assert isinstance(current, str) and "CPU:0" in current, current


def _all_reduce_sum() -> None:
    _tensorflow()
    opt = keras.optimizers.SGD(0.5)
    v = keras.Variable(np.ones(2, "float32"))
    opt.build([v])
    assert callable(getattr(type(opt), "_all_reduce_sum_gradients", None))
    seen = []

    def already_reduced(grads_and_vars):
        seen.append(len(list(grads_and_vars)))
        return list(grads_and_vars)

    vars(opt)["_all_reduce_sum_gradients"] = already_reduced
    try:
        opt.apply([keras.ops.ones(2)], [v])
    finally:
        vars(opt).pop("_all_reduce_sum_gradients", None)
    assert seen == [1], "the apply did not go through the instance's _all_reduce_sum_gradients"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(v), [0.5, 0.5])


def _loss_scale_methods() -> None:
    from gradient_accumulator.keras import _loss_scale

    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    lso = keras.optimizers.LossScaleOptimizer(opt)
    for name, function in (
        ("scale_loss", _loss_scale._adopted_scale_loss),
        ("apply", _loss_scale._adopted_apply),
        ("stateless_apply", _loss_scale._adopted_stateless_apply),
        ("save_own_variables", _loss_scale._adopted_save_own_variables),
        ("load_own_variables", _loss_scale._adopted_load_own_variables),
    ):
        own = getattr(keras.optimizers.LossScaleOptimizer, name, None)
        assert callable(own), f"LossScaleOptimizer has no method {name}"
        assert not hasattr(own, "__set__"), f"LossScaleOptimizer.{name} is a data descriptor"
        assert getattr(lso, name).__func__ is function, f"the instance's {name} is not ours"
    loss = keras.ops.convert_to_tensor(2.0)
    scaled = keras.ops.convert_to_numpy(lso.scale_loss(loss))
    assert float(scaled) == 2.0 * opt.initial_scale, "scale_loss does not reach the wrapper"


def _instance_train_step() -> None:
    model = keras.Model(*_mlp())
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, batch_size=2, verbose=0)
    calls = []
    step = model.train_step

    def train_step(*args):
        calls.append(len(args))
        return step(*args)

    object.__setattr__(model, "train_step", train_step)
    object.__setattr__(model, "train_function", None)  # made again by the next fit
    model.fit(x, y, batch_size=2, verbose=0)
    assert calls, "fit did not call the model's instance train_step"


def _variable_layout() -> None:
    v = keras.Variable(np.ones(2, "float32"))
    assert hasattr(v, "_layout") and v._layout is None, "a Variable without layout has one"
    layer = keras.layers.Layer()
    w = layer.add_weight(shape=(2,), initializer="zeros", name="w")
    assert w._layout is None


def _bn_moments() -> None:
    layer = keras.layers.BatchNormalization()
    layer.build((None, 4, 3))
    x = np.random.default_rng(0).normal(size=(5, 4, 3)).astype("float32")
    object.__setattr__(layer, "_reduction_axes", [0, 1])
    mean, variance = layer._moments(keras.ops.convert_to_tensor(x), None)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(mean), x.mean((0, 1)), rtol=1e-5)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(variance), x.var((0, 1)), rtol=1e-4, atol=1e-6
    )


def _control_flow_graph() -> None:
    tf = _tensorflow()
    from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

    seen = {}

    @tf.function
    def step(x):
        seen["function"] = tf.compat.v1.get_default_graph()

        def branch():
            seen["cond"] = tf.compat.v1.get_default_graph()
            return x + 1.0

        return tf.cond(x > 0.0, branch, lambda: x)

    step(tf.constant(1.0))
    assert isinstance(seen["cond"], ControlFlowFuncGraph)
    assert not isinstance(seen["function"], ControlFlowFuncGraph)
    assert seen["cond"].outer_graph is seen["function"]


PROBES: dict[str, Callable[[], None]] = dict(
    zip(
        [r.target for r in _compat.REACHES],
        [
            _tracking,
            _optimizer,
            _build_shapes,
            _flatten_layers,
            _jax_state,
            _callback_model,
            _fit_hook,
            _clone_frame,
            _loss_scale_frame,
            _apply_parts,
            _jaxpr,
            _switch_case,
            _no_merge_call,
            _device_util,
            _all_reduce_sum,
            _loss_scale_methods,
            _instance_train_step,
            _variable_layout,
            _bn_moments,
            _control_flow_graph,
        ],
    )
)


def test_every_reach_has_a_probe():
    assert len(PROBES) == len(_compat.REACHES)
    assert all(r.library in ("keras", "jax", "tensorflow") for r in _compat.REACHES)


@pytest.mark.parametrize("reach", _compat.REACHES, ids=lambda r: r.target.split(" ")[0])
def test_reach_is_where_it_was(reach: Reach):
    try:
        PROBES[reach.target]()
    except Exception as e:  # whatever the upgrade broke, name the reach
        pytest.fail(moved(reach, f"{type(e).__name__}: {e}"), pytrace=False)
