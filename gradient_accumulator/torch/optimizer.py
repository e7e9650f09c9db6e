"""GradientAccumulateOptimizer: any torch optimizer stepping once per k micro-batches, exactly.

The public face: it checks arguments and translates torch's optimizer interface into calls on
its working parts (``_loop.Loop``, which drives the shared engine's cycle)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Callable

import torch

from gradient_accumulator import _validation
from gradient_accumulator.torch._guards import refuse_outer_accumulation
from gradient_accumulator.torch._loop import Loop, StepHooks
from gradient_accumulator.torch._options import (
    HOOK_DICTS,
    AccumulationState,
    check_leftover,
    check_max_norm,
    check_options,
    check_policy,
    checked,
    inner_attribute,
)
from gradient_accumulator.torch._proxy import (
    inner_of,
    install_lightning_forwarding,
    is_lightning_proxy,
)
from gradient_accumulator.torch.batchnorm import register as register_batchnorm

__all__ = ["AccumulationState", "GradientAccumulateOptimizer", "unwrap_optimizer"]


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


def unwrap_optimizer(optimizer: Any) -> Any:
    """The GradientAccumulateOptimizer behind a framework's optimizer proxy, else ``optimizer``.

    Follows Lightning's ``LightningOptimizer`` and accelerate's ``AcceleratedOptimizer``, so
    that state set on the result reaches the real wrapper and not a copy on the proxy.
    """
    for _ in range(8):
        if isinstance(optimizer, GradientAccumulateOptimizer) and not is_lightning_proxy(
            type(optimizer)
        ):
            return optimizer
        inner = inner_of(optimizer)
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


class GradientAccumulateOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` so that it steps once every ``accum_steps`` micro-batches.

    Keep the usual loop — ``loss.backward(); opt.step(); opt.zero_grad()`` on every micro-batch.
    Each ``step()`` folds the fresh ``.grad`` of every parameter into an fp32 accumulator (one
    pass of the C++ core, whatever the gradient's dtype) and frees it; the ``accum_steps``-th call
    applies the update. For ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (amsgrad off) the update
    is the core's fused pass — average, unscale, clip or AGC, optimizer step — writing the inner
    optimizer's own state tensors, so ``optimizer.state_dict()`` stays interchangeable with the
    plain optimizer. Any other optimizer gets the final gradient in ``.grad`` and its own
    ``step()``. The inner optimizer's step count, bias correction and learning rate therefore
    count real updates.

    Micro-batches may carry a weight (samples or tokens): with ``reduction="mean"`` the update
    uses the exact weighted mean ``Σ wᵢ gᵢ / Σ wᵢ``, so uneven micro-batches match the big batch
    when each loss is a mean over its own micro-batch and ``weight`` is its size.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        accum_steps: micro-batches per update, an int ≥ 1.
        reduction: ``"mean"`` (divide by the total weight), ``"sum"`` (no division) or
            ``"running_mean"`` (the accumulator always holds the mean so far).
        max_grad_norm: clip the global L2 norm of the averaged gradient to this value.
        use_agc: adaptive gradient clipping of the averaged gradient (NFNets).
        clip_factor: AGC's λ.
        eps: AGC's ε (floor of a unit's weight norm).
        agc_exclude: parameters (or modules, whose parameters are taken) left unclipped by AGC.
            ``"final"`` (default) excludes the last parameter of rank ≥ 2 and the rank ≤ 1
            parameters that follow it — the final classifier when parameters are in
            registration order, as in the NFNets paper. ``()`` clips everything.
        grad_scaler: a ``torch.amp.GradScaler`` whose scale the losses were multiplied by
            (``scaler.scale(loss).backward()``; then call ``opt.step()``, not
            ``scaler.step(opt)``). Gradients are accumulated scaled and unscaled once at the
            boundary; a cycle with a non-finite gradient skips the update, resets the
            accumulators and lowers the scale. The wrapper calls ``scaler.update()``.
        leftover: what :meth:`flush` does with a cycle cut short by the end of the data:
            ``"apply"`` it with its true weight (default) or ``"carry"`` it into the next cycle.
        process_group: reduce the accumulators over this ``torch.distributed`` group once per
            cycle. By default the default group is used when torch.distributed is initialised
            with more than one rank. Per-rank weights are summed in the same round, so the
            update is the exact weighted mean over all ranks' micro-batches. Use it with an
            unwrapped model (it replaces DDP's reduction), or with a DDP model whose forward
            and backward run inside :func:`accumulate` (DDP then stays silent on every
            micro-batch and this reduction replaces its own). ``False``: never reduce.
        bucket_cap_mb: size of a reduction bucket (one collective each), in MiB.
        overlap_reduce: start each bucket's reduction during the last micro-batch's backward, as
            soon as its gradients are final (needs the micro-batch's weight before the
            backward: the default 1, or ``accumulate(model, opt, weight=...)``). False: reduce
            after the backward, in ``step()``.
        reduce_timeout: seconds to wait for the other ranks at the boundary before raising
            ``RuntimeError`` (None: the process group's own timeout).
        on_nonfinite: what a cycle whose accumulated gradient holds NaN or Inf does (a NaN/Inf
            micro-batch gradient, or finite ones whose weighted sum overflowed fp32):
            ``"skip"`` (default) drops it and warns (``NonFiniteGradientWarning``, on the 1st,
            2nd, 4th, … skipped cycle), ``"raise"`` raises ``NonFiniteGradientError`` before
            anything is written, ``"apply"`` applies it. With ``grad_scaler`` such a cycle is
            skipped silently and the scale lowered, whatever this says.
        model: the module the parameters come from (optional). Errors then name parameters
            by their names in it, and its ``AccumBatchNorm*d`` layers are registered with
            this optimizer: they take the cycle's length and phase from it (their running
            statistics update in the forward whose ``step()`` ends the cycle, whatever
            ``accum_steps`` is set to between cycles) and :meth:`flush` flushes them.
            Required for a model sharded by FSDP2 (``fully_shard``): the accumulators and
            the update then work on each rank's shard, and each micro-batch's weight (named
            before its backward) enters FSDP2's reduce-scatter, so that the ranks are weighted
            exactly.
        gradient_as_view: make each fp32 parameter's ``.grad`` a view of its accumulator, so
            autograd adds every micro-batch's gradient into it in place and ``step()`` makes no
            pass over the gradients (as DDP's ``gradient_as_bucket_view``). A micro-batch's
            weight must then be known before its backward (the default 1, or
            ``accumulate(model, opt, weight=...)``) and ``.grad`` holds the cycle's running sum:
            see the semantics page for what that rules out. Needs ``reduction="mean"`` or
            ``"sum"``; bf16/fp16 gradients are folded into fp32 by a hook as autograd makes them.

    On CUDA the accumulate, norm, clip and update run in the core's CUDA kernels on the current
    stream; micro-steps do not synchronise with the device, and each update reads one flag
    (whether a gradient of the cycle was non-finite) back to the host, as ``GradScaler`` does.

    Example:
        >>> import torch
        >>> from gradient_accumulator.torch import GradientAccumulateOptimizer
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters()), 4)
        >>> for _ in range(8):
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> opt.optimizer.state[model.weight]["step"].item()
        2.0
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if is_lightning_proxy(cls):
            install_lightning_forwarding(cls, GradientAccumulateOptimizer)

    # accelerate's Accelerator.prepare() leaves an optimizer it counts as prepared as it is, so a
    # plain accelerator.prepare(model, opt, sched) hands back this wrapper itself, with its
    # step(weight=), flush(), update_applied and micro_step (an AcceleratedOptimizer would hide
    # them), and the prepared scheduler reads step_was_skipped. A loss scaler is the wrapper's
    # own (grad_scaler=accelerator.scaler), unscaled once per cycle.
    _is_accelerate_prepared = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accum_steps: int,
        reduction: str = "mean",
        *,
        max_grad_norm: float | None = None,
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        agc_exclude: str | Iterable[Any] = "final",
        grad_scaler: Any = None,
        leftover: str = "apply",
        process_group: Any = None,
        bucket_cap_mb: float = 25.0,
        overlap_reduce: bool = True,
        reduce_timeout: float | None = None,
        on_nonfinite: str = "skip",
        model: torch.nn.Module | None = None,
        gradient_as_view: bool = False,
    ) -> None:
        options = check_options(
            optimizer,
            model,
            grad_scaler,
            GradientAccumulateOptimizer,
            accum_steps=accum_steps,
            reduction=reduction,
            max_grad_norm=max_grad_norm,
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
            leftover=leftover,
            on_nonfinite=on_nonfinite,
            bucket_cap_mb=bucket_cap_mb,
            overlap_reduce=overlap_reduce,
            reduce_timeout=reduce_timeout,
            gradient_as_view=gradient_as_view,
        )
        self.optimizer = optimizer
        # The inner optimizer's groups, state and defaults are the wrapper's (properties below
        # read its current objects). torch.optim.Optimizer.__init__ would rebuild the groups.
        for name in HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._loop = Loop(optimizer, model, options, grad_scaler, process_group, agc_exclude)
        if model is not None:  # its AccumBatchNorm layers follow this optimizer's cycle
            register_batchnorm(model, self)

    # ---- settings (may be changed between cycles) ----

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
    def update_applied(self) -> bool:
        """Whether the last step() or flush() updated the weights. On CUDA, where the boundary
        leaves the non-finite skip to the device, the first read after a boundary waits for
        the GPU (docs/cuda.md)."""
        return self._loop.update_applied

    @property
    def last_grad_norm(self) -> Any:
        """With ``max_grad_norm``, the norm of the last cycle's averaged gradient before
        clipping: a float for CPU parameters, a 0-dim device tensor for CUDA ones (the step
        never waits for the GPU). NaN after a skipped cycle."""
        return self._loop.last_grad_norm

    @property
    def use_agc(self) -> bool:
        """Adaptive gradient clipping of the averaged gradient at the boundary."""
        return self._loop.update.agc_skip is not None

    @use_agc.setter
    def use_agc(self, value: bool) -> None:
        self._loop.configure(use_agc=checked("use_agc")(self, value))

    # ---- the inner optimizer's state, always its current objects ----

    param_groups = inner_attribute("param_groups")  # type: ignore[assignment]
    state = inner_attribute("state")  # type: ignore[assignment]
    defaults = inner_attribute("defaults")  # type: ignore[assignment]

    # ---- read-outs ----

    @property
    def uses_fused_apply(self) -> bool:
        """True when the update is the core's fused pass (SGD, Adam, AdamW)."""
        return self._loop.update.kind is not None

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated in the current cycle."""
        return self._loop.cycle.micro_step

    @property
    def step_was_skipped(self) -> bool:
        """True unless the last ``step()`` or ``flush()`` applied an update (accelerate's
        prepared scheduler reads it: stepped on every micro-batch, it advances once per
        update)."""
        return not self._loop.update_applied

    @property
    def accumulation_state(self) -> AccumulationState:
        """The cycle's position, total weight and non-finite flag."""
        c = self._loop.cycle
        return AccumulationState(c.micro_step, c.total_weight, c.nonfinite, self._loop.updates)

    @property
    def reduces_across_ranks(self) -> bool:
        """Whether the accumulators are reduced over a torch.distributed group once per cycle."""
        return self._loop.distributed

    @property
    def collectives(self) -> int:
        """Collectives launched by this optimizer's reductions so far (0 when not distributed)."""
        reducer = self._loop.reducer
        return 0 if reducer is None else reducer.collectives

    @property
    def bytes_reduced(self) -> int:
        """Bytes this rank has handed to all-reduce so far."""
        reducer = self._loop.reducer
        return 0 if reducer is None else reducer.bytes_reduced

    @property
    def num_buckets(self) -> int:
        """Reduction buckets (one collective each per cycle; 0 when not distributed)."""
        reducer = self._loop.reducer
        return 0 if reducer is None else reducer.num_buckets

    def is_boundary_next(self) -> bool:
        """True if the next ``step()`` call ends a cycle (and applies an update)."""
        return self._loop.cycle.boundary_next

    def accumulators(self) -> list[torch.Tensor]:
        """The fp32 accumulators, one per parameter (views of one flat buffer)."""
        return list(self._loop.cycle.accs)

    # ---- the loop ----

    def expect_weight(self, weight: float | torch.Tensor) -> None:
        """Name the weight of the coming micro-batch before its backward.

        :func:`~gradient_accumulator.torch.accumulate` calls it for its ``weight``; with
        ``overlap_reduce`` the last micro-batch's buckets are reduced during its backward,
        already weighted. ``step()`` then takes this weight. ``weight`` is a number or a 0-d
        tensor, as in :meth:`step` (a CUDA tensor is read once, waiting for the GPU).
        """
        self._loop.name_weight(check_weight(weight))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' ``.grad`` (already folded into the accumulators by ``step``).

        With ``gradient_as_view`` the views stay: they are the accumulators (and a micro-batch
        whose backward has written into them cannot be dropped: ``RuntimeError``).
        """
        self._loop.zero_grad(set_to_none)

    @torch.no_grad()
    def step(
        self, closure: Callable[[], Any] | None = None, *, weight: float | torch.Tensor = 1.0
    ) -> Any:
        """Accumulate this micro-batch's gradients; apply the update at the cycle's end.

        Args:
            closure: re-evaluates the loss (called once, before accumulating), as in torch.
            weight: this micro-batch's weight, finite and ≥ 0 (its sample or token count when
                losses are per-micro-batch means): a number or a 0-d tensor of an integer or
                floating dtype, e.g. ``(labels != -100).sum()``. A tensor is read with
                ``.item()``; for a CUDA tensor that waits once for the GPU's queued work (the
                backward), because the weight is checked before anything is written and the
                core folds it as a host number — the same wait as calling ``.item()`` yourself.

        Returns:
            The closure's loss, if a closure was given.

        A step is all or nothing: an error raised by it (bad input, a refused gradient, a
        non-finite cycle under ``on_nonfinite="raise"``) leaves the micro-batch uncounted and its
        ``.grad`` in place, so fixing the cause and calling ``step()`` again counts it once. A
        Ctrl-C arriving while the step writes is held until counters and buffers agree and then
        raised: the micro-batch has then been counted (:attr:`micro_step` moved) and must not be
        fed again.
        """
        refuse_outer_accumulation()
        self._loop.check_groups()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight = check_weight(weight)
        self._loop.step(weight, self._step_hooks())
        return loss

    def flush(self) -> bool:
        """End of data: apply a partial cycle with its true weight (``leftover="apply"``).

        The ``AccumBatchNorm*d`` layers this optimizer knows (those of ``model`` and those
        registered through ``convert_batchnorm(model, optimizer)``) fold their partial cycle
        into the running statistics at the same time, so they stay in phase with the updates.
        With ``leftover="carry"`` the partial cycle — of the optimizer and of those layers —
        is kept and continues with the next data. Under torch.distributed every rank must
        call ``flush()`` (a rank with an empty partial cycle still takes part in the
        reduction).

        Returns:
            True if an update was applied.
        """
        return self._loop.flush(self._step_hooks())

    def _step_hooks(self) -> StepHooks:
        return StepHooks(self, self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks)

    # ---- state ----

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the accumulators and the cycle's position.

        ``"layout"`` is a fingerprint of the parameters' shapes, dtypes and groups, checked by
        :meth:`load_state_dict`.
        """
        accumulation = self._loop.save()
        return {"optimizer": self.optimizer.state_dict(), "accumulation": accumulation}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (mid-cycle included).

        Everything is checked before anything is loaded: a state dict of another model (a
        different layout fingerprint, even with a buffer of the same size), of other settings,
        or with entries missing or of the wrong kind raises ``ValueError`` and leaves this
        optimizer and the inner one as they were.
        """
        self._loop.load(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after wrapping: the accumulator buffer is laid out once."""
        raise RuntimeError(
            "add the parameter group to the inner optimizer before wrapping it in "
            "GradientAccumulateOptimizer"
        )

    def __repr__(self) -> str:
        return (
            f"GradientAccumulateOptimizer({self.optimizer.__class__.__name__}, "
            f"accum_steps={self.accum_steps}, reduction={self.reduction!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
