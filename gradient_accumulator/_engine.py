"""The accumulation cycle on eager PyTorch tensors, written once.

Both eager adapters drive the C++ core through this class: the PyTorch optimizer wrapper and
the Keras wrapper on the PyTorch backend. It owns what a cycle is — the fp32 accumulators, which
parameters had a gradient (``seen``), the micro-step count, the total weight, the non-finite flag,
the first micro-step's overwrite, a running mean's treatment of a missing gradient, the scale the
boundary applies and the check that the accumulated result is finite. The adapters translate
their framework's objects in (gradients, weights, a loss scale) and decide what an update is
(the inner optimizer's step, their own state, their counters).

The TensorFlow and JAX graph paths of the Keras wrapper keep their backend ops; the rules they
share with this class are the pure functions at the top of this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gradient_accumulator import _validation, core

FLT_MAX = 3.4028234663852886e38
REDUCTIONS = ("mean", "sum", "running_mean")


def grad_scale(reduction: str, total_weight: float, loss_scale: float = 1.0) -> float:
    """What the boundary multiplies the accumulators by: 1/W for a mean (0 for an empty one),
    1 for a sum or a running mean (already a mean), divided by the loss scale."""
    if reduction == "mean":
        if not total_weight > 0:
            return 0.0
        scale = 1.0 / total_weight
    else:
        scale = 1.0
    return scale / loss_scale


def ends_cycle(micro_step: int, accum_steps: int) -> bool:
    """Whether a cycle that has folded ``micro_step`` micro-steps ends now: at its length, or
    past it after ``accum_steps`` was lowered (``keras/_cycle.ends_cycle`` in ``keras.ops``)."""
    return micro_step >= accum_steps


def boundary_scale(
    reduction: str,
    total_weight: float,
    loss_scale: float,
    *,
    mixed_precision: bool,
    static_scale: float | None,
) -> float:
    """The boundary's factor on Python numbers: :func:`grad_scale`, then 1/the loss scale under
    ``mixed_precision``, then 1/the inner optimizer's static factor (``keras/_cycle.grad_scale``
    is its ``keras.ops`` transcription, which takes 1/max(W, 1e-30) for an empty mean)."""
    scale = grad_scale(reduction, total_weight)
    if mixed_precision:
        scale /= loss_scale
    if static_scale is not None:
        scale /= float(static_scale)
    return scale


class BoundaryRule(NamedTuple):
    """What :func:`boundary_rule` decides: whether the inner optimizer updates, whether the
    cycle ends without an update as non-finite, and the loss scale, growth counter and count
    of dropped cycles after the boundary."""

    do_update: bool
    skipped: bool
    loss_scale: float
    growth: int
    dropped: int


def boundary_rule(
    nonfinite: bool,
    loss_scale: float,
    growth: int,
    dropped: int,
    *,
    mixed_precision: bool,
    drops_nonfinite: bool,
    growth_steps: int,
) -> BoundaryRule:
    """The end of a cycle on Python numbers, the rule ``keras/_cycle.boundary`` transcribes in
    ``keras.ops`` (held equal to it by ``tests/keras/test_keras_boundary_rule.py``).

    ``nonfinite``: the cycle's verdict (under ``mixed_precision`` the loss scaler's, else, with
    ``drops_nonfinite``, ``on_nonfinite``'s; with neither it is not looked at). A non-finite
    cycle halves the loss scale and restarts its growth (``mixed_precision``) or is dropped and
    counted (``drops_nonfinite``); a good one updates and, under ``mixed_precision``, counts
    towards doubling the loss scale every ``growth_steps`` good cycles. ``growth`` is read only
    under ``mixed_precision`` and ``dropped`` only where a cycle is dropped: a caller may pass
    anything else where it has not read them.
    """
    if mixed_precision and nonfinite:
        return BoundaryRule(False, True, loss_scale * 0.5, 0, dropped)
    if drops_nonfinite and nonfinite:
        return BoundaryRule(False, True, loss_scale, growth, dropped + 1)
    if mixed_precision:
        growth = growth + 1
        if growth >= growth_steps:
            loss_scale, growth = loss_scale * 2.0, 0
    return BoundaryRule(True, False, loss_scale, growth, dropped)


def clip_coef(norm: Any, max_norm: float) -> Any:
    """min(1, max_norm / (‖g‖ + 1e-6)): a float for a float norm, a tensor for a device norm.

    The core's formula (``csrc/core/formulas.h``), for a norm taken over every group before the
    per-group apply calls.
    """
    coef = max_norm / (norm + 1e-6)
    return coef.clamp(max=1.0) if isinstance(coef, torch.Tensor) else min(1.0, coef)


class SplitFold(Exception):
    """:meth:`Cycle.fold` with ``single_call`` would need two accumulate calls (nothing done)."""


class Cycle:
    """One accumulation cycle over a fixed list of fp32 accumulators.

    Args:
        accs: the accumulators (float32 tensors, one per parameter, written in place).
        accum_steps: micro-steps per cycle.
        reduction: ``"mean"``, ``"sum"`` or ``"running_mean"``.
        device_flag: on CUDA, a 0-dim float32 tensor the core raises for a non-finite gradient,
            so micro-steps never read the device; :meth:`collect_device_flag` reads it once.

    Its state is its own: the adapters read it through read-only properties (``micro_step``,
    ``total_weight``, ``nonfinite``, ``seen``, …) and change it only through its methods — a
    micro-step (:meth:`fold`, :meth:`fold_one`), a named weight (:meth:`name_weight`), a new
    setting (:meth:`set_accum_steps`, :meth:`set_reduction`), the totals of a reduction over
    ranks (:meth:`merge_reduction`), a reset, a saved position (:meth:`load_state`). The sum of
    squares a boundary fold computes belongs to the accumulators as that fold left them: every
    other change clears it, and :meth:`result_norm` uses it once.
    """

    def __init__(
        self,
        accs: Sequence[torch.Tensor],
        accum_steps: int,
        reduction: str,
        *,
        device_flag: torch.Tensor | None = None,
    ) -> None:
        self._accs = list(accs)
        self._accum_steps = int(accum_steps)
        self._set_reduction(reduction)
        self._device_flag = device_flag
        # Gradients folded in during a backward (see fold_one) before the step that counts them.
        self._early = False
        self._early_weight = 1.0
        self._early_index: set[int] = set()
        # The weight of the coming micro-batch when it was named before its backward.
        self._named_weight: float | None = None
        # Registered sets of accumulators (core.tensor_set), by the indices they hold: a call
        # then checks each accumulator in a fraction of what exporting it costs.
        self._sets: dict[tuple[int, ...], Any] = {}
        self.reset()

    # ---- read-outs ----

    @property
    def accs(self) -> list[torch.Tensor]:
        """The accumulators (a new list of the same tensors)."""
        return list(self._accs)

    @property
    def accum_steps(self) -> int:
        """Micro-steps per cycle (:meth:`set_accum_steps` changes it)."""
        return self._accum_steps

    @property
    def reduction(self) -> str:
        """``"mean"``, ``"sum"`` or ``"running_mean"`` (what the accumulators hold)."""
        return self._reduction

    @property
    def device_flag(self) -> torch.Tensor | None:
        """The CUDA non-finite flag the core raises (None on CPU)."""
        return self._device_flag

    @property
    def cuda(self) -> bool:
        """Whether the accumulators live on a CUDA device (non-finite flag on the device)."""
        return self._device_flag is not None

    @property
    def micro_step(self) -> int:
        """Micro-steps folded in this cycle."""
        return self._micro_step

    @property
    def total_weight(self) -> float:
        """The total weight of this cycle's micro-steps."""
        return self._total_weight

    @property
    def nonfinite(self) -> bool:
        """Whether a gradient (or, after :meth:`result_norm`, the result) was NaN/Inf."""
        return self._nonfinite

    @property
    def seen(self) -> list[bool]:
        """Which accumulators hold a gradient of this cycle (a copy)."""
        return list(self._seen)

    @property
    def sumsq(self) -> Any:
        """Σacc² of the accumulators as the last boundary :meth:`fold` left them, else None."""
        return self._sumsq

    @property
    def named_weight(self) -> float | None:
        """The coming micro-step's weight, named before its backward (:meth:`name_weight`)."""
        return self._named_weight

    @property
    def early(self) -> bool:
        """Whether gradients of the coming micro-step were folded during its backward."""
        return self._early

    @property
    def early_weight(self) -> float:
        """The weight those gradients were folded in with."""
        return self._early_weight

    def folded_early(self, i: int) -> bool:
        """Whether accumulator ``i`` already holds the coming micro-step's gradient."""
        return i in self._early_index

    # ---- settings ----

    def _set_reduction(self, value: str) -> None:
        if value not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}")
        self._reduction = value
        self._mode = "running_mean" if value == "running_mean" else "sum"

    def set_reduction(self, value: str) -> None:
        """Change the reduction (between cycles only: the accumulators hold this one's).

        Raises:
            ValueError: ``value`` is not a reduction, or micro-steps of this cycle were folded
                with another one (nothing changed).
        """
        if value != self._reduction and self._micro_step > 0:
            if value not in REDUCTIONS:
                raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}")
            raise ValueError(
                f"reduction can change between cycles only ({self._micro_step} "
                f"micro-batches of this cycle are accumulated as {self._reduction!r}; "
                "flush() first)"
            )
        self._set_reduction(value)

    def set_accum_steps(self, value: int) -> None:
        """Change the cycle's length (a cycle already past it ends at its next micro-step)."""
        self._accum_steps = _validation.check_accum_steps(value)

    # ---- position ----

    def reset(self) -> None:
        """Start a new cycle (the accumulators are overwritten by its first micro-step)."""
        self._micro_step = 0
        self._total_weight = 0.0
        self._nonfinite = False
        self._sumsq: Any = None
        self._seen = [False] * len(self._accs)

    @property
    def boundary_next(self) -> bool:
        """Whether the next micro-step ends the cycle."""
        return ends_cycle(self._micro_step + 1, self._accum_steps)

    def acc_set(self, index: Sequence[int]) -> Any:
        """The accumulators ``index`` as a registered tensor set (made on first use)."""
        key = tuple(index)
        found = self._sets.get(key)
        if found is None:
            if len(self._sets) > 64:  # index sets that keep changing: keep the cache bounded
                self._sets.clear()
            found = self._sets[key] = core.tensor_set([self._accs[i] for i in key])
        return found

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sets"] = {}  # sets are registrations of this process's tensors, made again
        return state

    def seen_index(self) -> list[int]:
        """The accumulators that hold a gradient of this cycle."""
        return [i for i, s in enumerate(self._seen) if s]

    def merge_reduction(self, total_weight: float, nonfinite: bool, seen: Sequence[bool]) -> None:
        """Take the totals of a reduction over ranks that summed the accumulators in place:
        the ranks' total weight, whether any rank's cycle was non-finite (or the total
        overflowed) and which accumulators any rank had a gradient for."""
        if len(seen) != len(self._accs):
            raise ValueError(f"seen has {len(seen)} flags for {len(self._accs)} accumulators")
        self._total_weight = float(total_weight)
        self._nonfinite = bool(nonfinite) or not math.isfinite(self._total_weight)
        self._seen = [bool(s) for s in seen]
        self._sumsq = None

    def mark_nonfinite(self) -> None:
        """A check made outside the cycle (a norm summed over shards) found its result
        non-finite."""
        self._nonfinite = True

    def check_total_weight(self) -> None:
        """A total weight that overflowed to inf makes the cycle non-finite."""
        if not math.isfinite(self._total_weight):
            self._nonfinite = True

    # ---- micro-steps ----

    def micro_weight(self, weight: float) -> float:
        """The weight a micro-step takes: ``weight``, reconciled with one named before its
        backward (:attr:`named_weight`, which a ``weight`` of 1 defers to) and with the one its
        gradients were already folded in with during the backward.

        Raises:
            ValueError: ``weight`` contradicts either (nothing changed).
        """
        named = self._named_weight
        if self._early:
            used = self._early_weight
            if weight != used and not (weight == 1.0 and named is not None):
                raise ValueError(
                    f"weight={weight} differs from the weight {used} the gradients were already "
                    "folded in with during the backward (overlap_reduce, or gradient_as_view "
                    "for bf16/fp16 parameters); pass the weight to accumulate(model, opt, "
                    "weight=...) before the backward (or set overlap_reduce=False / "
                    "gradient_as_view=False)"
                )
            return used
        if named is not None and weight != named:
            if weight != 1.0:
                raise ValueError(
                    f"weight={weight} differs from the weight {named} given to "
                    "accumulate(model, opt, weight=...); give it once"
                )
            return named
        return weight

    def check_named_weight(self, weight: float) -> None:
        """Refuse naming a weight other than the one gradients of the micro-step in flight
        were already folded in with during its backward (:meth:`fold_one`).

        Raises:
            ValueError: it is another (nothing changed).
        """
        if self._early and weight != self._early_weight:
            raise ValueError(
                f"weight={weight}, but gradients of this micro-batch were already folded in "
                f"with weight {self._early_weight} during its backward; name the weight once, "
                "before the backward"
            )

    def name_weight(self, weight: float) -> None:
        """Name the coming micro-step's weight before its backward (checked as
        :meth:`check_named_weight`); the :meth:`fold` that counts the micro-step forgets it."""
        self.check_named_weight(weight)
        self._named_weight = weight

    def hook_weight(self) -> float:
        """The weight gradients folded in during a backward take (the named one, else 1)."""
        return self._named_weight if self._named_weight is not None else 1.0

    def fold(
        self,
        grads: Sequence[torch.Tensor | None],
        weight: float,
        *,
        norm: bool,
        held: Sequence[int] = (),
        single_call: bool = False,
    ) -> None:
        """Fold one micro-step's gradients (``None``: no gradient for that accumulator).

        ``grads`` are contiguous, of the accumulators' shapes (the adapter checks). ``norm``:
        also keep Σacc² of the result (the boundary's clip norm and finiteness check, for free).
        ``held``: accumulators that already hold this micro-step's gradient, weighted (autograd
        added it into them); they count as having one. Everything is checked by the core before
        anything is written. ``single_call``: raise :class:`SplitFold` (nothing done) where the
        gradients would take two accumulate calls, so that a refused gradient in the second
        could not leave the first applied: callers that pass gradients unchecked retry checked.
        """
        early = self._early
        first = self._micro_step == 0 or (
            self.reduction == "running_mean" and self._total_weight == 0 and not early
        )
        fresh_g: list[Any] = []
        add_g: list[Any] = []
        fresh_i: list[int] = []
        add_i: list[int] = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            # Accumulators unseen this cycle were zeroed on its first micro-step; a running mean
            # must still scale a late gradient by w/(W+w), so it adds rather than overwrites.
            # A gradient already folded in this micro-step (fold_one) is added to, never
            # overwritten: the parameter's later backward in the same micro-step.
            later = not first and (self._seen[i] or self.reduction == "running_mean")
            if later or i in self._early_index:
                add_i.append(i)
                add_g.append(g)
            else:
                fresh_i.append(i)
                fresh_g.append(g)
        if single_call and fresh_i and add_i:
            raise SplitFold
        # A running mean over a total weight of 0 is empty: the next weighted micro-step starts
        # it afresh (zero-weight micro-steps only count).
        empty = self._mode == "running_mean" and self._total_weight + weight == 0 and not early
        if empty:
            fresh_i, fresh_g, add_i, add_g = [], [], [], []
        nonfinite, sumsq = False, 0.0
        for idx, gs, overwrite in ((fresh_i, fresh_g, True), (add_i, add_g, False)):
            if not idx:
                continue
            r = core.accumulate(
                self.acc_set(idx),
                gs,
                weight=weight,
                mode=self._mode,
                weight_before=self._total_weight,
                overwrite=overwrite,
                compute_sumsq=norm,
                nonfinite_out=self._device_flag,
            )
            if not self.cuda:
                nonfinite |= r.nonfinite
            if norm:
                sumsq += r.sumsq
        held_now = self._early_index.union(held)
        present = [g is not None or i in held_now for i, g in enumerate(grads)]
        if first and empty:
            self._seen = [False] * len(self._accs)
        elif first:
            # Accumulators without a gradient in the cycle's first micro-step start from zero.
            self._seen = [s or p for s, p in zip(self._seen, present)]
            missing = [self._accs[i] for i, s in enumerate(self._seen) if not s]
            if missing:
                core.zero(missing)
        else:
            if self.reduction == "running_mean":
                # A micro-step without a gradient for an accumulator adds a zero to its mean:
                # acc ← acc·W/(W+w) for those seen earlier in the cycle but not now.
                before = self._total_weight - (weight if early else 0.0)
                stale = [a for a, s, p in zip(self._accs, self._seen, present) if s and not p]
                if stale and before + weight > 0:
                    core.apply(
                        None,
                        stale,
                        optimizer="none",
                        grad_scale=before / (before + weight),
                        reset=False,
                    )
            self._seen = [s or p for s, p in zip(self._seen, present)]
        self._nonfinite |= nonfinite
        if not early:
            self._total_weight += weight
        self._early = False
        self._early_index = set()
        self._named_weight = None  # it named this micro-step
        self._micro_step += 1
        if norm:
            # Accumulators that this micro-step did not touch still count towards the norm.
            stale = [a for a, s, g in zip(self._accs, self._seen, grads) if s and g is None]
            self._sumsq = sumsq + (core.sum_of_squares(stale) if stale else 0.0)
        else:
            self._sumsq = None

    def fold_one(self, i: int, grad: torch.Tensor, weight: float) -> None:
        """Fold accumulator ``i``'s gradient during the backward of the micro-step that
        :meth:`fold` will count next (its weight is counted now, once)."""
        before, fresh = self.early_write(i, weight)
        nonfinite = self.write_gradient(self._accs[i], grad, weight, before, fresh)
        self.early_written((i,), weight, nonfinite)

    def write_gradient(
        self, acc: torch.Tensor, grad: torch.Tensor, weight: float, before: float, overwrite: bool
    ) -> bool:
        """``core.accumulate`` of one gradient into ``acc`` with this cycle's mode; whether it
        was non-finite (on CUDA the device flag is raised instead, and this is False)."""
        r = core.accumulate(
            [acc],
            [grad],
            weight=weight,
            mode=self._mode,
            weight_before=before,
            overwrite=overwrite,
            nonfinite_out=self._device_flag,
        )
        return bool(r.nonfinite) if not self.cuda else False

    def early_write(self, i: int, weight: float) -> tuple[float, bool]:
        """How a gradient of the micro-step in flight, folded during its backward, is written
        into accumulator ``i``: ``(weight_before, overwrite)`` for the accumulate formula.
        Changes nothing: :meth:`early_written` records the write once it is done."""
        before = self._total_weight - (self._early_weight if self._early else 0.0)
        # A second gradient of the same micro-step (a second backward) adds to the first.
        fresh = i not in self._early_index and (
            self._micro_step == 0 or (not self._seen[i] and self.reduction != "running_mean")
        )
        return before, fresh

    def early_written(self, index: Sequence[int], weight: float, nonfinite: bool) -> None:
        """Record that gradients of the micro-step in flight were folded into ``index`` during
        its backward with ``weight`` (counted once per micro-step): what a layer's fused
        fold, which writes a weight and a bias in one call, and :meth:`fold_one` report."""
        self._sumsq = None
        if not self._early:
            self._early = True
            self._early_weight = weight
            self._total_weight += weight
        self._nonfinite |= nonfinite
        for i in index:
            self._seen[i] = True
            self._early_index.add(i)

    @property
    def mode(self) -> str:
        """The accumulate formula's mode (``"sum"`` or ``"running_mean"``) of the reduction."""
        return self._mode

    # ---- the boundary ----

    def collect_device_flag(self) -> None:
        """Fold the CUDA non-finite flag into :attr:`nonfinite` (one device read per cycle)."""
        if self._device_flag is not None:
            self._nonfinite |= bool(self._device_flag.item())
            self._device_flag.zero_()

    def result_norm(self, index: Sequence[int], scale: float) -> Any:
        """‖accumulators × scale‖ over ``index``, and whether the result is finite.

        Finite micro-step gradients can sum to more than fp32 holds (a huge weight, a loss
        scale that kept growing): the accumulated result itself is checked. On CPU the norm is
        a float; one past float32's range sets :attr:`nonfinite` when an element of the result
        is not finite (:meth:`_scaled_finite`). On CUDA it stays a device tensor, and a norm
        past the range raises the device flag, read with the cycle's one flag read.
        """
        if self.cuda:
            device = self._device_flag.device
            if index:
                sumsq = core.sum_of_squares([self._accs[i] for i in index])
                # A device tensor on CUDA; a float where the flag lives in host memory.
                norm = torch.as_tensor(sumsq, dtype=torch.float64, device=device).sqrt() * abs(
                    scale
                )
            else:
                norm = torch.zeros((), dtype=torch.float64, device=device)
            self._device_flag.add_((~(norm <= FLT_MAX)).to(torch.float32))
            return norm
        sumsq, self._sumsq = self._sumsq, None  # used once: the boundary's
        if sumsq is None:
            sumsq = core.sum_of_squares([self._accs[i] for i in index]) if index else 0.0
        norm = math.sqrt(sumsq) * abs(scale)
        if not norm <= FLT_MAX and not self._scaled_finite(index, scale):
            self._nonfinite = True
        return norm

    def _scaled_finite(self, index: Sequence[int], scale: float) -> bool:
        """Whether every element of ``accumulators × scale`` over ``index`` is finite, as the
        Keras TensorFlow and JAX paths decide (``keras/_cycle.all_finite``). Asked only when
        the norm passed float32's range: the elements can still all be finite (many of them
        near the top of the range), and such a cycle is not dropped. CPU only: on CUDA a norm
        past the range raises the flag on the device (docs/semantics.md)."""
        for i in index:
            acc = self._accs[i]
            if not bool(torch.isfinite(acc * torch.tensor(scale, dtype=acc.dtype)).all()):
                return False
        return True

    # ---- saving ----

    def state(self) -> dict[str, Any]:
        """The cycle's position (the accumulators are saved by their owner)."""
        self.collect_device_flag()
        return {
            "micro_step": self._micro_step,
            "total_weight": self._total_weight,
            "nonfinite": self._nonfinite,
            "seen": list(self._seen),
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a saved position that does not fit this cycle (nothing is loaded)."""
        seen, micro = state["seen"], state["micro_step"]
        if (
            not isinstance(seen, (list, tuple))
            or len(seen) != len(self._accs)
            or not isinstance(micro, int)
            or not 0 <= micro < self._accum_steps
        ):
            raise ValueError(
                "state_dict's cycle position (micro_step, seen) does not fit this optimizer "
                "(truncated or edited)"
            )

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a position :meth:`check_state` accepted."""
        if self._device_flag is not None:
            self._device_flag.zero_()
        self._micro_step = int(state["micro_step"])
        self._total_weight = float(state["total_weight"])
        self._nonfinite = bool(state["nonfinite"])
        self._seen = [bool(s) for s in state["seen"]]
        self._sumsq = None
        self._early = False
        self._early_index = set()
