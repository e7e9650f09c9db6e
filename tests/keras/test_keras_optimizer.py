"""GradientAccumulateOptimizer's own contract: when the inner optimizer runs, what it counts,
reductions, precision, loss scaling, config round-trip and argument errors."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops
from keras_helpers import BACKEND, data, flat, make_inner, mlp, rel_diff

from gradient_accumulator.keras import GradientAccumulateOptimizer

# On the PyTorch backend every behaviour is checked on both paths (C++ core and backend ops).
PATHS = [None, False] if BACKEND == "torch" else [None]


def _np(x):
    return np.asarray(ops.convert_to_numpy(x))


def _apply(opt, variables, grads):
    opt.apply([ops.convert_to_tensor(g) for g in grads], variables)


@pytest.mark.parametrize("use_core", PATHS)
def test_inner_update_runs_only_at_the_boundary(use_core):
    """No moment update, no weight change, no inner step on the k−1 skipped micro-steps."""
    w = keras.Variable(np.ones(3, "float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), accum_steps=3, use_core=use_core)
    grads = [
        np.array([1.0, 2.0, 3.0], "float32"),
        np.array([3.0, 2.0, 1.0], "float32"),
        np.array([2.0, 2.0, 2.0], "float32"),
    ]
    for g in grads[:2]:
        _apply(opt, [w], [g])
        np.testing.assert_array_equal(_np(w), np.ones(3))
        np.testing.assert_array_equal(_np(opt.optimizer._momentums[0]), np.zeros(3))
        assert int(opt.iterations) == 0
    _apply(opt, [w], [grads[2]])
    mean = np.mean(grads, axis=0)
    # One Adam step from zero moments with the mean gradient: m̂/√v̂ = sign, so w -= lr·(1 − tiny).
    np.testing.assert_allclose(_np(opt.optimizer._momentums[0]), 0.1 * mean, rtol=1e-6)
    np.testing.assert_allclose(_np(opt.optimizer._velocities[0]), 0.001 * mean**2, rtol=1e-5)
    np.testing.assert_allclose(_np(w), 1.0 - 0.1 * mean / (mean + 1e-7), rtol=1e-6)
    assert int(opt.iterations) == 1 and int(opt.optimizer.iterations) == 1
    assert int(opt.micro_steps) == 3 and opt.pending() == 0


@pytest.mark.parametrize("use_core", PATHS)
def test_schedule_counts_updates(use_core):
    """The learning-rate schedule sees the number of updates, not of micro-steps."""
    sched = keras.optimizers.schedules.PiecewiseConstantDecay([0, 1], [1.0, 0.5, 0.25])
    w = keras.Variable(np.zeros(2, "float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(sched), accum_steps=2, use_core=use_core)
    expected = np.zeros(2)
    for lr in (1.0, 0.5, 0.25):
        for _ in range(2):
            _apply(opt, [w], [np.ones(2, "float32")])
        expected -= lr
        np.testing.assert_allclose(_np(w), expected, rtol=1e-6)
    assert float(_np(opt.learning_rate)) == pytest.approx(0.25)


@pytest.mark.parametrize("use_core", PATHS)
def test_learning_rate_is_settable_by_callbacks(use_core):
    """LearningRateScheduler and ReduceLROnPlateau set the inner optimizer's learning rate."""
    x, y = data(32)
    inputs, outputs = mlp()
    model = keras.Model(inputs, outputs)
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2, use_core=use_core)
    model.compile(opt, loss="mse")
    seen = []
    sched = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: seen.append(float(_np(model.optimizer.learning_rate)))
    )
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[sched, record])
    np.testing.assert_allclose(seen, [0.1, 0.05, 0.1 / 3], rtol=1e-6)
    assert float(_np(opt.optimizer.learning_rate)) == pytest.approx(0.1 / 3)
    opt.learning_rate = 0.5
    assert float(_np(opt.optimizer.learning_rate)) == pytest.approx(0.5)


