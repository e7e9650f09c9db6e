"""GradientAccumulateOptimizer: any Keras 3 optimizer stepping once per k micro-batches, exactly.

Three code paths share one arithmetic: a functional one for JAX (``stateless_apply`` with
``lax.cond``, so non-boundary micro-steps do the accumulate and nothing else), a stateful one in
backend ops for TensorFlow (compiled by ``tf.function``, replica-local accumulators under
``tf.distribute``) and eager PyTorch, and the C++ core on the PyTorch backend (one accumulate pass
per micro-step, one fused apply per cycle).
"""

from __future__ import annotations

import copy
import re
import types
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src.utils.tracking import no_automatic_dependency_tracking

from gradient_accumulator import _validation
from gradient_accumulator._options import Options, check_agc_exclude, keras_reduction
from gradient_accumulator.keras import _cycle
from gradient_accumulator.keras._compat import (
    after,
    loss_scale_optimizer_wrapping,
    to_numpy,
    warn_deprecated,
)
from gradient_accumulator.keras.agc import clip_one
from gradient_accumulator.nonfinite import NonFiniteCounter

__all__ = ["GradientAccumulateOptimizer"]

_BACKEND = keras.backend.backend()
_FORBIDDEN_ON_WRAPPER = (
    "weight_decay",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
    "learning_rate",
)
# Base-optimizer arguments at their defaults, as older configs of the wrapper hold them.
_BASE_DEFAULTS = {
    "weight_decay": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
_IGNORED_FROM_0_5 = {
    "lr": "it has no effect; set learning_rate on the inner optimizer",
    "decay": "it has no effect; give the inner optimizer a "
    "keras.optimizers.schedules.LearningRateSchedule as learning_rate",
}
# Own scalar state, in the order the variables are created (after the base class's iteration
# counter and learning-rate variable): the JAX path reads them back by position. ``skipped``
# counts the cycles dropped as non-finite under ``on_nonfinite`` (not the loss scaler's skips).
_SCALARS = (
    "micro_step",
    "total_weight",
    "nonfinite",
    "batch_weight",
    "loss_scale",
    "growth",
    "skipped",
)
_INT_SCALARS = ("micro_step", "growth", "skipped")
# Settings held by the options record (properties, checked on assignment).
_SETTINGS = (
    "accum_steps",
    "reduction",
    "use_agc",
    "clip_factor",
    "eps",
    "leftover",
    "on_nonfinite",
    "mixed_precision",
    "initial_scale",
    "dynamic_growth_steps",
)


def _resolve_inner(optimizer: Any) -> Any:
    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as e:
            raise ValueError(f"optimizer {optimizer!r} is not a Keras optimizer: {e}") from e
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "optimizer must be a keras.optimizers.Optimizer, its name or its config, got "
            f"{type(optimizer).__name__}"
        )
    return optimizer


def _no_merge_call() -> bool:
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def _strategy() -> Any:
    """The active tf.distribute strategy (any number of replicas), or None for the default one.

    A one-replica ``MirroredStrategy`` still runs the step in a replica context whose
    optimizer updates go through ``merge_call``, so it takes the distributed path too.
    """
    if _BACKEND != "tensorflow":
        return None
    import tensorflow as tf

    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


