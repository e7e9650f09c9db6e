"""Deprecation warnings for arguments and attributes of gradient-accumulator 0.5."""

from __future__ import annotations

import warnings


def warn_deprecated(what: str, instead: str, stacklevel: int = 3) -> None:
    """Warn that ``what`` (a 0.5 argument or attribute) has no effect now; say ``instead``.

    Args:
        what: the argument or attribute, as the user wrote it.
        instead: what to do instead, one sentence.
        stacklevel: frames between the user's call and this function, plus one.
    """
    warnings.warn(
        f"{what} is deprecated (gradient-accumulator 0.5): {instead}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