@pytest.mark.parametrize("use_core", PATHS)
@pytest.mark.parametrize("reduction", ["MEAN", "SUM", "RUNNING_MEAN", "running_mean"])
def test_reductions(reduction, use_core):
    """MEAN and RUNNING_MEAN apply the mean, SUM the sum (SGD, lr 0.5)."""
    w = keras.Variable(np.zeros((2, 2), "float32"))
    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.5), accum_steps=4, reduction=reduction, use_core=use_core
    )
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(4, 2, 2)).astype("float32")
    for g in grads:
        _apply(opt, [w], [g])
    total = grads.astype(np.float64).sum(0)
    expected = -0.5 * (total if reduction == "SUM" else total / 4)
    np.testing.assert_allclose(_np(w), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("use_core", PATHS)
def test_low_precision_variables_accumulate_in_float32(use_core):
    """bf16 variables and gradients: fp32 accumulators, within one bf16 rounding of fp64."""
    k = 64
    w = keras.Variable(np.zeros(256, "float32"), dtype="bfloat16")
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=k, use_core=use_core)
    rng = np.random.default_rng(0)
    grads = [
        ops.cast(rng.normal(1.0, 0.1, size=256).astype("float32"), "bfloat16") for _ in range(k)
    ]
    opt.apply(grads[:1], [w])
    assert keras.backend.standardize_dtype(opt.accumulators[0].dtype) == "float32"
    for g in grads[1:]:
        opt.apply([g], [w])
    ref = -np.mean([_np(ops.cast(g, "float32")).astype(np.float64) for g in grads], axis=0)
    got = _np(ops.cast(w, "float32")).astype(np.float64)
    # One bf16 rounding of the result (8 significant bits); k roundings would be ~k times more.
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= 2.0**-8


@pytest.mark.parametrize("use_core", PATHS)
def test_nonfinite_cycle_is_skipped_and_scale_adapts(use_core):
    """mixed_precision: a cycle with inf skips, resets, halves the scale; growth doubles it."""
    w = keras.Variable(np.zeros(2, "float32"))
    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(1.0),
        accum_steps=2,
        mixed_precision=True,
        initial_scale=8.0,
        dynamic_growth_steps=2,
        use_core=use_core,
    )
    one = np.ones(2, "float32")
    _apply(opt, [w], [8.0 * one])
    _apply(opt, [w], [np.array([np.inf, 1.0], "float32")])
    np.testing.assert_array_equal(_np(w), [0.0, 0.0])
    assert float(_np(opt.loss_scale)) == 4.0 and int(opt.iterations) == 0
    # Next cycle: scaled by 4; its update alone (nothing of the skipped cycle is left over).
    _apply(opt, [w], [4.0 * one])
    _apply(opt, [w], [12.0 * one])
    np.testing.assert_allclose(_np(w), [-2.0, -2.0])
    _apply(opt, [w], [4.0 * one])
    _apply(opt, [w], [4.0 * one])
    np.testing.assert_allclose(_np(w), [-3.0, -3.0])
    assert float(_np(opt.loss_scale)) == 8.0  # two good updates: doubled
    assert float(_np(opt.scale_loss(ops.convert_to_tensor(1.0)))) == 8.0


def test_loss_scale_optimizer_is_taken_over():
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    opt = GradientAccumulateOptimizer(inner, accum_steps=2)
    assert opt.mixed_precision and opt.initial_scale == 64.0
    assert isinstance(opt.optimizer, keras.optimizers.SGD)


def test_config_round_trip():
    opt = GradientAccumulateOptimizer(
        keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)),
        accum_steps=3,
        reduction="SUM",
        use_agc=True,
        clip_factor=0.02,
        eps=1e-4,
        leftover="carry",
        global_clipnorm=1.0,
    )
    config = opt.get_config()
    assert config["accum_steps"] == 3 and config["reduction"] == "SUM"
    clone = GradientAccumulateOptimizer.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.optimizer, keras.optimizers.Adam)
    revived = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(revived, GradientAccumulateOptimizer)
    assert revived.get_config() == config


def test_string_optimizer_and_defaults():
    opt = GradientAccumulateOptimizer()
    assert isinstance(opt.optimizer, keras.optimizers.SGD)
    assert (opt.accum_steps, opt.reduction, opt.name) == (1, "MEAN", "GradientAccumulateOptimizer")
    assert isinstance(GradientAccumulateOptimizer("adam", 2).optimizer, keras.optimizers.Adam)


