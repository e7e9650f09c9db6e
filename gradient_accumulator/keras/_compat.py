"""Small helpers shared by the Keras modules: deprecation warnings for 0.5's arguments and
attributes, and op ordering in TensorFlow graphs."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import keras


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


def after(tensors: Sequence[Any]) -> Any:
    """A context in which the ops created run only after ``tensors`` are computed (TensorFlow).

    In a ``tf.function`` the counter updates do not read the batch, so nothing orders them
    after the iterator's ``get_next``: on a dataset of unknown size, the step Keras runs on the
    exhausted iterator would tick them (a phantom micro-step) before the end-of-data error
    stops it. Tying them to the gradients makes every micro-step all-or-nothing.
    """
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.control_dependencies([t for t in tensors if tf.is_tensor(t)])
