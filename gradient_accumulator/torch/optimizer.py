"""GradientAccumulateOptimizer: any torch optimizer stepping once per k micro-batches, exactly.

The public face: it checks arguments and translates torch's optimizer interface into calls on
its working parts (``_loop.Loop``, which drives the shared engine's cycle)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Callable

import torch

from gradient_accumulator.torch import _readouts, _settings
from gradient_accumulator.torch._guards import refuse_outer_accumulation
from gradient_accumulator.torch._loop import Loop, StepHooks
from gradient_accumulator.torch._options import (
    HOOK_DICTS,
    AccumulationState,
    check_options,
    check_weight,
    inner_attribute,
)
from gradient_accumulator.torch._proxy import (
    inner_of,
    install_lightning_forwarding,
    is_lightning_proxy,
)
from gradient_accumulator.torch.batchnorm import register as register_batchnorm

__all__ = ["AccumulationState", "GradientAccumulateOptimizer", "unwrap_optimizer"]


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

    # ---- settings (may be changed between cycles; _settings.py) and two read-outs ----

    accum_steps = _settings.accum_steps
    reduction = _settings.reduction
    clip_factor = _settings.clip_factor
    eps = _settings.eps
    grad_scaler = _settings.grad_scaler
    max_grad_norm = _settings.max_grad_norm
    leftover = _settings.leftover
    on_nonfinite = _settings.on_nonfinite
    model = _settings.model
    update_applied = _readouts.update_applied
    last_grad_norm = _readouts.last_grad_norm
    use_agc = _settings.use_agc

    # ---- the inner optimizer's state, always its current objects ----

    param_groups = inner_attribute("param_groups")  # type: ignore[assignment]
    state = inner_attribute("state")  # type: ignore[assignment]
    defaults = inner_attribute("defaults")  # type: ignore[assignment]

    # ---- read-outs (_readouts.py) ----

    uses_fused_apply = _readouts.uses_fused_apply
    micro_step = _readouts.micro_step
    step_was_skipped = _readouts.step_was_skipped
    accumulation_state = _readouts.accumulation_state
    reduces_across_ranks = _readouts.reduces_across_ranks
    collectives = _readouts.collectives
    bytes_reduced = _readouts.bytes_reduced
    num_buckets = _readouts.num_buckets

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
