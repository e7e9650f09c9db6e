"""Batch norm stays in phase with the optimizer when an epoch ends with a short cycle.

56 samples in micro-batches of 4 with ``accum_steps=4``: 3 full cycles and a short one of 2
micro-batches per epoch. The big-batch reference (batches of 16, the last of 8) updates its
moving statistics 4 times per epoch; the accumulating layer must too. The learning rate is 0:
each micro-batch is normalised with its own statistics, so the gradients (and the weights feeding
the layer) differ from the big batch's by design; the moving statistics must not.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import TOL, data, mlp, rel_diff

from gradient_accumulator.keras import (
    AccumBatchNormalization,
    FlushAccumulation,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)

ACCUM, MICRO, N, MOMENTUM = 4, 4, 56, 0.5


def _moving(model):
    layer = next(
        lay for lay in model._flatten_layers() if isinstance(lay, keras.layers.BatchNormalization)
    )
    return np.concatenate([np.asarray(layer.moving_mean), np.asarray(layer.moving_variance)])


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_short_last_cycle_gives_big_batch_statistics(wrapper):
    x, y = data(N)
    inputs, outputs = mlp(bn=keras.layers.BatchNormalization, momentum=MOMENTUM)
    ref = keras.Model(inputs, outputs)
    ref.compile(keras.optimizers.SGD(0.0), loss="mse")
    ref.fit(x, y, batch_size=ACCUM * MICRO, epochs=2, shuffle=False, verbose=0)

    inputs, outputs = mlp(bn=AccumBatchNormalization, accum_steps=ACCUM, momentum=MOMENTUM)
    callbacks = []
    if wrapper == "model":
        model = GradientAccumulateModel(accum_steps=ACCUM, inputs=inputs, outputs=outputs)
        model.compile(keras.optimizers.SGD(0.0), loss="mse")
    else:
        model = keras.Model(inputs, outputs)
        model.compile(
            GradientAccumulateOptimizer(keras.optimizers.SGD(0.0), accum_steps=ACCUM), loss="mse"
        )
        callbacks = [FlushAccumulation()]
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)

    assert rel_diff(_moving(model), _moving(ref)) <= TOL
    layer = next(lay for lay in model.layers if isinstance(lay, AccumBatchNormalization))
    assert int(np.asarray(layer.accum_step)) == 0


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="tf.data.Dataset.from_generator (a dataset of unknown size) is TF's",
)
def test_dataset_of_unknown_size_keeps_statistics_in_phase():
    # Keras runs one more step on the exhausted iterator of a dataset of unknown size: the layer's
    # micro-step counter must not move in it, or its statistics drift out of phase.
    import tensorflow as tf

    x, y = data(N)
    inputs, outputs = mlp(bn=keras.layers.BatchNormalization, momentum=MOMENTUM)
    ref = keras.Model(inputs, outputs)
    ref.compile(keras.optimizers.SGD(0.0), loss="mse")
    ref.fit(x, y, batch_size=ACCUM * MICRO, epochs=2, shuffle=False, verbose=0)

    def gen():
        for i in range(0, N, MICRO):
            yield x[i : i + MICRO], y[i : i + MICRO]

    spec = (
        tf.TensorSpec((None, x.shape[1]), tf.float32),
        tf.TensorSpec((None, y.shape[1]), tf.float32),
    )
    ds = tf.data.Dataset.from_generator(gen, output_signature=spec)
    assert int(ds.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    inputs, outputs = mlp(bn=AccumBatchNormalization, accum_steps=ACCUM, momentum=MOMENTUM)
    model = GradientAccumulateModel(accum_steps=ACCUM, inputs=inputs, outputs=outputs)
    model.compile(keras.optimizers.SGD(0.0), loss="mse")
    model.fit(ds, epochs=2, verbose=0)

    assert rel_diff(_moving(model), _moving(ref)) <= TOL
    layer = next(lay for lay in model.layers if isinstance(lay, AccumBatchNormalization))
    assert int(np.asarray(layer.accum_step)) == 0
