"""The original package's module path of ``replace_batchnorm_layers`` (gradient-accumulator 0.5).

The function is the Keras 3 one of :mod:`gradient_accumulator.keras`, with 0.5's signature
``replace_batchnorm_layers(model, accum_steps, position="replace")``. Importing this module
imports Keras.
"""

from gradient_accumulator.keras.utils import replace_batchnorm_layers

__all__ = ["replace_batchnorm_layers"]