@pytest.mark.parametrize("use_core", PATHS)
def test_accum_steps_one_is_the_plain_optimizer(use_core):
    x, y = data(32)
    runs = []
    for wrap in (False, True):
        inputs, outputs = mlp()
        model = keras.Model(inputs, outputs)
        inner = make_inner("Adam")
        opt = GradientAccumulateOptimizer(inner, 1, use_core=use_core) if wrap else inner
        model.compile(opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs.append(flat(model))
    assert rel_diff(runs[1], runs[0]) <= 1e-5


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": -2}, ValueError, "accum_steps"),
        ({"accum_steps": 2.5}, TypeError, "accum_steps"),
        ({"accum_steps": "4"}, TypeError, "accum_steps"),
        ({"accum_steps": True}, TypeError, "accum_steps"),
        ({"reduction": "median"}, ValueError, "reduction"),
        ({"reduction": 1}, TypeError, "reduction"),
        ({"optimizer": 42}, TypeError, "optimizer"),
        ({"optimizer": "no-such-optimizer"}, ValueError, "optimizer"),
        ({"leftover": "drop"}, ValueError, "leftover"),
        ({"clip_factor": -1.0}, ValueError, "clip_factor"),
        ({"eps": "x"}, TypeError, "eps"),
        ({"mixed_precision": "yes"}, TypeError, "mixed_precision"),
        ({"weight_decay": 0.1}, ValueError, "weight_decay"),
        ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps"),
        ({"initial_scale": 0.0}, ValueError, "initial_scale"),
        ({"agc_exclude": 3}, TypeError, "agc_exclude"),
    ],
)
def test_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        GradientAccumulateOptimizer(**kwargs)


def test_inner_gradient_accumulation_is_refused():
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        GradientAccumulateOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2), 2)
    with pytest.raises(TypeError, match="already"):
        GradientAccumulateOptimizer(GradientAccumulateOptimizer(), 2)


def test_use_core_needs_torch():
    if BACKEND == "torch":
        assert GradientAccumulateOptimizer(use_core=True).use_core is True
    else:
        with pytest.raises(ValueError, match="use_core"):
            GradientAccumulateOptimizer(use_core=True)


