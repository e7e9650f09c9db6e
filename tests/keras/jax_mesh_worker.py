"""Runs the Keras-distribution cases of test_keras_jax_distribution.py in a process of its own.

JAX fixes its number of host devices when it is imported, so the cases on 4 and 8 virtual CPU
devices run here, in an interpreter started with ``XLA_FLAGS=--xla_force_host_platform_device_
count=8``; the test module starts it once and asserts on what it prints: one JSON object, which
maps each case's name to its result.

Each case trains a small model with accumulation (4 micro-batches of 8) under
``keras.distribution.DataParallel`` or ``ModelParallel`` and reports max|Δw| / max|w| against a
run on one device without any distribution, plus the sharding of every accumulator beside the
sharding of the variable it belongs to.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402

if jax.device_count() < 8:  # pragma: no cover - started wrongly
    raise SystemExit(f"needs 8 host devices (XLA_FLAGS), found {jax.device_count()}")
jax.config.update("jax_default_matmul_precision", "highest")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from gradient_accumulator.keras import (  # noqa: E402
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)

ACCUM, MICRO, SAMPLES, EPOCHS = 4, 8, 64, 2
# The hidden layer's kernel is sharded on its columns, the output kernel on its rows, the hidden
# bias and the batch norm's four vectors on their one axis; the output bias stays replicated.
LAYOUT = {
    "hidden/kernel": (None, "model"),
    "hidden/bias": ("model",),
    "out/kernel": ("model", None),
    "bn/(gamma|beta|moving_mean|moving_variance)": ("model",),
}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    w = rng.normal(size=(6, 3)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(SAMPLES, 3))).astype("float32")
    return x, y


def distribution(kind: str, devices: int):
    """``dp``: DataParallel over ``devices``; ``mp``: ModelParallel on a 2 × devices/2 mesh."""
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    if kind == "none":
        return
    chosen = jax.devices()[:devices]
    if kind == "dp":
        dist = keras.distribution.DataParallel(devices=chosen)
    else:
        mesh = keras.distribution.DeviceMesh((2, devices // 2), ["batch", "model"], chosen)
        layout_map = keras.distribution.LayoutMap(mesh)
        for path, axes in LAYOUT.items():
            layout_map[path] = axes
        dist = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    keras.distribution.set_distribution(dist)


def build(wrapper: str, accum: int, bn: bool, use_agc: bool, initial):
    """Dense(8, tanh) [→ AccumBN] → Dense(3) with ``initial`` weights, compiled with Adam."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    if bn:
        h = AccumBatchNormalization(accum_steps=accum, momentum=0.9, name="bn")(h)
    outputs = keras.layers.Dense(3, name="out")(h)
    inner = keras.optimizers.Adam(0.05)
    if wrapper == "plain":
        model = keras.Model(inputs, outputs)
        model.compile(inner, loss="mse")
    elif wrapper == "model":
        model = GradientAccumulateModel(
            accum_steps=accum, use_agc=use_agc, inputs=inputs, outputs=outputs
        )
        model.compile(inner, loss="mse")
    else:
        model = keras.Model(inputs, outputs)
        opt = GradientAccumulateOptimizer(inner, accum_steps=accum, use_agc=use_agc)
        model.compile(opt, loss="mse")
    if initial is not None:
        model.set_weights(initial[: len(model.get_weights())])
    return model


def flat(model) -> np.ndarray:
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in model.get_weights()])


def layouts(model) -> list[dict]:
    """Each accumulator's sharding beside its variable's (the optimizer's and the batch
    norm's)."""
    pairs = list(zip(model.trainable_variables, model.optimizer.accumulators))
    for layer in model.layers:
        if isinstance(layer, AccumBatchNormalization):
            pairs += [
                (layer.moving_mean, layer.accum_mean),
                (layer.moving_variance, layer.accum_variance),
            ]
    out = []
    for var, acc in pairs:
        vs, as_ = var.value.sharding, acc.value.sharding
        out.append(
            {
                "variable": var.path,
                "accumulator": acc.path,
                "variable_spec": str(getattr(vs, "spec", vs)),
                "accumulator_spec": str(getattr(as_, "spec", as_)),
                "same": bool(as_.is_equivalent_to(vs, len(var.shape))),
                "sharded": not vs.is_fully_replicated,
                "shard_shape": list(acc.value.addressable_shards[0].data.shape),
                "variable_shard_shape": list(var.value.addressable_shards[0].data.shape),
            }
        )
    return out


_REFERENCES: dict = {}


def reference(wrapper, bn, use_agc):
    """Initial weights (from an undistributed build) and the weights after training on one
    device: the big batch, clipped by the wrapper with k = 1 for AGC; for batch norm, which
    normalises each micro-batch alone, the same micro-batches with the same wrapper."""
    key = (wrapper if bn else "", bn, use_agc)
    if key not in _REFERENCES:
        x, y = data()
        distribution("none", 0)
        keras.utils.set_random_seed(0)
        initial = build("plain", 1, bn, False, None).get_weights()
        if bn:
            ref = build(wrapper, ACCUM, True, False, initial)
            ref.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
        else:
            ref = build("optimizer" if use_agc else "plain", 1, False, use_agc, initial)
            ref.fit(x, y, batch_size=ACCUM * MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
        _REFERENCES[key] = initial, flat(ref)
    return _REFERENCES[key]


def run(wrapper, kind, devices, bn=False, use_agc=False):
    x, y = data()
    initial, expected = reference(wrapper, bn, use_agc)
    distribution(kind, devices)
    model = build(wrapper, ACCUM, bn, use_agc, initial)
    model.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    got = flat(model)
    return {
        "rel": float(np.abs(got - expected).max() / np.abs(expected).max()),
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "layouts": layouts(model),
    }


# Each wrapper on both distributions and on both device counts, the 2 × 2 and 2 × 4 meshes, with
# AGC (unit norms of sharded kernels) and with AccumBatchNormalization.
CASES = {
    "model-dp4": ("model", "dp", 4, False, False),
    "model-mp4": ("model", "mp", 4, False, False),
    "model-mp8-agc": ("model", "mp", 8, False, True),
    "model-dp8-bn": ("model", "dp", 8, True, False),
    "optimizer-dp8": ("optimizer", "dp", 8, False, False),
    "optimizer-mp8": ("optimizer", "mp", 8, False, False),
    "optimizer-mp4-agc": ("optimizer", "mp", 4, False, True),
    "optimizer-mp8-bn": ("optimizer", "mp", 8, True, False),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    print(json.dumps({name: run(*CASES[name]) for name in names}))
