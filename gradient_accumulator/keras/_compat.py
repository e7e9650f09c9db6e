"""Small helpers shared by the Keras modules: deprecation warnings for 0.5's arguments and
attributes, op ordering in TensorFlow graphs, and host copies of variables."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np


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


def to_numpy(value: Any) -> np.ndarray:
    """``value`` (a tensor or a ``keras.Variable``) as a NumPy array, without NumPy 2's
    ``DeprecationWarning`` about ``__array__``.

    ``keras.Variable.__array__``, ``tf.Variable.__array__`` and torch's ``Tensor.__array__``
    do not take NumPy 2's ``copy`` keyword, and ``keras.ops.convert_to_numpy`` goes through
    them: a variable is read through its backend value, which TensorFlow and torch convert
    with their own ``numpy()``.
    """
    if isinstance(value, keras.Variable):
        value = value.value
    if keras.backend.backend() == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            if value.dtype == torch.bfloat16:
                value = value.float()
            return value.numpy()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(value, (tf.Variable, tf.Tensor)):
            return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))
