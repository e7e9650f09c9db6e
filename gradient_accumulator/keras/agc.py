"""Adaptive gradient clipping (NFNets) for Keras weights, in backend ops (any Keras backend)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from gradient_accumulator._validation import check_agc_args

__all__ = ["adaptive_clip_grad", "compute_norm", "unitwise_norm"]

# Reduction axes of a unit-wise norm by rank, for Keras layouts (*kernel, in, out): the original
# package's rules. Rank ≤ 1 (biases, gains) is one unit; rank 2 and 3 (Dense, multi-head Dense,
# and Conv1D kernels) norm over axis 0; Conv2D over (0, 1, 2); Conv3D over (0, 1, 2, 3).
_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def compute_norm(x: Any, axis: Any, keepdims: bool) -> Any:
    """L2 norm of ``x`` over ``axis``: ``sqrt(sum(x**2, axis, keepdims))``.

    Args:
        x: a tensor.
        axis: an axis, a tuple of axes, or None for the whole tensor.
        keepdims: keep the reduced axes with length 1.

    Returns:
        The norm, a tensor of ``x``'s dtype.

    Example:
        >>> from keras import ops
        >>> float(compute_norm(ops.convert_to_tensor([3.0, 4.0]), axis=None, keepdims=False))
        5.0
    """
    return ops.sqrt(ops.sum(ops.square(x), axis=axis, keepdims=keepdims))


def _rank(x: Any) -> int:
    return len(tuple(x.shape))


def unitwise_norm(x: Any) -> Any:
    """Per-unit L2 norm of a Keras weight, broadcastable against it.

    Rank ≤ 1 gives the norm of the whole tensor. Rank 2 and 3 give one norm per output unit over
    axis 0; rank 4 (Conv2D kernels, HWIO) over axes (0, 1, 2); rank 5 (Conv3D, DHWIO) over
    (0, 1, 2, 3). The reduced axes are kept, so the result broadcasts against ``x``.

    Args:
        x: a weight or gradient tensor of rank ≤ 5.

    Returns:
        The norms (a scalar for rank ≤ 1).

    Raises:
        ValueError: ``x`` has rank 6 or more.

    Example:
        >>> import numpy as np
        >>> from keras import ops
        >>> kernel = ops.convert_to_tensor(np.array([[3.0, 0.0], [4.0, 1.0]], np.float32))
        >>> ops.convert_to_numpy(unitwise_norm(kernel)).tolist()
        [[5.0, 1.0]]
    """
    rank = _rank(x)
    if rank <= 1:
        return compute_norm(x, axis=None, keepdims=False)
    axes = _AXES.get(rank)
    if axes is None:
        raise ValueError(
            f"unitwise_norm supports tensors of rank <= 5, got x of rank {rank} "
            f"(shape {tuple(x.shape)})"
        )
    return compute_norm(x, axis=axes, keepdims=True)


def clip_one(param: Any, grad: Any, clip_factor: float, eps: float) -> Any:
    """AGC of one gradient, computed in float32 and returned in ``grad``'s dtype."""
    dtype = keras.backend.standardize_dtype(grad.dtype)
    g = ops.cast(grad, "float32")
    max_norm = ops.maximum(unitwise_norm(ops.cast(param, "float32")), eps) * clip_factor
    grad_norm = unitwise_norm(g)
    clipped = g * (max_norm / ops.maximum(grad_norm, 1e-6))
    return ops.cast(ops.where(grad_norm < max_norm, g, clipped), dtype)


def adaptive_clip_grad(
    parameters: Sequence[Any],
    gradients: Sequence[Any],
    clip_factor: float = 0.01,
    eps: float = 1e-3,
) -> list[Any]:
    """Adaptive gradient clipping (Brock et al., 2021) of each gradient, unit by unit.

    For each unit u of each (parameter, gradient) pair:
    ``g_u ← g_u · λ·max(‖w_u‖, ε) / max(‖g_u‖, 1e-6)`` where ``‖g_u‖ ≥ λ·max(‖w_u‖, ε)``, and
    unchanged elsewhere; units follow :func:`unitwise_norm`.

    Args:
        parameters: the weights (Keras variables or tensors).
        gradients: their gradients, in the same order.
        clip_factor: λ > 0.
        eps: ε ≥ 0, the floor of a unit's weight norm.

    Returns:
        The clipped gradients, a new list.

    Raises:
        ValueError: the lists differ in length, or ``clip_factor``/``eps`` are out of range.

    Example:
        >>> import numpy as np
        >>> from keras import ops
        >>> w = ops.ones((2, 2))
        >>> g = ops.full((2, 2), 10.0)
        >>> (clipped,) = adaptive_clip_grad([w], [g], clip_factor=0.1)
        >>> np.round(ops.convert_to_numpy(clipped).astype(float), 4).tolist()  # norm 0.1·√2
        [[0.1, 0.1], [0.1, 0.1]]
    """
    parameters, gradients = list(parameters), list(gradients)
    if len(parameters) != len(gradients):
        raise ValueError(
            f"parameters and gradients must have the same length, got {len(parameters)} "
            f"and {len(gradients)}"
        )
    clip_factor, eps = check_agc_args(clip_factor, eps)
    return [
        g if g is None else clip_one(p, g, clip_factor, eps) for p, g in zip(parameters, gradients)
    ]
