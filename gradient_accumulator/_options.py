"""The settings of both optimizer wrappers (PyTorch and Keras) as one frozen, checked record.

:class:`Options` checks and normalises every field when it is built, and the rules between
fields (one clipping rule at a time; a gradient view cannot hold a running mean) with them, so
a record that exists is a valid one. A wrapper's setter builds the next record with
:meth:`Options.replace` and keeps it only if that succeeds: a bad value raises
``TypeError``/``ValueError`` naming the argument and changes nothing. Each choice has one
spelling here (lower case, as the C core's); the Keras wrapper accepts and shows Keras's
``"MEAN"``/``"SUM"``/``"RUNNING_MEAN"`` at its door (:func:`keras_reduction`). Nothing here
imports a framework.

Example:
    >>> o = Options(accum_steps=4, reduction="MEAN")
    >>> o.reduction, keras_reduction(o.reduction)
    ('mean', 'MEAN')
    >>> o.replace(accum_steps=0)
    Traceback (most recent call last):
    ...
    ValueError: accum_steps must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gradient_accumulator import _validation
from gradient_accumulator.nonfinite import check_on_nonfinite

__all__ = [
    "EXCLUSIVE_CLIPPING",
    "LEFTOVERS",
    "REDUCTIONS",
    "Options",
    "check_agc_exclude",
    "keras_reduction",
]

REDUCTIONS = ("mean", "sum", "running_mean")
LEFTOVERS = ("apply", "carry")
EXCLUSIVE_CLIPPING = "use_agc and max_grad_norm are exclusive: choose one clipping rule"
VIEW_NEEDS_SUM = (
    "gradient_as_view needs reduction='mean' or 'sum' (autograd adds gradients into "
    "the accumulators; a running mean rescales them every micro-step)"
)


def _optional_positive(name: str) -> Any:
    def check(value: Any) -> float | None:
        return None if value is None else _validation.check_positive(value, name)

    return check


# One check per field: it returns the normalised value or raises naming the field.
_CHECKS: dict[str, Any] = {
    "accum_steps": _validation.check_accum_steps,
    "reduction": lambda v: _validation.check_choice(v, "reduction", REDUCTIONS),
    "max_grad_norm": _optional_positive("max_grad_norm"),
    "use_agc": lambda v: _validation.check_bool(v, "use_agc"),
    "clip_factor": lambda v: _validation.check_positive(v, "clip_factor"),
    "eps": lambda v: _validation.check_positive(v, "eps", allow_zero=True),
    "leftover": lambda v: _validation.check_choice(v, "leftover", LEFTOVERS),
    "on_nonfinite": check_on_nonfinite,
    "bucket_cap_mb": lambda v: _validation.check_positive(v, "bucket_cap_mb"),
    "overlap_reduce": bool,
    "reduce_timeout": _optional_positive("reduce_timeout"),
    "gradient_as_view": lambda v: _validation.check_bool(v, "gradient_as_view"),
    "mixed_precision": lambda v: _validation.check_bool(v, "mixed_precision"),
    "initial_scale": lambda v: _validation.check_positive(v, "initial_scale"),
    "dynamic_growth_steps": lambda v: _validation.check_int(v, "dynamic_growth_steps"),
}


@dataclasses.dataclass(frozen=True)
class Options:
    """A wrapper's settings, checked and normalised at construction.

    Shared by both wrappers: ``accum_steps``, ``reduction``, ``use_agc``, ``clip_factor``
    (AGC's λ), ``eps`` (AGC's ε), ``leftover``, ``on_nonfinite``. PyTorch wrapper only:
    ``max_grad_norm``, ``bucket_cap_mb``, ``overlap_reduce``, ``reduce_timeout``,
    ``gradient_as_view``. Keras wrapper only: ``mixed_precision``, ``initial_scale``,
    ``dynamic_growth_steps``. Each wrapper documents their meaning.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range (the message names
            it), or two fields that cannot go together.
    """

    accum_steps: int = 1
    reduction: str = "mean"
    max_grad_norm: float | None = None
    use_agc: bool = False
    clip_factor: float = 0.01
    eps: float = 1e-3
    leftover: str = "apply"
    on_nonfinite: str = "skip"
    bucket_cap_mb: float = 25.0
    overlap_reduce: bool = True
    reduce_timeout: float | None = None
    gradient_as_view: bool = False
    mixed_precision: bool = False
    initial_scale: float = 2.0**15
    dynamic_growth_steps: int = 2000

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = _CHECKS[field.name](getattr(self, field.name))
            object.__setattr__(self, field.name, value)
        if self.use_agc and self.max_grad_norm is not None:
            raise ValueError(EXCLUSIVE_CLIPPING)
        if self.gradient_as_view and self.reduction == "running_mean":
            raise ValueError(VIEW_NEEDS_SUM)

    def replace(self, **changes: Any) -> Options:
        """A checked copy with ``changes`` (this record is left as it is)."""
        unknown = set(changes) - set(_CHECKS)
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)


def keras_reduction(reduction: str) -> str:
    """The Keras wrapper's spelling of a reduction (``"mean"`` → ``"MEAN"``)."""
    return reduction.upper()


def check_agc_exclude(value: Any) -> Any:
    """AGC's exclusion: ``"final"`` (the last weight matrix and the vectors after it), None
    (clip everything), or an iterable of what to leave unclipped (a single string other than
    ``"final"`` is one pattern)."""
    if value is not None and not isinstance(value, (str, Iterable)):
        raise TypeError(
            "agc_exclude must be 'final', None, or an iterable of variables, layers or "
            f"patterns, got {type(value).__name__}"
        )
    if isinstance(value, str) and value != "final":
        return (value,)
    return value
