"""Models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): DTensor parameters.

Each rank holds a shard of every parameter (``param.to_local()``), and FSDP2 reduce-scatters
each micro-batch's gradients, so each rank receives its shard of the gradient summed over the
ranks. The wrapper keeps its fp32 accumulators and runs its fused update on those local shards
(4 bytes per parameter ÷ the number of shards), and reduces only a few scalars itself, once
per cycle: the ranks' total weights, the non-finite flag, the sum of squares of the shards (the
global clip norm) and the ranks' agreement on the cycle.

FSDP2 divides the summed gradient by the number of ranks (equal ranks); a micro-batch's weight
``w`` may differ between ranks (uneven micro-batches, token counts). The wrapper therefore
installs its own reduce-scatter on every FSDP2 module: each rank's gradient is multiplied by
its micro-batch's weight before the sum and nothing is divided, so each shard receives
``Σ_ranks w·g``, and the boundary divides by the total weight of all ranks' micro-batches. The
weight must thus be named before the backward (``accumulate(model, opt, weight=w)`` or
``opt.expect_weight(w)``; 1 by default).

With gradient sync off (``model.set_requires_gradient_sync(False)``, FSDP2's own way to save
communication), FSDP2 keeps each rank's unsharded gradients and adds the micro-batches'
gradients into them, unweighted, until a backward with sync on reduce-scatters the sum. The
wrapper then multiplies each micro-batch's gradient by its weight as it reaches the unsharded
parameter (a hook on FSDP2's unsharded parameter, before FSDP2 adds it in), and that final
reduce-scatter multiplies by nothing: each shard receives the same ``Σ_ranks Σ_micro w·g``.
The micro-steps with sync off fold nothing into the accumulators (their gradients are still
in FSDP2's unsharded buffers); the cycle's last backward must run with sync on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradient_accumulator import core
from gradient_accumulator.torch.distributed import (
    SCALAR_SLOTS,
    agreement_slots,
    check_ranks_agree,
    disagreement,
)

__all__ = ["FsdpSharding", "check_options", "is_dtensor", "local"]

_FLT_MAX = 3.4028234663852886e38


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    if not (dist.is_available() and type(t).__name__ in ("DTensor", "Parameter")):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without torch.distributed.tensor
        return False
    return isinstance(t, DTensor)


def local(t: Any) -> Any:
    """The rank's local shard of a DTensor (sharing its memory), any other tensor itself."""
    if t is not None and is_dtensor(t):
        # The DTensor's own local tensor (a persistent object: the core's registered tensor
        # sets keep track of it between cycles); to_local() would make a new one each call.
        held = getattr(t, "_local_tensor", None)
        if isinstance(held, torch.Tensor):
            return held
        with torch.no_grad():
            return t.to_local()
    return t


def check_options(process_group: Any, options: Any) -> None:
    """Refuse, for FSDP2 parameters, the options that do not apply to them.

    Raises:
        ValueError: naming the option.
    """
    if process_group is not None:
        raise ValueError(
            "process_group must be left at None for a model sharded by FSDP2: the reduction "
            "follows the parameters' device mesh"
        )
    if options.gradient_as_view:
        raise ValueError(
            "gradient_as_view is not supported for a model sharded by FSDP2 (its gradients are "
            "FSDP2's reduce-scatter outputs); leave it False"
        )
    if options.reduction == "running_mean":
        raise ValueError(
            "reduction='running_mean' is not supported for a model sharded by FSDP2; use "
            "'mean' (the same result)"
        )


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp_params(module: Any) -> list[Any]:
    """FSDP2's records of the parameters one ``fully_shard`` call manages."""
    state = module._get_fsdp_state()
    return [fp for g in state._fsdp_param_groups for fp in g.fsdp_params]


