"""The PyTorch-backend fast path of GradientAccumulateOptimizer: the C++ core on torch tensors.

Per micro-step: one ``core.accumulate`` pass over all gradients (fp32 accumulators whatever the
gradient dtype, first micro-step overwrites, non-finite check folded in). At the boundary: for
``SGD`` without momentum, ``Adam`` and ``AdamW`` one fused ``core.apply`` per group of variables
(scale, AGC, optimizer step) writing the inner optimizer's own variables, so its state stays that
of a plain Keras optimizer; for any other optimizer ``core.apply(optimizer="none")`` averages and
clips in place and the inner optimizer's own ``apply`` takes the result.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import keras
import torch

from gradient_accumulator import core

_MODES = {"MEAN": "mean", "SUM": "sum", "RUNNING_MEAN": "running_mean"}
_FLT_MAX = 3.4028234663852886e38


class _Group(NamedTuple):
    """Variables updated by one core call: same AGC flag and weight decay."""

    index: list[int]
    agc: bool
    weight_decay: float
    units: list[tuple[int, str]] | None


class _Plan(NamedTuple):
    kind: str  # "sgd", "adamw" or "none"
    accs: list[torch.Tensor]
    params: list[torch.Tensor]
    state1: list[torch.Tensor] | None
    state2: list[torch.Tensor] | None
    groups: list[_Group]


def _fused_kind(opt: Any) -> str:
    """Which fused core update reproduces the inner optimizer's own formula exactly, if any."""
    inner = opt.optimizer
    if not type(inner).__module__.startswith("keras."):
        return "none"  # a user subclass may change update_step
    if any(x is not None for x in (inner.clipnorm, inner.clipvalue, inner.global_clipnorm)):
        return "none"
    if any(x is not None for x in (opt.clipnorm, opt.clipvalue, opt.global_clipnorm)):
        return "none"
    if inner.use_ema or any(v.constraint is not None for v in opt._trainable_variables):
        return "none"
    if isinstance(inner, keras.optimizers.SGD) and not inner.momentum:
        # Plain SGD: decoupled weight decay equals L2 decay, which is the core's.
        return "sgd"
    if isinstance(inner, keras.optimizers.Adam) and not inner.amsgrad:
        # Keras Adam and AdamW both decay decoupled (AdamW's formula).
        return "adamw"
    return "none"


def _plan(opt: Any) -> _Plan:
    if opt._core_plan is not None:
        return opt._core_plan
    variables = opt._trainable_variables
    kind = _fused_kind(opt)
    inner = opt.optimizer
    state1 = state2 = None
    if kind == "adamw":
        state1 = [m.value.detach() for m in inner._momentums]
        state2 = [v.value.detach() for v in inner._velocities]
    buckets: dict[tuple[bool, float], list[int]] = {}
    for i, v in enumerate(variables):
        wd = 0.0
        if kind != "none" and inner.weight_decay and inner._use_weight_decay(v):
            wd = float(inner.weight_decay)
        buckets.setdefault((bool(opt._agc_mask[i]), wd), []).append(i)
    groups = [
        _Group(
            index,
            agc,
            wd,
            [core.unit_layout(tuple(variables[i].shape), "trailing") for i in index]
            if agc
            else None,
        )
        for (agc, wd), index in buckets.items()
    ]
    plan = _Plan(
        kind,
        [a.value.detach() for a in opt._accumulators],
        [v.value.detach() for v in variables],
        state1,
        state2,
        groups,
    )
    opt._core_plan = plan
    return plan


def _scalar(var: Any) -> float:
    return float(var.value.item())


@torch.no_grad()
def apply(opt: Any, grads: list[Any], variables: list[Any]) -> None:
    """One micro-step: accumulate through the core; the cycle's last one also updates."""
    plan = _plan(opt)
    del variables  # the wrapper's own, in its order: ``grads`` follows it
    tensors = []
    for g, acc in zip(grads, plan.accs):
        if g is None:
            g = torch.zeros_like(acc)
        tensors.append(g.detach().contiguous())
    micro = int(opt._micro_step.value.item())
    first = micro == 0
    seen = opt._seen.value
    if all(g is not None for g in grads):
        seen.fill_(1.0)
    else:
        mask = torch.tensor([float(g is not None) for g in grads], device=seen.device)
        seen.copy_(mask if first else torch.maximum(seen, mask))
    weight = 1.0 if opt.reduction == "SUM" else _scalar(opt._batch_weight)
    before = 0.0 if first else _scalar(opt._total_weight)
    result = core.accumulate(
        plan.accs,
        tensors,
        weight=weight,
        mode=_MODES[opt.reduction],
        weight_before=before,
        overwrite=first,
    )
    if opt.mixed_precision or opt._drops_nonfinite():
        # Sticky for the cycle; cleared at the boundary and at a cycle's first micro-step.
        if result.nonfinite:
            opt._nonfinite.assign(1.0)
        elif first:
            opt._nonfinite.assign(0.0)
    opt._total_weight.assign(before + weight)
    opt._micro_step.assign(micro + 1)
    opt._iterations.assign_add(1)
    if micro + 1 >= opt.accum_steps:
        boundary(opt)


