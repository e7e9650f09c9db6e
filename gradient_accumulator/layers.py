"""The original package's module path of ``AccumBatchNormalization`` (gradient-accumulator 0.5).

The layer is the Keras 3 one of :mod:`gradient_accumulator.keras`, with 0.5's arguments and
defaults (``accum_steps=1, momentum=0.99, epsilon=1e-3, trainable=True``). Importing this module
imports Keras.
"""

from gradient_accumulator.keras.layers import AccumBatchNormalization

__all__ = ["AccumBatchNormalization"]
