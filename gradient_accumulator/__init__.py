"""gradient-accumulator: exact, fast gradient accumulation for Keras 3 and PyTorch.

The Keras names of the original package are imported lazily, so ``import gradient_accumulator``
needs no ML framework:

    >>> from gradient_accumulator import GradientAccumulateModel  # doctest: +SKIP

PyTorch users import from :mod:`gradient_accumulator.torch`; the framework-free functional core
is :mod:`gradient_accumulator.core`. Where Keras or its backend is not installed, the Keras names
are left out of ``dir()``, ``__all__`` and ``help()``, and importing one says what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# Re-exported (``__all__`` is computed, below, to leave out what cannot be imported here).
from gradient_accumulator.deprecation import (
    GradientAccumulatorDeprecationWarning as GradientAccumulatorDeprecationWarning,
)
from gradient_accumulator.nonfinite import NonFiniteGradientError as NonFiniteGradientError
from gradient_accumulator.nonfinite import NonFiniteGradientWarning as NonFiniteGradientWarning

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
_KERAS_MODULES = ("accumulators", "layers", "agc", "utils")

# What every install has, whatever framework it has or lacks.
_ALWAYS = [
    "__version__",
    "core",
    "GradientAccumulatorDeprecationWarning",
    "NonFiniteGradientError",
    "NonFiniteGradientWarning",
]

_keras_available: bool | None = None


def _has_keras() -> bool:
    """Whether the Keras names can be imported here: Keras 3 and a backend it can load.

    Asked only by ``dir()``, ``__all__`` and ``help()``, which list names that resolve; the
    answer imports Keras when it is installed, and is kept for the process."""
    global _keras_available
    if _keras_available is None:
        if importlib.util.find_spec("keras") is None:
            _keras_available = False
        else:
            try:
                importlib.import_module("gradient_accumulator.keras")
                _keras_available = True
            except ImportError:
                _keras_available = False
    return _keras_available


def _import_keras_module(module: str, name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        # gradient_accumulator.keras names the install in its own message.
        raise ImportError(f"gradient_accumulator.{name}: {e}") from e


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return [*_ALWAYS, *(_KERAS_NAMES if _has_keras() else ())]
    if name == "core":
        return importlib.import_module("gradient_accumulator.core")
    if name in _KERAS_MODULES:
        return _import_keras_module(f"gradient_accumulator.{name}", name)
    module = _KERAS_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'gradient_accumulator' has no attribute {name!r}")
    return getattr(_import_keras_module(module, name), name)


def __dir__() -> list[str]:
    keras_names = [*_KERAS_NAMES, *_KERAS_MODULES] if _has_keras() else []
    return sorted({*_ALWAYS, *keras_names})
