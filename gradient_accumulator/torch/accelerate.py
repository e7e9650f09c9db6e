"""Hugging Face accelerate: ``prepare()`` with the checks a plain ``accelerator.prepare()`` lacks.

``accelerator.prepare(model, opt, sched, loader)`` hands a GradientAccumulateOptimizer back as
it is (accelerate counts it as prepared), so ``step(weight=...)``, ``flush()``,
``update_applied`` and ``micro_step`` work on what it returns, and the prepared scheduler —
stepped on every micro-batch, as with accelerate's own accumulation — advances once per real
update (it reads the wrapper's ``step_was_skipped``)::

    from accelerate import Accelerator
    from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate
    from gradient_accumulator.torch.accelerate import prepare

    accelerator = Accelerator()  # gradient_accumulation_steps stays 1
    opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters()), 4, max_grad_norm=1.0)
    model, opt, sched, loader = prepare(accelerator, model, opt, sched, loader)
    for x, y in loader:
        with accumulate(model, opt, weight=len(x)):
            accelerator.backward(loss_fn(model(x), y))
        opt.step(weight=len(x))
        opt.zero_grad()
        sched.step()  # the prepared scheduler advances only after an update
    if opt.flush():
        sched.step()

This module's :func:`prepare` is ``accelerator.prepare`` plus two refusals made before anything
is prepared: ``Accelerator(gradient_accumulation_steps=n)`` with ``n > 1`` would accumulate a
second time (``GradientAccumulateOptimizer.step()`` also refuses to run under it after a plain
``accelerator.prepare()``), and with ``mixed_precision="fp16"`` the wrapper must be created with
``grad_scaler=accelerator.scaler`` (it unscales and updates the scaler once per cycle), which a
plain ``accelerator.prepare()`` cannot check.
"""

from __future__ import annotations

from typing import Any

from gradient_accumulator._reaches import Reach
from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer

ACCELERATE = "1.15.0"

# accelerate's internals the package relies on (probed by the integration tests).
REACHES = (
    Reach(
        "accelerate",
        "accelerate.state.GradientState._shared_state['plugin_kwargs']['num_steps']",
        ACCELERATE,
        "refusing a GradientAccumulateOptimizer step under Accelerator(gradient_accumulation_"
        "steps=n > 1), read without importing accelerate (torch/_guards.py)",
    ),
    Reach(
        "accelerate",
        "Accelerator.prepare() leaving objects with _is_accelerate_prepared = True as they are",
        ACCELERATE,
        "handing the wrapper itself back from prepare(), with step(weight=), flush() and "
        "update_applied (torch/optimizer.py)",
    ),
    Reach(
        "accelerate",
        "accelerate.optimizer.AcceleratedOptimizer().optimizer",
        ACCELERATE,
        "reaching the real wrapper behind accelerate's proxy (unwrap_optimizer)",
    ),
)

__all__ = ["prepare"]


def prepare(accelerator: Any, *objects: Any, **kwargs: Any) -> Any:
    """``accelerator.prepare(*objects)`` after checking the accelerator suits the wrapper.

    Args:
        accelerator: an ``accelerate.Accelerator`` with ``gradient_accumulation_steps=1``.
        *objects: what ``accelerator.prepare`` takes (models, optimizers, schedulers, loaders).
        **kwargs: passed to ``accelerator.prepare``.

    Returns:
        What ``accelerator.prepare`` returns: each GradientAccumulateOptimizer as it was given,
        each scheduler wrapped so that it advances only after a real update.

    Raises:
        ValueError: if the accelerator accumulates gradients itself, or uses a loss scaler the
            wrapper was not given.
    """
    steps = accelerator.gradient_accumulation_steps
    ours = [o for o in objects if isinstance(o, GradientAccumulateOptimizer)]
    if ours and steps > 1:
        raise ValueError(
            f"accelerator accumulates gradients over gradient_accumulation_steps={steps}, and "
            "GradientAccumulateOptimizer accumulates too: the micro-batches would be "
            "accumulated twice. Create the Accelerator with gradient_accumulation_steps=1"
        )
    scaler = getattr(accelerator, "scaler", None)
    for opt in ours:
        if scaler is not None and opt.grad_scaler is not scaler:
            raise ValueError(
                "accelerator scales the loss (mixed_precision='fp16'): create the "
                "GradientAccumulateOptimizer with grad_scaler=accelerator.scaler"
            )
    return accelerator.prepare(*objects, **kwargs)
