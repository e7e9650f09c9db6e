"""Checks of public arguments, shared by the PyTorch and Keras adapters and batch norm.

One function per kind of argument, so that the same mistake gets the same error everywhere: a
value of the wrong type raises ``TypeError``, a value of the right type that is out of range or
unknown raises ``ValueError``; the message names the argument as the user spelled it and shows
the value. NumPy scalars count as the Python numbers they stand for (``np.int64(4)`` is an
integer, ``np.float32(0.5)`` a real number) and come back as plain ``int``/``float``. Nothing
here imports a framework or NumPy.

Example:
    >>> check_accum_steps(4)
    4
    >>> check_choice("Mean", "reduction", ("mean", "sum", "running_mean"))
    'mean'
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_ACCUM_STEPS",
    "check_accum_steps",
    "check_agc_args",
    "check_bool",
    "check_choice",
    "check_int",
    "check_positive",
]

# Micro-steps are counted in 32-bit integers in the Keras optimizer's state (saved with the
# model) and in the C core's descriptors; a cycle of more than two billion micro-batches is a
# mistake (a sample count passed for a batch count), not a plan.
MAX_ACCUM_STEPS = 2**31 - 1


def check_int(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An integral number (Python or NumPy, not bool) in ``[minimum, maximum]``, as ``int``.

    Raises:
        TypeError: ``value`` is not integral.
        ValueError: ``value`` is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_accum_steps(value: Any, name: str = "accum_steps") -> int:
    """Micro-batches per update: an integral number in ``[1, MAX_ACCUM_STEPS]``."""
    return check_int(value, name, 1, MAX_ACCUM_STEPS)


def check_bool(value: Any, name: str) -> bool:
    """``True``/``False`` (also NumPy's, and the integers 0 and 1), as ``bool``.

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, bool):
        return value
    dtype = getattr(value, "dtype", None)
    if getattr(dtype, "kind", None) == "b" and getattr(value, "ndim", None) == 0:
        return bool(value)  # a NumPy bool scalar
    if not isinstance(value, numbers.Integral) or value not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_positive(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """A finite real number ``> 0`` (``>= 0`` with ``allow_zero``), as ``float``.

    Raises:
        TypeError: ``value`` is not a real number (bools are not).
        ValueError: ``value`` is NaN, infinite or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    """One of ``choices``, in any letter case; returned as spelled in ``choices``.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not one of ``choices``.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a string, one of {tuple(choices)}, got "
            f"{type(value).__name__} {value!r}"
        )
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_agc_args(clip_factor: Any, eps: Any) -> tuple[float, float]:
    """Adaptive clipping's λ (finite, > 0) and ε (finite, >= 0), as floats."""
    return check_positive(clip_factor, "clip_factor"), check_positive(eps, "eps", allow_zero=True)
