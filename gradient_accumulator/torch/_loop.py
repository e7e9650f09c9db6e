"""The PyTorch optimizer wrapper's working parts: the engine's cycle driven with torch objects.

:class:`Loop` holds what the wrapper builds from its inner optimizer and options — the flat fp32
accumulator buffer, the engine's :class:`~gradient_accumulator._engine.Cycle`, the inner update,
the loss scale, the reduction over ranks, the ``.grad`` views — and runs a micro-step, a
boundary, a flush and a checkpoint's save and load with them. The public class
(``optimizer.py``) checks arguments and translates: ``.grad`` tensors in, properties out.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradient_accumulator._engine import (
    REDUCTIONS,
    Cycle,
    SplitFold,
    clip_coef,
    ends_cycle,
    grad_scale,
)
from gradient_accumulator.nonfinite import NonFiniteCounter
from gradient_accumulator.torch import _params, fsdp
from gradient_accumulator.torch._guards import held_interrupts
from gradient_accumulator.torch._options import Options
from gradient_accumulator.torch._outcomes import DeviceOutcomes
from gradient_accumulator.torch._update import InnerUpdate, LossScale
from gradient_accumulator.torch._views import GradViews
from gradient_accumulator.torch.batchnorm import Registered, layers_to_flush
from gradient_accumulator.torch.distributed import SCALAR_SLOTS, CycleReduction, resolve_group

_UNCHANGED: Any = object()  # a setting of Loop.configure that is not given

# The CUDA path's boundary with the non-finite flag in host memory: set by tests to run that
# path's logic (device flag, skip and step counters decided by the core) on CPU tensors.
DEVICE_PATH_ON_CPU = False


class StepHooks(NamedTuple):
    """The wrapper's step pre- and post-hooks, and the optimizer they receive."""

    owner: Any
    pre: dict
    post: dict


