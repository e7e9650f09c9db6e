"""The package's own deprecation warnings, in one class a test or a user can single out.

Every deprecation the package announces is a :class:`GradientAccumulatorDeprecationWarning`, a
subclass of :class:`DeprecationWarning`, so ``-W error::DeprecationWarning`` still catches it and
a test can make exactly the package's own warnings errors, without the frameworks' ones:

    python -W error::gradient_accumulator.GradientAccumulatorDeprecationWarning train.py

Example:
    >>> import warnings
    >>> from gradient_accumulator import GradientAccumulatorDeprecationWarning
    >>> issubclass(GradientAccumulatorDeprecationWarning, DeprecationWarning)
    True
"""

from __future__ import annotations

import warnings

__all__ = ["GradientAccumulatorDeprecationWarning", "warn_once"]


class GradientAccumulatorDeprecationWarning(DeprecationWarning):
    """A deprecated argument, attribute or behaviour of gradient-accumulator."""


_warned: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int) -> None:
    """Issue ``message`` the first time ``key`` is seen in this process, and never again.

    Args:
        key: what the warning is about; one warning per key per process.
        message: the text, saying what to do instead.
        stacklevel: frames between the user's call and this function, plus one.
    """
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, GradientAccumulatorDeprecationWarning, stacklevel=stacklevel + 1)
