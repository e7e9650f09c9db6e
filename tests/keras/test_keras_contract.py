"""Keras's own accumulation contract: the scenarios of Keras's optimizer and loss-scale-optimizer
tests for ``gradient_accumulation_steps``, run against GradientAccumulateOptimizer next to Keras's
built-in accumulation. Where the two differ on purpose (EMA, the accumulators after an update),
the test pins our behaviour and checks the built-in's is the one documented in semantics.md."""

from __future__ import annotations

import pickle

import keras
import numpy as np
import pytest
from keras import ops

from gradient_accumulator.keras import GradientAccumulateOptimizer

BACKEND = keras.backend.backend()

# Keras's test_gradient_accumulation_with_weigth_decay list.
ALL_OPTIMIZERS = [
    "adam",
    "sgd",
    "adamw",
    "adagrad",
    "rmsprop",
    "adadelta",
    "adamax",
    "lion",
    "nadam",
    "ftrl",
    "adafactor",
]


def _np(x):
    return np.asarray(ops.convert_to_numpy(x), np.float64)


def _grads(steps, shape=(2, 2), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype("float32") for _ in range(steps)]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_values_around_the_boundary(name):
    """Keras's test_gradient_accumulation, with varying gradients and Adam too: after every
    micro-step the variable and the update counters equal the built-in's, and so do the
    accumulators inside a cycle."""
    k = 3
    inner = keras.optimizers.get({"class_name": name, "config": {"learning_rate": 0.5}})
    builtin = keras.optimizers.get(
        {"class_name": name, "config": {"learning_rate": 0.5, "gradient_accumulation_steps": k}}
    )
    ours = GradientAccumulateOptimizer(inner, accum_steps=k)
    v_ours = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
    v_keras = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
    for step, g in enumerate(_grads(7), start=1):
        ours.apply_gradients([(ops.convert_to_tensor(g), v_ours)])
        builtin.apply_gradients([(ops.convert_to_tensor(g), v_keras)])
        # Adam divides by sqrt(v) + eps: the two summation orders differ in the last bits.
        np.testing.assert_allclose(_np(v_ours), _np(v_keras), rtol=1e-5, atol=1e-5)
        assert int(_np(ours.iterations)) == int(_np(builtin.iterations)) == step // k
        assert int(_np(ours.micro_steps)) == int(_np(builtin._iterations)) == step
        assert ours.pending() == step % k
        if step % k:  # inside a cycle: the sum of the cycle's gradients, as Keras holds it
            np.testing.assert_allclose(
                _np(ours.accumulators[0]), _np(builtin._accumulated_gradients[0]), rtol=1e-6
            )
    assert not np.allclose(_np(v_ours), [[1.0, 2.0], [3.0, 4.0]])


def test_accumulators_after_an_update():
    """Keras zeroes its accumulators at the update, and so does ours on TensorFlow (its fold
    adds onto them outside any conditional). On JAX and torch ours keep the finished cycle's
    sum (no extra write pass) and the next micro-batch overwrites it, so nothing stale is ever
    applied. ``pending()`` says whether they hold a live cycle."""
    ours = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=3)
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=3)
    v_ours = keras.Variable(np.zeros((2, 2), "float32"))
    v_keras = keras.Variable(np.zeros((2, 2), "float32"))
    ones = ops.ones((2, 2))
    for _ in range(3):
        ours.apply_gradients([(ones, v_ours)])
        builtin.apply_gradients([(ones, v_keras)])
    np.testing.assert_array_equal(_np(builtin._accumulated_gradients[0]), 0.0)
    np.testing.assert_array_equal(
        _np(ours.accumulators[0]), 0.0 if BACKEND == "tensorflow" else 3.0
    )
    assert ours.pending() == 0
    ours.apply_gradients([(ones, v_ours)])
    builtin.apply_gradients([(ones, v_keras)])
    np.testing.assert_array_equal(_np(ours.accumulators[0]), 1.0)
    np.testing.assert_array_equal(_np(ours.accumulators[0]), _np(builtin._accumulated_gradients[0]))
    np.testing.assert_array_equal(_np(v_ours), _np(v_keras))


