"""The optimizer wrapper's options, checked in one place before anything is built, and the parts
of ``torch.optim.Optimizer``'s interface a wrapper that never calls its ``__init__`` provides."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from gradient_accumulator import _validation
from gradient_accumulator._engine import REDUCTIONS
from gradient_accumulator.nonfinite import check_on_nonfinite

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
    "delegated",
    "inner_attribute",
]

LEFTOVERS = ("apply", "carry")
EXCLUSIVE_CLIPPING = "use_agc and max_grad_norm are exclusive: choose one clipping rule"
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


class Options(NamedTuple):
    """The wrapper's constructor arguments, checked and normalised (see its docstring)."""

    accum_steps: int
    reduction: str
    max_grad_norm: float | None
    use_agc: bool
    clip_factor: float
    eps: float
    leftover: str
    on_nonfinite: str
    bucket_cap_mb: float
    overlap_reduce: bool
    reduce_timeout: float | None
    gradient_as_view: bool


def needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` requires its closure (``torch.optim.LBFGS``)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


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
        raise TypeError(
            f"optimizer {type(optimizer).__name__} needs a closure in step(): it re-evaluates "
            "the loss and gradient several times per update (a line search), which an "
            "accumulated gradient cannot provide (the closure would have to replay the whole "
            "cycle). Use it without GradientAccumulateOptimizer, with a closure that sums the "
            "micro-batches' weighted losses"
        )
    o = dict(kwargs)
    o["accum_steps"] = _validation.check_accum_steps(o["accum_steps"])
    o["reduction"] = _validation.check_choice(o["reduction"], "reduction", REDUCTIONS)
    o["leftover"] = _validation.check_choice(o["leftover"], "leftover", LEFTOVERS)
    if o["max_grad_norm"] is not None:
        o["max_grad_norm"] = _validation.check_positive(o["max_grad_norm"], "max_grad_norm")
    o["use_agc"] = _validation.check_bool(o["use_agc"], "use_agc")
    if o["use_agc"] and o["max_grad_norm"] is not None:
        raise ValueError(EXCLUSIVE_CLIPPING)
    o["clip_factor"], o["eps"] = _validation.check_agc_args(o["clip_factor"], o["eps"])
    o["on_nonfinite"] = check_on_nonfinite(o["on_nonfinite"])
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
        raise TypeError("grad_scaler must be a torch.amp.GradScaler")
    o["gradient_as_view"] = _validation.check_bool(o["gradient_as_view"], "gradient_as_view")
    if o["gradient_as_view"] and o["reduction"] == "running_mean":
        raise ValueError(
            "gradient_as_view needs reduction='mean' or 'sum' (autograd adds gradients into "
            "the accumulators; a running mean rescales them every micro-step)"
        )
    o["bucket_cap_mb"] = _validation.check_positive(o["bucket_cap_mb"], "bucket_cap_mb")
    if o["reduce_timeout"] is not None:
        o["reduce_timeout"] = _validation.check_positive(o["reduce_timeout"], "reduce_timeout")
    o["overlap_reduce"] = bool(o["overlap_reduce"])
    return Options(**o)


def check_max_norm(wrapper: Any, value: Any) -> float | None:
    """A new ``max_grad_norm`` for ``wrapper``: None, or finite and > 0, and not beside AGC."""
    if value is None:
        return None
    value = _validation.check_positive(value, "max_grad_norm")
    if wrapper.use_agc:
        raise ValueError(EXCLUSIVE_CLIPPING)
    return value


def check_leftover(wrapper: Any, value: Any) -> str:
    """A new ``leftover`` for ``wrapper``: ``"apply"`` or ``"carry"``."""
    return _validation.check_choice(value, "leftover", LEFTOVERS)


def check_policy(wrapper: Any, value: Any) -> str:
    """A new ``on_nonfinite`` for ``wrapper``: ``"skip"``, ``"raise"`` or ``"apply"``."""
    return check_on_nonfinite(value)


def inner_attribute(name: str) -> property:
    """The inner optimizer's ``name``, always its current object (its ``load_state_dict()``
    replaces them, and an LR scheduler must keep acting on them)."""

    def get(self: Any) -> Any:
        return getattr(self.optimizer, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self.optimizer, name, value)

    return property(get, set_, doc=f"The inner optimizer's ``{name}``.")


def delegated(path: str, doc: str, check: Any = None, *, read_only: bool = False) -> property:
    """A wrapper setting or read-out that lives on one of its parts (``path``:
    ``"part.attribute"``, or deeper; a part that is None reads as 0), checked by
    ``check(wrapper, value)`` when assigned."""
    *parts, name = path.split(".")

    def owner(self: Any) -> Any:
        for part in parts:
            self = getattr(self, part)
        return self

    def get(self: Any) -> Any:
        part = owner(self)
        return 0 if part is None else getattr(part, name)

    def set_(self: Any, value: Any) -> None:
        setattr(owner(self), name, value if check is None else check(self, value))

    return property(get, None if read_only else set_, doc=doc)
