"""Loss scaling and non-finite reporting of GradientAccumulateOptimizer, and the adoption of a
``LossScaleOptimizer`` that wraps it (the loss is scaled once, the cycle's gradient unscaled once).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from gradient_accumulator.keras import _cycle, _packed
from gradient_accumulator.keras._compat import loss_scale_optimizer_wrapping, to_numpy


class LossScaling:
    """Mixin of GradientAccumulateOptimizer: loss scale and non-finite cycles."""

    @property
    def loss_scale_factor(self) -> None:
        """Always None: a static factor belongs to the inner optimizer (taken over at
        construction), dynamic scaling to ``mixed_precision``."""
        return None

    @loss_scale_factor.setter
    def loss_scale_factor(self, value: Any) -> None:
        if value is not None:
            raise ValueError(
                "loss_scale_factor is not an argument of GradientAccumulateOptimizer: set it on "
                "the inner optimizer"
            )
        # keras.optimizers.LossScaleOptimizer(inner) ends its constructor by setting its inner
        # optimizer's loss_scale_factor to None; that is the one moment this wrapper learns it
        # is wrapped (Keras's compile does it under a mixed_float16 policy).
        # (The frames between are the attribute assignment's.)
        caller = loss_scale_optimizer_wrapping(self, skip=1)
        if caller is not None:
            self._adopt_loss_scaler(caller)

    def _use_loss_scaling(self, initial_scale: float, dynamic_growth_steps: int) -> None:
        """Switch on ``mixed_precision`` with these settings (a no-op if it is on already:
        the wrapper's own settings win)."""
        if self.mixed_precision:
            return
        self._set(
            mixed_precision=True,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=int(dynamic_growth_steps),
        )
        if self.built:
            self._loss_scale.assign(self.initial_scale)
            self._growth.assign(0)

    def _adopt_loss_scaler(self, lso: Any) -> None:
        """Make ``LossScaleOptimizer(self)`` scale per cycle through this wrapper.

        Left as it is, Keras's loss scaler would unscale every micro-batch's gradient, drop
        only the micro-batch that overflowed (the cycle would go on without it) and count its
        growth in micro-steps; with this wrapper's own ``mixed_precision`` on as well, the
        gradients would be unscaled twice. Instead the wrapper takes the loss scaling over
        (with the scaler's ``initial_scale`` and ``dynamic_growth_steps`` unless
        ``mixed_precision`` was set on the wrapper itself): the scaler's ``scale_loss``,
        ``apply`` and ``stateless_apply`` hand over to the wrapper's, so the loss is scaled
        once, the accumulated gradient unscaled once at the boundary, a non-finite micro-batch
        drops its whole cycle and the scale grows after ``dynamic_growth_steps`` good updates.
        The scaler's ``dynamic_scale`` and ``step_counter`` mirror the wrapper's loss scale and
        growth counter after each step.
        """
        self._use_loss_scaling(lso.initial_scale, lso.dynamic_growth_steps)
        # Instance attributes (not tracked by Keras, not saved): a config round trip rebuilds
        # LossScaleOptimizer(wrapper), which adopts again.
        for name, function in (
            ("scale_loss", _adopted_scale_loss),
            ("apply", _adopted_apply),
            ("stateless_apply", _adopted_stateless_apply),
            ("save_own_variables", _adopted_save_own_variables),
            ("load_own_variables", _adopted_load_own_variables),
        ):
            vars(lso)[name] = types.MethodType(function, lso)

    def scale_loss(self, loss: Any) -> Any:
        """Multiply the loss by the current loss scale (and the inner static factor, if any)."""
        factor = 1.0 if self._static_scale is None else float(self._static_scale)
        if self.mixed_precision:
            scale = self._loss_scale.value if self.built else self.initial_scale
            return ops.multiply(loss, ops.cast(scale, "float32") * factor)
        return loss if factor == 1.0 else ops.multiply(loss, factor)

    @property
    def loss_scale(self) -> Any:
        """The current dynamic loss scale (1.0 without ``mixed_precision``): its variable (on
        JAX, where the scalars are packed, its current value)."""
        if not self.mixed_precision:
            return 1.0
        if not self.built:
            return self.initial_scale
        scale = self._loss_scale
        return scale.value if isinstance(scale, _packed.Slot) else scale

    @property
    def nonfinite_skipped(self) -> int:
        """Cycles dropped so far because their averaged gradient held NaN or Inf.

        Counts the drops made under ``on_nonfinite="skip"`` or ``"raise"``, not the loss
        scaler's skips under ``mixed_precision``.
        """
        return int(to_numpy(self._skipped)) if self.built else 0

    @property
    def drops_nonfinite(self) -> bool:
        """Whether ``on_nonfinite`` decides about a non-finite cycle (the loss scaler does not)."""
        return self._drops_nonfinite()

    def _drops_nonfinite(self) -> bool:
        """Whether ``on_nonfinite`` decides about a non-finite cycle (the loss scaler does not)."""
        return _cycle.drops_nonfinite(self._options)

    def report_nonfinite(self, skipped: int | None = None) -> int:
        """Warn, or raise, for the non-finite cycles dropped since the last report.

        Eager ``apply`` and :meth:`flush` report by themselves; a compiled step cannot, so
        :class:`FlushAccumulation` calls this at the end of each epoch of ``fit`` (and before
        every batch with ``on_nonfinite="raise"``).

        Args:
            skipped: the current :attr:`nonfinite_skipped`, when the caller has read it
                (under JAX ``fit`` the callback reads it from the trainer's state).

        Returns:
            The number of cycles dropped since the last report.

        Raises:
            NonFiniteGradientError: with ``on_nonfinite="raise"``, if a cycle was dropped.
        """
        if not self.built or not self._drops_nonfinite():
            return 0
        count = self.nonfinite_skipped if skipped is None else int(skipped)
        new, self._reported_skips = count - self._reported_skips, count
        if new <= 0:
            return 0
        if self.on_nonfinite == "raise":
            self._nonfinite_counter.raise_error()
        for _ in range(new):
            self._nonfinite_counter.record_skip(stacklevel=None)  # at the user's call
        return new


# LossScaleOptimizer(GradientAccumulateOptimizer) after adoption (see _adopt_loss_scaler):
# ``self`` is the LossScaleOptimizer, its inner optimizer the wrapper that scales per cycle.


def _adopted_scale_loss(self: Any, loss: Any) -> Any:
    return self.inner_optimizer.scale_loss(loss)


def _adopted_apply(
    self: Any, grads: Any, trainable_variables: Any = None, weight: Any = None
) -> None:
    if not self.built:
        with keras.name_scope(self.name, caller=self):
            self.build(trainable_variables)
        self.built = True
    inner = self.inner_optimizer
    inner.apply(grads, trainable_variables, weight=weight)
    self.dynamic_scale.assign(inner.counter("loss_scale").value)
    self.step_counter.assign(inner.counter("growth").value)


def _adopted_stateless_apply(
    self: Any, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Any
) -> tuple[list[Any], list[Any]]:
    if not self.built:
        raise ValueError(
            "LossScaleOptimizer must be built before stateless_apply: call "
            "build(trainable_variables)"
        )
    inner = self.inner_optimizer
    n_own = len(self._variables)
    tv, new_inner = inner.stateless_apply(
        list(optimizer_variables)[n_own:], grads, trainable_variables
    )
    new_inner = list(new_inner)
    sources = {id(self.dynamic_scale): "loss_scale", id(self.step_counter): "growth"}
    mirrored = {
        key: _packed.read(new_inner, _packed.locate(inner.variables, inner.counter(name)))
        for key, name in sources.items()
    }
    own = [
        mirrored.get(id(v), value)
        for v, value in zip(self._variables, list(optimizer_variables)[:n_own])
    ]
    return tv, own + new_inner


def _adopted_saved_entries(self: Any) -> list[Any]:
    # The scaler's variables, then the wrapper's in its one layout (see _packed).
    return list(self._variables) + _packed.saved_entries(self.inner_optimizer)


def _adopted_save_own_variables(self: Any, store: Any) -> None:
    _packed.save(_adopted_saved_entries(self), store)


def _adopted_load_own_variables(self: Any, store: Any) -> None:
    _packed.load(_adopted_saved_entries(self), store, self.name)
    self.inner_optimizer._zero_between_cycles()
