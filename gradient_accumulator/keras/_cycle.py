"""The Keras wrapper's accumulation arithmetic as functions of values, in backend ops.

:func:`fold` takes the cycle's state and one micro-batch's gradients and returns the next state;
it is the fold of every path: the stateful one (TensorFlow, eager PyTorch without the core)
writes the returned values into the optimizer's variables, the functional one (JAX) passes
them on. :func:`boundary` takes the cycle's state at the end of a micro-step and returns the next
state with what the shell does with it: the factor that turns the accumulators into the
cycle's gradient, whether the inner optimizer updates and whether the cycle is left out as
non-finite. The loss scale's growth and halving, the non-finite check, the count of dropped
cycles and the reset of the counters are decided there, once, for both shells; each shell keeps
only what is its own (writing variables and running the inner update in a conditional, under
``tf.distribute`` in the cross-replica context; threading values through a ``lax.cond``).
Nothing here writes a variable; the options come in as the wrapper's record
(:class:`gradient_accumulator._options.Options`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from keras import ops

from gradient_accumulator._options import Options
from gradient_accumulator.keras._compat import checks_finite_by_sum, to_numpy, traced

__all__ = [
    "CycleEnd",
    "CycleState",
    "FoldState",
    "all_finite",
    "boundary",
    "checks_nonfinite",
    "concrete",
    "decide",
    "dense",
    "drops_nonfinite",
    "ends_cycle",
    "epoch_clock",
    "epoch_countdown",
    "fold",
    "grad_scale",
    "grown_scale",
    "nonfinite_after",
    "on_choice",
    "seen_choice",
    "traced",
]


class FoldState(NamedTuple):
    """What a micro-step changes: the accumulators, the seen flags (one per variable: had a
    gradient in this cycle), the cycle's total weight, its non-finite flag (with mixed
    precision), the micro-step in the cycle and the micro-steps seen so far."""

    accs: list[Any]
    seen: Any
    total_weight: Any
    nonfinite: Any
    micro_step: Any
    iterations: Any


class CycleState(NamedTuple):
    """What a boundary reads and writes besides the accumulators: the micro-step in the cycle,
    the cycle's total weight, its non-finite flag (set per micro-step under
    ``mixed_precision``), the loss scale and its growth counter, and the number of cycles
    dropped as non-finite under ``on_nonfinite``."""

    micro_step: Any
    total_weight: Any
    nonfinite: Any
    loss_scale: Any
    growth: Any
    skipped: Any


class CycleEnd(NamedTuple):
    """What :func:`boundary` returns: the next ``state``; ``scale``, the factor turning the
    accumulators into the cycle's gradient (:func:`grad_scale`; None where the caller gave
    that gradient, ``scaled``); ``do_update``, whether the
    inner optimizer takes that gradient now; ``skipped``, whether the cycle ends without an
    update because it is non-finite (the loss scaler's skip or ``on_nonfinite``'s drop).
    ``do_update`` and ``skipped`` are Python booleans where they are known without a tensor."""

    state: CycleState
    scale: Any
    do_update: Any
    skipped: Any


def concrete(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array when it is concrete (eager), None when it is traced."""
    return None if traced(value) else to_numpy(value)


def dense(grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
    """The gradients in float32, zeros for a variable without one (None)."""
    out = []
    for g, v in zip(grads, variables):
        if g is None:
            out.append(ops.zeros(v.shape, "float32"))
        else:
            out.append(ops.cast(ops.convert_to_tensor(g), "float32"))
    return out


def all_finite(grads: list[Any]) -> Any:
    """Whether every element of ``grads`` is finite (a boolean tensor)."""
    if not grads:  # nothing to check (no trainable variable)
        return ops.convert_to_tensor(True)
    if checks_finite_by_sum():
        return _all_finite_by_sum(grads)
    return _all_finite_exact(grads)


def _all_finite_exact(grads: list[Any]) -> Any:
    return ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in grads]))


def _all_finite_by_sum(grads: list[Any]) -> Any:
    """TensorFlow: :func:`all_finite` from the tensors' sums, the same verdict in fewer passes.

    A NaN or an Inf makes every sum it enters non-finite, whatever the order of the additions
    (IEEE arithmetic: Inf plus a finite value is Inf, Inf minus Inf is NaN, NaN stays NaN), so a
    finite total proves every element finite. A non-finite total may also be finite elements
    whose sum overflows: then the elementwise check decides, in the branch not taken on a good
    cycle. TensorFlow's vectorised sum is one read of each tensor, where ``is_finite`` then
    ``reduce_all`` writes and reads a boolean tensor and reduces it element by element
    (measured in benchmarks/README.md).
    """
    import tensorflow as tf

    total = tf.add_n([tf.cast(tf.reduce_sum(g), "float32") for g in grads])
    return tf.cond(
        tf.math.is_finite(total), lambda: tf.constant(True), lambda: _all_finite_exact(grads)
    )


