"""The replica shell of the Keras cycle: TensorFlow under a ``tf.distribute`` strategy.

Each replica folds its micro-batch in place into replica-local accumulators (as
:class:`~gradient_accumulator.keras._tf_shell.TensorFlowShell` does into plain ones); the boundary
runs in the cross-replica context (``merge_call``), where the replicas' verdicts and, with
clipping, their accumulators are reduced once per cycle, or, where the strategy has no merge_call
(XLA on GPUs), with the verdicts summed in the replica context and the inner update counted after
its conditional.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from gradient_accumulator.keras import _cycle
from gradient_accumulator.keras._compat import applies_itself, apply_uncounted
from gradient_accumulator.keras._shell import accumulator_name
from gradient_accumulator.keras._tf_shell import StatefulShell, TensorFlowShell


def _no_merge_call() -> bool:
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def _summed_over_replicas(at: Any, verdict: Any) -> Any:
    """A boundary's ``agree`` under a strategy without merge_call: the replicas' verdicts
    summed, at the boundary only (no collective on the other micro-steps)."""
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    return ops.cond(
        at, lambda: ctx.all_reduce(tf.distribute.ReduceOp.SUM, verdict), lambda: verdict
    )


def _already_reduced(grads_and_vars: Any) -> list:
    """Stands in for a Keras optimizer's all-reduce of gradients that are reduced already."""
    return list(grads_and_vars)


