"""AccumBatchNormalization: k=1 is Keras BN; k micro-batches give the big batch's statistics;
any input rank and axis; Keras's training=None/trainable rules; replace_batchnorm_layers."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops
from keras_helpers import data, flat, mlp, rel_diff

from gradient_accumulator.keras import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    replace_batchnorm_layers,
)


def _np(x):
    return np.asarray(ops.convert_to_numpy(x), np.float64)


def _stats(layer):
    return np.concatenate([_np(layer.moving_mean), _np(layer.moving_variance)])


def test_k1_is_keras_batchnorm():
    """The original's test_compare_bn_layers: AccumBN(k=1) ≡ BatchNormalization, weights too."""
    x, y = data(64)
    models = []
    for bn in (keras.layers.BatchNormalization, AccumBatchNormalization):
        inputs, outputs = mlp(bn=bn)
        model = keras.Model(inputs, outputs)
        model.compile(keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        models.append(model)
    keras_bn, accum_bn = (m.layers[2] for m in models)
    assert rel_diff(_stats(accum_bn), _stats(keras_bn)) <= 1e-6

    def bn_model_weights(model):  # AccumBN's own accumulators come after BN's four weights
        return np.concatenate(
            [np.ravel(w) for layer in model.layers for w in layer.get_weights()[:4]]
        )

    assert rel_diff(bn_model_weights(models[1]), bn_model_weights(models[0])) <= 1e-6
    np.testing.assert_allclose(
        models[1].predict(x, verbose=0), models[0].predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("accum", [2, 4])
def test_k_micro_batches_give_big_batch_statistics(accum):
    """The original's test_compare_accum_bn_expected_result, on the statistics themselves.

    BN sits on the inputs, so its statistics depend on the data only: after training, AccumBN(k)
    fed micro-batches of 8 in a k-step model wrapper has the moving statistics of a Keras BN fed
    batches of 8·k.
    """
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(96, 5)) * [1, 2, 3, 4, 5] + [0, 1, -1, 2, 5]).astype("float32")
    y = rng.normal(size=(96, 1)).astype("float32")

    def build(bn, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        outputs = keras.layers.Dense(1)(bn(momentum=0.8, **kwargs)(inputs))
        return inputs, outputs

    inputs, outputs = build(keras.layers.BatchNormalization)
    big = keras.Model(inputs, outputs)
    big.compile(keras.optimizers.SGD(0.01), loss="mse")
    big.fit(x, y, batch_size=8 * accum, epochs=2, shuffle=False, verbose=0)
    inputs, outputs = build(AccumBatchNormalization, accum_steps=accum)
    acc = GradientAccumulateModel(accum_steps=accum, inputs=inputs, outputs=outputs)
    acc.compile(keras.optimizers.SGD(0.01), loss="mse")
    acc.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(_stats(acc.layers[1]), _stats(big.layers[1])) <= 1e-5
    # The original's shortcut (mean of the micro-batch variances) would be visibly off here.
    cycle = x[: 8 * accum].astype(np.float64)
    shortcut = np.mean([cycle[i : i + 8].var(0) for i in range(0, 8 * accum, 8)], axis=0)
    assert np.max(np.abs(shortcut - cycle.var(0)) / cycle.var(0)) > 1e-2


def _reference_update(batches, axis, momentum, init_mean, init_var):
    """Moving statistics after one Keras-convention update with the concatenated batches."""
    x = np.concatenate(batches, axis=0).astype(np.float64)
    axes = tuple(a for a in range(x.ndim) if a != axis % x.ndim)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    return init_mean * momentum + mean * (1 - momentum), init_var * momentum + var * (1 - momentum)


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((4, 3), -1), ((4, 7, 3), -1), ((4, 5, 6, 3), -1), ((2, 4, 3, 5, 3), -1), ((4, 3, 5, 6), 1)],
    ids=["dense", "conv1d", "conv2d", "conv3d", "channels-first"],
)
def test_any_rank_and_axis(shape, axis):
    """The original's test_bn_conv2d / test_bn_conv3d (and rank 3, and axis=1), with numbers."""
    rng = np.random.default_rng(7)
    batches = [(rng.normal(size=shape) * 2 + 1).astype("float32") for _ in range(3)]
    layer = AccumBatchNormalization(accum_steps=3, momentum=0.9, axis=axis)
    for i, b in enumerate(batches):
        out = _np(layer(b, training=True))
        # Each micro-batch is normalised with its own statistics.
        axes = tuple(a for a in range(len(shape)) if a != axis % len(shape))
        ref = (b - b.mean(axes, keepdims=True)) / np.sqrt(b.var(axes, keepdims=True) + 1e-3)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
        if i < 2:  # no update before the end of the cycle
            np.testing.assert_array_equal(_np(layer.moving_mean), 0.0)
            np.testing.assert_array_equal(_np(layer.moving_variance), 1.0)
    channels = shape[axis]
    mean, var = _reference_update(batches, axis, 0.9, np.zeros(channels), np.ones(channels))
    np.testing.assert_allclose(_np(layer.moving_mean), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(layer.moving_variance), var, rtol=1e-5, atol=1e-6)


