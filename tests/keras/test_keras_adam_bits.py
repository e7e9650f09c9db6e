"""With ``accum_steps=1`` the wrapper is the plain optimizer, bit for bit: Adam and AdamW (with
and without weight decay) over several updates, weights and moments, on every backend and path.

The torch backend's fused C++ Adam follows PyTorch's formula (bias corrections in float64, the
moment updates fused, epsilon added after the correction), which rounds differently from
Keras's Adam in the last bit or two of an update; the wrapper leaves the update to Keras's own
(multi-tensor) Adam so that both agree exactly.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND, data, mlp

from gradient_accumulator.keras import GradientAccumulateOptimizer

STEPS = 6
PATHS = [{}] + ([{"use_core": False}] if BACKEND == "torch" else [])
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam-decay": lambda: keras.optimizers.Adam(0.01, weight_decay=0.1),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.3),
    "adamw-schedule": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=1, decay_rate=0.9),
        beta_1=0.8,
        beta_2=0.95,
        epsilon=1e-6,
    ),
}


def _state(model, inner):
    tensors = list(model.weights) + list(inner._momentums) + list(inner._velocities)
    return [np.asarray(keras.ops.convert_to_numpy(t)) for t in tensors]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "core" if not p else "ops")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_accum_steps_1_is_the_plain_optimizer_bit_for_bit(name, path):
    x, y = data(16 * STEPS)
    runs = []
    for wrapped in (False, True):
        inputs, outputs = mlp()
        model = keras.Model(inputs, outputs)
        inner = OPTIMIZERS[name]()
        opt = GradientAccumulateOptimizer(inner, accum_steps=1, **path) if wrapped else inner
        model.compile(opt, loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        assert int(keras.ops.convert_to_numpy(inner.iterations)) == STEPS
        runs.append(_state(model, inner))
    for ours, ref in zip(*runs):
        np.testing.assert_array_equal(ours, ref)
