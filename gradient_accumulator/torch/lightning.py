"""Lightning: exact gradient accumulation in a ``LightningModule`` with manual optimization.

Lightning's automatic loop counts every ``optimizer.step()`` call as an optimizer step, so a
wrapper that must see every micro-batch would make ``global_step`` and ``interval="step"``
schedulers count micro-batches. The route that keeps them exact is manual optimization with one
call per micro-batch::

    from gradient_accumulator.torch import GradientAccumulateOptimizer
    from gradient_accumulator.torch.lightning import accumulation_step

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            ...

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)  # mean over this micro-batch
            self.manual_backward(loss)
            accumulation_step(self, batch_idx, weight=len(x))

        def configure_optimizers(self):
            opt = GradientAccumulateOptimizer(torch.optim.AdamW(self.parameters()), 4)
            sched = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=10)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

Through ``self.optimizers()`` (Lightning's ``LightningOptimizer`` proxy) every method and
attribute of the wrapper acts on the real wrapper; a ``step()`` counts as Lightning's optimizer
step (``global_step``) only when it ends a cycle, and ``flush()`` when it applies an update. With
``automatic_optimization=True`` a wrapper of ``accum_steps > 1`` is refused with a message saying
so. Lightning's own ``accumulate_grad_batches`` and ``gradient_clip_val`` must stay off (use the
wrapper's ``accum_steps`` and ``max_grad_norm``). Checkpoints hold the wrapper's full state (the
accumulators and the cycle's position) and resume bit-exactly.
"""

from __future__ import annotations

from typing import Any

from gradient_accumulator.torch.batchnorm import flush_batchnorm
from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer

__all__ = ["accumulation_step"]


def _single_optimizer(module: Any) -> Any:
    opt = module.optimizers()
    if isinstance(opt, (list, tuple)):
        if len(opt) != 1:
            raise ValueError(
                "accumulation_step() needs a module with one optimizer; with several, pass "
                "optimizer= explicitly"
            )
        opt = opt[0]
    return opt


def accumulation_step(
    module: Any, batch_idx: int, weight: Any = 1.0, *, optimizer: Any = None
) -> bool:
    """Fold one micro-batch into the wrapper; update, and step the schedulers, at a cycle's end.

    Call it in ``training_step`` after ``self.manual_backward(loss)``. On the epoch's last batch a
    short cycle is applied with its true weight (``flush()``, batch-norm layers included). After
    each update the ``interval="step"`` schedulers of ``configure_optimizers`` step once (with
    manual optimization Lightning leaves them to the module).

    Args:
        module: the ``LightningModule`` (``self``).
        batch_idx: the ``batch_idx`` of ``training_step``.
        weight: this micro-batch's weight (its sample or token count when the loss is a mean): a
            number or a 0-d tensor, as ``GradientAccumulateOptimizer.step``'s ``weight``.
        optimizer: the optimizer to step (default: the module's only optimizer).

    Returns:
        True if the weights were updated.

    Raises:
        TypeError: if the optimizer is not a ``GradientAccumulateOptimizer``.
        ValueError: if a scheduler with ``interval="step"`` needs a monitored metric.
    """
    opt = _single_optimizer(module) if optimizer is None else optimizer
    if not isinstance(opt, GradientAccumulateOptimizer):
        raise TypeError(
            f"optimizer must be a GradientAccumulateOptimizer, got {type(opt).__name__}"
        )
    trainer = module.trainer
    configs = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
    if any(c.reduce_on_plateau for c in configs):
        raise ValueError(
            "accumulation_step() cannot step a ReduceLROnPlateau scheduler with "
            "interval='step' (it needs a metric); step it yourself when update_applied is True"
        )
    opt.step(weight=weight)
    opt.zero_grad()
    applied = bool(opt.update_applied)
    total = trainer.num_training_batches
    if isinstance(total, int) and batch_idx + 1 >= total:
        # The epoch's last micro-batch: a short cycle is applied now, with its true weight.
        flush_batchnorm(module)  # the module's batch norms, registered with opt or not
        applied = opt.flush() or applied
    if applied:
        for config in configs:
            config.scheduler.step()
    return applied
