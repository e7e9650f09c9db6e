"""A small Keras CNN with batch norm on scikit-learn's digits: 8 micro-batches of 8 vs 64.

Runs on any Keras 3 backend (``KERAS_BACKEND=tensorflow|jax|torch``). Two copies of the same
network start from the same weights:

* ``accumulated``: a :class:`GradientAccumulateModel` with ``accum_steps=8`` fed batches of 8,
  its batch norm an ``AccumBatchNormalization(accum_steps=8)`` (put in by
  ``replace_batchnorm_layers``);
* ``big batch``: a plain ``keras.Model`` fed batches of 64. Its batch-norm layer normalises each
  group of 8 samples with that group's statistics (the most a micro-batch can see) and updates
  its moving statistics once from all 64 — the exact target of accumulation.

Both use SGD with a learning rate that decays at every update, so a
schedule that counted micro-batches would show. The activation is SiLU rather than ReLU on
purpose: the two runs compute the same function in float32 with different summation orders, so
their pre-activations differ by rounding (~1e-7). With ReLU, a pre-activation that lands within
that distance of 0 is switched on in one run and off in the other; that single unit changes the
gradient by ~1e-3 (relative) through batch norm's backward pass, and the runs part for good
(each run still agrees with a float64 computation of its own gradient). A smooth activation
turns the same rounding into a rounding-sized difference in the gradient.

The script prints the largest weight and moving-statistic difference (float32 rounding), the
test accuracies and the peak memory, and exits non-zero if the two runs are not equivalent.
The data ships with scikit-learn: nothing is downloaded.

Run: ``KERAS_BACKEND=jax python examples/keras_digits.py [--epochs 4] [--seed 0]``
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from gradient_accumulator.keras import (  # noqa: E402
    GradientAccumulateModel,
    replace_batchnorm_layers,
)

MICRO_BATCH = 8
ACCUM_STEPS = 8


class GroupBatchNormalization(keras.layers.BatchNormalization):
    """Reference layer: normalise each group of ``group`` samples with its own statistics and
    update the moving statistics once from the whole batch (Keras's conventions: biased
    variance, ``moving = moving·momentum + batch·(1 − momentum)``)."""

    def __init__(self, group: int, **kwargs):
        super().__init__(**kwargs)
        self.group = group

    def call(self, inputs, training=None, mask=None):
        if not training or not self.trainable:
            return super().call(inputs, training=False)
        x = ops.cast(inputs, "float32")
        grouped = ops.reshape(x, (-1, self.group, *x.shape[1:]))
        group_axes = tuple(range(1, len(grouped.shape) - 1))
        mean, var = ops.moments(grouped, axes=group_axes, keepdims=True)
        y = (grouped - mean) * ops.rsqrt(var + self.epsilon) * self.gamma + self.beta
        batch_mean, batch_var = ops.moments(x, axes=tuple(range(len(x.shape) - 1)))
        m = self.momentum
        self.moving_mean.assign(self.moving_mean * m + batch_mean * (1 - m))
        self.moving_variance.assign(self.moving_variance * m + batch_var * (1 - m))
        return ops.cast(ops.reshape(y, ops.shape(inputs)), inputs.dtype)

    def get_config(self):
        return {**super().get_config(), "group": self.group}


def build(bn_layer: type, **bn_kwargs) -> tuple:
    """Conv(16) → BN → SiLU → Conv(32) → BN → SiLU → 2×2 average pool → Dense(10).

    SiLU, not ReLU: ReLU's kink lets float32 rounding switch a unit on in one run and off in
    the other, and the comparison would measure that chaos instead of the accumulation (see
    the module docstring).
    """
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.Activation("silu")(bn_layer(**bn_kwargs)(h))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(h)
    h = keras.layers.Activation("silu")(bn_layer(**bn_kwargs)(h))
    h = keras.layers.Flatten()(keras.layers.AveragePooling2D(4)(h))
    outputs = keras.layers.Dense(10)(h)
    return inputs, outputs


def make_optimizer(lr: float) -> keras.optimizers.Optimizer:
    schedule = keras.optimizers.schedules.ExponentialDecay(lr, decay_steps=1, decay_rate=0.995)
    return keras.optimizers.SGD(schedule)


def rel_diff(a: list, b: list) -> float:
    num = max(float(np.max(np.abs(np.float64(x) - np.float64(y)))) for x, y in zip(a, b))
    den = max(float(np.max(np.abs(np.float64(y)))) for y in b)
    return num / den


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--verbose", type=int, default=2, help="Keras fit verbosity (0, 1, 2)")
    args = parser.parse_args(argv)
    big = MICRO_BATCH * ACCUM_STEPS

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=args.seed, stratify=y
    )
    # Whole big batches only: the reference layer splits every batch into groups of 8. (Short
    # last cycles are exercised by the test suite.)
    n = len(x_train) // big * big
    x_train, y_train = x_train[:n], y_train[:n]

    keras.utils.set_random_seed(args.seed)
    inputs, outputs = build(GroupBatchNormalization, group=MICRO_BATCH, momentum=0.9)
    reference = keras.Model(inputs, outputs, name="big_batch")
    plain = keras.Model(*build(keras.layers.BatchNormalization, momentum=0.9))
    plain.set_weights(reference.get_weights())
    swapped = replace_batchnorm_layers(plain, ACCUM_STEPS)
    accumulated = GradientAccumulateModel(
        accum_steps=ACCUM_STEPS, inputs=swapped.inputs, outputs=swapped.outputs, name="accumulated"
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference.compile(make_optimizer(args.lr), loss=loss, metrics=["accuracy"])
    accumulated.compile(make_optimizer(args.lr), loss=loss, metrics=["accuracy"])

    start = time.perf_counter()
    print(f"big batch: batches of {big}")
    reference.fit(
        x_train, y_train, batch_size=big, epochs=args.epochs, shuffle=False, verbose=args.verbose
    )
    mid = time.perf_counter()
    print(f"accumulated: {ACCUM_STEPS} micro-batches of {MICRO_BATCH}")
    accumulated.fit(
        x_train,
        y_train,
        batch_size=MICRO_BATCH,
        epochs=args.epochs,
        shuffle=False,
        verbose=args.verbose,
    )
    end = time.perf_counter()

    trainable = rel_diff(
        [ops.convert_to_numpy(v) for v in accumulated.trainable_weights],
        [ops.convert_to_numpy(v) for v in reference.trainable_weights],
    )
    stats_acc = [
        ops.convert_to_numpy(v)
        for layer in accumulated.layers
        if "batch" in type(layer).__name__.lower()
        for v in (layer.moving_mean, layer.moving_variance)
    ]
    stats_ref = [
        ops.convert_to_numpy(v)
        for layer in reference.layers
        if isinstance(layer, GroupBatchNormalization)
        for v in (layer.moving_mean, layer.moving_variance)
    ]
    stats = rel_diff(stats_acc, stats_ref)
    updates = int(accumulated.optimizer.iterations)
    acc_eval = accumulated.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    ref_eval = reference.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(
        f"backend {keras.backend.backend()}: {args.epochs} epochs, {updates} updates; "
        f"big batch {mid - start:.1f} s, accumulated {end - mid:.1f} s"
    )
    print(f"largest weight difference (relative):        {trainable:.3e}")
    print(f"largest moving-statistic difference (rel.):  {stats:.3e}")
    print(f"test accuracy: accumulated {acc_eval:.4f}, big batch {ref_eval:.4f}")
    print(f"peak memory (process RSS): {peak_mib:.0f} MiB")
    ok = trainable <= 1e-5 and stats <= 1e-5 and updates == args.epochs * n // big
    print("equivalent to the big batch" if ok else "NOT equivalent to the big batch")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
