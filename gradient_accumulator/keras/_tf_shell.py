"""The stateful shells of the Keras cycle: eager torch off the core, and TensorFlow.

Each folds a micro-batch into the wrapper's variables and ends a cycle in backend ops.
:class:`StatefulShell` (the torch backend off the core) overwrites the accumulators at a cycle's
first micro-step. :class:`TensorFlowShell` (no strategy) adds every micro-step in place onto
accumulators that each cycle starts from zeros, and the boundary is one conditional that
TensorFlow calls when the cycle ends (:meth:`TensorFlowShell._apply_dense`); every end of a cycle
zeroes the accumulators (:meth:`TensorFlowShell._zero_accumulators`). The hooks of
:class:`StatefulShell` after ``_after_cycle`` are what ``_replica_shell.ReplicaShell`` (under a
``tf.distribute`` strategy) changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from gradient_accumulator.keras import _cycle, _packed
from gradient_accumulator.keras._compat import (
    after,
    switch_case,
    to_numpy,
)
from gradient_accumulator.keras._shell import Shell


def _plain(var: Any) -> Any:
    """The ``tf.Variable`` behind a Keras variable, None where it is not a plain one."""
    import tensorflow as tf

    value = var.value
    return value if isinstance(value, tf.Variable) and hasattr(value, "handle") else None


def _axpy(acc: Any, minus_w: Any, g: Any) -> None:
    """``acc += w·g`` in one pass over ``acc``: TensorFlow's in-place gradient-descent kernel,
    ``acc - (-w)·g``, the same rounding as ``acc + w·g`` (a multiply, then an add)."""
    import tensorflow as tf

    plain = _plain(acc)
    if plain is None:
        acc.assign_add(g * ops.negative(minus_w))
        return
    tf.raw_ops.ResourceApplyGradientDescent(var=plain.handle, alpha=minus_w, delta=g)


def _add_to(var: Any, value: Any) -> None:
    """``var += value`` as one op (Keras's ``assign_add`` reads, adds and assigns)."""
    import tensorflow as tf

    plain = _plain(var)
    if plain is None:
        var.assign_add(value)
        return
    plain.assign_add(tf.cast(value, plain.dtype), read_value=False)


def write(var: Any, value: Any) -> None:
    """``var = value`` through the ``tf.Variable`` behind ``var`` where it is a plain one
    (Keras's ``assign`` converts and checks first: eagerly 71 µs against 26 µs)."""
    plain = _plain(var)
    if plain is None:
        var.assign(value)
        return
    plain.assign(value, read_value=False)


def _control_flow_graph(graph: Any) -> bool:
    """Whether ``graph`` is a branch or loop body of TensorFlow's control flow (built anew
    with each trace of the graph around it), not a function's (whose traces are cached)."""
    try:
        from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph
    except ImportError:  # pragma: no cover - the module moved: take none as control flow
        return False
    return isinstance(graph, ControlFlowFuncGraph)


class StatefulShell(Shell):
    """Eager torch off the core (and the base of TensorFlow's shells): the wrapper's variables
    folded and ended in backend ops; a cycle's first micro-step overwrites the accumulators."""

    from_zeros = False  # every cycle starts from zeroed accumulators (TensorFlow)
    _clock_after = 0  # fit's steps after the current epoch's (TensorFlowShell.set_epoch_clock)

    def build(self, var_list: list[Any]) -> None:
        """One variable per scalar (``_packed.SCALARS``), fit's epoch clock, one float32
        accumulator per variable and the seen flags."""
        initial = {"batch_weight": 1.0, "loss_scale": self._opt.initial_scale}
        for name in _packed.SCALARS:
            int_like = name in _packed.INTS
            setattr(
                self._opt,
                f"_{name}",
                self._opt.add_variable(
                    shape=(),
                    dtype="int" if int_like else "float32",
                    initializer=keras.initializers.Constant(initial.get(name, 0.0)),
                    aggregation="only_first_replica",
                    name=name,
                ),
            )
        self._build_epoch_clock()
        self._opt._acc_flat = None
        self._opt._accumulators = [self._accumulator(v) for v in var_list]
        # 1.0 for each variable that had a gradient in the current cycle: one without any is
        # left alone at the boundary, as plain Keras leaves a variable whose gradient is None.
        self._opt._seen = self._opt.add_variable(
            shape=(len(var_list),),
            dtype="float32",
            initializer="zeros",
            aggregation="only_first_replica",
            name="seen",
        )

    def _build_epoch_clock(self) -> None:
        """The epoch's clock (``_packed.EPOCH``): none here; the torch backend, which runs
        eagerly, flushes at the epoch's end instead."""
        for name in _packed.EPOCH:
            setattr(self._opt, f"_{name}", None)

    def micro_step(self, grads: list[Any], variables: list[Any], weight: Any) -> None:
        direct = self.takes_step_weight
        if weight is None and direct:
            weight = self._stashed_weight()
        if weight is not None and not direct:
            self._opt._batch_weight.assign(weight)
        overwrite = self.overwrite_maxima(grads, self._opt._micro_step.value, self._opt._seen.value)
        reported = self._fold_and_end(grads, variables, weight if direct else None)
        if overwrite:
            boundary = ops.equal(self._opt._micro_step, 0)
            seen = self._opt._seen.value
            for i, acc, maximum in overwrite:
                var = variables[i]
                write = ops.logical_and(boundary, ops.greater(seen[i], 0.0))
                var.assign(ops.where(write, ops.cast(maximum, var.dtype), var))
                acc.assign(maximum)
        if weight is not None and not direct:
            self._opt._batch_weight.assign(1.0)
        if self._opt._drops_nonfinite() and not reported and self._eager():
            self._opt.report_nonfinite()

    def _stashed_weight(self) -> Any:
        return None

    def _fold_and_end(self, grads: list[Any], variables: list[Any], weight: Any | None) -> bool:
        """One micro-step of the stateful paths. ``weight``: the micro-batch's weight as a
        tensor or number (TensorFlow without a strategy); None: ``counter("batch_weight")``.
        Returns whether the path reported a dropped cycle itself (the core's)."""
        present = [g is not None for g in grads]
        grads = _cycle.dense(grads, variables)
        if weight is None:
            weight = self._opt._batch_weight.value
        self._apply_dense(grads, variables, present, weight)
        return False

    def _apply_dense(
        self, grads: list[Any], variables: list[Any], present: list[bool], weight: Any
    ) -> None:
        self._stateful_fold(grads, variables, present, weight)
        # Every op below reads a counter written after the batch, so it is ordered after it.
        self._end_cycle(
            _cycle.ends_cycle(self._opt._micro_step, self._opt.accum_steps), variables, present
        )

    def _stateful_fold(
        self, grads: list[Any], variables: list[Any], present: list[bool], weight: Any
    ) -> None:
        accs = [self._opt._accumulators[self._opt._get_variable_index(v)] for v in variables]
        in_place = self._opt._options.reduction != "running_mean"
        if in_place:  # before the counters move (the torch backend's first micro-step overwrites)
            _cycle.fold_in_place(
                accs,
                grads,
                self._opt._micro_step.value,
                weight,
                self._opt._options,
                from_zeros=self.from_zeros,  # TensorFlow: see _end_cycle
            )
        state = _cycle.fold(
            _cycle.FoldState(
                [a.value for a in accs],
                self._opt._seen.value,
                self._opt._total_weight.value,
                self._opt._nonfinite.value,
                self._opt._micro_step.value,
                self._opt._iterations.value,
            ),
            grads,
            weight,
            self._opt._options,
            present,
            accs_in_place=in_place,
        )
        if not in_place:
            for acc, value in zip(accs, state.accs):
                acc.assign(value)
        if self._opt.mixed_precision:
            self._opt._nonfinite.assign(state.nonfinite)
        with after(grads[:1]):
            self._opt._seen.assign(state.seen)
            self._opt._total_weight.assign(state.total_weight)
            # Counted by increments, as replicas under tf.distribute count them.
            self._opt._micro_step.assign_add(1)
            self._opt._iterations.assign_add(1)

    def _end_cycle(self, boundary: Any, variables: list[Any], present: list[bool]) -> None:
        """If ``boundary``: the cycle ends as :func:`_cycle.boundary` decides; this shell runs
        the inner update in a conditional and writes the next state into the variables.

        ``present``: which variables have a gradient in the current call (see
        :func:`_cycle.seen_choice`). Only the inner update sits in a conditional; the counters
        and the loss scale are selected outside it, so no replica synchronisation happens
        inside a branch.
        """
        merged = self._merges()
        choice = _cycle.seen_choice(self._opt._seen.value, present)
        agree = self._agree(choice, variables)
        accs = [self._opt._accumulators[self._opt._get_variable_index(v)] for v in variables]
        scaled = None
        if (
            boundary is True
            and self.scales_at_a_known_boundary
            and self._opt._drops_nonfinite()
            and choice[0] is True
        ):
            # A boundary known to end the cycle, with a known set of variables to update: the
            # cycle's gradient is computed once, for the check and for the update.
            scale = self.grad_scale(self._opt._total_weight, self._opt._loss_scale)
            scaled = [a.value * scale for a in accs]
        end = _cycle.boundary(
            # The variables themselves: each is read where the boundary uses it.
            _cycle.CycleState(*(getattr(self._opt, f"_{k}") for k in _cycle.CycleState._fields)),
            self._opt._options,
            at=boundary,
            accs=accs if scaled is None else scaled,
            scaled=scaled is not None,
            static_scale=self._opt._static_scale,
            check_result=self._opt.mixed_precision and self.checks_result,
            agree=agree,
        )
        if not merged:
            if scaled is None:

                def update() -> Any:
                    return _cycle.on_choice(
                        choice, lambda keep: self._inner_update(variables, keep)
                    )

            else:
                # The final gradients outside the conditional too (AGC's norms cannot be
                # computed in a branch from a gradient computed outside it).
                kept = [variables[i] for i in choice[1]]
                final = self.final_grads(
                    [scaled[i] for i in choice[1]], kept, [v.value for v in kept], None
                )

                def update() -> Any:
                    if kept:
                        self._opt.optimizer.apply(final, kept)

            if end.do_update is True:
                update()
            else:
                ops.cond(end.do_update, update, lambda: None)
            self._count_inner_update(end.do_update, choice)
        self._write_state(end.state)
        self._after_cycle(boundary)

    def _write_state(self, state: _cycle.CycleState) -> None:
        """The cycle's next counters and loss scale into the wrapper's variables."""
        if self._opt.mixed_precision:
            self._opt._loss_scale.assign(state.loss_scale)
            self._opt._growth.assign(state.growth)
        if self._opt._drops_nonfinite():
            self._opt._skipped.assign(state.skipped)
        self._opt._micro_step.assign(state.micro_step)
        self._opt._total_weight.assign(state.total_weight)
        self._opt._nonfinite.assign(state.nonfinite)

    def _after_cycle(self, boundary: Any) -> None:
        """What the end of a cycle leaves behind besides the counters: nothing here (the next
        cycle's first micro-step overwrites the accumulators)."""
        return None

    # What a strategy's replicas change in the boundary (see ReplicaShell). The cycle's
    # gradient is computed once, outside the conditional, at a boundary known to end the cycle
    # (no replica: nothing to agree on first).
    scales_at_a_known_boundary = True
    # The loss scaler checks the cycle's result too, not only the per-micro-step flag.
    checks_result = False

    def _merges(self) -> bool:
        """Whether the boundary runs in the cross-replica context (``merge_call``)."""
        return False

    def _agree(self, choice: tuple, variables: list[Any]) -> Any:
        """The boundary's ``agree`` (:func:`_cycle.boundary`): None, one replica."""
        return None

    def _count_inner_update(self, do_update: Any, choice: tuple) -> None:
        """The inner optimizer counts its own update here."""
        return None

    def _summed(self, accs: list[Any], reduced: Sequence[Any] | None) -> list[Any]:
        """The kept accumulators as the update reads them: one replica's are the cycle's."""
        return accs

    def _apply_inner(self, grads: list[Any], variables: list[Any]) -> None:
        """The inner optimizer's update with the cycle's final gradients."""
        self._opt.optimizer.apply(grads, variables)

    def _inner_update(
        self,
        variables: list[Any],
        keep: list[int],
        reduced: Sequence[Any] | None = None,
    ) -> None:
        """The inner optimizer's update of ``variables[keep]`` with the cycle's averaged
        gradient (replica context).

        ``reduced``: the kept accumulators already summed over the replicas (the cross-replica
        context reduced them); under a strategy with clipping they are reduced here otherwise.
        """
        if not keep:
            return
        variables = [variables[i] for i in keep]
        accs = [self._opt._accumulators[self._opt._get_variable_index(v)].value for v in variables]
        accs = self._summed(accs, reduced)
        grads = self.final_grads(
            accs,
            variables,
            [v.value for v in variables],
            self.grad_scale(self._opt._total_weight, self._opt._loss_scale),
        )
        self._apply_inner(grads, variables)

    def flush(self, present: list[bool], overwrites: bool) -> None:
        variables = self._opt._trainable_variables
        self._end_cycle(ops.convert_to_tensor(True), variables, present)

    def counters(self) -> dict[str, int]:
        out = {
            name: int(to_numpy(getattr(self._opt, f"_{name}")))
            for name in ("micro_step", "skipped")
        }
        clock = self._opt._steps_left
        now = 0 if clock is None else int(to_numpy(clock))
        out["steps_left"] = now + self._clock_after if now else 0
        return out


class TensorFlowShell(StatefulShell):
    """TensorFlow without a ``tf.distribute`` strategy: in-place folds onto accumulators that
    every cycle starts from zeros, the boundary one conditional that TensorFlow calls when the
    cycle ends, fit's epoch clock counted down in the step."""

    takes_step_weight = True
    from_zeros = True

    def __init__(self, opt: Any) -> None:
        super().__init__(opt)
        # The compiled flushes, per seen-flags pattern and setting (see _tf_flush).
        self._flush_cache: dict[tuple, Any] = {}

    def _build_epoch_clock(self) -> None:
        """Fit's epoch clock (``_packed.EPOCH``), two int variables that no file saves. The
        step reads only ``steps_left`` (see :meth:`set_epoch_clock`); ``epoch_steps`` keeps the
        variables' layout of earlier versions."""
        for name in _packed.EPOCH:
            clock = self._opt.add_variable(
                shape=(),
                dtype="int",
                initializer="zeros",
                aggregation="only_first_replica",
                name=name,
            )
            setattr(self._opt, f"_{name}", clock)

    def _stashed_weight(self) -> Any:
        """The batch size ``fit``'s step stashed (``callbacks.weighing``) where this call may
        use it, else None (the fold then reads ``counter("batch_weight")``).

        The stash is a tensor of the step's graph: used eagerly, or where this call traces
        that graph itself or a conditional or loop inside it (built anew with each trace). In
        a ``tf.function`` of its own inside the step, a capture of it would stay in that
        function's cached trace, a tensor of a dead graph once the step retraces: not used
        there. (``weighing`` writes the counter instead of stashing for a ``train_step`` that
        is not Keras's own, which may apply from such a function.)
        """
        stash = self._opt.__dict__.get("_step_weight")
        if stash is None:
            return None
        import tensorflow as tf

        if tf.executing_eagerly():
            return stash
        home = getattr(stash, "graph", None)  # None for an eager tensor
        graph = tf.compat.v1.get_default_graph()
        while graph is not home and _control_flow_graph(graph):
            graph = graph.outer_graph
        return stash if graph is home else None

    def _apply_dense(
        self, grads: list[Any], variables: list[Any], present: list[bool], weight: Any
    ) -> None:
        """One TensorFlow micro-step without a strategy: the fold, then the boundary in a
        conditional that TensorFlow calls when the cycle ends.

        The fold adds each weighted gradient in place, outside any conditional, so each
        accumulator's add starts as soon as its gradient is ready: the accumulators (and the
        cycle's total weight and non-finite flag) are zero whenever a cycle starts, because
        every path that ends or discards a cycle on TensorFlow zeroes them
        (:meth:`_end_cycle`, ``reset_cycle``, a load at a cycle's start). The boundary is one
        op that calls its branch, not lowered into the step's graph, so the micro-steps do not
        walk its ops. The same values as :meth:`_stateful_fold` then :meth:`_end_cycle` (the
        first micro-step's ``0 + w·g`` is ``w·g``), held to them bit for bit by
        ``tests/cycle_table.py``; measured in benchmarks/README.md.
        """
        epoch_last = self._tick_epoch_clock()
        step = ops.cast(self._opt._micro_step.value, "int32")  # read before the fold moves it
        self._fold_added(grads, variables, present, step, weight)

        def end() -> None:
            self._end_cycle(True, variables, present)

        k = self._opt.accum_steps
        if k == 1:  # every micro-step is a whole cycle
            end()
            return
        # A micro-step counter at or past the cycle's length (after accum_steps was lowered)
        # ends the cycle too, as does the last step of fit's epoch.
        last = ops.logical_or(_cycle.ends_cycle(step + 1, k), epoch_last)
        switch_case(ops.cast(last, "int32"), [lambda: None, end], lowered=False)

    def _tick_epoch_clock(self) -> Any:
        """One step of fit's epoch clock (:func:`_cycle.epoch_countdown`: the steps left in
        the current epoch): whether this step is the epoch's last (a boolean tensor); the
        count moves on."""
        import tensorflow as tf

        # One read of the counter (the variable itself would be read at each use).
        last, after = _cycle.epoch_countdown(tf.convert_to_tensor(self._opt._steps_left.value))
        self._opt._steps_left.assign(after)
        return last

    def _fold_added(
        self, grads: list[Any], variables: list[Any], present: list[bool], step: Any, weight: Any
    ) -> None:
        """The fold of one micro-step as in-place adds onto a cycle that starts from zeros
        (TensorFlow, no strategy); ``step``: the micro-step counter before this one; ``weight``
        the micro-batch's weight."""
        options = self._opt._options
        if options.reduction == "running_mean":  # its fold rescales: the generic one
            self._stateful_fold(grads, variables, present, weight)
            return
        accs = [self._opt._accumulators[self._opt._get_variable_index(v)] for v in variables]
        weighted = options.reduction != "sum"
        w = ops.cast(weight, "float32") if weighted else 1.0
        minus_w = ops.negative(w) if weighted else None
        for acc, g in zip(accs, grads):
            if weighted:
                _axpy(acc, minus_w, g)
            else:
                _add_to(acc, g)
        if self._opt.mixed_precision:  # the flag is zero when a cycle starts here
            self._opt._nonfinite.assign(_cycle.nonfinite_after(self._opt._nonfinite.value, grads))
        mask = ops.convert_to_tensor(np.asarray(present, "float32"))
        with after(grads[:1]):
            if all(present):
                self._opt._seen.assign(mask)
            else:  # the flags are not zeroed between cycles: the first micro-step sets them
                first = ops.equal(step, 0)
                self._opt._seen.assign(
                    ops.where(first, mask, ops.maximum(self._opt._seen.value, mask))
                )
            _add_to(self._opt._total_weight, w)
            _add_to(self._opt._micro_step, 1)
            _add_to(self._opt._iterations, 1)

    # The accumulators are plain ``tf.Variable`` s, written through their handles.
    plain_variables = True

    def _after_cycle(self, boundary: Any) -> None:
        self._zero_accumulators(boundary, self.plain_variables)

    def _zero_accumulators(self, boundary: Any, plain: bool = True) -> None:
        """The accumulators back to zero where ``boundary`` holds (TensorFlow): every cycle
        starts from zeros, as :meth:`_apply_dense`'s fold needs. ``plain``: no strategy (the
        variables are written through their backing ``tf.Variable``)."""

        def zero() -> None:
            for acc in self._summing_accumulators():
                value = ops.zeros(acc.shape, "float32")
                if plain:
                    write(acc, value)
                else:
                    acc.assign(value)

        if boundary is True:
            zero()
        else:
            ops.cond(boundary, zero, lambda: None)

    def _summing_accumulators(self) -> list[Any]:
        """The accumulators that hold sums: not those of ``overwrite_with_gradient`` variables,
        which hold the cycle's running maximum (set afresh at a cycle's first gradient, read
        by the boundary and the flush after the cycle's end, see :meth:`overwrite_maxima`)."""
        return [
            acc
            for acc, v in zip(self._opt._accumulators, self._opt._trainable_variables)
            if not getattr(v, "overwrite_with_gradient", False)
        ]

    def zero_between_cycles(self, idle: bool = False) -> None:
        """The accumulators (and the cycle's total weight and non-finite flag) zeroed if no
        cycle is pending, as after a load of a file from another backend, whose folds
        overwrite at a cycle's first micro-step and leave the last cycle's sums behind:
        TensorFlow's fold adds onto them. ``idle``: no cycle is pending and the counters are
        zeroed already (``reset_cycle``): the accumulators only."""
        if not idle and int(to_numpy(self._opt._micro_step)) != 0:
            return
        self._zero_accumulators(True, plain=self.plain_variables)
        if not idle:
            self._opt._total_weight.assign(0.0)
            self._opt._nonfinite.assign(0.0)

    def set_epoch_clock(self, epoch_steps: int, steps_left: int) -> bool:
        """The step counts down the current epoch's steps only (``_cycle.epoch_countdown``);
        the fit's steps after it are kept here, and the epoch-end callback, finding the count
        run out, sets it again."""
        now = (steps_left - 1) % epoch_steps + 1 if steps_left > 0 and epoch_steps > 0 else 0
        self._clock_after = steps_left - now if now else 0
        write(self._opt._steps_left, now)
        return True

    def flush(self, present: list[bool], overwrites: bool) -> None:
        self._tf_flush(tuple(bool(p) for p in present))()

    def _tf_flush(self, present: tuple[bool, ...]) -> Any:
        """The TensorFlow flush's update as one ``tf.function``, cached per seen-flags pattern
        and setting like the JAX flush (run eagerly, op by op, it cost more per epoch end than
        the rest of a small epoch's overhead over Keras's own accumulation)."""
        import tensorflow as tf

        key = self._flush_key(present)
        cache = self._flush_cache
        if key not in cache:
            variables = self._opt._trainable_variables
            cache[key] = tf.function(
                lambda: self._end_cycle(tf.constant(True), variables, list(present))
            )
        return cache[key]