class _WeightedReduceScatter:
    """FSDP2's reduce-scatter with each rank's gradient multiplied by its micro-batch's weight
    first, and a plain sum (FSDP2's own divide factor is set to 1)."""

    def __init__(self, weight: Any) -> None:
        self.weight = weight  # () -> the weight of the micro-batch whose backward runs
        self.calls = 0
        # True while the gradients being reduced were multiplied by their weights already (a
        # cycle with gradient sync off, see FsdpSharding.unreduced).
        self.pre_weighted = False

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Any:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        w = 1.0 if self.pre_weighted else self.weight()
        if w != 1.0:
            input_tensor.mul_(w)
        self.calls += 1
        scatter = getattr(dist, "reduce_scatter_single", None)
        if scatter is not None:
            return scatter(
                output=output_tensor,
                input=input_tensor,
                op=dist.ReduceOp.SUM,
                group=group,
                async_op=async_op,
            )
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )


def _install(module: Any, comm: _WeightedReduceScatter) -> None:
    module.set_custom_reduce_scatter(comm)
    module.set_gradient_divide_factor(1.0)


class FsdpSharding:
    """What the wrapper does differently for parameters sharded by FSDP2.

    Args:
        params: the optimizer's parameters (DTensors; plain tensors are refused).
        names: how errors name them.
        model: the module ``fully_shard`` was applied to (its FSDP2 modules get the weighted
            reduce-scatter).
        weight: ``() -> float``, the weight of the micro-batch whose backward runs.
        agc_skip: parameters AGC leaves alone (None: AGC off).
        settings: integers every rank must hold (checked once, with the layout).

    Raises:
        ValueError: naming the parameter or option that cannot be supported, and what to do.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        model: torch.nn.Module | None,
        weight: Any,
        agc_skip: set[int] | None,
        settings: dict[str, int],
    ) -> None:
        plain = [names[i] for i, p in enumerate(params) if not is_dtensor(p)]
        if plain:
            raise ValueError(
                f"parameters {', '.join(plain[:3])} are plain tensors while others are DTensors: "
                "shard the whole model with fully_shard (each block, then the root) before "
                "wrapping its optimizer"
            )
        if model is None:
            raise ValueError(
                "the parameters are DTensors sharded by FSDP2 (fully_shard): pass "
                "model=<the module fully_shard was applied to> so that each rank's micro-batch "
                "weight can enter FSDP2's gradient reduction"
            )
        modules = _fsdp_modules(model)
        managed: dict[int, Any] = {}
        for m in modules:
            for fp in _fsdp_params(m):
                managed[id(fp.sharded_param)] = fp
        outside = [names[i] for i, p in enumerate(params) if id(p) not in managed]
        if outside:
            raise ValueError(
                f"parameters {', '.join(outside[:3])} are DTensors that no fully_shard module of "
                "model manages (tensor parallelism, or another model): only parameters sharded "
                "by fully_shard are supported; pass the model fully_shard was applied to"
            )
        mesh = params[0].device_mesh
        for i, p in enumerate(params):
            if p.device_mesh != mesh:
                raise ValueError(
                    f"parameter {names[i]} lives on another device mesh than {names[0]}: one "
                    "wrapper takes the parameters of one fully_shard mesh"
                )
        self.mesh = mesh
        shard_dims = [mesh.ndim - 1]  # FSDP2: the last mesh dimension shards (HSDP: 0 replicates)
        self.replicas = 1 if mesh.ndim == 1 else mesh.size(0)
        self.shards = mesh.size(shard_dims[0])
        self.sumsq = 0.0  # Σacc² over every shard, from the last reduce()
        if self.shards == 1 and self.replicas > 1:
            raise ValueError(
                "the device mesh shards over 1 rank and replicates over several: use "
                "DistributedDataParallel for pure replication"
            )
        # Adaptive clipping's units are slices of a parameter's first dimension: they must lie
        # whole on one rank, so the parameter must be sharded on dimension 0.
        if agc_skip is not None:
            for i, p in enumerate(params):
                if i in agc_skip or p.dim() < 2:
                    continue
                dim = managed[id(p)].fsdp_placement.dim
                if dim != 0:
                    raise ValueError(
                        f"parameter {names[i]} is sharded by FSDP2 on dimension {dim}, so its "
                        "adaptive-clipping units (slices of dimension 0) span several ranks; "
                        "shard it on dimension 0 (fully_shard's default shard_placement_fn) or "
                        "leave it out of AGC (agc_exclude)"
                    )
        # The whole mesh's group: weights and flags are summed over every rank (shards and
        # replicas).
        if mesh.size() == dist.get_world_size():
            self.group = None
        else:
            self.group = mesh._flatten().get_group() if mesh.ndim > 1 else mesh.get_group()
        device = local(params[0]).device
        check_ranks_agree(self.group, settings, device)
        self.groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
        self.comm = _WeightedReduceScatter(weight) if self.shards > 1 else None
        # Gradient sync off: each micro-batch's gradient is weighted as it reaches FSDP2's
        # unsharded parameter. Those exist from a module's first forward on (one object,
        # re-filled by every all-gather), so a forward hook finds them.
        self.unreduced = False  # a backward of this cycle ran with gradient sync off
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        if self.comm is not None:
            for m in modules:
                _install(m, self.comm)
                self._handles.append(m.register_forward_hook(self._watch_unsharded))
                self._watch_unsharded(m)
        self.device = device
        self.weight = 0.0  # this rank's total micro-batch weight in the cycle
        self.collectives = 0
        self.agree: list[int] = []

    @property
    def weighted_by_reduction(self) -> bool:
        """Whether FSDP2's reduction already multiplies the gradients by their weight (a
        micro-step then folds its shard with weight 1 and counts its weight here)."""
        return self.comm is not None

    def _watch_unsharded(self, module: Any, *_: Any) -> None:
        """Hook the unsharded parameters of ``module``'s FSDP2 groups not hooked yet."""
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                param = getattr(fp, "_unsharded_param", None)
                if param is None or id(param) in self._hooked:
                    continue
                self._hooked.add(id(param))
                self._handles.append(param.register_hook(functools.partial(self._weigh, group)))

    def _weigh(self, group: Any, grad: torch.Tensor) -> torch.Tensor | None:
        """A micro-batch's gradient reaching an unsharded parameter: multiplied by its weight
        when FSDP2 keeps it unreduced (sync off), and for the rest of that cycle."""
        if group.reduce_grads and not self.unreduced:
            return None  # reduced in this backward: the reduce-scatter weighs it
        self.unreduced = True
        self.comm.pre_weighted = True
        w = self.comm.weight()
        return None if w == 1.0 else grad * w

    def sync_off(self) -> bool:
        """Whether the micro-step's backward ran with FSDP2's gradient sync off (its gradients
        are still in FSDP2's unsharded buffers, weighted).

        Raises:
            ValueError: sync is off for some FSDP2 modules and on for others (nothing changed).
        """
        off = [not g.reduce_grads for g in self.groups]
        if any(off) and not all(off):
            raise ValueError(
                "gradient sync is off for some FSDP2 modules of the model and on for others; "
                "switch it for the whole model (model.set_requires_gradient_sync(flag) on the "
                "root, recursive by default)"
            )
        if any(off) and self.comm is None:
            raise ValueError(
                "gradient sync is off on an FSDP2 model sharded over one rank; leave it on "
                "(with one shard there is no communication to save)"
            )
        return bool(off) and all(off)

    def check_unreduced(self, what: str) -> None:
        """Refuse ``what`` while micro-batches of the cycle are still unreduced in FSDP2's
        unsharded gradients (sync off): they are not in the accumulators.

        Raises:
            ValueError: nothing changed.
        """
        if self.unreduced:
            raise ValueError(
                f"{what} while this cycle's gradients are held unreduced by FSDP2 (gradient "
                "sync off): run the cycle's last backward with sync on "
                f"(model.set_requires_gradient_sync(True)) and step() it, then {what}"
            )

    def reduced(self) -> None:
        """A micro-step with sync on was folded: FSDP2's unsharded gradients are consumed."""
        self.unreduced = False
        if self.comm is not None:
            self.comm.pre_weighted = False

    def fold_weight(self, weight: float, named: float | None) -> float:
        """The weight a micro-step's gradient shard is folded in with: 1, as FSDP2's reduction
        already multiplied each rank's gradient by its weight (named before the backward).

        Raises:
            ValueError: ``weight`` was not named before the backward (nothing changed).
        """
        if weight != 1.0 and named is None:
            raise ValueError(
                f"weight={weight} was given to step() only; for a model sharded by FSDP2 the "
                "weight enters FSDP2's gradient reduction during the backward, so name it "
                "before: accumulate(model, opt, weight=...) or opt.expect_weight(...)"
            )
        return 1.0

    def norm(self, cycle: Any, scale: float) -> Any:
        """The global L2 norm of the averaged gradient from :meth:`reduce`'s Σacc² (a float;
        a 0-dim device tensor for CUDA parameters); a non-finite one marks the cycle."""
        value = math.sqrt(self.sumsq) * abs(scale) if self.sumsq >= 0 else math.nan
        if not value <= _FLT_MAX:
            cycle.mark_nonfinite()
        if cycle.cuda:
            return torch.tensor(value, dtype=torch.float64, device=self.device)
        return value

    def whole_units(self, params: Sequence[torch.Tensor], agc_skip: set[int] | None) -> list[int]:
        """Parameters whose one adaptive-clipping unit is the whole tensor (rank ≤ 1: biases,
        gains) that AGC clips: their shards lie on several ranks, so their norms are summed
        over the ranks (:meth:`clip_whole`) and the core's AGC leaves them alone."""
        if agc_skip is None or self.shards == 1:
            return []
        return [i for i, p in enumerate(params) if i not in agc_skip and p.dim() <= 1]

    def clip_whole(
        self,
        whole: list[int],
        params: Sequence[torch.Tensor],
        cycle: Any,
        scale: float,
        clip_factor: float,
        eps: float,
    ) -> None:
        """AGC of the rank ≤ 1 parameters ``whole``, each one unit spread over the shards:
        ‖w‖ and ‖g‖ from the squares summed over the ranks (one all-reduce), then each
        accumulator scaled by min(1, λ·max(‖w‖, ε) / max(‖g‖, 1e-6)), g = accumulator × scale.
        """
        if not whole:
            return
        sq = []
        for i in whole:
            w = local(params[i]).detach().double()
            a = cycle.accs[i].double()
            sq += [w.square().sum(), a.square().sum()]
        t = torch.stack(sq).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self.collectives += 1
        t = (t / self.replicas).tolist()
        for j, i in enumerate(whole):
            w_norm = math.sqrt(t[2 * j])
            g_norm = math.sqrt(t[2 * j + 1]) * abs(scale)
            coef = min(1.0, clip_factor * max(w_norm, eps) / max(g_norm, 1e-6))
            if coef < 1.0:
                cycle.accs[i].mul_(coef)

    def reduce(self, cycle: Any, flushing: bool) -> float:
        """Sum the ranks' weights, non-finite flags, the shards' Σacc² and seen flags; write
        the totals into ``cycle``. Returns the global Σacc² (for the clip norm).

        Raises:
            RuntimeError: on every rank, in the same round, when the ranks disagree on the
                cycle (``accum_steps``, the reduction, a flush on some ranks only); the cycle
                is dropped.
        """
        unseen = [a for a, s in zip(cycle.accs, cycle.seen) if not s]
        if unseen:  # stale values from an earlier cycle must not count
            core.zero(unseen)
        weight = self.weight if self.weighted_by_reduction else cycle.total_weight
        sumsq = core.sum_of_squares(cycle.accs) if cycle.accs else 0.0
        if isinstance(sumsq, torch.Tensor):
            sumsq = sumsq.to(self.device, torch.float64).reshape(1)
        else:
            sumsq = torch.tensor([float(sumsq)], dtype=torch.float64, device=self.device)
        reduction = ("mean", "sum", "running_mean").index(cycle.reduction)
        host = [weight, 1.0 if cycle.nonfinite else 0.0]
        host += agreement_slots([cycle.accum_steps, reduction, int(flushing)])
        host += [0.0] * (SCALAR_SLOTS - len(host))
        host += [1.0 if s else 0.0 for s in cycle.seen]
        t = torch.tensor(host, dtype=torch.float64, device=self.device)
        t = torch.cat([t, sumsq])
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self.collectives += 1
        reduced = t.tolist()
        bad = disagreement(reduced[2:], ["accum_steps", "reduction", "flush"])
        if bad:
            cycle.reset()
            self.weight = 0.0
            raise RuntimeError(
                "GradientAccumulateOptimizer: the ranks disagreed on "
                + ", ".join(bad)
                + " in this cycle's reduction (different accum_steps, or flush() called on some "
                "ranks and a regular step on others); the cycle was dropped"
            )
        self.weight = 0.0
        cycle.merge_reduction(
            reduced[0],
            reduced[1] > 0,
            [n > 0 for n in reduced[SCALAR_SLOTS : SCALAR_SLOTS + len(cycle.accs)]],
        )
        # Replicas (HSDP) hold the same shards: each shard's squares were counted once per
        # replica.
        self.sumsq = reduced[-1] / self.replicas
        return self.sumsq

    # ---- checkpoints (torch.distributed.checkpoint) ----

    def fill_state(self, optimizer: torch.optim.Optimizer, kind: str | None) -> None:
        """Create the fused update's optimizer state where it does not exist yet, as the first
        update would (Adam: step 0, zero moments; SGD with momentum and no dampening: a zero
        buffer, which the first update then treats exactly as torch's first step does), so that
        every checkpoint has the same entries: torch.distributed.checkpoint loads into a state
        dict of the same structure."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state[p]
                if kind == "adam" and len(st) == 0:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif (
                    kind == "sgd"
                    and float(group["momentum"]) != 0
                    and float(group["dampening"]) == 0
                    and st.get("momentum_buffer") is None
                ):
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def save(self, params: Sequence[Any], accs: Sequence[torch.Tensor], nonfinite: bool) -> dict:
        """This rank's part of the ``"accumulation"`` entry, in a form that
        torch.distributed.checkpoint saves and reshards: each accumulator as a DTensor laid out
        like its parameter, and the values that differ between ranks gathered (every rank then
        holds the same: the checkpoint keeps one copy)."""
        from torch.distributed.tensor import DTensor

        self.check_unreduced("state_dict()")
        saved = [
            DTensor.from_local(
                a.clone(),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            for p, a in zip(params, accs)
        ]
        t = torch.zeros(2 * dist.get_world_size(), dtype=torch.float64, device=self.device)
        rank = dist.get_rank()
        t[rank], t[dist.get_world_size() + rank] = self.weight, float(nonfinite)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        values = t.tolist()
        n = dist.get_world_size()
        return {
            "accumulators": saved,
            "rank_weights": values[:n],
            "nonfinite": any(v > 0 for v in values[n:]),
        }

    def loaded(self, acc: dict, params: Sequence[Any], flat: torch.Tensor, accs: Sequence[Any]):
        """``acc`` with its accumulators as this rank's flat buffer (what the checks and the
        load of a single process take), and this rank's weight of the cycle.

        Raises:
            ValueError: the accumulators are not one DTensor per parameter of its shape.
        """
        saved = acc.get("accumulators")
        if not (
            isinstance(saved, (list, tuple))
            and len(saved) == len(params)
            and all(is_dtensor(d) and d.shape == p.shape for d, p in zip(saved, params))
        ):
            raise ValueError(
                "state_dict's accumulators are not the sharded ones of this FSDP2 model (one "
                "DTensor per parameter, of its shape)"
            )
        out = flat.clone()
        for d, a in zip(saved, accs):
            shard = local(d)
            if shard.shape != a.shape:
                raise ValueError(
                    "state_dict's accumulators are sharded differently from the parameters"
                )
            start = a.storage_offset() - flat.storage_offset()
            out[start : start + a.numel()].view_as(a).copy_(shard)
        acc = dict(acc, accumulators=out)
        weights = acc.get("rank_weights")
        if not isinstance(weights, (list, tuple)):
            raise ValueError("state_dict['accumulation'] lacks 'rank_weights' (not sharded)")
        n, rank = dist.get_world_size(), dist.get_rank()
        if len(weights) == n:
            weight = float(weights[rank])
        else:  # another number of ranks: only the sum over the ranks counts at the boundary
            weight = float(sum(weights)) if rank == 0 else 0.0
        return acc, weight
