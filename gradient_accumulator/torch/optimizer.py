"""GradientAccumulateOptimizer: any torch optimizer stepping once per k micro-batches, exactly.

The cycle itself (accumulators, weights, seen flags, the non-finite check) is the shared eager
engine's (``gradient_accumulator._engine.Cycle``); this module translates torch objects in:
``.grad`` tensors, micro-batch weights, a ``GradScaler``, the inner optimizer, hooks and
``state_dict()``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Callable, NamedTuple

import torch

from gradient_accumulator import _validation, core
from gradient_accumulator._engine import REDUCTIONS, Cycle, clip_coef, grad_scale
from gradient_accumulator.nonfinite import NonFiniteCounter, check_on_nonfinite
from gradient_accumulator.torch import _params
from gradient_accumulator.torch._guards import held_interrupts, refuse_outer_accumulation
from gradient_accumulator.torch._proxy import (
    install_lightning_forwarding,
    is_lightning_proxy,
    unwrap_optimizer,
)
from gradient_accumulator.torch._update import InnerUpdate, LossScale
from gradient_accumulator.torch._views import GradViews
from gradient_accumulator.torch.batchnorm import layers_to_flush
from gradient_accumulator.torch.distributed import SCALAR_SLOTS, CycleReduction, resolve_group

__all__ = ["AccumulationState", "GradientAccumulateOptimizer", "unwrap_optimizer"]

_LEFTOVERS = ("apply", "carry")
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


def _inner_attribute(name: str) -> property:
    """The inner optimizer's ``name``, always its current object (its ``load_state_dict()``
    replaces them, and an LR scheduler must keep acting on them)."""

    def get(self: Any) -> Any:
        return getattr(self.optimizer, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self.optimizer, name, value)

    return property(get, set_, doc=f"The inner optimizer's ``{name}``.")


def _dense(g: torch.Tensor, p: torch.Tensor, name: str) -> torch.Tensor:
    """A parameter's ``.grad`` as the core takes it, or a clear error naming the parameter."""
    if g.is_sparse:
        raise TypeError(f"parameter {name} has a sparse gradient, which is not supported")
    if g.shape != p.shape:
        raise ValueError(
            f"parameter {name}'s .grad has shape {tuple(g.shape)}, not {tuple(p.shape)}"
        )
    g = g.detach()
    return g if g.is_contiguous() else g.contiguous()


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
            by their names in it, and :meth:`flush` also flushes its ``AccumBatchNorm*d``
            layers (without it, those whose affine weight this optimizer holds).
        gradient_as_view: make each fp32 parameter's ``.grad`` a view of its accumulator, so
            autograd adds every micro-batch's gradient into it in place and ``step()`` makes no
            pass over the gradients (as DDP's ``gradient_as_bucket_view``). A micro-batch's
            weight must then be known before its backward: the default 1, or
            ``accumulate(model, opt, weight=...)``; ``step(weight=w)`` with another weight is
            refused. ``.grad`` holds the cycle's running sum: a micro-batch cannot be dropped
            after its backward, per-micro-batch clipping of ``.grad`` clips the sum (use
            ``max_grad_norm``), ``backward(create_graph=True)`` is refused, and
            ``zero_grad(set_to_none=False)`` on the model or the inner optimizer would zero the
            accumulators (``opt.zero_grad()`` keeps the views; ``model.zero_grad()`` after
            ``step()`` drops them: exact, but each step then copies again). Needs
            ``reduction="mean"`` or ``"sum"``; bf16/fp16 parameters keep the fold; under
            torch.distributed the reduction runs after the backward.

    Attributes:
        update_applied: whether the last :meth:`step` (or :meth:`flush`) updated the weights.
        last_grad_norm: with ``max_grad_norm``, the norm of the last cycle's averaged gradient
            before clipping — a float for CPU parameters, a 0-dim device tensor for CUDA ones
            (read it when you need it; the step itself never waits for the GPU). NaN after a
            skipped cycle.

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
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, GradientAccumulateOptimizer):
            raise TypeError("optimizer is already a GradientAccumulateOptimizer")
        accum_steps = _validation.check_accum_steps(accum_steps)
        reduction = _validation.check_choice(reduction, "reduction", REDUCTIONS)
        self.leftover = _validation.check_choice(leftover, "leftover", _LEFTOVERS)
        if max_grad_norm is not None:
            max_grad_norm = float(_validation.check_positive(max_grad_norm, "max_grad_norm"))
        use_agc = _validation.check_bool(use_agc, "use_agc")
        if use_agc and max_grad_norm is not None:
            raise ValueError("use_agc and max_grad_norm are exclusive: choose one clipping rule")
        clip_factor, eps = _validation.check_agc_args(clip_factor, eps)
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
            raise TypeError("grad_scaler must be a torch.amp.GradScaler")
        gradient_as_view = _validation.check_bool(gradient_as_view, "gradient_as_view")
        if gradient_as_view and reduction == "running_mean":
            raise ValueError(
                "gradient_as_view needs reduction='mean' or 'sum' (autograd adds gradients into "
                "the accumulators; a running mean rescales them every micro-step)"
            )
        bucket_cap_mb = _validation.check_positive(bucket_cap_mb, "bucket_cap_mb")
        if reduce_timeout is not None:
            reduce_timeout = _validation.check_positive(reduce_timeout, "reduce_timeout")
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.model = model
        self._nonfinite_counter = NonFiniteCounter("GradientAccumulateOptimizer")
        # The inner optimizer's groups, state and defaults are the wrapper's (properties below
        # read its current objects: its load_state_dict() replaces them, and an LR scheduler
        # must keep acting on them). torch.optim.Optimizer.__init__ would rebuild the groups.
        for name in HOOK_DICTS:
            setattr(self, name, OrderedDict())

        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._names = _params.parameter_names(optimizer, model)
        _params.check_parameters(self._params, self._names)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._scaler = LossScale(grad_scaler, self._params[0].device)
        # One flat fp32 buffer for all accumulators, laid out in backward order and cut into
        # buckets; a tail of scalars travels with the last bucket: SCALAR_SLOTS for the weight,
        # the non-finite flag and the ranks' agreement, then one "seen" flag per parameter (a
        # multiple of 16 elements, for 64-byte alignment).
        self._distributed, group = (
            (False, None) if process_group is False else resolve_group(process_group)
        )
        plan = core.arena_plan(
            [p.numel() for p in self._params], bucket_numel=max(1, int(bucket_cap_mb * 2**18))
        )
        tail = SCALAR_SLOTS + -(-len(self._params) // 16) * 16
        device = self._params[0].device
        self._flat = torch.zeros(plan.total + tail, dtype=torch.float32, device=device)
        accs = [
            self._flat[o : o + p.numel()].view_as(p) for o, p in zip(plan.offsets, self._params)
        ]
        # On CUDA the core raises a device flag for non-finite gradients instead of returning a
        # Python bool, so micro-steps never wait for the GPU; the flag is read once per cycle.
        flag = (
            torch.zeros((), dtype=torch.float32, device=device) if device.type == "cuda" else None
        )
        self._cycle = Cycle(accs, accum_steps, reduction, device_flag=flag)
        self._agc_exclude = agc_exclude
        agc_skip = _params.agc_excluded(self._params, agc_exclude) if use_agc else None
        self._update = InnerUpdate(
            optimizer,
            self._params,
            accs,
            agc_skip=agc_skip,
            clip_factor=float(clip_factor),
            eps=float(eps),
        )
        self._layout = _params.layout_fingerprint(optimizer, self._flat.numel())
        self._reduction: CycleReduction | None = None
        self._hooks: list[Any] = []
        self._next_weight: float | None = None
        if self._distributed:
            agree = {
                "accum_steps": self.accum_steps,
                "reduction": REDUCTIONS.index(self.reduction),
                "number of parameters": len(self._params),
                "accumulator elements": self._flat.numel(),
                "buckets": len(plan.bucket_start),
                "layout fingerprint": int(self._layout[:12], 16),
                "overlap_reduce": int(bool(overlap_reduce)),
            }
            self._reduction = CycleReduction(
                self._flat, plan, group, reduce_timeout, tail, self._layout, agree
            )
            if overlap_reduce and not gradient_as_view:
                self._hooks = self._reduction.overlap(self._params, self._cycle, self._hook_weight)
        self._updates = 0
        self._flushing = False  # the reduction in progress is a flush's (checked across ranks)
        self._views = GradViews(self._params, accs) if gradient_as_view else None
        self.update_applied = False
        self.last_grad_norm: Any = None

    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (may be changed between cycles; ranks must agree)."""
        return self._cycle.accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        self._cycle.accum_steps = _validation.check_accum_steps(value)

    @property
    def reduction(self) -> str:
        """``"mean"``, ``"sum"`` or ``"running_mean"``; may change between cycles."""
        return self._cycle.reduction

    @reduction.setter
    def reduction(self, value: str) -> None:
        value = _validation.check_choice(value, "reduction", REDUCTIONS)
        if value != self._cycle.reduction:
            if self._cycle.micro_step > 0:
                raise ValueError(
                    f"reduction can change between cycles only ({self._cycle.micro_step} "
                    "micro-batches of this cycle are accumulated as "
                    f"{self._cycle.reduction!r}; flush() first)"
                )
            if value == "running_mean" and self._views is not None:
                raise ValueError("gradient_as_view needs reduction='mean' or 'sum'")
        self._cycle.reduction = value

    @property
    def use_agc(self) -> bool:
        """Adaptive gradient clipping of the averaged gradient at the boundary."""
        return self._update.agc_skip is not None

    @use_agc.setter
    def use_agc(self, value: bool) -> None:
        value = _validation.check_bool(value, "use_agc")
        if value and self.max_grad_norm is not None:
            raise ValueError("use_agc and max_grad_norm are exclusive: choose one clipping rule")
        self._update.agc_skip = (
            _params.agc_excluded(self._params, self._agc_exclude) if value else None
        )

    @property
    def clip_factor(self) -> float:
        """AGC's λ."""
        return self._update.clip_factor

    @clip_factor.setter
    def clip_factor(self, value: float) -> None:
        self._update.clip_factor = float(_validation.check_agc_args(value, self.eps)[0])

    @property
    def eps(self) -> float:
        """AGC's ε (floor of a unit's weight norm)."""
        return self._update.eps

    @eps.setter
    def eps(self, value: float) -> None:
        self._update.eps = float(_validation.check_agc_args(self.clip_factor, value)[1])

    @property
    def grad_scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` the losses are scaled by (None: no loss scaling)."""
        return self._scaler.scaler

    @grad_scaler.setter
    def grad_scaler(self, value: Any) -> None:
        self._scaler.scaler = value

    # ---- the inner optimizer's state, always its current objects ----

    param_groups = _inner_attribute("param_groups")  # type: ignore[assignment]
    state = _inner_attribute("state")  # type: ignore[assignment]
    defaults = _inner_attribute("defaults")  # type: ignore[assignment]

    @property
    def uses_fused_apply(self) -> bool:
        """True when the update is the core's fused pass (SGD, Adam, AdamW)."""
        return self._update.kind is not None

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated in the current cycle."""
        return self._cycle.micro_step

    @property
    def accumulation_state(self) -> AccumulationState:
        """The cycle's position, total weight and non-finite flag."""
        c = self._cycle
        return AccumulationState(c.micro_step, c.total_weight, c.nonfinite, self._updates)

    @property
    def reduces_across_ranks(self) -> bool:
        """Whether the accumulators are reduced over a torch.distributed group once per cycle."""
        return self._distributed

    @property
    def collectives(self) -> int:
        """Collectives launched by this optimizer's reductions so far (0 when not distributed)."""
        return self._reduction.reducer.collectives if self._reduction is not None else 0

    @property
    def bytes_reduced(self) -> int:
        """Bytes this rank has handed to all-reduce so far."""
        return self._reduction.reducer.bytes_reduced if self._reduction is not None else 0

    @property
    def num_buckets(self) -> int:
        """Reduction buckets (one collective each per cycle; 0 when not distributed)."""
        return self._reduction.reducer.num_buckets if self._reduction is not None else 0

    def is_boundary_next(self) -> bool:
        """True if the next ``step()`` call ends a cycle (and applies an update)."""
        return self._cycle.boundary_next

    def accumulators(self) -> list[torch.Tensor]:
        """The fp32 accumulators, one per parameter (views of one flat buffer)."""
        return list(self._cycle.accs)

    def expect_weight(self, weight: float) -> None:
        """Name the weight of the coming micro-batch before its backward.

        :func:`~gradient_accumulator.torch.accumulate` calls it for its ``weight``; with
        ``overlap_reduce`` the last micro-batch's buckets are reduced during its backward,
        already weighted. ``step()`` then takes this weight.
        """
        self._next_weight = _validation.check_positive(weight, "weight", allow_zero=True)
        if self._views is not None:
            self._views.expect(self._next_weight)

    # ---- the loop ----

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' ``.grad`` (already folded into the accumulators by ``step``).

        With ``gradient_as_view`` the views stay: they are the accumulators (and a micro-batch
        whose backward has written into them cannot be dropped: ``RuntimeError``).
        """
        if self._views is not None:
            self._views.check_drop(self._names.__getitem__)
        for i, p in enumerate(self._params):
            if p.grad is not None and not (self._views is not None and self._views.holds(i)):
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, weight: float = 1.0) -> Any:
        """Accumulate this micro-batch's gradients; apply the update at the cycle's end.

        Args:
            closure: re-evaluates the loss (called once, before accumulating), as in torch.
            weight: this micro-batch's weight, finite and ≥ 0 (its sample or token count when
                losses are per-micro-batch means).

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
        if sum(len(g["params"]) for g in self.optimizer.param_groups) != len(self._params):
            # A group added to the inner optimizer after wrapping: its gradients would never be
            # folded in, weighted or freed, and would reach the update summed over the cycles.
            raise RuntimeError(
                "the inner optimizer's parameter groups changed after it was wrapped in "
                "GradientAccumulateOptimizer (add_param_group on the inner optimizer?); add "
                "every group before wrapping, or wrap it again"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight = self._micro_weight(_validation.check_positive(weight, "weight", allow_zero=True))
        cycle = self._cycle
        if cycle.boundary_next and not all(p.is_contiguous() for p in self._params):
            # A parameter converted since construction (e.g. model.to(memory_format=...)):
            # refuse before this micro-batch is folded in, naming it.
            _params.check_layout(self._params, self._names)
        views = self._views
        if views is not None:
            views.settle_check(weight, self._names.__getitem__)
        grads = [
            None
            if p.grad is None or (views is not None and views.holds(i))
            else _dense(p.grad, p, self._names[i])
            for i, p in enumerate(self._params)
        ]
        # At the boundary the pass also returns Σacc²: the clip norm, and the check that the
        # accumulated result is finite (finite gradients can overflow fp32 once summed).
        norm = cycle.boundary_next and not self._distributed and self.reduction != "running_mean"
        with held_interrupts:
            held = views.settle() if views is not None else ()
            cycle.fold(grads, weight, norm=norm and not cycle.cuda, held=held)
            for p in self._params:  # the gradient now lives in the accumulator
                p.grad = None
            self._next_weight = None
            self.update_applied = False
            try:
                if cycle.micro_step >= self.accum_steps:
                    self._apply()
            finally:
                self._views_after_step()
        return loss

    def _views_after_step(self) -> None:
        """With ``gradient_as_view``: the views are ``.grad`` again, zeroed after a cycle."""
        if self._views is not None:
            if self._cycle.micro_step == 0:
                self._views.clear()
            else:
                self._views.done()

    def _micro_weight(self, weight: float) -> float:
        """The micro-batch's weight, reconciled with one named before its backward."""
        if self._cycle.early:
            used = self._cycle.early_weight
            if weight != used and not (weight == 1.0 and self._next_weight is not None):
                raise ValueError(
                    f"weight={weight} differs from the weight {used} the gradients were already "
                    "reduced with during the backward; with overlap_reduce pass the weight to "
                    "accumulate(model, opt, weight=...) (or set overlap_reduce=False)"
                )
            return used
        if self._next_weight is not None:
            if weight == 1.0:
                return self._next_weight
            if weight != self._next_weight:
                raise ValueError(
                    f"weight={weight} differs from the weight {self._next_weight} given to "
                    "accumulate(model, opt, weight=...); give it once"
                )
        return weight

    def _hook_weight(self) -> float:
        """The weight gradients folded in during a backward take (see ``expect_weight``)."""
        return self._next_weight if self._next_weight is not None else 1.0

    def flush(self) -> bool:
        """End of data: apply a partial cycle with its true weight (``leftover="apply"``).

        The ``AccumBatchNorm*d`` layers this optimizer knows (those of ``model``, or those
        whose affine weight it holds) fold their partial cycle into the running statistics at
        the same time, so they stay in phase with the updates. With ``leftover="carry"`` the
        partial cycle — of the optimizer and of those layers — is kept and continues with the
        next data. Under torch.distributed every rank must call ``flush()`` (a rank with an
        empty partial cycle still takes part in the reduction).

        Returns:
            True if an update was applied.
        """
        self.update_applied = False
        if self.leftover == "carry":
            return False
        with held_interrupts:
            applied = False
            if self._cycle.micro_step > 0 or self._distributed:
                self._cycle.sumsq = None
                self._flushing = True
                try:
                    applied = self._apply()
                finally:
                    self._flushing = False
                    self._views_after_step()
            for layer in layers_to_flush(self.model, self._index):
                layer.flush()
        return applied

    def _apply(self) -> bool:
        cycle = self._cycle
        if self._reduction is not None:
            cycle.collect_device_flag()
            self._reduction.reduce(cycle, self._flushing)
        idx = cycle.seen_index()
        scaling = self._scaler.enabled()
        scale = grad_scale(self.reduction, cycle.total_weight, self._scaler.scale())
        norm = cycle.result_norm(idx, scale)
        cycle.collect_device_flag()
        cycle.nonfinite |= not math.isfinite(cycle.total_weight)
        if cycle.nonfinite and (scaling or self.on_nonfinite != "apply"):
            # Skip the whole cycle: nothing half-applied, accumulators start over.
            self._scaler.update(found_inf=True)
            cycle.reset()
            self.last_grad_norm = float("nan")
            if not scaling:
                if self.on_nonfinite == "raise":
                    self._nonfinite_counter.raise_error()
                self._nonfinite_counter.record_skip(stacklevel=4)
            return False
        if not cycle.total_weight > 0:
            # Every micro-batch of the cycle had weight 0: there is no gradient to apply (an
            # update would still move weights through weight decay and momentum).
            cycle.reset()
            return False
        self._update.run_step_hooks(self, self._optimizer_step_pre_hooks, post=False)
        coef = None
        if self.max_grad_norm is not None:
            self.last_grad_norm = norm
            if cycle.cuda:  # norm and coefficient stay on the device
                coef = clip_coef(norm, self.max_grad_norm).to(torch.float32).reshape(1)
            else:
                scale *= clip_coef(norm, self.max_grad_norm)
        self._update(idx, scale, coef)
        self._updates += 1
        self._scaler.update(found_inf=False)
        cycle.reset()
        self.update_applied = True
        self._update.run_step_hooks(self, self._optimizer_step_post_hooks, post=True)
        return True

    # ---- state ----

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the accumulators and the cycle's position.

        ``"layout"`` is a fingerprint of the parameters' shapes, dtypes and groups, checked by
        :meth:`load_state_dict`.
        """
        accumulation = {"layout": self._layout, "accum_steps": self.accum_steps}
        accumulation.update(reduction=self.reduction, **self._cycle.state())
        accumulation.update(updates=self._updates, growth_tracker=self._scaler.growth_tracker)
        views = self._views
        accumulation["accumulators"] = (
            self._flat.clone() if views is None else views.saved(self._flat)
        )
        return {"optimizer": self.optimizer.state_dict(), "accumulation": accumulation}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (mid-cycle included).

        Everything is checked before anything is loaded: a state dict of another model (a
        different layout fingerprint, even with a buffer of the same size), of other settings,
        or with entries missing or of the wrong kind raises ``ValueError`` and leaves this
        optimizer and the inner one as they were.
        """
        _params.check_saved(
            state_dict,
            layout=self._layout,
            flat=self._flat,
            accum_steps=self.accum_steps,
            reduction=self.reduction,
            groups=[len(g["params"]) for g in self.optimizer.param_groups],
        )
        acc, inner = state_dict["accumulation"], state_dict["optimizer"]
        self._cycle.check_state(acc)
        self.optimizer.load_state_dict(inner)
        self._flat.copy_(acc["accumulators"])
        self._cycle.load_state(acc)
        if self._views is not None:
            self._views.scale = 1.0
            if self._cycle.micro_step == 0:
                self._views.clear()
            if self._next_weight is not None:  # a weight named before this load still holds
                self._views.expect(self._next_weight)
        self._updates = int(acc["updates"])
        self._scaler.growth_tracker = int(acc.get("growth_tracker", 0))

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