def _fold_accs(
    accs: list[Any], grads: list[Any], first: Any, w: Any, w_before: Any, reduction: str
) -> list:
    """New accumulator values after folding in one micro-batch (first: overwrite)."""
    if reduction == "running_mean":
        total = ops.maximum(w_before + w, 1e-30)
        keep, take = w_before / total, w / total
        return [ops.where(first, g, a * keep + g * take) for a, g in zip(accs, grads)]
    if reduction == "sum":
        return [ops.where(first, g, a + g) for a, g in zip(accs, grads)]
    return [ops.where(first, g * w, a + g * w) for a, g in zip(accs, grads)]


def nonfinite_after(nonfinite: Any, grads: list[Any], first: Any = None) -> Any:
    """The cycle's non-finite flag after a micro-step with ``grads``: raised (1.0) by a NaN or
    Inf among them. ``first``: whether the micro-step starts the cycle (the flag restarts);
    None where the flag was zeroed when the cycle started (TensorFlow's in-place fold)."""
    bad = ops.cast(ops.logical_not(all_finite(grads)), "float32")
    before = nonfinite if first is None else ops.where(first, 0.0, nonfinite)
    return ops.maximum(before, bad)


def _seen_after(seen: Any, present: Sequence[bool], first: Any) -> Any:
    """The seen flags after a micro-step in which ``present`` variables have a gradient."""
    mask = ops.convert_to_tensor(np.asarray(present, "float32"))
    if all(present):  # every flag is set whatever it was
        return mask
    return ops.where(first, mask, ops.maximum(seen, mask))


def fold(
    state: FoldState,
    grads: list[Any],
    batch_weight: Any,
    options: Options,
    present: Sequence[bool],
    *,
    accs_in_place: bool = False,
) -> FoldState:
    """The state after one micro-batch: ``grads`` (dense, float32) of weight ``batch_weight``
    (ignored under ``"sum"``) folded in; ``present`` says which variables had a gradient.

    ``accs_in_place``: the caller folds the accumulators itself with :func:`fold_in_place`
    (the returned ``accs`` are ``state.accs``, unchanged)."""
    first = ops.equal(state.micro_step, 0)
    w = 1.0 if options.reduction == "sum" else ops.cast(batch_weight, "float32")
    w_before = ops.where(first, 0.0, state.total_weight)
    nonfinite = state.nonfinite
    if options.mixed_precision:
        nonfinite = nonfinite_after(state.nonfinite, grads, first)
    return FoldState(
        accs=state.accs
        if accs_in_place
        else _fold_accs(state.accs, grads, first, w, w_before, options.reduction),
        seen=_seen_after(state.seen, present, first),
        total_weight=ops.cast(w_before + w, "float32"),
        nonfinite=nonfinite,
        micro_step=state.micro_step + 1,
        iterations=state.iterations + 1,
    )


def fold_in_place(
    accs: list[Any],
    grads: list[Any],
    micro_step: Any,
    batch_weight: Any,
    options: Options,
    *,
    from_zeros: bool = False,
) -> None:
    """:func:`fold`'s accumulator values written into the variables ``accs`` for ``"mean"`` and
    ``"sum"``: an overwrite on a cycle's first micro-step, an in-place add after it. A select
    over both candidates costs two more passes over every gradient (TensorFlow does not fuse
    them on the CPU). ``from_zeros``: every cycle starts from zeroed accumulators (TensorFlow
    zeroes them wherever a cycle ends or is discarded), so every micro-step adds, with no
    conditional."""
    if options.reduction == "running_mean":
        raise ValueError("fold_in_place folds 'mean' and 'sum' only")
    w = ops.cast(batch_weight, "float32")
    terms = grads if options.reduction == "sum" else [g * w for g in grads]

    def overwrite() -> None:
        for acc, t in zip(accs, terms):
            acc.assign(t)

    def add() -> None:
        for acc, t in zip(accs, terms):
            acc.assign_add(t)

    if from_zeros:
        add()
    else:
        ops.cond(ops.equal(micro_step, 0), overwrite, add)