@keras.saving.register_keras_serializable(package="gradient-accumulator")
class GradientAccumulateOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer so that it updates once every ``accum_steps`` micro-batches.

    Each ``apply()`` folds the micro-batch's gradients into float32 accumulators (whatever the
    variables' dtype); the ``accum_steps``-th call hands the averaged gradient to the inner
    optimizer, once. The inner optimizer never sees the skipped micro-steps, so its moments,
    its ``iterations`` (bias correction) and its learning-rate schedule count real updates, and
    ``k`` micro-batches of ``b`` give the weights of one batch of ``k·b`` for any optimizer.
    Accumulators and counters are optimizer variables: they are saved with the model, so a run
    saved in the middle of a cycle resumes exactly.

    On the PyTorch backend the accumulate, the unscale and AGC and, for ``SGD`` (no momentum),
    the whole update run in the package's C++ core (any other optimizer, Adam and AdamW
    included, updates with Keras's own code, bit-identical to the plain optimizer); on
    TensorFlow and JAX in backend ops that
    ``tf.function``/XLA compile. Under a ``tf.distribute`` strategy every replica accumulates its
    own gradients and they are all-reduced once per cycle, at the boundary.

    Args:
        optimizer: the inner optimizer: an instance, a name (``"SGD"``, ``"adam"``) or a config.
            A ``LossScaleOptimizer`` is unwrapped and its scaling taken over; so is the
            scaling of a ``LossScaleOptimizer`` that wraps this wrapper (``compile`` adds one
            under a ``"mixed_float16"`` policy): the loss is scaled once, the accumulated
            gradient unscaled once per cycle.
        accum_steps: micro-batches per update, an int ≥ 1.
        reduction: ``"MEAN"`` (the weighted mean of the micro-batch gradients; exact for
            micro-batches of equal size, and for unequal ones in ``fit``, which weights each by
            its number of samples, or in a custom loop that passes
            ``apply(..., weight=batch_size)``),
            ``"SUM"`` (their plain sum) or ``"RUNNING_MEAN"`` (the accumulator always holds the
            mean so far: same result as MEAN, no growth of the accumulated values).
        name: the optimizer's name.
        mixed_precision: dynamic loss scaling (as ``LossScaleOptimizer``) at cycle level:
            ``scale_loss`` multiplies the loss by the scale, gradients are accumulated scaled and
            unscaled once at the boundary; a cycle with a non-finite gradient skips the update,
            resets the accumulators and halves the scale; after ``dynamic_growth_steps`` good
            updates the scale doubles.
        use_agc: adaptive gradient clipping (NFNets) of the accumulated, averaged gradient.
        clip_factor: AGC's λ.
        eps: AGC's ε, the floor of a unit's weight norm.
        agc_exclude: variables left unclipped by AGC: ``"final"`` (default) excludes the last
            trainable variable of rank ≥ 2 and the rank ≤ 1 variables after it (the final
            classifier, as in the NFNets paper); ``None`` or ``()`` clips everything; otherwise
            an iterable of variables, layers (all their weights) or regular expressions matched
            against variable paths.
        leftover: what :meth:`flush` (called at the end of each epoch of ``fit``, on any model,
            by the :class:`FlushAccumulation` callback that ``fit`` adds) does with a cycle cut
            short by the end of the data: ``"apply"`` it with its true weight (an update, which
            ``iterations`` counts), or ``"carry"`` it into the next epoch.
        initial_scale: first loss scale when ``mixed_precision``.
        dynamic_growth_steps: good updates between doublings of the loss scale.
        on_nonfinite: what a cycle whose averaged gradient holds NaN or Inf does (without
            ``mixed_precision``, whose loss scaler skips such cycles silently): ``"skip"``
            (default) drops it — no update, the inner optimizer's ``iterations`` and state
            unchanged, the next micro-batch starts a fresh cycle — and warns with
            :class:`~gradient_accumulator.nonfinite.NonFiniteGradientWarning` on the 1st, 2nd,
            4th, … dropped cycle; ``"raise"`` drops it and raises
            :class:`~gradient_accumulator.nonfinite.NonFiniteGradientError`; ``"apply"`` applies
            it as computed. Inside a compiled step the warning or error comes when control is
            back in Python: in ``fit`` (through :class:`FlushAccumulation`) at the end of the
            epoch with ``"skip"`` and before the next batch with ``"raise"``, in :meth:`flush`,
            or from :meth:`report_nonfinite`.
        use_core: run accumulate/apply through the C++ core (PyTorch backend only). ``None``:
            whenever the backend is PyTorch and the core is importable.
        **kwargs: ``clipnorm``, ``clipvalue`` or ``global_clipnorm``, applied to the
            accumulated gradient at the boundary (not per micro-batch). Learning rate, weight
            decay, EMA and loss-scale factors belong to the inner optimizer. 0.5's ``lr`` and
            ``decay``, which it ignored, warn with ``DeprecationWarning``.

    The settings (``accum_steps``, ``reduction``, ``use_agc``, ``clip_factor``, ``eps``,
    ``leftover``, ``on_nonfinite``, the loss-scaling ones) may be assigned between cycles: they
    are checked as the constructor's arguments (a bad value raises and changes nothing), and the
    next ``fit`` traces its compiled step again when one it holds has changed. A step compiled
    outside ``fit`` must be traced again by its owner.

    Example:
        >>> import numpy as np, keras
        >>> from gradient_accumulator.keras import GradientAccumulateOptimizer
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> opt = GradientAccumulateOptimizer(keras.optimizers.Adam(1e-3), accum_steps=4)
        >>> model.compile(optimizer=opt, loss="mse")
        >>> x, y = np.ones((32, 3), "float32"), np.zeros((32, 1), "float32")
        >>> _ = model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
        >>> int(opt.iterations)  # 8 micro-batches, 2 updates
        2
    """

    def __init__(
        self,
        optimizer: Any = "SGD",
        accum_steps: int = 1,
        reduction: str = "MEAN",
        name: str = "GradientAccumulateOptimizer",
        *,
        mixed_precision: bool = False,
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        agc_exclude: Any = "final",
        leftover: str = "apply",
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        use_core: bool | None = None,
        on_nonfinite: str = "skip",
        **kwargs: Any,
    ) -> None:
        # 0.5 accepted these (Keras 2's OptimizerV2 arguments) and ignored them.
        for key, instead in _IGNORED_FROM_0_5.items():
            if key in kwargs:
                kwargs.pop(key)
                warn_deprecated(f"GradientAccumulateOptimizer({key}=...)", instead)
        for key in _FORBIDDEN_ON_WRAPPER:
            if kwargs.get(key) not in (None, False):
                raise ValueError(
                    f"{key} is not an argument of GradientAccumulateOptimizer: set it on the inner "
                    "optimizer (accumulation is set with accum_steps on the wrapper)"
                )
            kwargs.pop(key, None)
        inner = _resolve_inner(optimizer)
        if isinstance(inner, GradientAccumulateOptimizer) or isinstance(
            getattr(inner, "inner_optimizer", None), GradientAccumulateOptimizer
        ):
            raise TypeError("optimizer is already a GradientAccumulateOptimizer")
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            mixed_precision = True
            initial_scale = float(inner.initial_scale)
            dynamic_growth_steps = int(inner.dynamic_growth_steps)
            inner = inner.inner_optimizer
        if inner.gradient_accumulation_steps:
            raise ValueError(
                "the inner optimizer has gradient_accumulation_steps set; accumulate with the "
                "wrapper's accum_steps only"
            )
        options = Options(
            accum_steps=accum_steps,
            reduction=reduction,
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
            leftover=leftover,
            on_nonfinite=on_nonfinite,
            mixed_precision=mixed_precision,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
        )
        if use_core is not None:
            use_core = _validation.check_bool(use_core, "use_core")
            if use_core and _BACKEND != "torch":
                raise ValueError(
                    f"use_core=True needs the torch backend; this Keras runs on {_BACKEND}"
                )
        agc_exclude = check_agc_exclude(agc_exclude)

        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.optimizer = inner
        self._options = options
        # The settings a compiled step was traced with (see _retrace_if_changed).
        self._traced_options: Options | None = None
        self.agc_exclude = agc_exclude
        self.use_core = use_core
        self._nonfinite_counter = NonFiniteCounter("GradientAccumulateOptimizer")
        self._reported_skips = 0
        # The inner optimizer's static loss-scale factor is taken over: scale_loss() is ours.
        self._static_scale = inner.loss_scale_factor
        inner.loss_scale_factor = None
        self._core_engine = None  # the PyTorch backend's eager path, built at first use
        self._build_strategy = None  # the tf.distribute strategy of build(), if any

    # ------------------------------------------------------------------------------- settings

    def _set(self, **changes: Any) -> None:
        """Replace settings through the options record: checked together, all or nothing."""
        self._options = self._options.replace(**changes)

    def _retrace_if_changed(self, model: Any) -> bool:
        """Drop ``model``'s compiled train step if a setting it holds as a constant changed
        since it was traced (``fit`` calls this before it makes its step). Returns whether it
        did."""
        if self._traced_options is None or self._traced_options == self._options:
            return False
        self._traced_options = None
        if getattr(model, "train_function", None) is not None:
            model.train_function = None
        return True

    def _note_trace(self, value: Any) -> None:
        """Remember the settings a traced step bakes in (``value``: a tensor of the call)."""
        if _cycle.traced(value):
            self._traced_options = self._options

    @property
    def accum_steps(self) -> Any:
        """Micro-batches per update (may change between cycles)."""
        return self._options.accum_steps

    @accum_steps.setter
    def accum_steps(self, value: Any) -> None:
        self._set(accum_steps=value)

    @property
    def use_agc(self) -> Any:
        """Adaptive gradient clipping of the accumulated gradient at the boundary."""
        return self._options.use_agc

    @use_agc.setter
    def use_agc(self, value: Any) -> None:
        self._set(use_agc=value)

    @property
    def clip_factor(self) -> Any:
        """AGC's λ."""
        return self._options.clip_factor

    @clip_factor.setter
    def clip_factor(self, value: Any) -> None:
        self._set(clip_factor=value)

    @property
    def eps(self) -> Any:
        """AGC's ε, the floor of a unit's weight norm."""
        return self._options.eps

    @eps.setter
    def eps(self, value: Any) -> None:
        self._set(eps=value)

    @property
    def leftover(self) -> Any:
        """What :meth:`flush` does with a short cycle: ``"apply"`` or ``"carry"``."""
        return self._options.leftover

    @leftover.setter
    def leftover(self, value: Any) -> None:
        self._set(leftover=value)

    @property
    def on_nonfinite(self) -> Any:
        """What a non-finite cycle does: ``"skip"``, ``"raise"`` or ``"apply"``."""
        return self._options.on_nonfinite

    @on_nonfinite.setter
    def on_nonfinite(self, value: Any) -> None:
        self._set(on_nonfinite=value)

    @property
    def mixed_precision(self) -> Any:
        """Dynamic loss scaling at cycle level."""
        return self._options.mixed_precision

    @mixed_precision.setter
    def mixed_precision(self, value: Any) -> None:
        self._set(mixed_precision=value)

    @property
    def initial_scale(self) -> Any:
        """The first loss scale under ``mixed_precision``."""
        return self._options.initial_scale

    @initial_scale.setter
    def initial_scale(self, value: Any) -> None:
        self._set(initial_scale=value)

    @property
    def dynamic_growth_steps(self) -> Any:
        """Good updates between doublings of the loss scale."""
        return self._options.dynamic_growth_steps

    @dynamic_growth_steps.setter
    def dynamic_growth_steps(self, value: Any) -> None:
        self._set(dynamic_growth_steps=value)

    @property
    def reduction(self) -> str:
        """``"MEAN"``, ``"SUM"`` or ``"RUNNING_MEAN"`` (assigned in any letter case)."""
        return keras_reduction(self._options.reduction)

    @reduction.setter
    def reduction(self, value: Any) -> None:
        self._set(reduction=value)

    # ----------------------------------------------------------------------------- properties

    @property
    def inner_optimizer(self) -> Any:
        """The wrapped optimizer (also ``optimizer``)."""
        return self.optimizer

    @property
    def iterations(self) -> Any:
        """Updates made by the inner optimizer (not micro-steps)."""
        return self.optimizer.iterations

    @property
    def micro_steps(self) -> Any:
        """Micro-batches seen so far (calls of ``apply``)."""
        return self._iterations

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's current learning rate; settable (callbacks set it)."""
        return self.optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.optimizer.learning_rate = learning_rate

    @property
    def variables(self) -> list[Any]:
        """The wrapper's state (counters, loss scale, accumulators), then the inner one's."""
        return self._variables[:] + self.optimizer.variables

    @property
    def accumulators(self) -> list[Any]:
        """The float32 gradient accumulators, one per trainable variable."""
        return list(self._accumulators)

    def __getattr__(self, name: str) -> Any:
        # 0.5's name of the accumulators. Resolved here rather than as a property so that
        # Keras's saving, which reads every attribute dir() lists, does not trigger the warning.
        if name == "gradients":
            warn_deprecated("GradientAccumulateOptimizer.gradients", "use accumulators")
            return self.accumulators
        getter = getattr(super(), "__getattr__", None)
        if getter is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getter(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTINGS:
            # Through the property's checks, whatever Keras's attribute tracking does.
            getattr(type(self), name).fset(self, value)
            return
        if name == "loss_scale_factor":
            # Straight to the property (TensorFlow's attribute tracking skips an assignment of
            # the value an attribute already has, None here).
            type(self).loss_scale_factor.fset(self, value)
            return
        super().__setattr__(name, value)

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
        ):
            vars(lso)[name] = types.MethodType(function, lso)

    def scale_loss(self, loss: Any) -> Any:
        """Multiply the loss by the current loss scale (and the inner static factor, if any)."""
        factor = 1.0 if self._static_scale is None else float(self._static_scale)
        if self.mixed_precision:
            scale = self._loss_scale if self.built else self.initial_scale
            return ops.multiply(loss, ops.cast(scale, "float32") * factor)
        return loss if factor == 1.0 else ops.multiply(loss, factor)

    @property
    def loss_scale(self) -> Any:
        """The current dynamic loss scale (1.0 without ``mixed_precision``)."""
        if not self.mixed_precision:
            return 1.0
        return self._loss_scale if self.built else self.initial_scale

    @property
    def nonfinite_skipped(self) -> int:
        """Cycles dropped so far because their averaged gradient held NaN or Inf.

        Counts the drops made under ``on_nonfinite="skip"`` or ``"raise"``, not the loss
        scaler's skips under ``mixed_precision``.
        """
        return int(to_numpy(self._skipped)) if self.built else 0

    def counter(self, name: str) -> Any:
        """One of the variables the cycle lives in, by name: ``"micro_step"``,
        ``"total_weight"``, ``"nonfinite"``, ``"batch_weight"`` (the coming micro-batch's weight,
        which :class:`GradientAccumulateModel` writes before each train step), ``"loss_scale"``,
        ``"growth"`` or ``"skipped"``. Built optimizers only."""
        if name not in _SCALARS:
            raise ValueError(f"name must be one of {_SCALARS}, got {name!r}")
        if not self.built:
            raise ValueError("the optimizer is not built yet (call build() or apply() first)")
        return getattr(self, f"_{name}")

    def reset_cycle(self) -> None:
        """Discard the pending micro-batches: the next one starts a new cycle."""
        if self.built:
            self._micro_step.assign(0)
            self._total_weight.assign(0.0)
            self._nonfinite.assign(0.0)

    @property
    def drops_nonfinite(self) -> bool:
        """Whether ``on_nonfinite`` decides about a non-finite cycle (the loss scaler does not)."""
        return self._drops_nonfinite()

    def _drops_nonfinite(self) -> bool:
        """Whether ``on_nonfinite`` decides about a non-finite cycle (the loss scaler does not)."""
        return not self.mixed_precision and self.on_nonfinite != "apply"

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

    def _eager(self) -> bool:
        """True when this call runs in Python on concrete values (not traced or compiled)."""
        return not _cycle.traced(self._skipped.value)

    # -------------------------------------------------------------------------------- build

    def build(self, var_list: Sequence[Any]) -> None:
        """Create the accumulators and counters, then build the inner optimizer."""
        if self.built:
            return
        var_list = list(var_list)
        self._build_own(var_list)
        # The inner optimizer builds with attribute tracking on, as it would alone: state kept
        # in plain attributes (Nadam's ``_u_product``) must be among its variables, or it is
        # neither updated statelessly (JAX) nor saved.
        self.optimizer.build(var_list)
        self._finish_build(var_list)

    @no_automatic_dependency_tracking
    def _finish_build(self, var_list: list[Any]) -> None:
        super().build(var_list)
        self._agc_mask = self._resolve_agc_mask(var_list)

    @no_automatic_dependency_tracking
    def _build_own(self, var_list: list[Any]) -> None:
        """Counters, loss scale and one float32 accumulator per variable."""
        initial = {"batch_weight": 1.0, "loss_scale": self.initial_scale}
        for name in _SCALARS:
            int_like = name in _INT_SCALARS
            setattr(
                self,
                f"_{name}",
                self.add_variable(
                    shape=(),
                    dtype="int" if int_like else "float32",
                    initializer=keras.initializers.Constant(initial.get(name, 0.0)),
                    aggregation="only_first_replica",
                    name=name,
                ),
            )
        strategy = _strategy()
        self._build_strategy = strategy
        self._accumulators = []
        for v in var_list:
            path = getattr(v, "path", v.name).replace("/", "_")
            if strategy is None:
                # Laid out like its variable under a Keras distribution (a sharded kernel gets
                # a sharded accumulator): the paths of a LayoutMap do not match ours.
                acc = self.add_variable(
                    shape=v.shape,
                    dtype="float32",
                    layout=getattr(v, "_layout", None),
                    name=f"{path}_accumulator",
                )
            else:
                # Replica-local: each replica sums its own gradients; read (and saved) as the
                # mean over replicas, which restores to every replica and so keeps the sum.
                with keras.name_scope(self.name, caller=self):
                    acc = keras.Variable(
                        initializer="zeros",
                        shape=v.shape,
                        dtype="float32",
                        trainable=False,
                        synchronization="on_read",
                        aggregation="mean",
                        name=f"{path}_accumulator",
                    )
                self._track_variable(acc)
            self._accumulators.append(acc)
        # 1.0 for each variable that had a gradient in the current cycle: one without any is
        # left alone at the boundary, as plain Keras leaves a variable whose gradient is None.
        self._seen = self.add_variable(
            shape=(len(var_list),),
            dtype="float32",
            initializer="zeros",
            aggregation="only_first_replica",
            name="seen",
        )

    def _resolve_agc_mask(self, var_list: list[Any]) -> list[bool]:
        """True for each variable AGC clips."""
        if not self.use_agc:
            return [False] * len(var_list)
        exclude = self.agc_exclude
        if exclude is None:
            return [True] * len(var_list)
        if exclude == "final":
            mask = [True] * len(var_list)
            last = max((i for i, v in enumerate(var_list) if len(v.shape) >= 2), default=None)
            if last is not None:
                for i in range(last, len(var_list)):
                    if i == last or len(var_list[i].shape) <= 1:
                        mask[i] = False
            return mask
        ids, patterns = set(), []
        for item in exclude:
            if isinstance(item, str):
                patterns.append(re.compile(item))
            elif isinstance(item, keras.layers.Layer):
                ids.update(id(w) for w in item.weights)
            else:
                ids.add(id(item))
        return [
            not (id(v) in ids or any(p.search(getattr(v, "path", v.name)) for p in patterns))
            for v in var_list
        ]

    # -------------------------------------------------------------------- shared arithmetic

    def _grad_scale(self, total_weight: Any, loss_scale: Any) -> Any:
        return _cycle.grad_scale(total_weight, loss_scale, self._options, self._static_scale)

    def _final_grads(
        self, accs: list[Any], variables: list[Any], params: list[Any], scale: Any
    ) -> list[Any]:
        """Averaged, unscaled, clipped gradients in the variables' dtypes.

        ``params`` are the variables' current values (traced values on the functional path).
        """
        grads = [a * scale for a in accs]
        if self.use_agc:
            index = [self._get_variable_index(v) for v in variables]
            grads = [
                clip_one(p, g, self.clip_factor, self.eps) if self._agc_mask[i] else g
                for p, g, i in zip(params, grads, index)
            ]
        grads = self._clip_gradients(grads)
        return [ops.cast(g, v.dtype) for g, v in zip(grads, variables)]

    # ---------------------------------------------------------------------------- apply

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[Any] | None = None,
        weight: Any = None,
    ) -> None:
        """Fold one micro-batch of gradients in; update through the inner optimizer at the boundary.

        Args:
            grads: one gradient per variable; None for a variable without one (it counts as
                zero in the cycle's mean, and a variable without any in the whole cycle is not
                updated).
            trainable_variables: the variables; on the first call they build the optimizer.
                Later calls may pass a subset of them: the others have no gradient this time.
            weight: the micro-batch's weight in the cycle's mean (``reduction="MEAN"`` or
                ``"RUNNING_MEAN"``), as the PyTorch wrapper's ``step(weight=...)``: its number
                of samples when the loss is a per-batch mean, so that a short last batch counts
                as much as it should. A number ≥ 0 or a scalar tensor. ``None``: the value in
                ``counter("batch_weight")`` (1, or the batch size ``fit`` writes there before
                each step, with either wrapper). A given weight
                counts for this call only.
        """
        if weight is not None:
            weight = self._check_weight(weight)
        if trainable_variables is None:
            if not self.built:
                raise ValueError("call build(trainable_variables) or pass trainable_variables")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        grads = list(grads)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"grads and trainable_variables differ in length: {len(grads)} vs "
                f"{len(trainable_variables)}"
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        self._check_variables_are_known(trainable_variables)
        if [id(v) for v in trainable_variables] != [id(v) for v in self._trainable_variables]:
            # A variable left out of the call has no gradient in this micro-step.
            by_id = {id(v): g for g, v in zip(grads, trainable_variables)}
            trainable_variables = self._trainable_variables
            grads = [by_id.get(id(v)) for v in trainable_variables]
        self._note_trace(next((g for g in grads if g is not None), None))
        if weight is not None:
            self._batch_weight.assign(weight)
        overwrite = self._overwrite_maxima(grads, self._micro_step, self._seen.value)
        core_path = _BACKEND == "torch" and not overwrite and self._core_enabled()
        if _BACKEND == "jax":
            self._jax_stateful(grads)
        elif core_path:
            self._core().apply(grads)  # reports a dropped cycle itself
        else:
            self._stateful_apply(grads, trainable_variables)
        if overwrite and _BACKEND != "jax":  # the JAX path does this in stateless_apply
            boundary = ops.equal(self._micro_step, 0)
            seen = self._seen.value
            for i, acc, maximum in overwrite:
                var = trainable_variables[i]
                write = ops.logical_and(boundary, ops.greater(seen[i], 0.0))
                var.assign(ops.where(write, ops.cast(maximum, var.dtype), var))
                acc.assign(maximum)
        if weight is not None:
            self._batch_weight.assign(1.0)
        if self._drops_nonfinite() and not core_path and self._eager():
            self.report_nonfinite()

    def _check_weight(self, weight: Any) -> Any:
        """A micro-batch weight, checked where it is concrete (ValueError/TypeError)."""
        if self._options.reduction == "sum":
            raise ValueError(
                'weight has no effect with reduction="SUM" (the plain sum of the gradients); '
                'use reduction="MEAN" for a weighted mean'
            )
        if isinstance(weight, bool) or not (
            isinstance(weight, (int, float, np.number)) or hasattr(weight, "shape")
        ):
            raise TypeError(f"weight must be a number or a scalar tensor, got {weight!r}")
        if hasattr(weight, "shape") and tuple(weight.shape) not in ((), (1,)):
            raise ValueError(f"weight must be a scalar, got shape {tuple(weight.shape)}")
        concrete = _cycle.concrete(weight) if hasattr(weight, "shape") else np.asarray(weight)
        if concrete is not None and not (np.isfinite(concrete).all() and (concrete >= 0).all()):
            raise ValueError(f"weight must be finite and >= 0, got {float(concrete.ravel()[0])}")
        return ops.reshape(ops.cast(weight, "float32"), ())

    def _overwrite_maxima(
        self, grads: Sequence[Any], micro_step: Any, seen: Any, accs: Sequence[Any] | None = None
    ) -> list[tuple]:
        """``(index, accumulator, cycle maximum)`` of the ``overwrite_with_gradient`` variables.

        As in Keras's own accumulation, such a variable (a float8 scale or amax history) keeps
        its value during a cycle and is overwritten at the boundary with the elementwise maximum
        of the cycle's gradients; the accumulator holds the running maximum, not a sum. The
        maximum is over the micro-steps that have a gradient (``seen``: the flags before this
        one); one without any in the cycle is left alone. ``grads`` follow the wrapper's
        variables; ``accs``: their accumulators' values on the functional path.
        """
        first = ops.equal(micro_step, 0)
        out = []
        for i, (g, v) in enumerate(zip(grads, self._trainable_variables)):
            if not getattr(v, "overwrite_with_gradient", False):
                continue
            acc = self._accumulators[i] if accs is None else accs[i]
            previous = acc.value if accs is None else acc
            if g is None:
                maximum = previous
            else:
                g = ops.cast(g, "float32")
                fresh = ops.logical_or(first, ops.less_equal(seen[i], 0.0))
                maximum = ops.where(fresh, g, ops.maximum(previous, g))
            out.append((i, acc, maximum))
        return out

    def _flush_overwrites(self, seen: Sequence[bool]) -> None:
        """After a flush: the ``overwrite_with_gradient`` variables seen in the cycle take its
        maximum (their accumulators hold it), as at a boundary."""
        for i, v in enumerate(self._trainable_variables):
            if seen[i] and getattr(v, "overwrite_with_gradient", False):
                v.assign(ops.cast(self._accumulators[i].value, v.dtype))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any = None) -> Any:
        """``apply`` on ``(gradient, variable)`` pairs (and the micro-batch's ``weight``);
        returns the micro-step counter."""
        grads, variables = zip(*grads_and_vars)
        self.apply(list(grads), list(variables), weight=weight)
        return self._iterations

    def _core(self) -> Any:
        """The PyTorch backend's eager path over this wrapper's variables (built once)."""
        if self._core_engine is None:
            from gradient_accumulator.keras import _core_path

            self._core_engine = _core_path.CorePath(
                self.optimizer,
                self._trainable_variables,
                self._accumulators,
                _core_path.CycleVariables(
                    self._micro_step,
                    self._total_weight,
                    self._nonfinite,
                    self._seen,
                    self._batch_weight,
                    self._iterations,
                    self._skipped,
                    self._loss_scale,
                    self._growth,
                ),
                self._agc_mask,
                self._core_settings,
                self._clip_gradients,
                self.report_nonfinite,
            )
        return self._core_engine

    def _core_settings(self) -> Any:
        """This wrapper's options for the torch path, read afresh on every call."""
        from gradient_accumulator.keras import _core_path

        own_clipping = (self.clipnorm, self.clipvalue, self.global_clipnorm)
        return _core_path.Settings(
            accum_steps=self.accum_steps,
            reduction=self._options.reduction,
            mixed_precision=bool(self.mixed_precision),
            drops_nonfinite=self._drops_nonfinite(),
            static_scale=self._static_scale,
            dynamic_growth_steps=self.dynamic_growth_steps,
            use_agc=bool(self.use_agc),
            clip_factor=self.clip_factor,
            eps=self.eps,
            fused=all(x is None for x in own_clipping),
        )

    def _core_enabled(self) -> bool:
        if self.use_core is False:
            return False
        try:
            from gradient_accumulator._loader import load_core

            load_core()
        except ImportError:
            if self.use_core:
                raise
            return False
        return True

    # Stateful path (TensorFlow graphs and replicas, eager PyTorch without the core). --------

    def _stateful_apply(self, grads: list[Any], variables: list[Any]) -> None:
        present = [g is not None for g in grads]
        grads = _cycle.dense(grads, variables)
        self._stateful_fold(grads, variables, present)
        # Every op below reads a counter written after the batch, so it is ordered after it.
        self._end_cycle(ops.greater_equal(self._micro_step, self.accum_steps), variables, present)

    def _stateful_fold(self, grads: list[Any], variables: list[Any], present: list[bool]) -> None:
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        in_place = self._options.reduction != "running_mean"
        if in_place:  # before the counters move: the first micro-step overwrites
            _cycle.fold_in_place(
                accs, grads, self._micro_step.value, self._batch_weight.value, self._options
            )
        state = _cycle.fold(
            _cycle.FoldState(
                [a.value for a in accs],
                self._seen.value,
                self._total_weight.value,
                self._nonfinite.value,
                self._micro_step.value,
                self._iterations.value,
            ),
            grads,
            self._batch_weight.value,
            self._options,
            present,
            accs_in_place=in_place,
        )
        if not in_place:
            for acc, value in zip(accs, state.accs):
                acc.assign(value)
        if self.mixed_precision:
            self._nonfinite.assign(state.nonfinite)
        with after(grads[:1]):
            self._seen.assign(state.seen)
            self._total_weight.assign(state.total_weight)
            # Counted by increments, as replicas under tf.distribute count them.
            self._micro_step.assign_add(1)
            self._iterations.assign_add(1)

    def _end_cycle(self, boundary: Any, variables: list[Any], present: list[bool]) -> None:
        """If ``boundary``: update (unless the cycle was non-finite), rescale, reset counters.

        ``present``: which variables have a gradient in the current call (see ``_seen_choice``).

        Only the inner update sits in a conditional; the counters and the loss scale are
        selected outside it, so no replica synchronisation happens inside a branch.
        """
        strategy = _strategy()
        nonfinite = self._nonfinite.value
        drops = self._drops_nonfinite()
        if drops or (self.mixed_precision and strategy is not None):
            # The cycle's result itself is checked, once, at the boundary: a NaN or Inf of any
            # micro-batch reaches it, and so does a finite sum that overflows float32. Under a
            # strategy this is also the loss scaler's check: the per-micro-step flag is a
            # first-replica variable, which would not see another replica's NaN.
            accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
            scale = self._grad_scale(self._total_weight, self._loss_scale)
            nonfinite = ops.cond(
                boundary,
                lambda: ops.cast(
                    ops.logical_not(_cycle.all_finite([a.value * scale for a in accs])), "float32"
                ),
                lambda: ops.convert_to_tensor(0.0, "float32"),
            )
        checks = self.mixed_precision or drops
        merged = strategy is not None and not _no_merge_call()
        pred, if_true, if_false = _cycle.seen_choice(self._seen.value, present)
        if strategy is not None and checks and not merged:
            import tensorflow as tf

            ctx = tf.distribute.get_replica_context()
            local = nonfinite
            nonfinite = ops.cond(
                boundary,
                lambda: ctx.all_reduce(tf.distribute.ReduceOp.SUM, local),
                lambda: local,
            )
        if merged:
            import tensorflow as tf
            from tensorflow.python.distribute import device_util

            # With clipping (or AGC) the cycle's gradient is reduced over the replicas before the
            # inner update: each replica's accumulators go to the cross-replica context, which
            # sums them at the boundary (a collective in a replica's branch would need a
            # merge_call there, which fails across workers).
            clips = self._clips()
            local_accs = (
                [self._accumulators[self._get_variable_index(v)].value for v in variables]
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
                skip = False
                if checks:
                    total = ops.cond(
                        at_boundary,
                        lambda: distribution.reduce(tf.distribute.ReduceOp.SUM, local, axis=None),
                        lambda: ops.convert_to_tensor(0.0, "float32"),
                    )
                    skip = ops.greater(total, 0.0)
                go = ops.logical_and(at_boundary, ops.logical_not(skip))
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
                return skip

            skip = tf.distribute.get_replica_context().merge_call(
                cross_replica, args=(boundary, nonfinite, pred, local_accs)
            )
        else:
            skip = ops.greater(nonfinite, 0.0) if checks else False
            do_update = ops.logical_and(boundary, ops.logical_not(skip))
            ops.cond(
                do_update,
                lambda: _cycle.on_choice(
                    (pred, if_true, if_false), lambda keep: self._inner_update(variables, keep)
                ),
                lambda: None,
            )
        if self.mixed_precision:
            scale, growth = _cycle.grown_scale(
                self._loss_scale.value, self._growth.value, self._options
            )
            scale = ops.where(skip, self._loss_scale * 0.5, scale)
            growth = ops.where(skip, ops.zeros_like(growth), growth)
            self._loss_scale.assign(ops.where(boundary, scale, self._loss_scale))
            self._growth.assign(ops.where(boundary, growth, self._growth))
        if drops:
            dropped = ops.logical_and(boundary, skip)
            self._skipped.assign(ops.where(dropped, self._skipped + 1, self._skipped))
        self._micro_step.assign(
            ops.where(boundary, ops.zeros_like(self._micro_step.value), self._micro_step)
        )
        self._total_weight.assign(ops.where(boundary, 0.0, self._total_weight))
        self._nonfinite.assign(ops.where(boundary, 0.0, self._nonfinite))

    def _clips(self) -> bool:
        """Whether the boundary clips the cycle's gradient (AGC or the wrapper's own clipping)."""
        return bool(self.use_agc) or any(
            c is not None for c in (self.clipnorm, self.clipvalue, self.global_clipnorm)
        )

    def _inner_update(
        self, variables: list[Any], keep: list[int], reduced: Sequence[Any] | None = None
    ) -> None:
        """The inner optimizer's update of ``variables[keep]`` with the cycle's averaged
        gradient (replica context).

        ``reduced``: the kept accumulators already summed over the replicas (the cross-replica
        context reduced them); under a strategy with clipping they are reduced here otherwise.
        """
        if not keep:
            return
        variables = [variables[i] for i in keep]
        accs = [self._accumulators[self._get_variable_index(v)].value for v in variables]
        strategy = _strategy()
        summed = strategy is not None and self._clips()
        if summed:
            import tensorflow as tf

            # Clipping needs the gradient summed over the replicas.
            if reduced is None:
                reduced = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, accs
                )
            accs = list(reduced)
        grads = self._final_grads(
            accs,
            variables,
            [v.value for v in variables],
            self._grad_scale(self._total_weight, self._loss_scale),
        )
        if not summed:
            self.optimizer.apply(grads, variables)
            return
        # Every replica holds the same clipped gradient: the inner optimizer takes it as it is,
        # without summing it over the replicas a second time (Keras's TensorFlow optimizers
        # sum in ``_all_reduce_sum_gradients``; one without it gets 1/R of the gradient, summed
        # again).
        chain, opt = [], self.optimizer
        while opt is not None and all(opt is not o for o in chain):
            chain.append(opt)
            opt = getattr(opt, "inner_optimizer", None)
        if not all(hasattr(o, "_all_reduce_sum_gradients") for o in chain):
            replicas = strategy.num_replicas_in_sync
            self.optimizer.apply([g / replicas for g in grads], variables)
            return
        for opt in chain:
            vars(opt)["_all_reduce_sum_gradients"] = _already_reduced
        try:
            self.optimizer.apply(grads, variables)
        finally:
            for opt in chain:
                vars(opt).pop("_all_reduce_sum_gradients", None)

    # Functional path (JAX). --------------------------------------------------------------

    def _own(self, optimizer_variables: Sequence[Any]) -> dict[str, Any]:
        values = dict(zip([id(v) for v in self.variables], optimizer_variables))
        own = {name: values[id(getattr(self, f"_{name}"))] for name in _SCALARS}
        own["iterations"] = values[id(self._iterations)]
        own["accs"] = [values[id(a)] for a in self._accumulators]
        own["seen"] = values[id(self._seen)]
        return own

    def _pack(self, optimizer_variables: Sequence[Any], own: dict, inner: Sequence[Any]) -> list:
        by_id = {id(getattr(self, f"_{name}")): own[name] for name in _SCALARS}
        by_id[id(self._iterations)] = own["iterations"]
        by_id.update({id(a): v for a, v in zip(self._accumulators, own["accs"])})
        by_id[id(self._seen)] = own["seen"]
        out = [by_id.get(id(v), val) for v, val in zip(self._variables, optimizer_variables)]
        return out + list(inner)

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Any
    ) -> tuple[list[Any], list[Any]]:
        """Functional ``apply``: returns new trainable and optimizer variable values.

        Non-boundary micro-steps compute the accumulate only: the update runs in one branch of
        a conditional (``lax.cond`` under JAX).
        """
        if not self.built:
            raise ValueError(
                "GradientAccumulateOptimizer must be built before stateless_apply: call "
                "build(trainable_variables)"
            )
        # Values, not Variables (LossScaleOptimizer passes its inner optimizer's variables,
        # inside a StatelessScope that maps them to values).
        optimizer_variables = [_value(v) for v in optimizer_variables]
        trainable_variables = [_value(v) for v in trainable_variables]
        n_own = len(self._variables)
        own = self._own(optimizer_variables)
        inner_values = optimizer_variables[n_own:]
        self._note_trace(next((g for g in grads if g is not None), None))
        overwrite = self._overwrite_maxima(grads, own["micro_step"], own["seen"], own["accs"])
        present = [g is not None for g in grads]
        grads = _cycle.dense(grads, self._trainable_variables)

        fields = ("accs", "seen", "total_weight", "nonfinite", "micro_step", "iterations")
        state = _cycle.fold(
            _cycle.FoldState(*(own[k] for k in fields)),
            grads,
            own["batch_weight"],
            self._options,
            present,
        )
        own.update(state._asdict())
        boundary = ops.greater_equal(own["micro_step"], self.accum_steps)
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
                own["accs"][i] = maximum
        return new_tv, self._pack(optimizer_variables, own, new_inner)

    def _stateless_cycle_end(
        self,
        boundary: Any,
        own: dict,
        inner_values: list,
        trainable_values: list,
        present: list[bool],
    ) -> tuple[list, dict, list]:
        """If ``boundary``: update through the inner optimizer and reset the counters."""
        carried = ("loss_scale", "growth", "micro_step", "total_weight", "nonfinite", "skipped")
        # Decided outside the conditional, where the seen flags may still be concrete.
        choice = _cycle.seen_choice(own["seen"], present)

        def update() -> tuple:
            grads = self._final_grads(
                own["accs"],
                self._trainable_variables,
                trainable_values,
                self._grad_scale(own["total_weight"], own["loss_scale"]),
            )

            def inner_update(keep: list[int]) -> tuple[list, list]:
                if not keep:
                    return list(trainable_values), list(inner_values)
                kept = set(keep)
                with warnings.catch_warnings():
                    # The inner optimizer drops a None gradient, as wanted, and warns.
                    warnings.filterwarnings("ignore", message="Gradients do not exist")
                    tv, inner = self.optimizer.stateless_apply(
                        inner_values,
                        [g if i in kept else None for i, g in enumerate(grads)],
                        trainable_values,
                    )
                return list(tv), list(inner)

            def good() -> tuple:
                tv, inner = _cycle.on_choice(choice, inner_update)
                if self.mixed_precision:
                    scale, growth = _cycle.grown_scale(
                        own["loss_scale"], own["growth"], self._options
                    )
                else:
                    scale, growth = own["loss_scale"], own["growth"]
                return list(tv), list(inner), scale, growth, own["skipped"]

            def bad() -> tuple:
                return (
                    list(trainable_values),
                    list(inner_values),
                    own["loss_scale"] * 0.5,
                    ops.zeros_like(own["growth"]),
                    own["skipped"],
                )

            def dropped() -> tuple:
                return (
                    list(trainable_values),
                    list(inner_values),
                    own["loss_scale"],
                    own["growth"],
                    own["skipped"] + 1,
                )

            if self.mixed_precision:
                out = ops.cond(ops.greater(own["nonfinite"], 0.0), bad, good)
            elif self._drops_nonfinite():
                # The cycle's final gradient itself is checked (NaN/Inf of any micro-batch,
                # or a sum that overflowed float32).
                out = ops.cond(_cycle.all_finite(grads), good, dropped)
            else:
                out = good()
            tv, inner, scale, growth, skipped = out
            return (
                tv,
                inner,
                scale,
                growth,
                ops.zeros_like(own["micro_step"]),
                ops.zeros_like(own["total_weight"]),
                ops.zeros_like(own["nonfinite"]),
                skipped,
            )

        def keep() -> tuple:
            return (list(trainable_values), list(inner_values), *[own[k] for k in carried])

        tv, inner, *rest = ops.cond(boundary, update, keep)
        own = dict(own)
        own.update(zip(carried, rest))
        return tv, own, inner

    def _jax_stateful(self, grads: list[Any]) -> None:
        tv, ov = self.stateless_apply(
            [v.value for v in self.variables], grads, [v.value for v in self._trainable_variables]
        )
        for var, value in zip(self._trainable_variables, tv):
            var.assign(value)
        for var, value in zip(self.variables, ov):
            var.assign(value)

    # ---------------------------------------------------------------------------- flush

    def pending(self) -> int:
        """Micro-batches accumulated in the current, unfinished cycle."""
        return int(to_numpy(self._micro_step)) if self.built else 0

    def flush(self) -> bool:
        """Apply a cycle cut short (end of data) with its true weight, now.

        Does nothing when no micro-batch is pending or ``leftover="carry"``; call it outside
        compiled functions (callbacks do). Under JAX ``fit``, sync the model's state first
        (``model.jax_state_sync()``); the :class:`FlushAccumulation` callback does.

        Returns:
            True if an update was made (or skipped as non-finite).
        """
        if self.leftover == "carry" or self.pending() == 0:
            return False
        variables = self._trainable_variables
        # No current call: the seen flags alone say which variables had a gradient.
        present = list(to_numpy(self._seen) > 0)
        overwrites = any(getattr(v, "overwrite_with_gradient", False) for v in variables)
        if _BACKEND == "jax":
            tv, values = self._jax_flush(tuple(bool(p) for p in present))(
                [v.value for v in self.variables], [v.value for v in variables]
            )
            for var, value in zip(variables, tv):
                var.assign(value)
            for var, value in zip(self.variables, values):
                var.assign(value)
        elif _BACKEND == "torch" and not overwrites and self._core_enabled():
            self._core().boundary()
        elif (_strategy() or self._build_strategy) is not None:
            import tensorflow as tf

            # The strategy the accumulators were built under, even when flush() is called
            # outside its scope: read there, replica-local accumulators would be averaged over
            # the replicas, and the update would carry one replica's share of the gradient.
            strategy = _strategy() or self._build_strategy
            with strategy.scope():
                tf.function(
                    lambda: strategy.run(
                        self._end_cycle, args=(tf.constant(True), variables, present)
                    )
                )()
        elif _BACKEND == "tensorflow":
            self._tf_flush(tuple(bool(p) for p in present))()
        else:
            self._end_cycle(ops.convert_to_tensor(True), variables, present)
        if overwrites:
            self._flush_overwrites(present)
        self.report_nonfinite()
        return True

    def _tf_flush(self, present: tuple[bool, ...]) -> Any:
        """The TensorFlow flush's update as one ``tf.function``, cached like :meth:`_jax_flush`
        (run eagerly, op by op, it cost more per epoch end than the rest of a small epoch's
        overhead over Keras's own accumulation)."""
        import tensorflow as tf

        key = self._flush_key(present)
        cache = self.__dict__.setdefault("_tf_flush_cache", {})  # untracked, never saved
        if key not in cache:
            variables = self._trainable_variables
            cache[key] = tf.function(
                lambda: self._end_cycle(tf.constant(True), variables, list(present))
            )
        return cache[key]

    def _flush_key(self, present: tuple[bool, ...]) -> tuple:
        """What a compiled flush depends on: the seen flags and every setting it reads."""
        return (
            present,
            self.accum_steps,
            self._options.reduction,
            self.mixed_precision,
            self.on_nonfinite,
            self.use_agc,
            self.clip_factor,
            self.eps,
            self.clipnorm,
            self.clipvalue,
            self.global_clipnorm,
            self.dynamic_growth_steps,
            self._static_scale,
        )

    def _jax_flush(self, present: tuple[bool, ...]) -> Any:
        """The JAX flush's update as one compiled function, cached per seen-flags pattern and
        setting (run op by op, its conditional was compiled afresh at every flush: 1.7 s per
        epoch end for a two-layer MLP)."""
        import jax

        key = self._flush_key(present)
        cache = self.__dict__.setdefault("_jax_flush_cache", {})  # untracked, never saved
        if key not in cache:

            def flush(optimizer_values: list, trainable_values: list) -> tuple[list, list]:
                own = self._own(optimizer_values)
                inner_values = optimizer_values[len(self._variables) :]
                tv, own, inner = self._stateless_cycle_end(
                    ops.convert_to_tensor(True), own, inner_values, trainable_values, list(present)
                )
                return list(tv), self._pack(optimizer_values, own, inner)

            cache[key] = jax.jit(flush)
        return cache[key]

    # --------------------------------------------------------------------------- config

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Delegates to the inner optimizer (EMA)."""
        self.optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict[str, Any]:
        """Serializable config: the inner optimizer's and the accumulation settings."""
        exclude = self.agc_exclude
        if exclude is not None and not isinstance(exclude, str):
            exclude = [e for e in exclude if isinstance(e, str)]
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.optimizer),
            "accum_steps": self.accum_steps,
            "reduction": self.reduction,
            "mixed_precision": self.mixed_precision,
            "use_agc": self.use_agc,
            "clip_factor": self.clip_factor,
            "eps": self.eps,
            "agc_exclude": exclude,
            "leftover": self.leftover,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "use_core": self.use_core,
            "on_nonfinite": self.on_nonfinite,
            "clipnorm": self.clipnorm,
            "clipvalue": self.clipvalue,
            "global_clipnorm": self.global_clipnorm,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """Inverse of :meth:`get_config`."""
        config = copy.deepcopy(config)
        # Configs written by older versions carry the base optimizer's arguments at their
        # defaults (and the unused wrapper learning rate); those mean nothing here. Other
        # values still reach __init__, which refuses them.
        config.pop("learning_rate", None)
        for key, default in _BASE_DEFAULTS.items():
            if key in config and config[key] == default:
                del config[key]
        inner = config["optimizer"]
        if isinstance(inner, dict) and "module" not in inner:
            # 0.5 wrote tf.keras 2 configs ({"class_name": "SGD", "config": {...}}), whose
            # decay=0.0 meant "no decay".
            inner = copy.deepcopy(inner)
            if inner.get("config", {}).get("decay", None) == 0.0:
                del inner["config"]["decay"]
            config["optimizer"] = keras.optimizers.deserialize(inner, custom_objects=custom_objects)
        else:
            config["optimizer"] = keras.saving.deserialize_keras_object(
                inner, custom_objects=custom_objects
            )
        return cls(**config)


def _already_reduced(grads_and_vars: Any) -> list:
    """Stands in for a Keras optimizer's all-reduce of gradients that are reduced already."""
    return list(grads_and_vars)


def _value(x: Any) -> Any:
    return x.value if isinstance(x, keras.Variable) else x


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
    self.dynamic_scale.assign(inner.counter("loss_scale"))
    self.step_counter.assign(inner.counter("growth"))


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
    by_id = dict(zip([id(v) for v in inner.variables], new_inner))
    mirrored = {
        id(self.dynamic_scale): by_id[id(inner.counter("loss_scale"))],
        id(self.step_counter): by_id[id(inner.counter("growth"))],
    }
    own = [
        mirrored.get(id(v), value)
        for v, value in zip(self._variables, list(optimizer_variables)[:n_own])
    ]
    return tv, own + new_inner