class Loop:
    """One wrapper's accumulation state and its micro-step, boundary, flush and checkpoint.

    Args:
        optimizer: the inner optimizer; ``model``: the module of its parameters, or None.
        options: the wrapper's checked options.
        grad_scaler, process_group, agc_exclude: as the wrapper takes them.

    Attributes (the wrapper's settings live here; it exposes them as properties and changes
    them through :meth:`configure`):
        max_grad_norm, leftover, on_nonfinite: as the wrapper takes them.
        update_applied, last_grad_norm: what the last step or flush did.
        updates: optimizer updates made so far.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module | None,
        options: Options,
        grad_scaler: Any,
        process_group: Any,
        agc_exclude: Any,
    ) -> None:
        o = options
        self.optimizer, self.model = optimizer, model
        self.max_grad_norm, self.leftover, self.on_nonfinite = (
            o.max_grad_norm,
            o.leftover,
            o.on_nonfinite,
        )
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.names = _params.parameter_names(optimizer, model)
        # FSDP2 (DTensor parameters): accumulators and update on each rank's local shard.
        self.sharded = any(fsdp.is_dtensor(p) for p in self.params)
        if self.sharded:
            fsdp.check_options(process_group, o)
        local = self.locals()
        _params.check_parameters(local, self.names)
        # Each parameter's memory layout (None: C-contiguous), which its accumulator copies.
        self.strides = _params.strides(local)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.scaler = LossScale(grad_scaler, local[0].device)
        self.distributed, group = (
            (False, None) if process_group is False else resolve_group(process_group)
        )
        self.distributed |= self.sharded
        # The tail's scalars travel with the last bucket: the weight, the non-finite flag, the
        # ranks' agreement and the seen flags.
        self.flat, plan, tail, accs = _params.accumulator_buffer(
            local, o.bucket_cap_mb, SCALAR_SLOTS
        )
        # On CUDA the core raises a device flag for non-finite gradients instead of returning a
        # Python bool, so micro-steps never wait for the GPU. The boundary leaves the flag to the
        # fused apply where it can (decides_on_device), else reads it once.
        device = local[0].device
        flag = (
            torch.zeros((), dtype=torch.float32, device=device)
            if device.type == "cuda" or DEVICE_PATH_ON_CPU
            else None
        )
        self.cycle = Cycle(accs, o.accum_steps, o.reduction, device_flag=flag)
        # Each accumulator's shape (the parameter's, local shard under FSDP2, when wrapped):
        # every micro-step compares its gradients' shapes with these, a tuple compare each.
        self.shapes = [tuple(a.shape) for a in accs]
        self.agc_exclude = agc_exclude
        agc_skip = _params.agc_excluded(self.params, agc_exclude) if o.use_agc else None
        _params.check_agc_layout(local, self.names, agc_skip)
        self.update = InnerUpdate(
            optimizer,
            self.params,
            accs,
            local=fsdp.local if self.sharded else None,
            agc_skip=agc_skip,
            clip_factor=o.clip_factor,
            eps=o.eps,
        )
        # Under FSDP2 the global shapes (every rank's shard differs).
        numel = sum(p.numel() for p in self.params) if self.sharded else self.flat.numel()
        self.layout = _params.layout_fingerprint(optimizer, numel)
        self.across_ranks: CycleReduction | None = None
        self.hooks: list[Any] = []
        agree = {
            "accum_steps": o.accum_steps,
            "reduction": REDUCTIONS.index(o.reduction),
            "number of parameters": len(self.params),
            "overlap_reduce": int(o.overlap_reduce),
        }
        self.fsdp: fsdp.FsdpSharding | None = None
        if self.sharded:
            agree["layout fingerprint"] = int(self.layout[:12], 16)
            self.fsdp = fsdp.FsdpSharding(
                self.params, self.names, model, self.cycle.hook_weight, agc_skip, agree
            )
        elif self.distributed:
            self.across_ranks = CycleReduction(
                self.flat, plan, group, o.reduce_timeout, tail, self.layout, agree
            )
            if o.overlap_reduce and not o.gradient_as_view:
                self.hooks = self.across_ranks.overlap(
                    self.params, self.cycle, self.cycle.hook_weight
                )
        self.views = GradViews(self.params, self.cycle) if o.gradient_as_view else None
        self.nonfinite_counter = NonFiniteCounter("GradientAccumulateOptimizer")
        self.outcomes = DeviceOutcomes(self.nonfinite_counter)
        self._updates = 0  # decided on the host; the device-decided ones are in outcomes
        self.flushing = False  # the reduction in progress is a flush's (checked across ranks)
        self._applied = False
        self.update_applied = False
        self.last_grad_norm: Any = None
        self.batchnorms = Registered()  # AccumBatchNorm layers that follow this cycle

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (pickle, deepcopy) holds new parameter objects: the id-keyed index is rebuilt.
        self.__dict__.update(state)
        self.index = {id(p): i for i, p in enumerate(self.params)}

    @property
    def updates(self) -> int:
        """Optimizer updates made so far (reads the device after device-decided boundaries)."""
        return self._updates + self.outcomes.settle()

    @updates.setter
    def updates(self, value: int) -> None:
        self.outcomes.clear()
        self._updates = value

    @property
    def update_applied(self) -> bool:
        """Whether the last step or flush updated the weights (reads the device when that was
        a device-decided boundary)."""
        skipped = self.outcomes.last_skipped()
        if skipped is not None:
            self._applied = not skipped
        return self._applied

    @update_applied.setter
    def update_applied(self, value: bool) -> None:
        self.outcomes.last = None
        self._applied = value

    def decides_on_device(self, hooks: StepHooks) -> bool:
        """Whether this boundary can leave the skip to the device: the default configuration
        on CUDA (no loss scaler, ``on_nonfinite="skip"``, one process, the fused update, no step
        hooks). Anything that needs the outcome on the host first reads the flag instead."""
        cycle = self.cycle
        if not cycle.cuda or cycle.nonfinite or self.scaler.enabled():
            return False
        if self.on_nonfinite != "skip" or self.distributed or hooks.pre or hooks.post:
            return False
        return self.update.decides_on_device()

    def locals(self) -> list[torch.Tensor]:
        """The parameters as the core takes them: each rank's local shard under FSDP2."""
        return [fsdp.local(p) for p in self.params] if self.sharded else self.params

    @property
    def reducer(self) -> Any:
        """The bucket reducer of the reduction over ranks (None when not distributed)."""
        return self.across_ranks.reducer if self.across_ranks is not None else None

    # ---- settings (checked by the wrapper's setters) ----

    def configure(
        self,
        *,
        max_grad_norm: Any = _UNCHANGED,
        leftover: str | None = None,
        on_nonfinite: str | None = None,
        model: Any = _UNCHANGED,
        grad_scaler: Any = _UNCHANGED,
        use_agc: bool | None = None,
        clip_factor: float | None = None,
        eps: float | None = None,
    ) -> None:
        """Change settings between steps (those not given stay as they are)."""
        if max_grad_norm is not _UNCHANGED:
            self.max_grad_norm = max_grad_norm
        if leftover is not None:
            self.leftover = leftover
        if on_nonfinite is not None:
            self.on_nonfinite = on_nonfinite
        if model is not _UNCHANGED:
            self.model = model
        if grad_scaler is not _UNCHANGED:
            self.scaler.scaler = grad_scaler
        if use_agc is not None:
            self.update.agc_skip = (
                _params.agc_excluded(self.params, self.agc_exclude) if use_agc else None
            )
        if clip_factor is not None:
            self.update.clip_factor = clip_factor
        if eps is not None:
            self.update.eps = eps

    # ---- the loop ----

    def check_groups(self) -> None:
        """Refuse a parameter group added to the inner optimizer after wrapping: its gradients
        would never be folded in, weighted or freed, and would reach the update summed."""
        if sum(len(g["params"]) for g in self.optimizer.param_groups) != len(self.params):
            raise RuntimeError(
                "the inner optimizer's parameter groups changed after it was wrapped in "
                "GradientAccumulateOptimizer (add_param_group on the inner optimizer?); add "
                "every group before wrapping, or wrap it again"
            )

    def name_weight(self, weight: float) -> None:
        """The coming micro-batch's weight, named before its backward (checked).

        Raises:
            ValueError: gradients of the micro-batch in flight were already folded in, or added
                into the views, with another weight (nothing changed).
        """
        self.cycle.check_named_weight(weight)
        if self.views is not None:
            self.views.expect(weight)
        self.cycle.name_weight(weight)

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop the ``.grad`` tensors that are not views of the accumulators."""
        views = self.views
        if views is not None:
            views.check_drop(self.names.__getitem__)
        for i, p in enumerate(self.params):
            if p.grad is not None and not (views is not None and views.holds(i)):
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def step(self, weight: float, hooks: StepHooks) -> None:
        """Fold the parameters' ``.grad`` in with ``weight``; update at the cycle's end."""
        cycle, views = self.cycle, self.views
        weight = cycle.micro_weight(weight)
        # FSDP2's reduce-scatter already multiplied each rank's gradient by its weight.
        fold_weight = weight
        unreduced = False  # FSDP2 with gradient sync off: the gradients stay in FSDP2
        if self.fsdp is not None:
            unreduced = self.fsdp.sync_off()
            if unreduced and cycle.boundary_next:
                raise ValueError(
                    "the last micro-step of a cycle ran its backward with FSDP2's gradient sync "
                    "off: its gradients are not reduced; turn sync on for the cycle's last "
                    "backward (model.set_requires_gradient_sync(True))"
                )
        if self.fsdp is not None and self.fsdp.weighted_by_reduction:
            fold_weight = self.fsdp.fold_weight(weight, cycle.named_weight)
        local = self.locals()
        if cycle.boundary_next:
            # A parameter resized or converted since construction (e.g. model.to(memory_format=
            # ...)): refuse before this micro-batch is folded in, naming it.
            _params.check_shapes(local, self.shapes, self.names)
            if not _params.same_layouts(local, self.strides):
                _params.check_layout(local, self.names, self.strides)
        if views is not None:
            views.settle_check(weight, self.names.__getitem__)
        if unreduced:
            grads = [None] * len(self.params)
        elif self.sharded:
            grads = [fsdp.local(p.grad) for p in self.params]
        elif views is None:
            grads = [p.grad for p in self.params]
        else:
            grads = [None if views.holds(i) else p.grad for i, p in enumerate(self.params)]
        for g, shape in zip(grads, self.shapes):  # about 0.3 µs a parameter
            if g is not None and g.shape != shape:
                _params.check_shapes(grads, self.shapes, self.names, what="its .grad")
        # At the boundary the pass also returns Σacc²: the clip norm, and the check that the
        # accumulated result is finite (finite gradients can overflow fp32 once summed).
        norm = cycle.boundary_next and not self.distributed and cycle.reduction != "running_mean"
        with held_interrupts:
            held = views.settle() if views is not None else ()
            try:
                # The gradients as autograd left them: the core reads each one laid out like its
                # accumulator through torch's accessors, and refuses anything else unwritten.
                cycle.fold(
                    grads, fold_weight, norm=norm and not cycle.cuda, held=held, single_call=True
                )
            except (SplitFold, ValueError, TypeError, RuntimeError):
                # Checked one by one, named, converted where they can be; then folded.
                grads = [
                    None if g is None else _params.dense_grad(g, p, self.names[i])
                    for i, (p, g) in enumerate(zip(local, grads))
                ]
                cycle.fold(grads, fold_weight, norm=norm and not cycle.cuda, held=held)
            if self.fsdp is not None:
                self.fsdp.weight += weight
                if not unreduced:
                    self.fsdp.reduced()
            for p in self.params:  # the gradient now lives in the accumulator
                p.grad = None
            self.update_applied = False
            try:
                if ends_cycle(cycle.micro_step, cycle.accum_steps):
                    self.apply(hooks)
            finally:
                if views is not None:
                    views.after_step(cycle.micro_step)

    def refuse_in_flight(self, what: str) -> None:
        """Refuse ``what`` between a backward whose gradients already went into the
        accumulators (overlap_reduce, gradient_as_view) and the ``step()`` that counts them:
        the accumulators then hold part of a micro-batch the counters do not know of.

        Raises:
            RuntimeError: nothing changed; ``step()`` counts the micro-batch, then ``what``.
        """
        views = self.views
        if self.cycle.early or (views is not None and views.in_flight()):
            raise RuntimeError(
                f"{what} between a backward and its step(): that backward's gradients are "
                "already in the accumulators (gradient_as_view or overlap_reduce), but not yet "
                f"counted; call step() first, then {what}"
            )

    def flush(self, hooks: StepHooks) -> bool:
        """Apply a partial cycle with its true weight (see the wrapper's ``flush``)."""
        self.update_applied = False
        if self.leftover == "carry":
            return False
        self.refuse_in_flight("flush()")
        if self.fsdp is not None:
            self.fsdp.check_unreduced("flush()")
        if self.cycle.micro_step > 0:
            _params.check_shapes(self.locals(), self.shapes, self.names)
        with held_interrupts:
            applied = False
            if self.cycle.micro_step > 0 or self.distributed:
                self.flushing = True
                try:
                    applied = self.apply(hooks)
                finally:
                    self.flushing = False
                    if self.views is not None:
                        self.views.after_step(self.cycle.micro_step)
            for layer in layers_to_flush(self.model, self.index, self.batchnorms):
                layer.flush()
        return applied and self.update_applied  # a device-decided boundary is read here

    def apply(self, hooks: StepHooks) -> bool:
        """The boundary: reduce over ranks, skip a non-finite or weightless cycle, else clip
        and update. Returns whether the weights were updated, or True for a boundary left to
        the device (:attr:`update_applied` then reads the outcome)."""
        cycle = self.cycle
        if self.fsdp is not None:
            cycle.collect_device_flag()
            self.fsdp.reduce(cycle, self.flushing)
        elif self.across_ranks is not None:
            cycle.collect_device_flag()
            self.across_ranks.reduce(cycle, self.flushing)
        idx = cycle.seen_index()
        scaling = self.scaler.enabled()
        scale = grad_scale(cycle.reduction, cycle.total_weight, self.scaler.scale())
        if self.fsdp is not None:  # Σacc² summed over the shards in the reduction
            norm = self.fsdp.norm(cycle, scale)
        else:
            norm = cycle.result_norm(idx, scale)
        cycle.check_total_weight()
        # A weightless cycle updates nothing: its flag is read (and lowered) on the host.
        on_device = cycle.total_weight > 0 and self.decides_on_device(hooks)
        if not on_device:
            cycle.collect_device_flag()
        if cycle.nonfinite and (scaling or self.on_nonfinite != "apply"):
            # Skip the whole cycle: nothing half-applied, accumulators start over.
            self.scaler.update(found_inf=True)
            cycle.reset()
            self.last_grad_norm = float("nan")
            if not scaling:
                if self.on_nonfinite == "raise":
                    self.nonfinite_counter.raise_error()
                self.nonfinite_counter.record_skip(stacklevel=None)  # at the user's call
            return False
        if not cycle.total_weight > 0:
            # Every micro-batch of the cycle had weight 0: there is no gradient to apply (an
            # update would still move weights through weight decay and momentum).
            cycle.reset()
            return False
        self.update.run_step_hooks(hooks.owner, hooks.pre, post=False)
        coef = None
        if self.max_grad_norm is not None:
            self.last_grad_norm = norm
            if cycle.cuda:  # norm and coefficient stay on the device
                coef = clip_coef(norm, self.max_grad_norm).to(torch.float32).reshape(1)
            else:
                scale *= clip_coef(norm, self.max_grad_norm)
        if on_device:
            # The core skips on the device when the flag is raised (a non-finite gradient or
            # result); Adam's step counters advance there. The outcome is read later, if asked.
            self.update(idx, scale, coef, skip_flag=cycle.device_flag)
            skipped = self.outcomes.record(cycle.device_flag)  # also update_applied's answer
            if self.max_grad_norm is not None:
                self.last_grad_norm = torch.where(skipped, float("nan"), norm)
            cycle.reset()
            return True
        if self.fsdp is not None:
            self.fsdp_update(idx, scale, coef)
        else:
            self.update(idx, scale, coef)
        self._updates += 1
        self.scaler.update(found_inf=False)
        cycle.reset()
        self.update_applied = True
        self.update.run_step_hooks(hooks.owner, hooks.post, post=True)
        return True

    def fsdp_update(self, idx: list[int], scale: float, coef: Any) -> None:
        """The update under FSDP2: AGC's whole-tensor units (rank ≤ 1 parameters, spread over
        the shards) clipped with norms summed over the ranks, the rest as usual."""
        update = self.update
        skip = update.agc_skip
        whole = self.fsdp.whole_units(self.params, skip)
        if not whole:
            update(idx, scale, coef)
            return
        self.fsdp.clip_whole(whole, self.params, self.cycle, scale, update.clip_factor, update.eps)
        update.agc_skip = set(skip) | set(whole)
        try:
            update(idx, scale, coef)
        finally:
            update.agc_skip = skip

    # ---- checkpoints ----

    def save(self) -> dict[str, Any]:
        """The ``"accumulation"`` entry of the wrapper's state dict."""
        self.refuse_in_flight("state_dict()")
        cycle = self.cycle
        saved = {"layout": self.layout, "accum_steps": cycle.accum_steps}
        saved.update(reduction=cycle.reduction, **cycle.state())
        saved.update(updates=self.updates, growth_tracker=self.scaler.growth_tracker)
        views = self.views
        if self.fsdp is not None:  # sharded: DTensors, the ranks' weights gathered
            saved.update(self.fsdp.save(self.params, cycle.accs, cycle.nonfinite))
            self.fsdp.fill_state(self.optimizer, self.update.kind)
        else:
            saved["accumulators"] = self.flat.clone() if views is None else views.saved(self.flat)
        return saved

    def load(self, state_dict: dict[str, Any]) -> None:
        """Check everything, then load the inner optimizer's state and the accumulation."""
        self.refuse_in_flight("load_state_dict()")
        cycle = self.cycle
        weight = 0.0
        if self.fsdp is not None and isinstance(state_dict, dict):
            acc = state_dict.get("accumulation")
            if isinstance(acc, dict):
                acc, weight = self.fsdp.loaded(acc, self.params, self.flat, cycle.accs)
                state_dict = dict(state_dict, accumulation=acc)
        _params.check_saved(
            state_dict,
            layout=self.layout,
            flat=self.flat,
            accum_steps=cycle.accum_steps,
            reduction=cycle.reduction,
            groups=[len(g["params"]) for g in self.optimizer.param_groups],
        )
        acc, inner = state_dict["accumulation"], state_dict["optimizer"]
        cycle.check_state(acc)
        self.optimizer.load_state_dict(inner)
        self.flat.copy_(acc["accumulators"])
        cycle.load_state(acc)
        if self.fsdp is not None:
            self.fsdp.weight = weight
        if self.views is not None:
            self.views.after_load(cycle.micro_step, cycle.named_weight)
        self.updates = int(acc["updates"])
        self.scaler.growth_tracker = int(acc.get("growth_tracker", 0))
