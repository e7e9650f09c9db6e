"""accumulate(): keep DistributedDataParallel silent until the cycle's last micro-batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer

__all__ = ["accumulate"]


@contextlib.contextmanager
def accumulate(model: torch.nn.Module, optimizer: GradientAccumulateOptimizer) -> Iterator[bool]:
    """Run one micro-batch's forward and backward inside this context.

    If ``model`` is wrapped in ``torch.nn.parallel.DistributedDataParallel`` and the next
    ``optimizer.step()`` does not end a cycle, DDP's gradient all-reduce is switched off
    (``no_sync``), so gradients cross the network once per update instead of once per
    micro-batch. For any other model the context does nothing.

    Args:
        model: the model, DDP-wrapped or not.
        optimizer: the GradientAccumulateOptimizer that will step after the backward.

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
    boundary = optimizer.is_boundary_next()
    no_sync = getattr(model, "no_sync", None)
    if boundary or no_sync is None:
        yield boundary
    else:
        with no_sync():
            yield boundary