class ReplicaShell(TensorFlowShell):
    """TensorFlow under a ``tf.distribute`` strategy: replica-local accumulators, each
    replica's fold in place, the boundary in the cross-replica context (``merge_call``) where
    the replicas' verdicts and, with clipping, their accumulators are reduced once per cycle."""

    takes_step_weight = False

    def __init__(self, opt: Any, strategy: Any) -> None:
        super().__init__(opt)
        self.strategy = strategy

    def _accumulator(self, variable: Any) -> Any:
        """Replica-local: each replica sums its own gradients; read (and saved) as the mean
        over replicas, which restores to every replica and so keeps the sum."""
        with keras.name_scope(self._opt.name, caller=self._opt):
            acc = keras.Variable(
                initializer="zeros",
                shape=variable.shape,
                dtype="float32",
                trainable=False,
                synchronization="on_read",
                aggregation="mean",
                name=accumulator_name(variable),
            )
        self._opt._track_variable(acc)
        return acc

    _apply_dense = StatefulShell._apply_dense
    scales_at_a_known_boundary = False
    # The per-micro-step flag is a first-replica variable, which would not see another
    # replica's NaN.
    checks_result = True
    plain_variables = False

    def set_epoch_clock(self, epoch_steps: int, steps_left: int) -> bool:
        return False

    def _merges(self) -> bool:
        return not _no_merge_call()

    def _agree(self, choice: tuple, variables: list[Any]) -> Any:
        """With merge_call the verdict is agreed, and the update run, in the cross-replica
        context; without, the replicas' verdicts are summed when the cycle is checked."""
        if self._merges():

            def agree(at: Any, verdict: Any) -> Any:
                return self._merged_boundary(at, verdict, choice, variables)

            return agree
        if _cycle.checks_nonfinite(self._opt._options):
            return _summed_over_replicas
        return None

    def _summed(self, accs: list[Any], reduced: Sequence[Any] | None) -> list[Any]:
        """With clipping (or AGC) the update needs the gradient summed over the replicas:
        ``reduced`` (summed in the cross-replica context), or an all-reduce here."""
        if not self._clips():
            return accs
        import tensorflow as tf

        if reduced is None:
            reduced = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, accs
            )
        return list(reduced)

    def _clips(self) -> bool:
        """Whether the boundary clips the cycle's gradient (AGC or the wrapper's own clipping)."""
        return bool(self._opt.use_agc) or any(
            c is not None
            for c in (self._opt.clipnorm, self._opt.clipvalue, self._opt.global_clipnorm)
        )

    def _apply_inner(self, grads: list[Any], variables: list[Any]) -> None:
        """The inner update in the replica context. Without merge_call it runs in a branch of
        the replica context: the inner optimizer's count moves after the conditional
        (:meth:`_count_inner_update`)."""
        apply = self._opt.optimizer.apply
        if _no_merge_call():
            apply = functools.partial(apply_uncounted, self._opt.optimizer)
        if not self._clips():
            apply(grads, variables)
            return
        # Every replica holds the same clipped gradient: the inner optimizer takes it as it is,
        # without summing it over the replicas a second time (Keras's TensorFlow optimizers
        # sum in ``_all_reduce_sum_gradients``; one without it gets 1/R of the gradient, summed
        # again).
        chain, opt = [], self._opt.optimizer
        while opt is not None and all(opt is not o for o in chain):
            chain.append(opt)
            opt = getattr(opt, "inner_optimizer", None)
        if not all(hasattr(o, "_all_reduce_sum_gradients") for o in chain):
            replicas = self.strategy.num_replicas_in_sync
            apply([g / replicas for g in grads], variables)
            return
        for opt in chain:
            vars(opt)["_all_reduce_sum_gradients"] = _already_reduced
        try:
            apply(grads, variables)
        finally:
            for opt in chain:
                vars(opt).pop("_all_reduce_sum_gradients", None)

    def _count_inner_update(self, do_update: Any, choice: tuple) -> None:
        """The inner optimizer's ``iterations += 1`` of an update run in a conditional's branch
        without merge_call (:func:`apply_uncounted`): once if the cycle updated any variable."""
        if applies_itself(self._opt.optimizer):
            return  # its own apply ran, and counted
        pred, if_true, if_false = choice
        if isinstance(pred, bool):
            some = bool(if_true if pred else if_false)
        else:
            some = ops.where(pred, bool(if_true), bool(if_false))
        counted = ops.logical_and(ops.convert_to_tensor(do_update), some)
        self._opt.optimizer.iterations.assign_add(
            ops.cast(counted, self._opt.optimizer.iterations.dtype)
        )

    def _merged_boundary(
        self, boundary: Any, verdict: Any, choice: tuple, variables: list[Any]
    ) -> Any:
        """The boundary's ``agree`` under a strategy with merge_call: the replicas' verdicts
        summed, and the update decided (:func:`_cycle.decide`) and run, in the cross-replica
        context; returns the summed verdict."""
        pred, if_true, if_false = choice
        import tensorflow as tf
        from tensorflow.python.distribute import device_util

        checks = _cycle.checks_nonfinite(self._opt._options)
        # With clipping (or AGC) the cycle's gradient is reduced over the replicas before the
        # inner update: each replica's accumulators go to the cross-replica context, which
        # sums them at the boundary (a collective in a replica's branch would need a
        # merge_call there, which fails across workers).
        clips = self._clips()
        local_accs = (
            [self._opt._accumulators[self._opt._get_variable_index(v)].value for v in variables]
            if clips
            else None
        )

        def cross_replica(
            distribution: Any, boundary: Any, local: Any, pred: Any, local_accs: Any
        ) -> Any:
            # The replicas' verdicts are summed here, in the cross-replica context (an
            # all-reduce inside a replica's conditional would need a merge_call there),
            # and only at the boundary: no collective on the other micro-steps.
            at_boundary = distribution.experimental_local_results(boundary)[0]
            total = ops.convert_to_tensor(0.0, "float32")
            if checks:
                total = ops.cond(
                    at_boundary,
                    lambda: distribution.reduce(tf.distribute.ReduceOp.SUM, local, axis=None),
                    lambda: total,
                )
            go, _ = _cycle.decide(at_boundary, total, self._opt._options)
            # The seen-flags choice is made here too, in the cross-replica context: an
            # inner update (which synchronises the replicas) cannot sit in a conditional
            # of a replica's.
            if isinstance(pred, bool):
                choices = [(go, if_true if pred else if_false)]
            else:
                first = distribution.experimental_local_results(pred)[0]
                choices = [
                    (ops.logical_and(go, first), if_true),
                    (ops.logical_and(go, ops.logical_not(first)), if_false),
                ]

            def update(keep: list[int]) -> None:
                reduced = None
                if clips and keep:
                    # One packed all-reduce of the kept accumulators, as Keras's step sends.
                    destination = device_util.current() or "/device:CPU:0"
                    reduced = distribution.extended.batch_reduce_to(
                        tf.distribute.ReduceOp.SUM,
                        [(local_accs[i], destination) for i in keep],
                    )
                distribution.extended.call_for_each_replica(
                    self._inner_update, args=(variables, keep, reduced)
                )

            for when, keep in choices:
                ops.cond(when, lambda keep=keep: update(keep), lambda: None)
            return total

        return tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(boundary, verdict, pred, local_accs)
        )

    def flush(self, present: list[bool], overwrites: bool) -> None:
        """The boundary in the strategy the accumulators were built under, even when flush()
        is called outside its scope: read there, replica-local accumulators would be averaged
        over the replicas, and the update would carry one replica's share of the gradient."""
        import tensorflow as tf

        strategy = self.strategy
        variables = self._opt._trainable_variables
        with strategy.scope():
            tf.function(
                lambda: strategy.run(self._end_cycle, args=(tf.constant(True), variables, present))
            )()
