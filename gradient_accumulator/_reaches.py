"""Records of the package's reaches into other libraries' private parts.

Each framework's glue module (``torch/_glue.py``, ``keras/_compat.py``, ``torch/_proxy.py`` for
Lightning, ``torch/accelerate.py``, ``torch/transformers.py``) lists the private attributes,
functions, patches and stack-frame lookups it relies on as :class:`Reach` records, with the
versions they were checked against. The test suite probes every record against the installed
library and fails with :func:`moved`'s message when an upgrade moved one.
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import NamedTuple


class Reach(NamedTuple):
    """One private part of another library that the package relies on.

    Attributes:
        library: the distribution that owns it (``"torch"``, ``"keras"``, ``"lightning"``, …).
        target: what is reached, as a dotted path (``Class().attr``: an attribute of
            instances; ``patch:``: a global replacement; ``frame:``: a caller's frame read).
        checked: the versions of ``library`` it was checked against.
        used_for: where the package reaches it and why.
    """

    library: str
    target: str
    checked: str
    used_for: str


def installed_version(library: str) -> str:
    """The installed version of ``library`` (``"not installed"`` without it)."""
    if library == "python":
        return platform.python_version()
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "not installed"


def moved(reach: Reach, detail: str) -> str:
    """The message for ``reach`` no longer being where the package expects it."""
    return (
        f"{reach.library} {installed_version(reach.library)} moved or changed "
        f"{reach.target} (checked against {reach.library} {reach.checked}): {detail}. "
        f"gradient_accumulator uses it for {reach.used_for}; update the glue that lists it"
    )


# The interpreter's own: the non-finite warning's stack level (nonfinite.py).
REACHES = (
    Reach(
        "python",
        "frame: sys._getframe and frame.f_back / f_globals['__name__'] (CPython)",
        "3.11",
        "pointing a skipped-cycle warning at the user's line, past the frames of this package "
        "and the frameworks around it (nonfinite.py)",
    ),
)
