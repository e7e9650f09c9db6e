"""Adaptive gradient clipping (NFNets) for PyTorch parameters, through the C++ core."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gradient_accumulator import _validation, core

__all__ = ["adaptive_clip_grad", "unitwise_norm"]


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """Per-output-unit L2 norm of a PyTorch weight ``(out, in, *kernel)``.

    Rank ≤ 1 tensors (biases, gains) are one unit: their whole-tensor norm.

    Returns:
        A float32 tensor on ``x``'s device with one norm per unit.

    Example:
        >>> import torch
        >>> unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([5., 1.])
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    num_units, _ = core.unit_layout(tuple(x.shape), "leading")
    out = torch.empty(num_units, dtype=torch.float32, device=x.device)
    core.unitwise_norm(x.detach().contiguous(), layout="leading", out=out)
    return out


@torch.no_grad()
def adaptive_clip_grad(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    clip_factor: float = 0.01,
    eps: float = 1e-3,
) -> None:
    """Clip ``.grad`` of ``parameters`` in place, unit by unit (Brock et al., 2021).

    For each output unit u: g_u ← g_u · min(1, λ·max(‖w_u‖, ε) / max(‖g_u‖, 1e-6)).
    Parameters without a gradient are skipped. Gradients that are not float32 are clipped in
    float32 and written back in their own dtype.

    Args:
        parameters: a tensor or an iterable of tensors with ``.grad``.
        clip_factor: λ > 0.
        eps: ε ≥ 0.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2, 2))
        >>> w.grad = torch.full((2, 2), 10.0)
        >>> adaptive_clip_grad([w], clip_factor=0.1)
        >>> w.grad  # each row's norm clipped to 0.1 * ‖(1, 1)‖ = 0.1414
        tensor([[0.1000, 0.1000],
                [0.1000, 0.1000]])
    """
    clip_factor, eps = _validation.check_agc_args(clip_factor, eps)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return
    grads = []
    for p in params:
        g = p.grad.detach()
        native = g.dtype == torch.float32 and g.is_contiguous()
        grads.append(g if native else g.float().contiguous())
    core.adaptive_clip(
        [p.detach().contiguous() for p in params],
        grads,
        clip_factor=clip_factor,
        eps=eps,
        layout="leading",
    )
    for p, g in zip(params, grads):
        if g.data_ptr() != p.grad.data_ptr():
            p.grad.copy_(g)
