"""The optimizer wrapper's options, checked in one place before anything is built, and the parts
of ``torch.optim.Optimizer``'s interface a wrapper that never calls its ``__init__`` provides.

The settings themselves are :class:`gradient_accumulator._options.Options`, the record both
wrappers share; this module adds the checks of the PyTorch objects handed to the wrapper and the
setters' check against the wrapper's current settings (:func:`checked`)."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from gradient_accumulator import _validation
from gradient_accumulator._options import EXCLUSIVE_CLIPPING, LEFTOVERS, Options

__all__ = [
    "HOOK_DICTS",
    "LEFTOVERS",
    "EXCLUSIVE_CLIPPING",
    "AccumulationState",
    "Options",
    "check_leftover",
    "check_max_norm",
    "check_options",
    "check_policy",
    "check_weight",
    "checked",
    "inner_attribute",
]

# The hook registries of torch.optim.Optimizer, which a wrapper not calling its __init__ needs.
HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class AccumulationState(NamedTuple):
    """Where the wrapper stands inside a cycle (also saved in ``state_dict()``).

    Attributes:
        micro_step: micro-batches accumulated in the current cycle (0 ≤ micro_step < accum_steps).
        total_weight: sum of the weights of those micro-batches.
        nonfinite: True if any of them had a NaN/Inf gradient.
        updates: optimizer updates made so far (skipped non-finite cycles not counted).
    """

    micro_step: int
    total_weight: float
    nonfinite: bool
    updates: int


def needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` requires its closure (``torch.optim.LBFGS``)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def closure_refusal(optimizer: Any) -> str:
    """Why an optimizer whose ``step`` requires a closure cannot be wrapped, naming its class."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        how = "it re-evaluates the loss and gradient several times per update (a line search)"
    else:
        how = "it calls the closure to re-evaluate the loss and gradient during its update"
    return (
        f"optimizer {name} needs a closure in step(): {how}. Under accumulation the update's "
        "gradient is the weighted mean over a cycle of micro-batches whose forward and backward "
        "are already done when it is applied; a closure re-evaluating it would have to replay "
        "the whole cycle, which the wrapper cannot do. Use it without "
        "GradientAccumulateOptimizer, with a closure that sums the micro-batches' weighted losses"
    )


def check_options(
    optimizer: Any, model: Any, grad_scaler: Any, wrapper_type: type, **kwargs: Any
) -> Options:
    """Check every argument of the wrapper (``TypeError``/``ValueError`` naming it).

    Args:
        optimizer, model, grad_scaler: the objects handed to the wrapper.
        wrapper_type: the wrapper class (an optimizer already wrapped is refused).
        **kwargs: the remaining arguments, by the names of :class:`Options`.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, wrapper_type):
        raise TypeError(f"optimizer is already a {wrapper_type.__name__}")
    if needs_closure(optimizer):
        raise TypeError(closure_refusal(optimizer))
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
        raise TypeError("grad_scaler must be a torch.amp.GradScaler")
    return Options(**kwargs)


def current_options(wrapper: Any) -> Options:
    """``wrapper``'s settings as they are now, as a record."""
    loop = wrapper._loop
    return Options(
        accum_steps=loop.cycle.accum_steps,
        reduction=loop.cycle.reduction,
        max_grad_norm=loop.max_grad_norm,
        use_agc=loop.update.agc_skip is not None,
        clip_factor=loop.update.clip_factor,
        eps=loop.update.eps,
        leftover=loop.leftover,
        on_nonfinite=loop.on_nonfinite,
        gradient_as_view=loop.views is not None,
    )


def checked(name: str) -> Any:
    """The check of a setter of ``name``: the value as the record normalises it, refused
    (``TypeError``/``ValueError``) if it is bad or breaks a rule with the current settings."""

    def check(wrapper: Any, value: Any) -> Any:
        return getattr(current_options(wrapper).replace(**{name: value}), name)

    return check


check_max_norm = checked("max_grad_norm")
check_leftover = checked("leftover")
check_policy = checked("on_nonfinite")


def inner_attribute(name: str) -> property:
    """The inner optimizer's ``name``, always its current object (its ``load_state_dict()``
    replaces them, and an LR scheduler must keep acting on them)."""

    def get(self: Any) -> Any:
        return getattr(self.optimizer, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self.optimizer, name, value)

    return property(get, set_, doc=f"The inner optimizer's ``{name}``.")


def check_weight(weight: Any, name: str = "weight") -> float:
    """A micro-batch's weight as a float: a real number or a 0-d real tensor, finite and ≥ 0.

    A tensor (integer or floating dtype, on any device) is read with ``.item()``: on CUDA that
    waits for the work queued before it, once per call. It cannot be avoided here: the weight
    is checked (finite, ≥ 0) before anything is written, and the core's fold and the cycle's
    total weight take it as a host number.

    Raises:
        TypeError: not a real number (bools, complex numbers and their tensors included).
        ValueError: a tensor that is not 0-d, or a value that is negative or not finite.
    """
    if isinstance(weight, torch.Tensor):
        if weight.dtype == torch.bool or weight.is_complex():
            raise TypeError(f"{name} must be a real number, got a tensor of dtype {weight.dtype}")
        if weight.dim() != 0:
            raise ValueError(
                f"{name} must be a number or a 0-d tensor, got a tensor of shape "
                f"{tuple(weight.shape)}"
            )
        weight = weight.item()
    return _validation.check_positive(weight, name, allow_zero=True)