def _overwrite_pair():
    v = keras.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], "float32"))
    v.overwrite_with_gradient = True
    return v, keras.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], "float32"))


def test_overwrite_with_gradient():
    """Keras's test_overwrite_with_gradient_with_gradient_accumulation, step by step against
    the built-in: such a variable (a float8 scale or amax history) keeps its value inside a
    cycle and takes the elementwise maximum of the cycle's gradients at the boundary; the
    others update normally. Non-negative gradients, as amax values are."""
    k = 2
    ours = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=k)
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=k)
    (ow_ours, v2_ours), (ow_keras, v2_keras) = _overwrite_pair(), _overwrite_pair()
    grads = [np.abs(g) for g in _grads(10, seed=3)]
    for step in range(0, 10, 2):
        for opt, ow, v2 in ((ours, ow_ours, v2_ours), (builtin, ow_keras, v2_keras)):
            opt.apply_gradients(
                [
                    (ops.convert_to_tensor(grads[step]), ow),
                    (ops.convert_to_tensor(grads[step + 1]), v2),
                ]
            )
        np.testing.assert_allclose(_np(ow_ours), _np(ow_keras), rtol=1e-6)
        np.testing.assert_allclose(_np(v2_ours), _np(v2_keras), rtol=1e-6)
        if step // 2 % k == 0:  # inside a cycle: unchanged
            expected = (
                np.array([[1.0, 2.0], [3.0, 4.0]])
                if step == 0
                else np.maximum(grads[step - 4], grads[step - 2])
            )
        else:
            expected = np.maximum(grads[step - 2], grads[step])
        np.testing.assert_allclose(_np(ow_ours), expected, rtol=1e-6)


def test_overwrite_with_negative_gradients_takes_their_maximum():
    """Deliberate difference: our cycle maximum is that of the gradients; Keras's built-in
    starts its maximum from zero, so a cycle of negative values gives it 0. With k=1 both the
    wrapper and a plain optimizer write the gradient itself."""
    ours = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=2)
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    (ow_ours, v2_ours), (ow_keras, v2_keras) = _overwrite_pair(), _overwrite_pair()
    g1, g2 = -np.abs(_grads(2, seed=4)[0]) - 0.1, -np.abs(_grads(2, seed=4)[1]) - 0.1
    for g in (g1, g2):
        ours.apply_gradients([(ops.convert_to_tensor(g), ow_ours), (ops.ones((2, 2)), v2_ours)])
        builtin.apply_gradients(
            [(ops.convert_to_tensor(g), ow_keras), (ops.ones((2, 2)), v2_keras)]
        )
    np.testing.assert_allclose(_np(ow_ours), np.maximum(g1, g2), rtol=1e-6)
    np.testing.assert_array_equal(_np(ow_keras), 0.0)
    single = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=1)
    ow, v2 = _overwrite_pair()
    single.apply_gradients([(ops.convert_to_tensor(g1), ow), (ops.ones((2, 2)), v2)])
    np.testing.assert_allclose(_np(ow), g1, rtol=1e-6)


