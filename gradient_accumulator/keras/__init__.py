"""Keras 3 adapter: exact gradient accumulation for the TensorFlow, JAX and PyTorch backends.

The names and defaults are the original ``gradient-accumulator`` package's, so code written for
it runs unchanged on Keras 3.

Example:
    >>> import keras
    >>> from gradient_accumulator.keras import GradientAccumulateModel
    >>> inputs = keras.Input((4,))
    >>> outputs = keras.layers.Dense(2)(inputs)
    >>> model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    >>> model.accum_steps
    4
"""

try:
    import keras as _keras  # noqa: F401  (only to name the install when it is missing)
except ImportError as _e:
    raise ImportError(
        "gradient_accumulator.keras needs Keras 3 and a backend: pip install "
        "'gradient-accumulator[tensorflow]' or 'gradient-accumulator[jax]' (Keras on the torch "
        "backend: 'gradient-accumulator[torch]' keras, with KERAS_BACKEND=torch). "
        f"Import failed with: {_e}"
    ) from _e

from gradient_accumulator.keras.agc import adaptive_clip_grad, compute_norm, unitwise_norm
from gradient_accumulator.keras.callbacks import FlushAccumulation
from gradient_accumulator.keras.layers import AccumBatchNormalization
from gradient_accumulator.keras.model import GradientAccumulateModel
from gradient_accumulator.keras.optimizer import GradientAccumulateOptimizer
from gradient_accumulator.keras.utils import replace_batchnorm_layers, restore_batchnorm_layers

__all__ = [
    "AccumBatchNormalization",
    "FlushAccumulation",
    "GradientAccumulateModel",
    "GradientAccumulateOptimizer",
    "adaptive_clip_grad",
    "compute_norm",
    "replace_batchnorm_layers",
    "restore_batchnorm_layers",
    "unitwise_norm",
]