def test_mismatched_lists():
    w = keras.Variable(np.zeros(2, "float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), 2)
    with pytest.raises(ValueError, match="differ in length"):
        opt.apply([ops.ones(2), ops.ones(2)], [w])


# --- Micro-batch weights (apply(weight=...)), against the big batch in float64. ---


def _linear_problem(n=28, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6))
    y = rng.normal(size=(n, 3))
    w0 = rng.normal(size=(6, 3)) * 0.3
    b0 = rng.normal(size=(3,)) * 0.1
    return x, y, w0, b0


def _mse_grads(x, y, w, b):
    """Gradient of mean((xw + b − y)²) over the batch and the outputs, in float64."""
    r = 2.0 * (x @ w + b - y) / y.size
    return x.T @ r, r.sum(axis=0)


def _sgd_fp64(x, y, w, b, lr, steps):
    for _ in range(steps):
        gw, gb = _mse_grads(x, y, w, b)
        w, b = w - lr * gw, b - lr * gb
    return w, b


@pytest.mark.parametrize("use_core", PATHS)
@pytest.mark.parametrize("call", ["apply", "apply_gradients"])
def test_micro_batch_weight_makes_a_short_last_batch_exact(call, use_core):
    """Micro-batches of 8, 8, 8 and 4 (per-batch mean gradients, weight = batch size): the
    cycle's update is the big batch's of 28, in float64, over two cycles."""
    x, y, w0, b0 = _linear_problem()
    lr = 0.1
    sizes = (8, 8, 8, 4)
    results = {}
    for weighted in (True, False):
        w = keras.Variable(w0.astype("float32"))
        b = keras.Variable(b0.astype("float32"))
        opt = GradientAccumulateOptimizer(
            keras.optimizers.SGD(lr), accum_steps=4, use_core=use_core
        )
        for _ in range(2):
            start = 0
            for size in sizes:
                xs, ys = x[start : start + size], y[start : start + size]
                start += size
                gw, gb = _mse_grads(xs, ys, _np(w).astype(np.float64), _np(b).astype(np.float64))
                grads = [ops.convert_to_tensor(g.astype("float32")) for g in (gw, gb)]
                weight = size if weighted else None
                if call == "apply":
                    opt.apply(grads, [w, b], weight=weight)
                else:
                    opt.apply_gradients(zip(grads, [w, b]), weight=weight)
        assert int(opt.iterations) == 2 and opt.pending() == 0
        assert float(_np(opt.counter("batch_weight"))) == 1.0  # the weight counted once
        results[weighted] = np.concatenate([_np(w).ravel(), _np(b).ravel()]).astype(np.float64)
    ref_w, ref_b = _sgd_fp64(x, y, w0, b0, lr, 2)
    ref = np.concatenate([ref_w.ravel(), ref_b.ravel()])
    assert rel_diff(results[True], ref) <= 2e-6
    assert rel_diff(results[False], ref) > 1e-4  # unweighted: each micro-batch counts 1/4


def test_micro_batch_weight_in_a_compiled_step():
    """The weight as a tensor argument of a custom step (compiled by tf.function on
    TensorFlow)."""
    x, y, w0, b0 = _linear_problem()
    w = keras.Variable(w0.astype("float32"))
    b = keras.Variable(b0.astype("float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
    opt.build([w, b])

    def step(gw, gb, weight):
        opt.apply([gw, gb], [w, b], weight=weight)

    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(step)
    start = 0
    for size in (8, 8, 8, 4):
        xs, ys = x[start : start + size], y[start : start + size]
        start += size
        gw, gb = _mse_grads(xs, ys, w0, b0)
        step(
            ops.convert_to_tensor(gw.astype("float32")),
            ops.convert_to_tensor(gb.astype("float32")),
            ops.convert_to_tensor(np.float32(size)),
        )
    ref_w, ref_b = _sgd_fp64(x, y, w0, b0, 0.1, 1)
    got = np.concatenate([_np(w).ravel(), _np(b).ravel()])
    assert rel_diff(got, np.concatenate([ref_w.ravel(), ref_b.ravel()])) <= 2e-6


@pytest.mark.parametrize(
    "kwargs, weight, error, match",
    [
        ({}, -1.0, ValueError, "weight must be finite and >= 0"),
        ({}, float("nan"), ValueError, "weight must be finite"),
        ({}, "8", TypeError, "weight must be a number"),
        ({}, True, TypeError, "weight must be a number"),
        ({}, np.ones(2, "float32"), ValueError, "weight must be a scalar"),
        ({"reduction": "SUM"}, 2.0, ValueError, "weight has no effect"),
    ],
)
def test_bad_micro_batch_weight_changes_nothing(kwargs, weight, error, match):
    w = keras.Variable(np.ones(2, "float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), 2, **kwargs)
    opt.build([w])
    before = [_np(v).copy() for v in opt.variables]
    with pytest.raises(error, match=match):
        opt.apply([ops.ones(2)], [w], weight=weight)
    assert all(np.array_equal(_np(v), b) for v, b in zip(opt.variables, before))
    assert opt.pending() == 0


def test_model_wrapper_fit_short_last_batch_matches_float64_big_batch():
    """GradientAccumulateModel in fit: batches 8, 8, 8, 4 per cycle (each weighted by its
    size), two epochs = two big-batch SGD steps of 28, in float64."""
    from gradient_accumulator.keras import GradientAccumulateModel

    x, y, w0, b0 = _linear_problem()
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(inputs)
    model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    model.set_weights([w0.astype("float32"), b0.astype("float32")])
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    model.fit(
        x.astype("float32"), y.astype("float32"), batch_size=8, epochs=2, shuffle=False, verbose=0
    )
    ref_w, ref_b = _sgd_fp64(x, y, w0, b0, 0.1, 2)
    got = np.concatenate([np.ravel(v) for v in model.get_weights()]).astype(np.float64)
    assert int(model.optimizer.iterations) == 2
    assert rel_diff(got, np.concatenate([ref_w.ravel(), ref_b.ravel()])) <= 2e-6


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_gradients_are_taken_like_tensors(dtype):
    # The torch backend's core path called .detach() on a NumPy gradient (AttributeError); the
    # other backends convert it. Two cycles with NumPy gradients equal the same with tensors.
    rng = np.random.default_rng(3)
    grads = [[rng.normal(size=s).astype(dtype) for s in ((4, 3), (3,))] for _ in range(4)]
    results = []
    for as_numpy in (False, True):
        variables = [keras.Variable(np.ones(s, "float32")) for s in ((4, 3), (3,))]
        opt = GradientAccumulateOptimizer(make_inner("Adam"), accum_steps=2)
        for g in grads:
            opt.apply(
                g if as_numpy else [ops.convert_to_tensor(x, "float32") for x in g], variables
            )
        assert int(opt.iterations) == 2
        results.append([_np(v) for v in variables])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