@torch.no_grad()
def boundary(opt: Any) -> None:
    """End of cycle: one fused update (or the inner optimizer's), then reset the counters."""
    plan = _plan(opt)
    total = _scalar(opt._total_weight)
    scale = 1.0
    if opt.reduction == "MEAN":
        scale /= max(total, 1e-30)
    loss_scale = _scalar(opt._loss_scale)
    if opt.mixed_precision:
        scale /= loss_scale
    if opt._static_scale is not None:
        scale /= float(opt._static_scale)
    dropped = False
    if opt._drops_nonfinite():
        # The cycle's result is checked, not only each micro-batch: finite gradients can sum
        # to more than float32 holds.
        dropped = _scalar(opt._nonfinite) > 0 or not _finite_result(plan.accs, scale)
    if opt.mixed_precision and _scalar(opt._nonfinite) > 0:
        opt._loss_scale.assign(loss_scale * 0.5)
        opt._growth.assign(0)
    elif dropped:
        opt._skipped.assign(int(opt._skipped.value.item()) + 1)
    else:
        # A variable without a gradient in the whole cycle is left alone, as plain Keras does.
        seen = opt._seen.value.tolist()
        keep = [i for i, flag in enumerate(seen) if flag > 0]
        if len(keep) == len(seen):
            groups = plan.groups
        else:
            groups = [g for g in (_subgroup(g, keep) for g in plan.groups) if g.index]
        if groups and plan.kind == "none":
            _generic_update(opt, plan, groups, scale)
        elif groups:
            _fused_update(opt, plan, groups, scale)
        if opt.mixed_precision:
            growth = int(opt._growth.value.item()) + 1
            if growth >= opt.dynamic_growth_steps:
                opt._loss_scale.assign(loss_scale * 2.0)
                growth = 0
            opt._growth.assign(growth)
    opt._micro_step.assign(0)
    opt._total_weight.assign(0.0)
    opt._nonfinite.assign(0.0)
    if dropped:
        opt.report_nonfinite()


def _finite_result(accs: list[torch.Tensor], scale: float) -> bool:
    """Whether every accumulator × ``scale`` is finite in float32 (one read pass)."""
    sumsq = float(core.sum_of_squares(accs))  # float64: overflows only past 1e308
    return math.isfinite(sumsq) and math.sqrt(sumsq) * abs(scale) <= _FLT_MAX


def _subgroup(group: _Group, keep: list[int]) -> _Group:
    """``group`` restricted to the variables in ``keep``."""
    kept = set(keep)
    pos = [j for j, i in enumerate(group.index) if i in kept]
    units = None if group.units is None else [group.units[j] for j in pos]
    return _Group([group.index[j] for j in pos], group.agc, group.weight_decay, units)


def _pick(values: list[Any] | None, index: list[int]) -> list[Any] | None:
    return None if values is None else [values[i] for i in index]


def _fused_update(opt: Any, plan: _Plan, groups: list[_Group], scale: float) -> None:
    inner = opt.optimizer
    lr = float(keras.ops.convert_to_numpy(inner.learning_rate))
    step = int(keras.ops.convert_to_numpy(inner.iterations)) + 1
    for group in groups:
        common = dict(
            lr=lr,
            grad_scale=scale,
            agc=group.agc,
            clip_factor=opt.clip_factor,
            agc_eps=opt.eps,
            layout=group.units if group.agc else "trailing",
            reset=False,
            weight_decay=group.weight_decay,
        )
        params = _pick(plan.params, group.index)
        accs = _pick(plan.accs, group.index)
        if plan.kind == "sgd":
            core.apply(params, accs, optimizer="sgd", **common)
        else:
            beta1, beta2 = float(inner.beta_1), float(inner.beta_2)
            # Keras adds epsilon to sqrt(v) before bias correction; the core (PyTorch's
            # formula) after it: the same update with eps / sqrt(1 - beta2^t).
            eps = float(inner.epsilon) / math.sqrt(1.0 - beta2**step)
            core.apply(
                params,
                accs,
                optimizer="adamw",
                state1=_pick(plan.state1, group.index),
                state2=_pick(plan.state2, group.index),
                betas=(beta1, beta2),
                eps=eps,
                step=step,
                **common,
            )
    inner._iterations.assign_add(1)


def _generic_update(opt: Any, plan: _Plan, groups: list[_Group], scale: float) -> None:
    for group in groups:
        core.apply(
            _pick(plan.params, group.index) if group.agc else None,
            _pick(plan.accs, group.index),
            optimizer="none",
            grad_scale=scale,
            agc=group.agc,
            clip_factor=opt.clip_factor,
            agc_eps=opt.eps,
            layout=group.units if group.agc else "trailing",
            reset=False,
        )
    keep = sorted(i for group in groups for i in group.index)
    variables = [opt._trainable_variables[i] for i in keep]
    grads = opt._clip_gradients([plan.accs[i] for i in keep])
    grads = [g.to(v.value.dtype) for g, v in zip(grads, variables)]
    # The accumulators now hold the final gradients; the next micro-step overwrites them.
    opt.optimizer.apply(grads, variables)
