"""The PyTorch-backend path of the Keras GradientAccumulateOptimizer: the shared eager engine.

The cycle (first micro-step overwrites, weights, seen flags, a missing gradient, the non-finite
check, the boundary's scale) is ``gradient_accumulator._engine.Cycle``, the one the PyTorch
adapter drives. This module translates Keras objects in: the wrapper's variables, which hold the
cycle's position so that a checkpoint saves it, and the inner Keras optimizer, updated at the
boundary by one fused ``core.apply`` per group of variables for ``SGD`` without momentum (the
same arithmetic as Keras's) or, for any other optimizer, by its own ``apply`` on the final
gradients that ``core.apply`` wrote into the accumulators. Adam and AdamW take that second way:
the core's fused Adam follows PyTorch's formula (bias corrections in float64, fused moment
updates, epsilon after the correction) and would round 1–2 ulp away from Keras's multi-tensor
Adam on every update, where Keras's own update keeps the wrapper bit-identical to the plain
optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import keras
import torch

from gradient_accumulator import core
from gradient_accumulator._engine import Cycle, boundary_rule, boundary_scale, ends_cycle
from gradient_accumulator.keras._compat import to_numpy
from gradient_accumulator.keras._tf_shell import StatefulShell


def _torch_tensor(g: Any) -> Any:
    """``g`` as a torch tensor: itself, or converted as Keras converts it (on Keras's device)."""
    return g if isinstance(g, torch.Tensor) else keras.ops.convert_to_tensor(g)


class CycleVariables(NamedTuple):
    """The wrapper's Keras variables the cycle lives in (saved with the model)."""

    micro_step: Any
    total_weight: Any
    nonfinite: Any
    seen: Any
    batch_weight: Any
    iterations: Any
    skipped: Any
    loss_scale: Any
    growth: Any


class Settings(NamedTuple):
    """The wrapper's options this path needs."""

    accum_steps: int
    reduction: str  # "MEAN", "SUM" or "RUNNING_MEAN"
    mixed_precision: bool
    drops_nonfinite: bool  # on_nonfinite decides about a non-finite cycle
    static_scale: float | None
    dynamic_growth_steps: int
    use_agc: bool
    clip_factor: float
    eps: float
    fused: bool  # the wrapper itself clips nothing, so a fused update may replace the inner's


class _Group(NamedTuple):
    """Variables updated by one core call: same AGC flag and weight decay."""

    index: list[int]
    agc: bool
    weight_decay: float
    units: list[tuple[int, str]] | None


def _fused_kind(inner: Any, variables: Sequence[Any], allowed: bool) -> str:
    """Which fused core update reproduces the inner optimizer's own formula bit for bit, if any.

    Only plain SGD: the core's Adam/AdamW rounds differently from Keras's (see the module's
    docstring), so they are left to the inner optimizer."""
    if not allowed or not type(inner).__module__.startswith("keras."):
        return "none"  # a user subclass may change update_step
    if any(x is not None for x in (inner.clipnorm, inner.clipvalue, inner.global_clipnorm)):
        return "none"
    if inner.use_ema or any(v.constraint is not None for v in variables):
        return "none"
    if isinstance(inner, keras.optimizers.SGD) and not inner.momentum:
        # Plain SGD: decoupled weight decay equals L2 decay, which is the core's.
        return "sgd"
    return "none"


def _value(var: Any) -> torch.Tensor:
    return var.value.detach()


class CorePath:
    """One wrapper's cycle on eager torch tensors.

    Args:
        inner: the inner Keras optimizer (built).
        variables: the wrapper's trainable variables; ``accumulators``: their fp32 accumulators.
        state: the wrapper's cycle variables.
        agc_mask: per variable, whether AGC clips it (all False without AGC).
        settings: the wrapper's options.
        clip: the wrapper's own gradient clipping (clipnorm and friends), for the generic update.
        report: reports dropped non-finite cycles (warns or raises).
    """

    def __init__(
        self,
        inner: Any,
        variables: Sequence[Any],
        accumulators: Sequence[Any],
        state: CycleVariables,
        agc_mask: Sequence[bool],
        settings: Callable[[], Settings],
        clip: Callable[[list[Any]], list[Any]],
        report: Callable[[], Any],
    ) -> None:
        self.inner = inner
        self.variables = list(variables)
        self.state = state
        self.agc_mask = [bool(m) for m in agc_mask]
        self._settings = settings
        self.clip = clip
        self.report = report
        self.accs = [_value(a) for a in accumulators]
        self.params = [_value(v) for v in self.variables]
        self._plans: dict[tuple[str, bool], list[_Group]] = {}
        flag = None
        if self.accs and self.accs[0].is_cuda:
            flag = torch.zeros((), dtype=torch.float32, device=self.accs[0].device)
        self.settings = settings()
        self.cycle = Cycle(
            self.accs, self.settings.accum_steps, self.settings.reduction.lower(), device_flag=flag
        )
        self._versions: tuple = ()

    def _refresh(self) -> None:
        """The wrapper's options as they are now (a user may change them between calls)."""
        self.settings = self._settings()
        self.cycle.set_accum_steps(self.settings.accum_steps)
        reduction = self.settings.reduction.lower()
        if reduction != self.cycle.reduction and self.cycle.micro_step == 0:
            self.cycle.set_reduction(reduction)

    def _groups(self, kind: str) -> list[_Group]:
        """Variables updated by one core call each: same AGC flag and weight decay."""
        key = (kind, self.settings.use_agc)
        if key not in self._plans:
            inner = self.inner
            buckets: dict[tuple[bool, float], list[int]] = {}
            for i, v in enumerate(self.variables):
                wd = 0.0
                if kind != "none" and inner.weight_decay and inner._use_weight_decay(v):
                    wd = float(inner.weight_decay)
                agc = self.agc_mask[i] and self.settings.use_agc
                buckets.setdefault((agc, wd), []).append(i)
            self._plans[key] = [
                _Group(
                    index,
                    agc,
                    wd,
                    [core.unit_layout(tuple(self.params[i].shape), "trailing") for i in index]
                    if agc
                    else None,
                )
                for (agc, wd), index in buckets.items()
            ]
        return self._plans[key]

    # ---- the cycle's position: the engine's, mirrored in the Keras variables ----

    def _mirrors(self) -> list[torch.Tensor]:
        s = self.state
        return [s.micro_step.value, s.total_weight.value, s.nonfinite.value, s.seen.value]

    def _load(self) -> None:
        """Take the position from the variables if anything but this path wrote them (a
        checkpoint restored, a ``fit`` that reset the cycle): their version counters moved."""
        versions = tuple((id(t), t._version) for t in self._mirrors())
        if versions == self._versions:
            return
        s = self.state
        micro_step = int(s.micro_step.value.item())
        # Between cycles (micro-step 0) nothing of the last cycle counts: a file may still hold
        # its weight, flag or seen flags.
        position = {
            "micro_step": micro_step,
            "total_weight": float(s.total_weight.value.item()) if micro_step > 0 else 0.0,
            "nonfinite": micro_step > 0 and bool(s.nonfinite.value.item() > 0),
            "seen": [micro_step > 0 and f > 0 for f in s.seen.value.tolist()],
        }
        self.cycle.load_state(position)
        self._versions = versions

    def _publish(self, seen: bool) -> None:
        """Mirror the cycle's position into the variables, in place (a Keras ``assign`` per
        counter cost this path about 40 µs a micro-step on the CPU, the whole difference from
        Keras's own accumulation on a small model)."""
        s, c = self.state, self.cycle
        s.micro_step.value.fill_(c.micro_step)
        s.total_weight.value.fill_(c.total_weight)
        track = self.settings.mixed_precision or self.settings.drops_nonfinite
        if c.device_flag is not None and track:
            s.nonfinite.value.copy_(torch.maximum(s.nonfinite.value, c.device_flag))
        else:
            s.nonfinite.value.fill_(1.0 if c.nonfinite and track else 0.0)
        if seen:
            s.seen.assign(torch.tensor(c.seen, dtype=torch.float32, device=s.seen.value.device))
        self._versions = tuple((id(t), t._version) for t in self._mirrors())

    # ---- micro-steps and the boundary ----

    @torch.no_grad()
    def apply(self, grads: Sequence[Any]) -> None:
        """One micro-step (``grads`` follow the wrapper's variables, None for a missing one);
        the cycle's last one also updates."""
        self._load()
        self._refresh()
        c = self.cycle
        weight = 1.0 if self.settings.reduction == "SUM" else float(self.state.batch_weight.value)
        # NumPy arrays (and other array-likes) are taken as the other backends take them.
        tensors = [None if g is None else _torch_tensor(g).detach().contiguous() for g in grads]
        seen_before = list(c.seen)
        first = c.micro_step == 0
        norm = c.boundary_next and c.reduction != "running_mean" and not c.cuda
        c.fold(tensors, weight, norm=norm and self.settings.drops_nonfinite)
        self.state.iterations.value.add_(1)
        self._publish(seen=first or c.seen != seen_before)
        if ends_cycle(c.micro_step, self.settings.accum_steps):
            self.boundary()

    @torch.no_grad()
    def boundary(self) -> None:
        """End of cycle: one fused update (or the inner optimizer's), then reset the counters."""
        self._load()
        self._refresh()
        c, s, opts = self.cycle, self.state, self.settings
        loss_scale = float(s.loss_scale.value)
        scale = boundary_scale(
            c.reduction,
            c.total_weight,
            loss_scale,
            mixed_precision=opts.mixed_precision,
            static_scale=opts.static_scale,
        )
        c.collect_device_flag()
        nonfinite = c.nonfinite  # a micro-step's gradient was NaN/Inf
        if opts.drops_nonfinite:
            # The cycle's result is checked, not only each micro-step: finite gradients can sum
            # to more than float32 holds.
            c.result_norm(c.seen_index(), scale)
            c.collect_device_flag()
            nonfinite = c.nonfinite
        # The counters are read only where the rule uses them (see boundary_rule).
        rule = boundary_rule(
            nonfinite,
            loss_scale,
            int(s.growth.value.item()) if opts.mixed_precision else 0,
            int(s.skipped.value.item()) if nonfinite and opts.drops_nonfinite else 0,
            mixed_precision=opts.mixed_precision,
            drops_nonfinite=opts.drops_nonfinite,
            growth_steps=opts.dynamic_growth_steps,
        )
        dropped = rule.skipped and opts.drops_nonfinite
        if dropped:
            s.skipped.assign(rule.dropped)
        if rule.do_update:
            # A variable without a gradient in the whole cycle is left alone, as plain Keras does.
            keep = set(c.seen_index())
            kind = _fused_kind(self.inner, self.variables, opts.fused)
            groups = [
                g
                for g in (self._subgroup(g, keep) for g in self._groups(kind))
                if g.index and c.total_weight > 0
            ]
            if groups and kind == "none":
                self._generic_update(groups, scale)
            elif groups:
                self._fused_update(kind, groups, scale)
        if opts.mixed_precision:  # after the update, which reads neither
            if rule.loss_scale != loss_scale or rule.skipped:
                s.loss_scale.assign(rule.loss_scale)
            s.growth.assign(rule.growth)
        c.reset()
        if c.device_flag is not None:
            s.nonfinite.assign(0.0)
        self._publish(seen=False)
        if dropped:
            self.report()

    @staticmethod
    def _subgroup(group: _Group, keep: set[int]) -> _Group:
        """``group`` restricted to the variables in ``keep``."""
        pos = [j for j, i in enumerate(group.index) if i in keep]
        if len(pos) == len(group.index):
            return group
        units = None if group.units is None else [group.units[j] for j in pos]
        return _Group([group.index[j] for j in pos], group.agc, group.weight_decay, units)

    def _agc_args(self, group: _Group) -> dict[str, Any]:
        """The core.apply arguments every update of ``group`` shares (AGC, no reset)."""
        return dict(
            agc=group.agc,
            clip_factor=self.settings.clip_factor,
            agc_eps=self.settings.eps,
            layout=group.units if group.agc else "trailing",
            reset=False,
        )

    def _fused_update(self, kind: str, groups: list[_Group], scale: float) -> None:
        """Plain SGD through ``core.apply`` (``kind`` is ``"sgd"``), then the step count."""
        lr = float(to_numpy(self.inner.learning_rate))
        for group in groups:
            core.apply(
                [self.params[i] for i in group.index],
                [self.accs[i] for i in group.index],
                optimizer=kind,
                lr=lr,
                grad_scale=scale,
                weight_decay=group.weight_decay,
                **self._agc_args(group),
            )
        self.inner.iterations.assign_add(1)

    def _generic_update(self, groups: list[_Group], scale: float) -> None:
        for group in groups:
            core.apply(
                [self.params[i] for i in group.index] if group.agc else None,
                [self.accs[i] for i in group.index],
                optimizer="none",
                grad_scale=scale,
                **self._agc_args(group),
            )
        keep = sorted(i for group in groups for i in group.index)
        variables = [self.variables[i] for i in keep]
        grads = self.clip([self.accs[i] for i in keep])
        grads = [g.to(v.value.dtype) for g, v in zip(grads, variables)]
        # The accumulators now hold the final gradients; the next micro-step overwrites them.
        self.inner.apply(grads, variables)


class CoreShell(StatefulShell):
    """The torch backend through the C++ core: :class:`CorePath` over the wrapper's variables,
    built at first use; its variables and the eager shell's build are the same."""

    def __init__(self, opt: Any) -> None:
        super().__init__(opt)
        self._engine: CorePath | None = None

    def _core(self) -> CorePath:
        if self._engine is None:
            self._engine = CorePath(
                self._opt.optimizer,
                self._opt._trainable_variables,
                self._opt._accumulators,
                CycleVariables(
                    *(getattr(self._opt, f"_{name}") for name in CycleVariables._fields)
                ),
                self._opt._agc_mask,
                self._settings,
                self._opt._clip_gradients,
                self._opt.report_nonfinite,
            )
        return self._engine

    def _settings(self) -> Settings:
        """The wrapper's options for this path, read afresh on every call."""
        own_clipping = (self._opt.clipnorm, self._opt.clipvalue, self._opt.global_clipnorm)
        return Settings(
            accum_steps=self._opt.accum_steps,
            reduction=self._opt._options.reduction,
            mixed_precision=bool(self._opt.mixed_precision),
            drops_nonfinite=self._opt._drops_nonfinite(),
            static_scale=self._opt._static_scale,
            dynamic_growth_steps=self._opt.dynamic_growth_steps,
            use_agc=bool(self._opt.use_agc),
            clip_factor=self._opt.clip_factor,
            eps=self._opt.eps,
            fused=all(x is None for x in own_clipping),
        )

    def _fold_and_end(self, grads: list[Any], variables: list[Any], weight: Any | None) -> bool:
        self._core().apply(grads)
        return True  # a dropped cycle reported by the path itself

    def flush(self, present: list[bool], overwrites: bool) -> None:
        self._core().boundary()
