"""The adoption of a ``LossScaleOptimizer`` that wraps GradientAccumulateOptimizer: the loss is
scaled once, the cycle's gradient unscaled once, by the wrapper's own loss scaling.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import keras

from gradient_accumulator.keras import _packed


def adopt(opt: Any, lso: Any) -> None:
    """Make ``LossScaleOptimizer(opt)`` scale per cycle through the wrapper ``opt``.

    Left as it is, Keras's loss scaler would unscale every micro-batch's gradient, drop
    only the micro-batch that overflowed (the cycle would go on without it) and count its
    growth in micro-steps; with the wrapper's own ``mixed_precision`` on as well, the
    gradients would be unscaled twice. Instead the wrapper takes the loss scaling over
    (with the scaler's ``initial_scale`` and ``dynamic_growth_steps`` unless
    ``mixed_precision`` was set on the wrapper itself): the scaler's ``scale_loss``,
    ``apply`` and ``stateless_apply`` hand over to the wrapper's, so the loss is scaled
    once, the accumulated gradient unscaled once at the boundary, a non-finite micro-batch
    drops its whole cycle and the scale grows after ``dynamic_growth_steps`` good updates.
    The scaler's ``dynamic_scale`` and ``step_counter`` mirror the wrapper's loss scale and
    growth counter after each step.
    """
    opt._use_loss_scaling(lso.initial_scale, lso.dynamic_growth_steps)
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


# LossScaleOptimizer(GradientAccumulateOptimizer) after adoption (see adopt):
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
