"""The optimizer wrapper's settings, as the properties its class takes over: each reads the
loop's current value and hands a new one, checked (``_options.checked`` and the other checks),
to the loop."""

from __future__ import annotations

from typing import Any

import torch

from gradient_accumulator.torch._options import (
    check_leftover,
    check_max_norm,
    check_policy,
    checked,
)


@property
def accum_steps(self) -> int:
    """Micro-batches per update (may be changed between cycles; ranks must agree)."""
    return self._loop.cycle.accum_steps


@accum_steps.setter
def accum_steps(self, value: int) -> None:
    self._loop.cycle.set_accum_steps(checked("accum_steps")(self, value))


@property
def reduction(self) -> str:
    """``"mean"``, ``"sum"`` or ``"running_mean"``; may change between cycles."""
    return self._loop.cycle.reduction


@reduction.setter
def reduction(self, value: str) -> None:
    value = checked("reduction")(self, value)
    if value == "running_mean" and self._loop.sharded and value != self.reduction:
        raise ValueError("a model sharded by FSDP2 needs reduction='mean' or 'sum'")
    self._loop.cycle.set_reduction(value)


@property
def clip_factor(self) -> float:
    """AGC's λ."""
    return self._loop.update.clip_factor


@clip_factor.setter
def clip_factor(self, value: float) -> None:
    self._loop.configure(clip_factor=checked("clip_factor")(self, value))


@property
def eps(self) -> float:
    """AGC's ε (floor of a unit's weight norm)."""
    return self._loop.update.eps


@eps.setter
def eps(self, value: float) -> None:
    self._loop.configure(eps=checked("eps")(self, value))


@property
def grad_scaler(self) -> Any:
    """The GradScaler of the losses, or None."""
    return self._loop.scaler.scaler


@grad_scaler.setter
def grad_scaler(self, value: Any) -> None:
    self._loop.configure(grad_scaler=value)


@property
def max_grad_norm(self) -> float | None:
    """The clip threshold."""
    return self._loop.max_grad_norm


@max_grad_norm.setter
def max_grad_norm(self, value: float | None) -> None:
    self._loop.configure(max_grad_norm=check_max_norm(self, value))


@property
def leftover(self) -> str:
    """flush()'s partial cycle: apply/carry."""
    return self._loop.leftover


@leftover.setter
def leftover(self, value: str) -> None:
    self._loop.configure(leftover=check_leftover(self, value))


@property
def on_nonfinite(self) -> str:
    """What a non-finite cycle does."""
    return self._loop.on_nonfinite


@on_nonfinite.setter
def on_nonfinite(self, value: str) -> None:
    self._loop.configure(on_nonfinite=check_policy(self, value))


@property
def model(self) -> torch.nn.Module | None:
    """The module the parameters come from, or None."""
    return self._loop.model


@model.setter
def model(self, value: torch.nn.Module | None) -> None:
    self._loop.configure(model=value)


@property
def use_agc(self) -> bool:
    """Adaptive gradient clipping of the averaged gradient at the boundary."""
    return self._loop.update.agc_skip is not None


@use_agc.setter
def use_agc(self, value: bool) -> None:
    self._loop.configure(use_agc=checked("use_agc")(self, value))
