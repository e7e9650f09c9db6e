"""One reduction per cycle: the accumulators' flat buckets summed over ranks by torch.distributed.

The accumulators live in one flat fp32 buffer laid out in backward order and cut into buckets at
tensor boundaries (see ``core.arena_plan``), so a bucket is a contiguous slice that the
framework's collective (NCCL on GPUs, Gloo on CPUs) reduces in place — no packing, no home-made
transport. Scalars ride in the last bucket: the rank's total micro-batch weight and its
non-finite flag, so the global weight and "skip this cycle" are agreed in the same round, and a
few small integers (``accum_steps``, part of the layout fingerprint, whether the round is a
flush) with their squares, so that every rank learns in that same round whether all ranks
agree on them (Σv² · n = (Σv)² only when every rank sent the same v).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradient_accumulator import core

__all__ = [
    "AGREE_SLOT",
    "BucketReducer",
    "CycleReduction",
    "SCALAR_SLOTS",
    "agreement_slots",
    "check_ranks_agree",
    "disagreement",
]

SCALAR_SLOTS = 16  # elements reserved after the last bucket (keeps 64-byte alignment)
AGREE_SLOT = 2  # first scalar slot of the per-cycle agreement check (0: weight, 1: non-finite)


def check_ranks_agree(group: Any, values: dict[str, int], device: Any) -> None:
    """Check, in one all-reduce, that every rank of ``group`` holds the same integers.

    Raises:
        ValueError: on every rank, naming each value the ranks disagree on, with its range.
    """
    items = list(values.items())
    own = [int(v) for _, v in items]
    t = torch.tensor(own + [-v for v in own], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    n = len(items)
    bad = [
        f"{name} (from {-int(t[n + i])} to {int(t[i])}; this rank: {own[i]})"
        for i, (name, _) in enumerate(items)
        if int(t[i]) != -int(t[n + i])
    ]
    if bad:
        raise ValueError(
            "GradientAccumulateOptimizer: the ranks of the process group disagree on "
            + ", ".join(bad)
            + "; every rank must wrap the same model with the same settings"
        )


def agreement_slots(values: list[int]) -> list[float]:
    """The scalars this rank adds to the cycle's reduction: 1, then each value and its square."""
    out = [1.0]
    for v in values:
        out += [float(v), float(v) * float(v)]
    return out


def disagreement(reduced: list[float], names: list[str]) -> list[str]:
    """Names of the values on which the ranks disagreed, from the reduced agreement slots."""
    n = reduced[0]
    bad = []
    for i, name in enumerate(names):
        total, squares = reduced[1 + 2 * i], reduced[2 + 2 * i]
        if total * total != n * squares:
            bad.append(name)
    return bad


class BucketReducer:
    """Launches one all-reduce per bucket, at most once per cycle, and waits for them.

    Args:
        flat: the accumulator buffer; its last ``tail`` elements hold the scalars.
        bucket_start: ``num_buckets + 1`` element offsets of the buckets in ``flat``.
        process_group: the group to reduce over (None: the default group).
        timeout: seconds to wait for a reduction before raising (None: the group's timeout).
        tail: scalar elements at the end of ``flat`` (at least ``SCALAR_SLOTS``).
    """

    def __init__(
        self,
        flat: torch.Tensor,
        bucket_start: list[int],
        process_group: Any = None,
        timeout: float | None = None,
        tail: int = SCALAR_SLOTS,
    ) -> None:
        self.flat = flat
        self.group = process_group
        self.timeout = timeout
        n = len(bucket_start) - 1
        # The last bucket also covers the scalar slots at the end of the buffer.
        self.bounds = [(bucket_start[b], bucket_start[b + 1]) for b in range(n)]
        end = flat.numel()
        if self.bounds:
            self.bounds[-1] = (self.bounds[-1][0], end)
        else:
            self.bounds = [(end - tail, end)]
        self.scalar_bucket = len(self.bounds) - 1
        self._works: dict[int, Any] = {}
        self.collectives = 0  # collectives launched so far (for tests and benchmarks)
        self.bytes_reduced = 0

    @property
    def num_buckets(self) -> int:
        return len(self.bounds)

    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def launch(self, bucket: int) -> None:
        """Start the all-reduce of one bucket (asynchronous); a second call does nothing."""
        if bucket in self._works:
            return
        lo, hi = self.bounds[bucket]
        self._works[bucket] = dist.all_reduce(
            self.flat[lo:hi], op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )
        self.collectives += 1
        self.bytes_reduced += (hi - lo) * self.flat.element_size()

    def finish(self) -> None:
        """Launch the buckets not started yet and wait for all of them.

        Raises:
            RuntimeError: a peer failed, disappeared or did not join within the timeout.
        """
        for b in range(self.num_buckets):
            self.launch(b)
        works, self._works = self._works, {}
        try:
            for b in sorted(works):
                if self.timeout is None:
                    works[b].wait()
                else:
                    works[b].wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # the backend's error types differ (Gloo, NCCL)
            rank = dist.get_rank(self.group) if dist.is_initialized() else "?"
            raise RuntimeError(
                f"gradient reduction failed on rank {rank}: another rank raised, exited or did "
                f"not reach the end of the cycle in time ({type(e).__name__}: {e})"
            ) from e

    def pending(self) -> bool:
        return bool(self._works)