def grad_scale(
    total_weight: Any, loss_scale: Any, options: Options, static_scale: float | None
) -> Any:
    """The factor turning the accumulators into the cycle's gradient: 1/total weight under
    ``"mean"``, 1/loss scale under ``mixed_precision``, 1/the inner optimizer's static factor."""
    scale = ops.convert_to_tensor(1.0, "float32")
    if options.reduction == "mean":
        scale = scale / ops.maximum(ops.cast(total_weight, "float32"), 1e-30)
    if options.mixed_precision:
        scale = scale / ops.cast(loss_scale, "float32")
    if static_scale is not None:
        scale = scale / float(static_scale)
    return scale


def grown_scale(loss_scale: Any, growth: Any, options: Options) -> tuple[Any, Any]:
    """Loss scale and growth counter after one good update."""
    grow = ops.greater_equal(growth + 1, options.dynamic_growth_steps)
    return (
        ops.where(grow, loss_scale * 2.0, loss_scale),
        ops.where(grow, ops.zeros_like(growth), growth + 1),
    )


def seen_choice(seen: Any, present: Sequence[bool]) -> tuple[Any, list[int], list[int]]:
    """``(pred, if_true, if_false)``: the indices of the variables the boundary updates.

    Those with a gradient in the cycle (``seen``, after the current micro-step); a variable
    without any is left alone, optimizer state included. On concrete values the choice is
    exact and static. In a traced function only the variables absent from the traced call
    (``present`` False, a trace-time fact) can be unseen: they are updated as a group if any
    of them had a gradient earlier in the cycle (from another traced function), else left
    out. (So only a cycle mixing functions with different missing gradients can update an
    unseen variable, with a zero gradient.)
    """
    everything = list(range(len(present)))
    if all(present):  # every variable has a gradient now: nothing to read
        return True, everything, everything
    values = concrete(seen)
    if values is not None:
        keep = [i for i in everything if values[i] > 0]
        return True, keep, keep
    absent = [i for i in everything if not present[i]]
    others = [i for i in everything if present[i]]
    pred = ops.any(ops.greater(ops.take(seen, np.asarray(absent, "int32")), 0.0))
    return pred, everything, others


def on_choice(choice: tuple[Any, list[int], list[int]], update: Callable[[list[int]], Any]) -> Any:
    """``update(indices)`` for the variables ``choice`` (from :func:`seen_choice`) picks."""
    pred, if_true, if_false = choice
    if isinstance(pred, bool):
        return update(if_true if pred else if_false)
    return ops.cond(pred, lambda: update(if_true), lambda: update(if_false))


def ends_cycle(micro_step: Any, accum_steps: Any) -> Any:
    """Whether a cycle that has folded ``micro_step`` micro-steps ends now (a boolean tensor):
    ``gradient_accumulator._engine.ends_cycle`` in ``keras.ops``."""
    return ops.greater_equal(micro_step, accum_steps)


def epoch_clock(epoch_steps: Any, steps_left: Any) -> tuple[Any, Any]:
    """``(last, steps_left_after)`` for one train step of ``fit``: whether it is the last step
    of its epoch, and the steps left in the fit after it. ``epoch_steps``: the steps of each
    epoch; ``steps_left``: the steps left in the fit before this one, this one included (0:
    no clock, never last; it stays 0, so the clock stops by itself after the fit's last
    step). The last step of an epoch ends the cycle, short or not, as the epoch-end flush
    would after it, so that the flush has nothing left to do."""
    on = ops.greater(steps_left, 0)
    period = ops.maximum(epoch_steps, 1)
    last = ops.logical_and(on, ops.equal(ops.mod(steps_left - 1, period), 0))
    return last, ops.maximum(steps_left - 1, 0)


def epoch_countdown(steps_left: Any) -> tuple[Any, Any]:
    """:func:`epoch_clock` for a clock that counts the steps left in the current epoch only
    (0: no clock). TensorFlow's is one: its variables take a write between two steps, so the
    epoch-end callback sets the count again for the next epoch, and a step pays one read and
    three ops for its clock where counting the whole fit's steps takes four reads and eight
    ops (``benchmarks/README.md``)."""
    return ops.equal(steps_left, 1), ops.maximum(steps_left - 1, 0)


def drops_nonfinite(options: Options) -> bool:
    """Whether ``on_nonfinite`` decides about a non-finite cycle (the loss scaler does not)."""
    return not options.mixed_precision and options.on_nonfinite != "apply"


