"""Loads the compiled core once, with an error that says what is missing."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def load_core() -> ModuleType:
    """Return ``gradient_accumulator._C``.

    Raises:
        ImportError: the package was installed without its compiled module (for example, run
            from a source tree that was never built); the message says how to build it.
    """
    try:
        from gradient_accumulator import _C
    except ImportError as e:  # pragma: no cover - exercised only on broken installs
        raise ImportError(
            "gradient_accumulator._C (the compiled core) could not be imported: "
            f"{e}. Install the package with `pip install .` (it builds the C++ core with CMake "
            "and scikit-build-core), or `pip install -e . --no-build-isolation` for development."
        ) from e
    return _C
