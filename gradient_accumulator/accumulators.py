"""The original package's module path of the two wrappers (gradient-accumulator 0.5).

``from gradient_accumulator.accumulators import GradientAccumulateModel`` keeps working: the
names are the Keras 3 implementations of :mod:`gradient_accumulator.keras`, with the same
arguments and defaults as in 0.5. Importing this module imports Keras.
"""

from gradient_accumulator.keras.model import GradientAccumulateModel
from gradient_accumulator.keras.optimizer import GradientAccumulateOptimizer

__all__ = ["GradientAccumulateModel", "GradientAccumulateOptimizer"]