def test_uneven_micro_batches_merge_exactly():
    rng = np.random.default_rng(8)
    batches = [rng.normal(size=(n, 4)).astype("float32") * 3 for n in (2, 5, 9)]
    layer = AccumBatchNormalization(accum_steps=3, momentum=0.5)
    for b in batches:
        layer(b, training=True)
    mean, var = _reference_update(batches, -1, 0.5, np.zeros(4), np.ones(4))
    np.testing.assert_allclose(_np(layer.moving_mean), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(layer.moving_variance), var, rtol=1e-5, atol=1e-6)


def test_training_none_and_trainable_false_are_inference():
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32") + 5
    for kwargs in ({"training": None}, {"training": False}):
        layer = AccumBatchNormalization()
        out = _np(layer(x, **kwargs))
        np.testing.assert_allclose(out, x / np.sqrt(1 + 1e-3), rtol=1e-6)
        np.testing.assert_array_equal(_np(layer.moving_mean), 0.0)
    frozen = AccumBatchNormalization()
    frozen.trainable = False
    frozen(x, training=True)
    np.testing.assert_array_equal(_np(frozen.moving_mean), 0.0)
    # In fit, training=True reaches the layer.
    inputs = keras.Input((3,))
    layer = AccumBatchNormalization()
    model = keras.Model(inputs, layer(inputs))
    model.compile("sgd", loss="mse")
    model.fit(x, x, batch_size=8, verbose=0)
    np.testing.assert_allclose(_np(layer.moving_mean), 0.01 * x.mean(0), rtol=1e-5)


def test_mixed_precision_statistics_in_float32():
    keras.config.set_dtype_policy("mixed_float16")
    layer = AccumBatchNormalization(accum_steps=2)
    x = np.random.default_rng(1).normal(size=(6, 4)).astype("float16")
    out = layer(x, training=True)
    layer(x, training=True)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert keras.backend.standardize_dtype(layer.moving_mean.dtype) == "float32"
    mean, _ = _reference_update([x, x], -1, 0.99, np.zeros(4), np.ones(4))
    np.testing.assert_allclose(_np(layer.moving_mean), mean, rtol=1e-3, atol=1e-6)


def test_config_round_trip_and_errors():
    layer = AccumBatchNormalization(accum_steps=3, momentum=0.9, epsilon=1e-4, axis=1, center=False)
    config = layer.get_config()
    assert config["accum_steps"] == 3 and config["axis"] == 1 and not config["center"]
    clone = AccumBatchNormalization.from_config(config)
    assert clone.get_config() == config
    with pytest.raises(ValueError, match="accum_steps"):
        AccumBatchNormalization(accum_steps=0)
    with pytest.raises(TypeError, match="accum_steps"):
        AccumBatchNormalization(accum_steps="2")
    with pytest.raises(ValueError, match="renorm"):
        AccumBatchNormalization(renorm=True)
    with pytest.raises(ValueError, match="rank"):
        AccumBatchNormalization().build((4,))


def _bn_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.999, epsilon=1e-5, name="bn")(h)
    a = keras.layers.Dense(2, name="a")(h)
    b = keras.layers.Dense(1, name="b")(keras.layers.BatchNormalization(name="bn2")(h))
    model = keras.Model(inputs, [a, b])
    x = np.random.default_rng(2).normal(size=(32, 4)).astype("float32")
    model.compile("sgd", loss=["mse", "mse"])
    model.fit(x, [x[:, :2], x[:, :1]], batch_size=8, epochs=2, verbose=0)
    return model, x


def test_replace_batchnorm_layers_copies_without_aliasing():
    """The original's test_swap_layer, fixed: γ/β/statistics copied, outputs kept, no sharing."""
    model, x = _bn_model()
    new = replace_batchnorm_layers(model, accum_steps=4)
    swapped = [lay for lay in new.layers if isinstance(lay, AccumBatchNormalization)]
    assert len(swapped) == 2 and all(lay.accum_steps == 4 for lay in swapped)
    assert len(new.outputs) == 2
    bn = new.get_layer("bn")
    assert (bn.momentum, bn.epsilon) == (0.999, 1e-5)
    old = model.get_layer("bn")
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        np.testing.assert_array_equal(_np(getattr(bn, name)), _np(getattr(old, name)))
    for p, q in zip(new.predict(x, verbose=0), model.predict(x, verbose=0)):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
    before = _np(old.moving_mean)
    bn.moving_mean.assign(np.full(6, 7.0, "float32"))
    np.testing.assert_array_equal(_np(old.moving_mean), before)
    with pytest.raises(ValueError, match="position"):
        replace_batchnorm_layers(model, 2, position="after")
    with pytest.raises(ValueError, match="accum_steps"):
        replace_batchnorm_layers(model, 0)


def test_save_and_load(tmp_path):
    model, x = _bn_model()
    new = replace_batchnorm_layers(model, accum_steps=2)
    new.save(tmp_path / "bn.keras")
    loaded = keras.models.load_model(tmp_path / "bn.keras")
    assert isinstance(loaded.get_layer("bn"), AccumBatchNormalization)
    assert loaded.get_layer("bn").accum_steps == 2
    np.testing.assert_allclose(flat(loaded), flat(new))