def checks_nonfinite(options: Options) -> bool:
    """Whether a boundary looks at the cycle's non-finite verdict at all."""
    return options.mixed_precision or drops_nonfinite(options)


def _select(at: Any, new: Any, old: Any) -> Any:
    return new if at is True else ops.where(at, new, old)


def decide(at: Any, verdict: Any, options: Options) -> tuple[Any, Any]:
    """``(do_update, skipped)`` at a boundary (``at``) whose cycle has the non-finite
    ``verdict`` (> 0: some value was NaN or Inf), the rule every shell applies."""
    if not checks_nonfinite(options):
        return at, False
    skipped = ops.greater(verdict, 0.0)
    if at is True:
        return ops.logical_not(skipped), skipped
    return ops.logical_and(at, ops.logical_not(skipped)), skipped


def boundary(
    state: CycleState,
    options: Options,
    *,
    at: Any = True,
    accs: Sequence[Any] = (),
    scaled: bool = False,
    static_scale: float | None = None,
    check_result: bool = False,
    agree: Callable[[Any, Any], Any] | None = None,
) -> CycleEnd:
    """The end of a cycle where ``at`` holds (True, or a boolean tensor: the state is returned
    unchanged where it is False).

    The non-finite verdict: with ``on_nonfinite`` deciding (``"skip"``, ``"raise"``), or with
    ``check_result`` under ``mixed_precision``, the cycle's gradient itself (the accumulators
    ``accs`` times the scale) is checked, at the boundary only: a NaN or Inf of any micro-batch
    reaches it, and so does a finite sum that overflows float32. Otherwise, under
    ``mixed_precision``, the flag the fold set per micro-step; with neither (``"apply"``), no
    verdict: the cycle is applied as computed, ``check_result`` or not. ``agree(at, verdict)``,
    given, returns the verdict the replicas agree on (their sum); the shell calls it here,
    between the check and the decision.

    A good cycle updates and, under ``mixed_precision``, counts towards the loss scale's
    growth; a non-finite one halves the loss scale (``mixed_precision``) or is dropped and
    counted (``on_nonfinite``). Then the micro-step, total weight and non-finite flag restart.
    ``accs`` may be variables: they are read only where the check runs. ``scaled``: ``accs``
    are the cycle's gradient already (the accumulators times the scale, which the caller
    holds: it is not computed again, and the returned ``scale`` is None).
    """
    scale = None
    if not scaled:
        scale = grad_scale(state.total_weight, state.loss_scale, options, static_scale)
    drops = drops_nonfinite(options)
    checks = drops or (check_result and checks_nonfinite(options))  # see the docstring
    verdict = state.nonfinite

    def finite() -> Any:
        return all_finite(list(accs) if scaled else [a * scale for a in accs])

    if checks and at is True and agree is None:
        # The update waits for this verdict: it is used as the check gives it, a boolean,
        # with no conversion between the check and the update's conditional.
        do_update = finite()
        skipped = ops.logical_not(do_update)
    else:
        if checks:

            def measured() -> Any:
                return ops.cast(ops.logical_not(finite()), "float32")

            verdict = (
                measured()
                if at is True
                else ops.cond(at, measured, lambda: ops.convert_to_tensor(0.0, "float32"))
            )
        if agree is not None:
            verdict = agree(at, verdict)
        do_update, skipped = decide(at, verdict, options)
    loss_scale, growth, dropped = state.loss_scale, state.growth, state.skipped
    if options.mixed_precision:
        grown, counted = grown_scale(state.loss_scale, state.growth, options)
        loss_scale = _select(at, ops.where(skipped, state.loss_scale * 0.5, grown), loss_scale)
        growth = _select(at, ops.where(skipped, ops.zeros_like(counted), counted), growth)
    if drops:
        dropped = ops.where(
            skipped if at is True else ops.logical_and(at, skipped),
            state.skipped + 1,
            state.skipped,
        )
    next_state = CycleState(
        micro_step=_select(at, ops.zeros_like(state.micro_step), state.micro_step),
        total_weight=_select(at, ops.zeros_like(state.total_weight), state.total_weight),
        nonfinite=_select(at, ops.zeros_like(state.nonfinite), state.nonfinite),
        loss_scale=loss_scale,
        growth=growth,
        skipped=dropped,
    )
    return CycleEnd(next_state, scale, do_update, skipped)