@pytest.mark.parametrize(
    "clipping", [{"global_clipnorm": 1.0}, {"clipnorm": 0.5}, {"clipvalue": 0.2}], ids=str
)
def test_clipping_leaves_overwrite_with_gradient_variables_out(clipping):
    """Keras takes the ``overwrite_with_gradient`` variables out before it clips: the wrapper's
    clipping of the cycle's gradient sees only the others, so their update equals a
    plain optimizer's with the same clipping on the big batch's mean gradient (float32; 1e-6
    relative), however large the overwrite variable's value (here 100 against gradients of
    order 1, which a global norm over every variable let shrink the update). Per-variable
    clipping (``clipnorm``, ``clipvalue``) never mixed them and is held as it was."""
    k = 2
    rng = np.random.default_rng(5)
    micro = rng.normal(size=(k, 2, 2)).astype("float32")
    amax = [np.full((2, 2), 100.0 * (i + 1), "float32") for i in range(k)]
    ours = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=k, **clipping)
    plain = keras.optimizers.SGD(1.0, **clipping)
    (ow_ours, v_ours), (ow_plain, v_plain) = _overwrite_pair(), _overwrite_pair()
    for i in range(k):
        ours.apply_gradients(
            [(ops.convert_to_tensor(amax[i]), ow_ours), (ops.convert_to_tensor(micro[i]), v_ours)]
        )
    plain.apply_gradients(
        [
            (ops.convert_to_tensor(np.maximum(*amax)), ow_plain),
            (ops.convert_to_tensor(micro.mean(axis=0)), v_plain),
        ]
    )
    np.testing.assert_allclose(_np(v_ours), _np(v_plain), rtol=1e-6)
    np.testing.assert_allclose(_np(ow_ours), np.maximum(*amax), rtol=1e-6)
    np.testing.assert_allclose(_np(ow_plain), np.maximum(*amax), rtol=1e-6)


@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
def test_weight_decay_every_optimizer(name):
    """Keras's test_gradient_accumulation_with_weigth_decay: 3 micro-batches through the
    wrapper equal one step of the same optimizer on their mean gradient, for every optimizer."""
    rng = np.random.default_rng(1)
    plain = keras.optimizers.get({"class_name": name, "config": {"weight_decay": 0.05}})
    ours = GradientAccumulateOptimizer(
        keras.optimizers.get({"class_name": name, "config": {"weight_decay": 0.05}}),
        accum_steps=3,
    )
    v_plain = keras.Variable([[0.9], [0.5]])
    v_ours = keras.Variable([[0.9], [0.5]])
    for _ in range(3):
        grads3 = rng.random((3, 2, 1)).astype("float32")
        plain.apply_gradients([(ops.convert_to_tensor(grads3.mean(axis=0)), v_plain)])
        for batch in range(3):
            ours.apply_gradients([(ops.convert_to_tensor(grads3[batch]), v_ours)])
    np.testing.assert_allclose(_np(v_ours), _np(v_plain), rtol=1e-5, atol=1e-6)
    assert not np.allclose(_np(v_plain), [[0.9], [0.5]])