class CycleReduction:
    """A cycle's one reduction over the ranks, for an optimizer's flat accumulator buffer.

    The accumulators, the total weight, the non-finite flag, the ranks' agreement and one "seen"
    flag per accumulator are summed in one round (the scalars ride in the last bucket). With
    overlap (:meth:`overlap`), a bucket's all-reduce starts as soon as its last gradient of the
    cycle has been folded in, during the backward.

    Args:
        flat: the buffer; the accumulators first, then ``tail`` scalar elements.
        plan: its ``core.arena_plan`` (bucket starts, each accumulator's bucket).
        group, timeout: as for :class:`BucketReducer`.
        tail: ``SCALAR_SLOTS`` plus room for the seen flags.
        layout: the buffer's layout fingerprint (hex digits).
        settings: named integers every rank must hold, checked once here (one all-reduce),
            with the buffer's size, bucket count and layout fingerprint.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        plan: Any,
        group: Any,
        timeout: float | None,
        tail: int,
        layout: str,
        settings: dict[str, int],
    ) -> None:
        # Ranks that disagree on the cycle or the layout would pair wrong collectives (or
        # abort inside the backend on different sizes): one clear error on every rank now.
        settings = dict(settings)
        settings.update(
            {
                "accumulator elements": flat.numel(),
                "buckets": len(plan.bucket_start),
                "layout fingerprint": int(layout[:12], 16),
            }
        )
        check_ranks_agree(group, settings, flat.device)
        self.flat = flat
        self.tail = tail
        # Checked again in every cycle's round, besides its accum_steps and reduction: two bytes
        # of the layout.
        self.agree = [int(layout[:2], 16), int(layout[2:4], 16)]
        self.reducer = BucketReducer(flat, plan.bucket_start, group, timeout, tail=tail)
        self.bucket_of = list(plan.bucket_of)
        self.bucket_size = [0] * self.reducer.num_buckets
        for b in self.bucket_of:
            self.bucket_size[b] += 1
        self.bucket_done = [0] * self.reducer.num_buckets

    def ready(self, i: int) -> None:
        """Accumulator ``i`` holds its last gradient of the cycle."""
        b = self.bucket_of[i]
        self.bucket_done[b] += 1
        if self.bucket_done[b] == self.bucket_size[b] and b != self.reducer.scalar_bucket:
            self.reducer.launch(b)

    def overlap(
        self, params: list[torch.Tensor], cycle: Any, weight: Callable[[], float]
    ) -> list[Any]:
        """Fold each gradient of a cycle's last backward into ``cycle`` as soon as autograd has
        it (``weight()``: the micro-batch's weight, named before the backward), and launch a
        bucket's all-reduce as soon as the bucket is complete. Returns the hook handles."""
        index = {id(p): i for i, p in enumerate(params)}

        def ready(p: torch.Tensor) -> None:
            if not cycle.boundary_next or p.grad is None:
                return
            i = index[id(p)]
            # Already folded: a backward of this micro-batch raised after folding it (and maybe
            # launching its bucket); the retried backward brings the same gradient again.
            if not cycle.folded_early(i):
                g = p.grad.detach()
                with torch.no_grad():
                    cycle.fold_one(i, g if g.is_contiguous() else g.contiguous(), weight())
                self.ready(i)
            p.grad = None

        return [p.register_post_accumulate_grad_hook(ready) for p in params]

    def reduce(self, cycle: Any, flushing: bool) -> None:
        """Sum ``cycle``'s accumulators, weight, non-finite and seen flags over all ranks.

        Raises:
            RuntimeError: on every rank, in the same round, when the ranks disagree on the
                cycle (``accum_steps``, the layout, or a flush on some ranks only); the cycle
                is dropped.
        """
        unseen = [a for a, s in zip(cycle.accs, cycle.seen) if not s]
        if unseen:  # stale values from an earlier cycle must not be summed
            core.zero(unseen)
        body = self.flat[: -self.tail]
        if cycle.reduction == "running_mean":
            body.mul_(cycle.total_weight)
        host = [cycle.total_weight, 1.0 if cycle.nonfinite else 0.0]
        reduction = ("mean", "sum", "running_mean").index(cycle.reduction)
        host += agreement_slots([cycle.accum_steps, reduction, *self.agree, int(flushing)])
        host += [0.0] * (SCALAR_SLOTS - len(host))
        host += [1.0 if s else 0.0 for s in cycle.seen]
        host += [0.0] * (self.tail - len(host))
        scalars = self.flat[-self.tail :]
        scalars.copy_(torch.tensor(host, dtype=torch.float32))
        self.bucket_done = [0] * self.reducer.num_buckets
        self.reducer.finish()
        reduced = scalars.tolist()
        names = ["accum_steps", "reduction", "parameter layout", "parameter layout", "flush"]
        bad = list(dict.fromkeys(disagreement(reduced[AGREE_SLOT:], names)))
        if bad:
            cycle.reset()
            raise RuntimeError(
                "GradientAccumulateOptimizer: the ranks disagreed on "
                + ", ".join(bad)
                + " in this cycle's reduction (different accum_steps or models, or flush() "
                "called on some ranks and a regular step on others); the cycle was dropped"
            )
        # An accumulator takes part in the update if any rank had a gradient for it (DDP with
        # find_unused_parameters leaves .grad None where no rank had one).
        seen = [n > 0 for n in reduced[SCALAR_SLOTS : SCALAR_SLOTS + len(cycle.seen)]]
        cycle.merge_reduction(reduced[0], reduced[1] > 0, seen)
        if cycle.reduction == "running_mean" and cycle.total_weight > 0:
            body.div_(cycle.total_weight)


def resolve_group(process_group: Any) -> tuple[bool, Any]:
    """Decide whether accumulators are reduced, and over which group.

    An explicit ``process_group`` is always used (also with one rank, e.g. NCCL's world of 1);
    otherwise the default group is used when torch.distributed is initialised with more than
    one rank.
    """
    if process_group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group was given but torch.distributed is not initialised")
        return True, process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True, None
    return False, None
