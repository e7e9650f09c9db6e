"""Argument checks shared by the Keras adapter: errors name the argument."""

from __future__ import annotations

import numbers
from typing import Any

REDUCTIONS = ("MEAN", "SUM", "RUNNING_MEAN")
LEFTOVERS = ("apply", "carry")


def check_accum_steps(accum_steps: Any) -> int:
    """``accum_steps`` as an int ≥ 1, or ``TypeError``/``ValueError`` naming it."""
    return check_int(accum_steps, "accum_steps")


def check_int(value: Any, name: str, minimum: int = 1) -> int:
    """An int ≥ ``minimum``, else ``TypeError``/``ValueError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_reduction(reduction: Any) -> str:
    """``reduction`` in upper case, one of MEAN, SUM, RUNNING_MEAN."""
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a str, got {type(reduction).__name__}")
    value = reduction.upper()
    if value not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return value


def check_leftover(leftover: Any) -> str:
    """``leftover`` as ``"apply"`` or ``"carry"``."""
    if leftover not in LEFTOVERS:
        raise ValueError(f"leftover must be one of {LEFTOVERS}, got {leftover!r}")
    return leftover


def check_bool(value: Any, name: str) -> bool:
    """A real bool (or NumPy bool), else ``TypeError`` naming the argument."""
    if not isinstance(value, (bool, numbers.Integral)) or value not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_positive(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """A finite real number > 0 (or ≥ 0), else ``TypeError``/``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not ok or value != value or value == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value
