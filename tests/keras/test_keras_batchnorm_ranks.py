"""AccumBatchNormalization after Dense and Conv1D/2D/3D layers, and one layer called at several
input ranks (only the channel axis is fixed), against a big-batch BatchNormalization."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from gradient_accumulator.keras import AccumBatchNormalization, GradientAccumulateModel

MOMENTUM = 0.8
CHANNELS = 3
SPATIAL = {"dense": None, "conv1d": (6,), "conv2d": (5, 4), "conv3d": (3, 4, 2)}


def _np(x):
    return np.asarray(ops.convert_to_numpy(x), np.float64)


def _model(kind: str, bn, accum: int | None = None, **bn_kwargs):
    """Frozen feature layer of ``kind`` → BN → pooling → Dense(1), seeded.

    The feature layer is frozen so BN's input depends on the data alone: the moving statistics
    of micro-batches and of the big batch must then agree exactly, whatever the head learns.
    """
    keras.utils.set_random_seed(3)
    spatial = SPATIAL[kind]
    if spatial is None:
        inputs = keras.Input((4,))
        features = keras.layers.Dense(CHANNELS, trainable=False)
        pool = None
    else:
        inputs = keras.Input((*spatial, 2))
        conv = {1: keras.layers.Conv1D, 2: keras.layers.Conv2D, 3: keras.layers.Conv3D}
        features = conv[len(spatial)](CHANNELS, 2, padding="same", trainable=False)
        pool = {
            1: keras.layers.GlobalAveragePooling1D,
            2: keras.layers.GlobalAveragePooling2D,
            3: keras.layers.GlobalAveragePooling3D,
        }[len(spatial)]()
    h = bn(momentum=MOMENTUM, name="bn", **bn_kwargs)(features(inputs))
    if pool is not None:
        h = pool(h)
    outputs = keras.layers.Dense(1)(h)
    if accum is None:
        return keras.Model(inputs, outputs)
    return GradientAccumulateModel(accum_steps=accum, inputs=inputs, outputs=outputs)


@pytest.mark.parametrize("kind", list(SPATIAL))
def test_moving_statistics_equal_big_batch_for_each_rank(kind):
    """Micro-batches of 4 with k=3 give the moving statistics of BatchNormalization on 12."""
    accum, micro = 3, 4
    spatial = SPATIAL[kind]
    rng = np.random.default_rng(11)
    shape = (4,) if spatial is None else (*spatial, 2)
    x = (rng.normal(size=(48, *shape)) * 2.0 + 0.5).astype("float32")
    y = rng.normal(size=(48, 1)).astype("float32")

    big = _model(kind, keras.layers.BatchNormalization)
    big.compile(keras.optimizers.SGD(0.01), loss="mse")
    big.fit(x, y, batch_size=micro * accum, epochs=2, shuffle=False, verbose=0)
    acc = _model(kind, AccumBatchNormalization, accum=accum, accum_steps=accum)
    acc.compile(keras.optimizers.SGD(0.01), loss="mse")
    acc.fit(x, y, batch_size=micro, epochs=2, shuffle=False, verbose=0)

    ref, got = big.get_layer("bn"), acc.get_layer("bn")
    for name in ("moving_mean", "moving_variance"):
        expected = _np(getattr(ref, name))
        assert not np.allclose(expected, 0.0 if name == "moving_mean" else 1.0)  # it moved
        np.testing.assert_allclose(_np(getattr(got, name)), expected, rtol=1e-5, atol=1e-6)


def test_one_layer_shared_by_inputs_of_different_rank():
    """The original's test_bn_conv2d/3d shape: one layer after a rank-4 and a rank-2 tensor.

    Each call is one micro-batch; with accum_steps=2 the pair of calls is one cycle whose merged
    statistics (all rank-4 positions and all rank-2 rows) make one moving-average update.
    """
    rng = np.random.default_rng(5)
    image = (rng.normal(size=(2, 3, 3, 4)) + 1.0).astype("float32")
    rows = (rng.normal(size=(5, 4)) * 3.0 - 2.0).astype("float32")
    layer = AccumBatchNormalization(accum_steps=2, momentum=0.5)
    out_image = _np(layer(image, training=True))
    out_rows = _np(layer(rows, training=True))
    assert out_image.shape == image.shape and out_rows.shape == rows.shape
    # Each call is normalised with its own statistics, over every axis but the last.
    for x, out in ((image, out_image), (rows, out_rows)):
        axes = tuple(range(x.ndim - 1))
        x64 = x.astype(np.float64)
        ref = (x64 - x64.mean(axes)) / np.sqrt(x64.var(axes) + 1e-3)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    merged = np.concatenate([image.reshape(-1, 4), rows]).astype(np.float64)
    np.testing.assert_allclose(_np(layer.moving_mean), 0.5 * merged.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(layer.moving_variance), 0.5 + 0.5 * merged.var(0), rtol=1e-5)
    # Inference works at either rank with the moving statistics.
    mean, var = 0.5 * merged.mean(0), 0.5 + 0.5 * merged.var(0)
    np.testing.assert_allclose(
        _np(layer(rows, training=False)), (rows - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5
    )


def test_channel_mismatch_and_rank_one_are_refused():
    """Only the channel axis is checked: a different width, or a rank-1 input, is an error."""
    layer = AccumBatchNormalization()
    layer(np.ones((2, 3, 4), "float32"), training=True)
    with pytest.raises(ValueError, match="axis"):
        layer(np.ones((2, 5), "float32"), training=True)
    with pytest.raises(ValueError):
        layer(np.ones((4,), "float32"), training=True)


def test_shared_layer_in_a_functional_model_trains_and_reloads(tmp_path):
    """A Conv2D branch and a Dense branch of the same width share one layer; save and load."""
    keras.utils.set_random_seed(0)
    a, b = keras.Input((4, 4, 1)), keras.Input((3,))
    shared = AccumBatchNormalization(accum_steps=2, name="shared_bn")
    ha = keras.layers.GlobalAveragePooling2D()(shared(keras.layers.Conv2D(4, 2)(a)))
    hb = shared(keras.layers.Dense(4)(b))
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([ha, hb]))
    model = GradientAccumulateModel(accum_steps=2, inputs=[a, b], outputs=out)
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(1)
    xa = rng.normal(size=(8, 4, 4, 1)).astype("float32")
    xb = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    model.fit([xa, xb], y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    moving = _np(model.get_layer("shared_bn").moving_mean)
    assert np.all(np.isfinite(moving)) and np.any(moving != 0.0)
    path = tmp_path / "shared.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(
        loaded.predict([xa, xb], verbose=0),
        model.predict([xa, xb], verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
