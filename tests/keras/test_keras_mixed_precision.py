"""Mixed precision (the original's test_mixed_precision and test_mp_batch_norm, with numbers):
mixed_float16 with per-cycle loss scaling and mixed_bfloat16, against the big batch."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops
from keras_helpers import data, flat, mlp, rel_diff

from gradient_accumulator.keras import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)

# Half-precision forward passes of a micro-batch and of the big batch round differently; the
# float32 runs of the same scenario are compared at 1e-5 elsewhere.
TOL = {"mixed_float16": 2e-3, "mixed_bfloat16": 2e-2}


def _float32_head():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3, dtype="float32")(h)
    return inputs, outputs


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_mixed_precision_matches_big_batch(policy, wrapper):
    keras.config.set_dtype_policy(policy)
    x, y = data(64)
    inputs, outputs = _float32_head()
    big = keras.Model(inputs, outputs)
    big.compile(keras.optimizers.Adam(1e-2), loss="mse")  # mixed_float16: Keras's own scaling
    big.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    inputs, outputs = _float32_head()
    if wrapper == "model":
        acc = GradientAccumulateModel(
            accum_steps=4, mixed_precision=True, inputs=inputs, outputs=outputs
        )
        acc.compile(keras.optimizers.Adam(1e-2), loss="mse")
    else:
        acc = keras.Model(inputs, outputs)
        opt = GradientAccumulateOptimizer(
            keras.optimizers.Adam(1e-2), accum_steps=4, mixed_precision=True
        )
        acc.compile(opt, loss="mse", auto_scale_loss=False)
    acc.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    opt = acc.optimizer
    assert isinstance(opt, GradientAccumulateOptimizer) and opt.mixed_precision
    assert int(opt.iterations) == 8
    assert float(ops.convert_to_numpy(opt.loss_scale)) == 2.0**15  # no overflow, no growth yet
    assert acc.layers[1].compute_dtype == policy.split("_")[1]
    assert rel_diff(flat(acc), flat(big)) <= TOL[policy]
    assert rel_diff(flat(acc), flat(keras.Model(*_float32_head()))) > 1e-2


def test_mixed_float16_policy_switches_scaling_on():
    keras.config.set_dtype_policy("mixed_float16")
    inputs, outputs = mlp()
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    model.compile("sgd", loss="mse")
    assert isinstance(model.optimizer, GradientAccumulateOptimizer)
    assert model.optimizer.mixed_precision


def test_overflowing_cycle_is_skipped_in_fit():
    """A cycle whose loss overflows float16 leaves the weights alone and halves the scale."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = data(16)
    y_bad = y.copy()
    y_bad[4:8] = 6e4  # the second micro-batch of the first cycle overflows in float16
    inputs, outputs = _float32_head()
    model = GradientAccumulateModel(
        accum_steps=2, mixed_precision=True, inputs=inputs, outputs=outputs
    )
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    before = flat(model)
    model.fit(x[:8], y_bad[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_array_equal(flat(model), before)
    assert int(model.optimizer.iterations) == 0
    assert float(ops.convert_to_numpy(model.optimizer.loss_scale)) < 2.0**15
    model.fit(x[8:], y[8:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 1 and rel_diff(flat(model), before) > 1e-6


def test_mixed_precision_batch_norm_statistics():
    """AccumBN(k=4) on micro-batches of 8 under mixed_float16 = AccumBN(k=1) on batches of 32."""
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(6)
    x = (rng.normal(size=(64, 5)) * 3 + 1).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    stats = []
    for accum, batch in ((1, 32), (4, 8)):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        h = AccumBatchNormalization(accum_steps=accum, momentum=0.9)(inputs)
        outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(4)(h))
        model = GradientAccumulateModel(accum_steps=accum, inputs=inputs, outputs=outputs)
        model.compile(keras.optimizers.SGD(0.01), loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        bn = model.layers[1]
        stats.append(
            np.concatenate(
                [
                    np.ravel(ops.convert_to_numpy(bn.moving_mean)),
                    np.ravel(ops.convert_to_numpy(bn.moving_variance)),
                ]
            )
        )
    # Statistics are computed in float32 from float16 inputs: equal up to float32 rounding.
    assert rel_diff(stats[1], stats[0]) <= 1e-5


# --- Keras's LossScaleOptimizer around the accumulating optimizer: one loss-scaling owner. ---


def _digits_like_head():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, dtype="float32")(h)
    return inputs, outputs


def _update_ratio(update, reference):
    """⟨Δ, Δ_ref⟩ / ⟨Δ_ref, Δ_ref⟩: 1 for the reference's update, 3e-5 when unscaled twice."""
    return float(update @ reference / (reference @ reference))


@pytest.mark.parametrize("own_scaling", [True, False], ids=["mp-on-wrapper", "mp-off"])
@pytest.mark.parametrize("wrap", ["compile", "explicit"])
@pytest.mark.parametrize("wrapper", ["optimizer", "model"])
def test_keras_loss_scaler_around_wrapper_scales_once(wrapper, wrap, own_scaling):
    """mixed_float16, one cycle of 4 × 8 against one batch of 32 (SGD 0.1): Keras's
    LossScaleOptimizer around the wrapper (added by compile, or by hand) scales the loss once
    and the gradient is unscaled once, per cycle."""
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.normal(size=(32, 10)).astype("float32")
    big = keras.Model(*_digits_like_head())
    big.compile(keras.optimizers.SGD(0.1), loss="mse")  # Keras's own scaling
    start = flat(big)
    big.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    reference = flat(big) - start

    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1), accum_steps=4, mixed_precision=own_scaling
    )
    if wrap == "explicit":
        opt = keras.optimizers.LossScaleOptimizer(opt)
    inputs, outputs = _digits_like_head()
    if wrapper == "model":
        model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    else:
        model = keras.Model(inputs, outputs)
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    update = flat(model) - start
    ratio = _update_ratio(update, reference)
    assert abs(ratio - 1.0) <= 1e-3, ratio
    assert rel_diff(update, reference) <= 2e-3
    acc = model.optimizer
    if isinstance(acc, keras.optimizers.LossScaleOptimizer):
        acc = acc.inner_optimizer
        # The scaler mirrors the wrapper's scale and growth counter.
        assert float(ops.convert_to_numpy(model.optimizer.dynamic_scale.value)) == 2.0**15
        assert int(ops.convert_to_numpy(model.optimizer.step_counter.value)) == 1
    assert isinstance(acc, GradientAccumulateOptimizer) and acc.mixed_precision
    assert int(acc.iterations) == 1
    assert float(ops.convert_to_numpy(acc.loss_scale)) == 2.0**15


def test_keras_loss_scaler_drops_the_whole_cycle_of_an_overflowing_micro_batch():
    """Under the scaler compile adds, a micro-batch whose gradient overflows float16 drops its
    cycle (not just itself) and halves the scale once."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = data(16)
    y_bad = y.copy()
    y_bad[4:8] = 6e4  # the second micro-batch of the first cycle overflows in float16
    model = keras.Model(*_float32_head())
    model.compile(
        GradientAccumulateOptimizer(keras.optimizers.SGD(0.01), accum_steps=2), loss="mse"
    )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    acc = model.optimizer.inner_optimizer
    before = flat(model)
    model.fit(x[:8], y_bad[:8], batch_size=4, shuffle=False, verbose=0)
    np.testing.assert_array_equal(flat(model), before)
    assert acc.pending() == 0  # the cycle is gone, not waiting for a replacement micro-batch
    assert int(acc.iterations) == 0
    assert float(ops.convert_to_numpy(acc.loss_scale)) == 2.0**14
    assert float(ops.convert_to_numpy(model.optimizer.dynamic_scale.value)) == 2.0**14
    # The next two micro-batches are a fresh cycle: the big batch's update from `before`.
    model.fit(x[8:], y[8:], batch_size=4, shuffle=False, verbose=0)
    ref = keras.Model(*_float32_head())
    ref.compile(keras.optimizers.SGD(0.01), loss="mse")
    ref.fit(x[8:], y[8:], batch_size=8, shuffle=False, verbose=0)
    assert int(acc.iterations) == 1
    assert rel_diff(flat(model) - before, flat(ref) - before) <= 2e-3


def test_keras_loss_scaler_by_hand_grows_per_cycle_under_float32():
    """LossScaleOptimizer(GradientAccumulateOptimizer(...)) by hand, float32 policy: the scale
    doubles after dynamic_growth_steps good updates (cycles), not micro-steps; training matches
    the unscaled run."""
    x, y = data(32)
    opt = keras.optimizers.LossScaleOptimizer(
        GradientAccumulateOptimizer(keras.optimizers.SGD(0.05), accum_steps=2),
        dynamic_growth_steps=2,
    )
    model = keras.Model(*_float32_head())
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)  # 8 micro-batches, 4 cycles
    acc = opt.inner_optimizer
    assert int(acc.iterations) == 4
    assert float(ops.convert_to_numpy(acc.loss_scale)) == 2.0**17  # two doublings
    assert float(ops.convert_to_numpy(opt.dynamic_scale.value)) == 2.0**17
    ref = keras.Model(*_float32_head())
    ref.compile(keras.optimizers.SGD(0.05), loss="mse")
    ref.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert rel_diff(flat(model), flat(ref)) <= 1e-5


def test_keras_loss_scaler_config_round_trip_keeps_one_owner():
    inner = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=3)
    opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**10)
    assert inner.mixed_precision and inner.initial_scale == 2.0**10
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    acc = restored.inner_optimizer
    assert isinstance(acc, GradientAccumulateOptimizer) and acc.mixed_precision
    assert acc.initial_scale == 2.0**10 and acc.accum_steps == 3
    assert "apply" in vars(restored)  # adopted again
    with pytest.raises(TypeError, match="already a GradientAccumulateOptimizer"):
        GradientAccumulateOptimizer(opt, accum_steps=2)
