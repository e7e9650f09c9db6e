"""Hugging Face accelerate: ``prepare()`` that keeps the wrapper's accumulation API.

``accelerator.prepare()`` wraps every optimizer in an ``AcceleratedOptimizer`` whose ``step()``
takes no weight and which hides ``flush()`` and ``update_applied``. Use this module's
:func:`prepare` instead (same arguments, same results): the prepared optimizer then takes
``step(weight=...)`` and forwards every attribute of the wrapper, and
:func:`gradient_accumulator.torch.accumulate` accepts it::

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

``Accelerator(gradient_accumulation_steps=n)`` with ``n > 1`` would accumulate a second time: it
is refused here, and ``GradientAccumulateOptimizer.step()`` refuses to run under it even after a
plain ``accelerator.prepare()``. With ``mixed_precision="fp16"`` create the wrapper with
``grad_scaler=accelerator.scaler``; the wrapper unscales and updates the scaler once per cycle.
"""

from __future__ import annotations

from typing import Any, Callable

from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer

__all__ = ["prepare"]

_PREPARED_CLASS: dict[type, type] = {}


def _prepared_class(base: type) -> type:
    """A subclass of accelerate's optimizer wrapper that speaks the accumulation API."""
    if base in _PREPARED_CLASS:
        return _PREPARED_CLASS[base]

    def step(self: Any, closure: Callable[[], Any] | None = None, *, weight: float = 1.0) -> Any:
        # No scaler.step() here: the wrapper unscales its accumulated gradient once per cycle.
        return self.optimizer.step(closure, weight=weight)

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def getattr_(self: Any, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def step_was_skipped(self: Any) -> bool:
        # Read by accelerate's scheduler wrapper: it advances only after a real update.
        return not self.optimizer.update_applied

    step.__doc__ = GradientAccumulateOptimizer.step.__doc__
    cls = type(
        "Accumulating" + base.__name__,
        (base,),
        {
            "step": step,
            "zero_grad": zero_grad,
            "__getattr__": getattr_,
            "step_was_skipped": property(step_was_skipped),
            "__doc__": "accelerate's optimizer wrapper around a GradientAccumulateOptimizer.",
        },
    )
    _PREPARED_CLASS[base] = cls
    return cls


def prepare(accelerator: Any, *objects: Any, **kwargs: Any) -> Any:
    """``accelerator.prepare(*objects)``, keeping each GradientAccumulateOptimizer's API.

    Args:
        accelerator: an ``accelerate.Accelerator`` with ``gradient_accumulation_steps=1``.
        *objects: what ``accelerator.prepare`` takes (models, optimizers, schedulers, loaders).
        **kwargs: passed to ``accelerator.prepare``.

    Returns:
        What ``accelerator.prepare`` returns; each prepared GradientAccumulateOptimizer takes
        ``step(weight=...)`` and forwards ``flush()``, ``update_applied``, ``micro_step`` and the
        rest of the wrapper's attributes.

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
    result = accelerator.prepare(*objects, **kwargs)
    prepared = result if isinstance(result, tuple) else (result,)
    for obj in prepared:
        inner = vars(obj).get("optimizer") if hasattr(obj, "__dict__") else None
        if isinstance(inner, GradientAccumulateOptimizer) and not isinstance(
            obj, GradientAccumulateOptimizer
        ):
            obj.__class__ = _prepared_class(type(obj))
    return result
