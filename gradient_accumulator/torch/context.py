"""accumulate(): keep DistributedDataParallel silent until the cycle's last micro-batch."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer

__all__ = ["accumulate"]


@contextlib.contextmanager
def accumulate(
    model: torch.nn.Module,
    optimizer: GradientAccumulateOptimizer,
    weight: float | None = None,
) -> Iterator[bool]:
    """Run one micro-batch's forward and backward inside this context.

    If ``model`` is wrapped in ``torch.nn.parallel.DistributedDataParallel`` and the next
    ``optimizer.step()`` does not end a cycle, DDP's gradient all-reduce is switched off
    (``no_sync``), so gradients cross the network once per update instead of once per
    micro-batch. For any other model it only tells the optimizer the micro-batch's weight.

    Args:
        model: the model, DDP-wrapped or not.
        optimizer: the GradientAccumulateOptimizer that will step after the backward.
        weight: this micro-batch's weight, known before the backward, so that the optimizer's
            own distributed reduction can start during the backward (``overlap_reduce``).

    Yields:
        True if this micro-batch ends a cycle (its gradients are synchronised).

    Example:
        >>> import torch
        >>> from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        >>> with accumulate(model, opt) as sync:
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> sync
        False
    """
    if not isinstance(optimizer, GradientAccumulateOptimizer):
        raise TypeError(
            f"optimizer must be a GradientAccumulateOptimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if weight is not None:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError(f"weight must be a number, got {type(weight).__name__}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        optimizer._next_weight = float(weight)
    boundary = optimizer.is_boundary_next()
    no_sync = getattr(model, "no_sync", None)
    if boundary or no_sync is None:
        yield boundary
    else:
        with no_sync():
            yield boundary
