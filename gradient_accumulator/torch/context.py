"""accumulate(): keep DistributedDataParallel silent until the cycle's last micro-batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer, unwrap_optimizer

__all__ = ["accumulate"]


def _is_multi_rank_ddp(model: torch.nn.Module) -> bool:
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    import torch.distributed as dist

    return dist.get_world_size(model.process_group) > 1


@contextlib.contextmanager
def accumulate(
    model: torch.nn.Module,
    optimizer: GradientAccumulateOptimizer,
    weight: float | torch.Tensor | None = None,
) -> Iterator[bool]:
    """Run one micro-batch's forward and backward inside this context.

    If ``model`` is wrapped in ``torch.nn.parallel.DistributedDataParallel``, DDP's gradient
    all-reduce is switched off (``no_sync``) and the optimizer's own reduction — one bucketed
    round per cycle, weighted exactly across ranks — takes its place, so gradients cross the
    network once per update instead of once per micro-batch. (DDP alone cannot be exact here:
    at the boundary it would average only the last micro-batch's ``.grad``, the others being
    already in the optimizer's accumulators; an optimizer created with ``process_group=False``
    is therefore refused for a DDP model over several ranks.) A model that merely offers
    ``no_sync`` with a non-distributed optimizer gets it on the non-boundary micro-batches.
    For any other model it only tells the optimizer the micro-batch's weight.

    Args:
        model: the model, DDP-wrapped or not.
        optimizer: the GradientAccumulateOptimizer that will step after the backward.
        weight: this micro-batch's weight, known before the backward, so that the optimizer's
            own distributed reduction can start during the backward (``overlap_reduce``).
            A number or a 0-d tensor, as ``GradientAccumulateOptimizer.step``'s ``weight``.

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
    optimizer = unwrap_optimizer(optimizer)  # Lightning's and accelerate's proxies
    if not isinstance(optimizer, GradientAccumulateOptimizer):
        raise TypeError(
            f"optimizer must be a GradientAccumulateOptimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if weight is not None:
        optimizer.expect_weight(weight)
    boundary = optimizer.is_boundary_next()
    no_sync = getattr(model, "no_sync", None)
    if optimizer.reduces_across_ranks and no_sync is not None:
        # The optimizer reduces its accumulators itself, once per cycle and weighted exactly:
        # DDP stays silent on every micro-batch, the boundary included.
        with no_sync():
            yield boundary
        return
    if _is_multi_rank_ddp(model):
        # DDP's boundary all-reduce would average only the last micro-batch's .grad: the
        # optimizer has already folded the others into its accumulators.
        raise ValueError(
            "optimizer does not reduce its accumulators (process_group=False), so a "
            "DistributedDataParallel model over several ranks would average only the last "
            "micro-batch of each cycle; create the optimizer with process_group=None (the "
            "default group) or the model's process group"
        )
    if boundary or no_sync is None:
        yield boundary
    else:
        with no_sync():
            yield boundary
