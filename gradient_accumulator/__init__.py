"""gradient-accumulator: exact, fast gradient accumulation for Keras 3 and PyTorch.

The Keras names of the original package are imported lazily, so ``import gradient_accumulator``
needs no ML framework:

    >>> from gradient_accumulator import GradientAccumulateModel  # doctest: +SKIP

PyTorch users import from :mod:`gradient_accumulator.torch`; the framework-free functional core
is :mod:`gradient_accumulator.core`.
"""

from __future__ import annotations

import importlib
from typing import Any

from gradient_accumulator.nonfinite import NonFiniteGradientError, NonFiniteGradientWarning

__version__ = "1.0.0"

_KERAS_NAMES = {
    "GradientAccumulateModel": "gradient_accumulator.keras",
    "GradientAccumulateOptimizer": "gradient_accumulator.keras",
    "AccumBatchNormalization": "gradient_accumulator.keras",
    "adaptive_clip_grad": "gradient_accumulator.keras",
    "compute_norm": "gradient_accumulator.keras",
    "unitwise_norm": "gradient_accumulator.keras",
    "replace_batchnorm_layers": "gradient_accumulator.keras",
}

# The original package's modules, kept as aliases of the Keras implementations; imported on
# first use so that importing the package needs no framework.
_SUBMODULES = ("core", "accumulators", "layers", "agc", "utils")

__all__ = [
    "__version__",
    "core",
    "NonFiniteGradientError",
    "NonFiniteGradientWarning",
    *_KERAS_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        try:
            return importlib.import_module(f"gradient_accumulator.{name}")
        except ImportError as e:
            if name == "core":
                raise
            raise ImportError(
                f"gradient_accumulator.{name} needs Keras 3 and a backend: "
                f"pip install 'gradient-accumulator[keras]' ({e})"
            ) from e
    module = _KERAS_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'gradient_accumulator' has no attribute {name!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"gradient_accumulator.{name} needs Keras 3 and a backend: "
            f"pip install 'gradient-accumulator[keras]' ({e})"
        ) from e
    return getattr(mod, name)


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBMODULES})
