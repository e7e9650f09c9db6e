"""The JAX shell of the Keras cycle: packed state, ``stateless_apply`` and its compiled flush.

The wrapper's variables are read back as values, matched by identity (its scalars and seen
flags unpacked from two vectors, the small accumulators sliced from one flat vector, see
``_packed``), folded and, at a boundary, ended as a cycle: the non-finite verdict in a
``lax.cond`` of its own, then the inner update in another (on a CPU, one per variable with its
slots: ``_jax_groups``), so non-boundary micro-steps compute the accumulate only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from gradient_accumulator.keras import _cycle, _jax_groups, _packed
from gradient_accumulator.keras._shell import Shell, accumulator_name


def _cond(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """``lax.cond`` under a trace; the branch itself where ``pred`` is already a value.

    A step run eagerly (``run_eagerly=True``) reaches here with concrete arrays, and a ``lax.cond``
    outside a trace compiles both branches on every call (its branches are new closures each
    step): about 0.2 s a step on a CPU for a small model, and long enough on a GPU that one
    eager test ran for minutes. Reading the predicate costs one device read instead.
    """
    if _cycle.traced(pred):
        return ops.cond(pred, true_fn, false_fn)
    return true_fn() if bool(pred) else false_fn()


def _value(x: Any) -> Any:
    return x.value if isinstance(x, keras.Variable) else x


class JaxShell(Shell):
    """JAX: the wrapper's scalars packed into two variables, the small accumulators into one
    (``_packed``); ``stateless_apply`` folds and ends a cycle on values, the stateful
    ``apply`` runs it on the variables' values and writes them back."""

    def __init__(self, opt: Any) -> None:
        super().__init__(opt)
        # The compiled flushes, per seen-flags pattern and setting (see _jax_flush).
        self._flush_cache: dict[tuple, Any] = {}

    def build(self, var_list: list[Any]) -> None:
        """The counters in one variable, the float scalars and seen flags in another, each
        reachable as a :class:`_packed.Slot` under its own name; the accumulators of the small
        variables (:func:`_packed.flat_members`) slices of one flat variable."""
        self._opt._ints = self._opt.add_variable(
            shape=(len(_packed.INTS),), dtype="int", initializer="zeros", name="counters"
        )
        self._opt._floats = self._opt.add_variable(
            shape=(len(_packed.FLOATS) + len(var_list),),
            dtype="float32",
            initializer=_packed.initial_floats(self._opt.initial_scale),
            name="cycle_state",
        )
        for i, name in enumerate(_packed.INTS):
            setattr(self._opt, f"_{name}", _packed.Slot(self._opt._ints, i, name))
        for i, name in enumerate(_packed.FLOATS):
            setattr(self._opt, f"_{name}", _packed.Slot(self._opt._floats, i, name))
        self._opt._seen = _packed.Slot(self._opt._floats, slice(len(_packed.FLOATS), None), "seen")
        members = _packed.flat_members(var_list)
        in_flat = dict(zip(members, self._flat_accumulators([var_list[i] for i in members])))
        self._opt._accumulators = [
            in_flat[i] if i in in_flat else self._accumulator(v) for i, v in enumerate(var_list)
        ]

    def _flat_accumulators(self, var_list: list[Any]) -> list[Any]:
        """The accumulators of ``var_list`` as slices of one float32 variable, each a
        :class:`_packed.Slot` with its variable's shape. No variable when ``var_list`` is
        empty."""
        self._opt._acc_flat = None
        if not var_list:
            return []
        sizes = [math.prod(v.shape) for v in var_list]
        self._opt._acc_flat = self._opt.add_variable(
            shape=(sum(sizes),), dtype="float32", initializer="zeros", name="small_accumulators"
        )
        slots, offset = [], 0
        for v, size in zip(var_list, sizes):
            index = slice(offset, offset + size)
            slots.append(
                _packed.Slot(self._opt._acc_flat, index, accumulator_name(v), tuple(v.shape))
            )
            offset += size
        return slots

    def micro_step(self, grads: list[Any], variables: list[Any], weight: Any) -> None:
        if weight is not None:
            self._opt._batch_weight.assign(weight)
        self._jax_stateful(grads)
        if weight is not None:
            self._opt._batch_weight.assign(1.0)
        if self._opt._drops_nonfinite() and self._eager():
            self._opt.report_nonfinite()

    def flush(self, present: list[bool], overwrites: bool) -> None:
        variables = self._opt._trainable_variables
        tv, values = self._jax_flush(tuple(bool(p) for p in present))(
            [v.value for v in self._opt.variables], [v.value for v in variables]
        )
        for var, value in zip(variables, tv):
            var.assign(value)
        for var, value in zip(self._opt.variables, values):
            var.assign(value)

    def counters(self) -> dict[str, int]:
        return dict(zip(_packed.INTS, np.asarray(self._opt._ints.value).tolist()))

    def set_epoch_clock(self, epoch_steps: int, steps_left: int) -> bool:
        """Both counters at once: EPOCH's two are adjacent in INTS."""
        self._opt._ints.assign(
            _packed.set_ints(
                self._opt._ints.value,
                self._opt._epoch_steps.index,
                np.array([epoch_steps, steps_left]),
            )
        )
        return True

    def _own(self, optimizer_variables: Sequence[Any]) -> dict[str, Any]:
        values = dict(zip([id(v) for v in self._opt.variables], optimizer_variables))
        own = _packed.unpack(values[id(self._opt._ints)], values[id(self._opt._floats)])
        own["iterations"] = values[id(self._opt._iterations)]
        # The accumulators in the flat variable are None here, read through _accs.
        own["accs"] = [
            None if isinstance(a, _packed.Slot) else values[id(a)] for a in self._opt._accumulators
        ]
        own["acc_flat"] = None if self._opt._acc_flat is None else values[id(self._opt._acc_flat)]
        return own

    def _acc(self, own: dict, i: int) -> Any:
        """Variable ``i``'s accumulator value, sliced from the flat one if it is there."""
        acc = own["accs"][i]
        return self._opt._accumulators[i].take(own["acc_flat"]) if acc is None else acc

    def _accs(self, own: dict) -> list[Any]:
        """Every variable's accumulator value, those in the flat variable sliced from it."""
        return [self._acc(own, i) for i in range(len(own["accs"]))]

    def _fold(self, own: dict, grads: list[Any], present: list[bool]) -> None:
        """:func:`_cycle.fold` into ``own``; the small accumulators as one flat vector, their
        gradients laid end to end (a concatenation XLA fuses into the fold, in place)."""
        fields = ("accs", "seen", "total_weight", "nonfinite", "micro_step", "iterations")
        loose = [i for i, acc in enumerate(own["accs"]) if acc is not None]
        members = [i for i, acc in enumerate(own["accs"]) if acc is None]
        accs = [own["accs"][i] for i in loose]
        fold_grads = [grads[i] for i in loose]
        if members:
            accs.append(own["acc_flat"])
            fold_grads.append(ops.concatenate([ops.reshape(grads[i], (-1,)) for i in members]))
        state = _cycle.fold(
            _cycle.FoldState(accs, *(own[k] for k in fields[1:])),
            fold_grads,
            own["batch_weight"],
            self._opt._options,
            present,
        )
        own.update(state._asdict())
        own["accs"] = [None] * len(present)
        for i, acc in zip(loose, state.accs):
            own["accs"][i] = acc
        if members:
            own["acc_flat"] = state.accs[-1]

    def _pack(self, optimizer_variables: Sequence[Any], own: dict, inner: Sequence[Any]) -> list:
        ints, floats = _packed.pack(own, self._opt._ints.dtype)
        by_id = {id(self._opt._ints): ints, id(self._opt._floats): floats}
        by_id[id(self._opt._iterations)] = own["iterations"]
        by_id.update(
            {id(a): v for a, v in zip(self._opt._accumulators, own["accs"]) if v is not None}
        )
        if self._opt._acc_flat is not None:
            by_id[id(self._opt._acc_flat)] = own["acc_flat"]
        out = [by_id.get(id(v), val) for v, val in zip(self._opt._variables, optimizer_variables)]
        return out + list(inner)

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Any
    ) -> tuple[list[Any], list[Any]]:
        """Functional ``apply``: returns new trainable and optimizer variable values.

        Non-boundary micro-steps compute the accumulate only: the update runs in one branch of
        a conditional (``lax.cond`` under JAX).
        """
        # Values, not Variables (LossScaleOptimizer passes its inner optimizer's variables,
        # inside a StatelessScope that maps them to values).
        optimizer_variables = [_value(v) for v in optimizer_variables]
        trainable_variables = [_value(v) for v in trainable_variables]
        n_own = len(self._opt._variables)
        own = self._own(optimizer_variables)
        inner_values = optimizer_variables[n_own:]
        self._opt._note_trace(next((g for g in grads if g is not None), None))
        overwrite = self.overwrite_maxima(
            grads, own["micro_step"], own["seen"], lambda i: self._acc(own, i)
        )
        present = [g is not None for g in grads]
        self._fold(own, _cycle.dense(grads, self._opt._trainable_variables), present)
        # The cycle ends after k micro-steps, or at the last step of fit's epoch (its clock).
        last, own["steps_left"] = _cycle.epoch_clock(own["epoch_steps"], own["steps_left"])
        boundary = ops.logical_or(_cycle.ends_cycle(own["micro_step"], self._opt.accum_steps), last)
        new_tv, own, new_inner = self._stateless_cycle_end(
            boundary, own, inner_values, trainable_variables, present
        )
        if overwrite:
            new_tv, own["accs"] = list(new_tv), list(own["accs"])
            for i, _, maximum in overwrite:
                write = ops.logical_and(boundary, ops.greater(own["seen"][i], 0.0))
                new_tv[i] = ops.where(
                    write, ops.cast(maximum, new_tv[i].dtype), trainable_variables[i]
                )
                if own["accs"][i] is not None:
                    own["accs"][i] = maximum
                else:
                    own["acc_flat"] = self._opt._accumulators[i].put(own["acc_flat"], maximum)
        return new_tv, self._pack(optimizer_variables, own, new_inner)

    def _stateless_cycle_end(
        self,
        boundary: Any,
        own: dict,
        inner_values: list,
        trainable_values: list,
        present: list[bool],
    ) -> tuple[list, dict, list]:
        """If ``boundary``: the cycle ends as :func:`_cycle.boundary` decides.

        Conditionals one after the other, not one inside the other: the verdict on the
        cycle's gradient (``boundary``'s own, which returns one scalar), then the inner
        optimizer's ``stateless_apply`` where the cycle updates (:meth:`_conditional_update`).
        A conditional whose untaken branch passes the optimizer's slots through costs a copy of
        each of them on every step once the update can be declined inside the taken one
        (XLA's copy insertion, with ``fit``'s donated state: benchmarks/README.md); the
        counters are scalars, selected.
        """
        if not _cycle.traced(boundary):  # run eagerly: known here
            if not bool(boundary):
                return list(trainable_values), own, list(inner_values)
            boundary = True
        fields = _cycle.CycleState._fields
        # Decided outside the conditional, where the seen flags may still be concrete.
        choice = _cycle.seen_choice(own["seen"], present)
        end = _cycle.boundary(
            _cycle.CycleState(*(own[k] for k in fields)),
            self._opt._options,
            at=boundary,
            # Checked whole: the flat variable is its members end to end, one reduction.
            accs=[a for a in own["accs"] if a is not None]
            + ([] if own["acc_flat"] is None else [own["acc_flat"]]),
            static_scale=self._opt._static_scale,
        )

        tv, inner = self._conditional_update(
            end.do_update, end.scale, own, inner_values, trainable_values, choice
        )
        own = dict(own)
        own.update(zip(fields, end.state))
        return tv, own, inner

    def _conditional_update(
        self,
        do_update: Any,
        scale: Any,
        own: dict,
        inner_values: list,
        trainable_values: list,
        choice: tuple,
    ) -> tuple[list, list]:
        """New trainable and inner values: the inner update if ``do_update``, else the old ones.

        One conditional, or under a JAX trace one per group of outputs that
        :func:`_jax_groups.write_groups` finds independent (a branch small enough for XLA's
        CPU runtime to run in the calling thread). The accumulators are sliced in the branch:
        no copy on a step that does not update.
        """
        n_tv = len(trainable_values)
        state = list(trainable_values) + list(inner_values)

        def update(accs: list, scale: Any, *state: Any) -> list:
            tv, inner = self._stateless_update(
                scale, accs, list(state[n_tv:]), list(state[:n_tv]), choice
            )
            return list(tv) + list(inner)

        groups, update = self._update_groups(do_update, update, own, scale, state, choice)
        if groups is None:
            groups = [list(range(len(state)))]
        new = list(state)
        for group in groups:

            def taken(group: list[int] = group) -> list:
                out = update(self._accs(own), scale, *state)
                return [out[i] for i in group]

            values = _cond(do_update, taken, lambda group=group: [state[i] for i in group])
            for i, value in zip(group, values):
                new[i] = value
        return new[:n_tv], new[n_tv:]

    def _update_groups(
        self, do_update: Any, update: Any, own: dict, scale: Any, state: list, choice: tuple
    ) -> tuple[list[list[int]] | None, Any]:
        """``(groups, update)``: the output groups for one conditional each (None: one for
        all), and ``update`` as the branches should call it (traced once; each calls it)."""
        if not _cycle.traced(do_update):
            return None, update
        import jax

        # XLA's CPU runtime only (on a GPU each conditional may cost a host read of its
        # predicate); a choice of variables decided on the device keeps the update whole, and
        # so does a model of more variables than groups allowed (its groups would be too many,
        # or one large group: nothing to gain from reading the jaxpr).
        if (
            jax.default_backend() != "cpu"
            or not isinstance(choice[0], bool)
            or len(self._opt._trainable_variables) > _jax_groups.MAX_GROUPS
        ):
            return None, update
        once = jax.jit(update)
        if not hasattr(once, "trace"):  # an older JAX: one conditional
            return None, update
        # Traced on the values themselves (their shardings included), so that the branches'
        # calls find this trace.
        accs = self._accs(own)
        jaxpr = once.trace(accs, scale, *state).jaxpr
        read = [*accs, *([] if scale is None else [scale])]
        groups = _jax_groups.write_groups(
            jaxpr,
            [int(np.prod(np.shape(a))) for a in read],
            [int(np.prod(np.shape(x))) for x in state],
        )
        return groups, once

    def _stateless_update(
        self,
        scale: Any,
        accs: list,
        inner_values: list,
        trainable_values: list,
        choice: tuple,
    ) -> tuple[list, list]:
        """The inner optimizer's ``stateless_apply`` with the cycle's gradient (the
        accumulators ``accs`` times ``scale``): new trainable and inner optimizer values."""
        grads = self.final_grads(accs, self._opt._trainable_variables, trainable_values, scale)

        def inner_update(keep: list[int]) -> tuple[list, list]:
            if not keep:
                return list(trainable_values), list(inner_values)
            kept = set(keep)
            with warnings.catch_warnings():
                # The inner optimizer drops a None gradient, as wanted, and warns.
                warnings.filterwarnings("ignore", message="Gradients do not exist")
                tv, inner = self._opt.optimizer.stateless_apply(
                    inner_values,
                    [g if i in kept else None for i, g in enumerate(grads)],
                    trainable_values,
                )
            return list(tv), list(inner)

        tv, inner = _cycle.on_choice(choice, inner_update)
        return list(tv), list(inner)

    def _jax_stateful(self, grads: list[Any]) -> None:
        tv, ov = self.stateless_apply(
            [v.value for v in self._opt.variables],
            grads,
            [v.value for v in self._opt._trainable_variables],
        )
        for var, value in zip(self._opt._trainable_variables, tv):
            var.assign(value)
        for var, value in zip(self._opt.variables, ov):
            var.assign(value)

    def _jax_flush(self, present: tuple[bool, ...]) -> Any:
        """The JAX flush's update as one compiled function, cached per seen-flags pattern and
        setting (run op by op, its conditional was compiled afresh at every flush: 1.7 s per
        epoch end for a two-layer MLP)."""
        import jax

        key = self._flush_key(present)
        cache = self._flush_cache
        if key not in cache:

            def flush(optimizer_values: list, trainable_values: list) -> tuple[list, list]:
                own = self._own(optimizer_values)
                inner_values = optimizer_values[len(self._opt._variables) :]
                tv, own, inner = self._stateless_cycle_end(
                    ops.convert_to_tensor(True), own, inner_values, trainable_values, list(present)
                )
                return list(tv), self._pack(optimizer_values, own, inner)

            cache[key] = jax.jit(flush)
        return cache[key]