@pytest.mark.parametrize("overwrite_frequency", [None, 2])
def test_ema_is_the_big_batch_ema(overwrite_frequency):
    """Deliberate difference: with ``use_ema`` on the inner optimizer, the moving average
    moves once per update, so it is the big batch's. Keras's built-in accumulation moves it
    on every micro-step (toward weights that have not changed), so from the third cycle on it
    is not. With ``ema_overwrite_frequency`` the weights themselves follow the big batch's."""
    k, cycles = 2, 4
    grads = _grads(k * cycles, seed=5)

    def sgd(**kw):
        return keras.optimizers.SGD(
            0.5, use_ema=True, ema_momentum=0.7, ema_overwrite_frequency=overwrite_frequency, **kw
        )

    big, builtin = sgd(), sgd(gradient_accumulation_steps=k)
    ours = GradientAccumulateOptimizer(sgd(), accum_steps=k)
    v_big, v_ours, v_keras = (keras.Variable([[1.0, 2.0], [3.0, 4.0]]) for _ in range(3))
    for c in range(cycles):
        cycle = grads[c * k : (c + 1) * k]
        big.apply_gradients([(ops.convert_to_tensor(np.mean(cycle, axis=0)), v_big)])
        for g in cycle:
            ours.apply_gradients([(ops.convert_to_tensor(g), v_ours)])
            builtin.apply_gradients([(ops.convert_to_tensor(g), v_keras)])
        np.testing.assert_allclose(_np(v_ours), _np(v_big), rtol=1e-6, atol=1e-6)
    ema_big = _np(big._model_variables_moving_average[0])
    ema_ours = _np(ours.inner_optimizer._model_variables_moving_average[0])
    ema_keras = _np(builtin._model_variables_moving_average[0])
    np.testing.assert_allclose(ema_ours, ema_big, rtol=1e-6, atol=1e-6)
    if overwrite_frequency is None:
        assert np.abs(ema_keras - ema_big).max() > 1e-3
    # finalize_variable_values (end of fit) writes the big batch's average into the variable.
    ours.finalize_variable_values([v_ours])
    big.finalize_variable_values([v_big])
    np.testing.assert_allclose(_np(v_ours), _np(v_big), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "clip", [{"clipnorm": 0.3}, {"clipvalue": 0.2}, {"global_clipnorm": 0.4}], ids=str
)
@pytest.mark.parametrize("where", ["wrapper", "inner"])
def test_clip_options_clip_the_averaged_gradient(clip, where):
    """Keras's built-in accumulation clips the cycle's averaged gradient; so do we, whether the
    option is set on the wrapper or on the inner optimizer."""
    k = 3
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=k, **clip)
    if where == "wrapper":
        ours = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=k, **clip)
    else:
        ours = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0, **clip), accum_steps=k)
    v_ours = [keras.Variable(np.zeros((2, 2), "float32")), keras.Variable(np.zeros(3, "float32"))]
    v_keras = [keras.Variable(np.zeros((2, 2), "float32")), keras.Variable(np.zeros(3, "float32"))]
    g1, g2 = _grads(6, seed=7), _grads(6, shape=(3,), seed=8)
    for a, b in zip(g1, g2):
        pair = [ops.convert_to_tensor(a), ops.convert_to_tensor(b)]
        ours.apply_gradients(zip(pair, v_ours))
        builtin.apply_gradients(zip(pair, v_keras))
        for x, y in zip(v_ours, v_keras):
            np.testing.assert_allclose(_np(x), _np(y), rtol=1e-6, atol=1e-7)
    # And clipping happened: unclipped SGD on the mean gradients is elsewhere.
    unclipped = -(np.mean(g1[:3], 0) + np.mean(g1[3:], 0))
    assert np.abs(_np(v_ours[0]) - unclipped).max() > 1e-2


def test_argument_errors():
    """The base optimizer's and the loss-scale optimizer's refusals, on the wrapper."""
    with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and"):
        GradientAccumulateOptimizer("sgd", clipnorm=1.0, clipvalue=1.0)
    with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and"):
        GradientAccumulateOptimizer("sgd", clipnorm=1.0, global_clipnorm=1.0)
    for key, value in [
        ("weight_decay", 0.5),
        ("use_ema", True),
        ("ema_momentum", 0.5),
        ("ema_overwrite_frequency", 2),
        ("loss_scale_factor", 0.5),
        ("gradient_accumulation_steps", 2),
        ("learning_rate", 0.1),
    ]:
        with pytest.raises(ValueError, match=f"{key} .*inner optimizer"):
            GradientAccumulateOptimizer("sgd", accum_steps=2, **{key: value})
    with pytest.raises(ValueError, match="Argument.*not recognized"):
        GradientAccumulateOptimizer("sgd", foo=True)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        GradientAccumulateOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="accum_steps"):
        GradientAccumulateOptimizer("sgd", accum_steps=0)
    with pytest.raises(TypeError, match="accum_steps"):
        GradientAccumulateOptimizer("sgd", accum_steps=2.0)


