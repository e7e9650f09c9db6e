"""What a cycle with a NaN or Inf in its accumulated gradient does — one policy for every adapter.

A gradient that is not finite cannot be applied without destroying the weights, and skipping it
without a word can freeze a diverging run unnoticed. Every wrapper (PyTorch and Keras, all
backends) takes ``on_nonfinite`` with the same three values:

- ``"skip"`` (default): the cycle is dropped — no update, the accumulators are reset, the inner
  optimizer's step count does not move — and a :class:`NonFiniteGradientWarning` is issued.
  Warnings are rate-limited: the 1st, 2nd, 4th, 8th, … skipped cycle of a wrapper warns, each
  saying how many cycles it has skipped so far.
- ``"raise"``: raise :class:`NonFiniteGradientError` at the boundary, before anything is written;
  the accumulators are left as they are, so the cycle can be inspected.
- ``"apply"``: apply the update as computed (NaN/Inf reach the weights), as plain optimizers do.

Under loss scaling (``grad_scaler=`` in PyTorch, ``mixed_precision=True`` in Keras) a non-finite
cycle is the loss scaler's normal signal that the scale is too large: it is skipped and the scale
is lowered silently, whatever ``on_nonfinite`` says, as ``torch.amp.GradScaler`` and Keras's
``LossScaleOptimizer`` do.

Example:
    >>> from gradient_accumulator.nonfinite import check_on_nonfinite
    >>> check_on_nonfinite("skip")
    'skip'
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteGradientError",
    "NonFiniteGradientWarning",
    "NonFiniteCounter",
    "check_on_nonfinite",
]

NONFINITE_POLICIES = ("skip", "raise", "apply")


class NonFiniteGradientWarning(RuntimeWarning):
    """A cycle's accumulated gradient held NaN or Inf and the update was skipped."""


class NonFiniteGradientError(FloatingPointError):
    """A cycle's accumulated gradient held NaN or Inf and ``on_nonfinite="raise"``."""


def check_on_nonfinite(value: Any, name: str = "on_nonfinite") -> str:
    """Validate an ``on_nonfinite`` argument and return it.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not one of :data:`NONFINITE_POLICIES`.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {NONFINITE_POLICIES}, got {value!r}")
    if value not in NONFINITE_POLICIES:
        raise ValueError(f"{name} must be one of {NONFINITE_POLICIES}, got {value!r}")
    return value


# Packages whose frames stand between a user's call and a warning: this one, and the frameworks
# that call a wrapper on the user's behalf (a scheduler's patched step, accelerate's and
# Lightning's optimizer proxies, Keras's fit loop).
_CALLERS_SKIPPED = frozenset(
    {
        "gradient_accumulator",
        "torch",
        "accelerate",
        "lightning",
        "lightning_fabric",
        "pytorch_lightning",
        "transformers",
        "keras",
        "tensorflow",
        "jax",
        "optree",
    }
)


def _outside_caller() -> int:
    """The ``warnings.warn`` stacklevel, for a warning issued by the caller of this function,
    of the first frame outside this package and the frameworks around it: the user's line."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.split(".")[0] not in _CALLERS_SKIPPED:
            return level
        frame, level = frame.f_back, level + 1
    return 1


class NonFiniteCounter:
    """Counts skipped cycles of one wrapper and warns on the 1st, 2nd, 4th, 8th, … of them.

    Args:
        owner: how the warning names the wrapper, e.g. ``"GradientAccumulateOptimizer"``.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.skipped = 0

    def record_skip(self, stacklevel: int | None = 3) -> None:
        """Count one skipped cycle; warn when the count is a power of two.

        Args:
            stacklevel: as for ``warnings.warn``; None points the warning at the first caller
                outside this package and the frameworks around it (the user's line).
        """
        self.skipped += 1
        n = self.skipped
        if stacklevel is None:
            stacklevel = _outside_caller()
        if n & (n - 1) == 0:
            warnings.warn(
                f"{self.owner}: the accumulated gradient of a cycle is not finite (NaN or Inf); "
                f"the update was skipped ({n} cycle{'s' if n > 1 else ''} skipped so far). "
                "Pass on_nonfinite='raise' to stop at the first one, or 'apply' to apply it.",
                NonFiniteGradientWarning,
                stacklevel=stacklevel,
            )

    def raise_error(self) -> None:
        """Raise :class:`NonFiniteGradientError` for the current cycle."""
        raise NonFiniteGradientError(
            f"{self.owner}: the accumulated gradient of a cycle is not finite (NaN or Inf) and "
            "on_nonfinite='raise'; no update was made and the accumulators are untouched"
        )
