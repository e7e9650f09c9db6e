"""Writes the mid-cycle checkpoints that ``test_keras_checkpoint_layout.py`` loads.

Run once per backend with the package version whose files are to be kept loadable
(``KERAS_BACKEND=<b> python tests/keras/data/make_checkpoints.py``): the checked-in files were
written by the version before the JAX state was packed (commit a242826), so the test proves
that files written before the packing load after it, and that every backend's file loads on
every backend.

Each file is a ``.keras`` model (Dense 3 → 2) compiled with ``GradientAccumulateOptimizer``
over Adam, k = 4, with loss scaling (initial scale 1024, growth after 5 good updates), saved
after one whole cycle and two micro-batches of the next (weights 1.0 and 2.0): the scalars then
differ from one another (micro-step 2, total weight 3, loss scale 1024, growth 1, no
non-finite value, no dropped cycle, batch weight 1), so a file read in another order fails.
The ``.npz`` beside it holds the expected state and the weights after two more micro-batches,
as that version computed them.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np

from gradient_accumulator import GradientAccumulateOptimizer


def grads(i: int) -> list[np.ndarray]:
    """Micro-batch i's gradients: dyadic values, so every sum is exact."""
    kernel = (np.arange(6, dtype="float32").reshape(3, 2) - 2.5 + i) / 8.0
    bias = np.array([0.5 * i, -0.25 * i], dtype="float32")
    return [kernel, bias]


def model_and_optimizer() -> tuple:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.full((3, 2), 0.5, "float32"), np.array([0.25, -0.5], "float32")])
    opt = GradientAccumulateOptimizer(
        keras.optimizers.Adam(0.01),
        accum_steps=4,
        use_core=False,
        mixed_precision=True,
        initial_scale=1024.0,
        dynamic_growth_steps=5,
    )
    model.compile(optimizer=opt, loss="mse")
    return model, opt


def micro_batch(model: keras.Model, i: int, weight: float) -> None:
    model.optimizer.apply(
        [keras.ops.convert_to_tensor(g) for g in grads(i)],
        model.trainable_variables,
        weight=weight,
    )


def main(folder: str) -> None:
    backend = keras.backend.backend()
    model, opt = model_and_optimizer()
    for i in range(4):
        micro_batch(model, i, 1.0)
    micro_batch(model, 4, 1.0)
    micro_batch(model, 5, 2.0)
    model.save(os.path.join(folder, f"mid_cycle_{backend}.keras"))
    saved = {
        "pending": np.array(opt.pending()),
        "iterations": np.array(int(keras.ops.convert_to_numpy(opt.iterations))),
        "kernel_accumulator": keras.ops.convert_to_numpy(opt.accumulators[0]),
        "bias_accumulator": keras.ops.convert_to_numpy(opt.accumulators[1]),
        "weights_at_save_kernel": model.get_weights()[0],
        "weights_at_save_bias": model.get_weights()[1],
    }
    micro_batch(model, 6, 1.0)
    micro_batch(model, 7, 0.5)
    saved["weights_after_kernel"] = model.get_weights()[0]
    saved["weights_after_bias"] = model.get_weights()[1]
    np.savez(os.path.join(folder, f"mid_cycle_{backend}.npz"), **saved)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