def test_config_round_trip():
    """get_config → from_config (and Keras serialization, and pickle) give the same config
    and the same updates."""
    opt = GradientAccumulateOptimizer(
        keras.optimizers.Adam(0.01, beta_1=0.8),
        accum_steps=3,
        reduction="SUM",
        clipnorm=0.5,
        name="acc",
    )
    config = opt.get_config()
    for clone in (
        GradientAccumulateOptimizer.from_config(config),
        keras.optimizers.deserialize(keras.optimizers.serialize(opt)),
        pickle.loads(pickle.dumps(opt)),
    ):
        assert type(clone) is GradientAccumulateOptimizer
        assert clone.get_config() == config
        assert clone.inner_optimizer.beta_1 == 0.8
    clone = GradientAccumulateOptimizer.from_config(config)
    v1, v2 = keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones(3, "float32"))
    for g in _grads(3, shape=(3,)):
        opt.apply_gradients([(ops.convert_to_tensor(g), v1)])
        clone.apply_gradients([(ops.convert_to_tensor(g), v2)])
    np.testing.assert_array_equal(_np(v1), _np(v2))


def test_older_configs_deserialize():
    """Keras's test_deserialization_backwards_compatibility, for our wrapper: a config holding
    the base optimizer's arguments at their defaults loads; one with a real value is refused;
    a 0.5 config (tf.keras 2 inner optimizer with decay=0.0) loads with its settings."""
    base = {
        "name": "acc",
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
        "learning_rate": 0.0,
        "optimizer": keras.optimizers.serialize(keras.optimizers.SGD(0.5)),
        "accum_steps": 2,
        "reduction": "MEAN",
    }
    opt = GradientAccumulateOptimizer.from_config(base)
    assert opt.accum_steps == 2 and float(_np(opt.learning_rate)) == 0.5
    with pytest.raises(ValueError, match="use_ema .*inner optimizer"):
        GradientAccumulateOptimizer.from_config({**base, "use_ema": True})
    v05 = {
        "name": "GradientAccumulateOptimizer",
        "accum_steps": 4,
        "reduction": "MEAN",
        "optimizer": {
            "class_name": "SGD",
            "config": {
                "name": "SGD",
                "learning_rate": 0.01,
                "decay": 0.0,
                "momentum": 0.9,
                "nesterov": False,
            },
        },
    }
    opt = GradientAccumulateOptimizer.from_config(v05)
    assert opt.accum_steps == 4 and opt.reduction == "MEAN"
    assert isinstance(opt.inner_optimizer, keras.optimizers.SGD)
    assert opt.inner_optimizer.momentum == 0.9
    assert float(_np(opt.learning_rate)) == pytest.approx(0.01)


@pytest.mark.parametrize("flush", [False, True], ids=["boundary", "flush"])
@pytest.mark.parametrize(
    "pattern",
    [("g", "g", "-"), ("-", "g", "g"), ("g", "-", "g"), ("-", "-", "-")],
    ids=lambda p: "".join(p),
)
def test_overwrite_with_gradient_missing_in_some_micro_steps(pattern, flush):
    """A cycle of three micro-steps in which the overwrite variable has a gradient only where
    ``pattern`` says "g": it takes the maximum of those, whichever micro-step lacks one (the
    boundary's included), and keeps its value when it has none; the other variable's update
    is unaffected. With ``flush``, the cycle is cut after its third micro-step (accum 4).
    Before the fix a gradient missing at the boundary wrote maximum / total weight (the torch
    backend's core path: an SGD step) into the variable."""
    k = 4 if flush else 3
    ours = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=k)
    ow, v2 = _overwrite_pair()
    start = _np(ow).copy()
    grads = [np.abs(g) + 0.5 for g in _grads(3, seed=5)]
    for g, mark in zip(grads, pattern):
        ours.apply([ops.convert_to_tensor(g) if mark == "g" else None, ops.ones((2, 2))], [ow, v2])
    if flush:
        assert ours.flush()
    present = [g for g, mark in zip(grads, pattern) if mark == "g"]
    expected = np.maximum.reduce(present) if present else start
    np.testing.assert_allclose(_np(ow), expected, rtol=1e-6)
    np.testing.assert_allclose(_np(v2), np.array([[0.0, 1.0], [2.0, 3.0]]), rtol=1e-6)
