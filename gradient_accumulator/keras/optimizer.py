"""GradientAccumulateOptimizer: any Keras 3 optimizer stepping once per k micro-batches, exactly.

This module is the wrapper's public face: Keras's optimizer interface, build, flush, config and
the settings. Its ``build()`` picks one shell (``_shells.make``) that runs the cycle in the
backend's way, and every micro-step, flush and counter read is delegated to it: JAX's
functional one (``_jax_shell.py``), TensorFlow's with or without a ``tf.distribute`` strategy
and eager torch's (``_tf_shell.py``), and the C++ core's on torch (``_core_path.py``). All share
one arithmetic (``_cycle.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import keras
from keras.src.utils.tracking import no_automatic_dependency_tracking

from gradient_accumulator._options import Options, keras_reduction
from gradient_accumulator.keras import (
    _boundary_grads,
    _config,
    _cycle,
    _loss_scale,
    _packed,
    _shells,
)
from gradient_accumulator.keras._compat import (
    loss_scale_optimizer_wrapping,
    to_numpy,
    warn_deprecated,
)
from gradient_accumulator.keras._shell import Shell
from gradient_accumulator.nonfinite import NonFiniteCounter

__all__ = ["GradientAccumulateOptimizer"]


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
            against variable paths. Resolved once, when the optimizer is built.
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
        scope = locals()
        settings = {k: scope[k] for k in _config.SETTINGS}
        inner, options, use_core, agc_exclude = _config.checked_arguments(
            GradientAccumulateOptimizer, optimizer, use_core, agc_exclude, kwargs, **settings
        )
        super().__init__(learning_rate=_shells.own_learning_rate(), name=name, **kwargs)
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
        self._shell: Shell | None = None  # the backend's path, chosen by build()

    # ------------------------------------------------------------------------------- settings

    def _set(self, **changes: Any) -> None:
        """Replace settings through the options record: checked together, all or nothing."""
        self._options = self._options.replace(**changes)

    accum_steps = _config.setting(
        "accum_steps", "Micro-batches per update (may change between cycles)."
    )
    use_agc = _config.setting(
        "use_agc", "Adaptive gradient clipping of the accumulated gradient at the boundary."
    )
    clip_factor = _config.setting("clip_factor", "AGC's λ.")
    eps = _config.setting("eps", "AGC's ε, the floor of a unit's weight norm.")
    leftover = _config.setting(
        "leftover", 'What :meth:`flush` does with a short cycle: ``"apply"`` or ``"carry"``.'
    )
    on_nonfinite = _config.setting(
        "on_nonfinite", 'What a non-finite cycle does: ``"skip"``, ``"raise"`` or ``"apply"``.'
    )
    mixed_precision = _config.setting("mixed_precision", "Dynamic loss scaling at cycle level.")
    initial_scale = _config.setting(
        "initial_scale", "The first loss scale under ``mixed_precision``."
    )
    dynamic_growth_steps = _config.setting(
        "dynamic_growth_steps", "Good updates between doublings of the loss scale."
    )
    reduction = _config.setting(
        "reduction",
        '``"MEAN"``, ``"SUM"`` or ``"RUNNING_MEAN"`` (assigned in any letter case).',
        shown=keras_reduction,
    )

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
        """The float32 gradient accumulators, one per trainable variable. On JAX those of
        small variables are views (``_packed.Slot``: ``value``, ``assign``, ``numpy``,
        ``shape``) of one flat variable they share."""
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
        if name in _config.SETTINGS:
            # Through the property's checks, whatever Keras's attribute tracking does.
            getattr(type(self), name).fset(self, value)
            return
        if name == "loss_scale_factor":
            # Straight to the property (TensorFlow's attribute tracking skips an assignment of
            # the value an attribute already has, None here).
            type(self).loss_scale_factor.fset(self, value)
            return
        super().__setattr__(name, value)

    # --------------------------------------------------------- loss scale, non-finite cycles

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
            _loss_scale.adopt(self, caller)

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

    def scale_loss(self, loss: Any) -> Any:
        """Multiply the loss by the current loss scale (and the inner static factor, if any)."""
        factor = 1.0 if self._static_scale is None else float(self._static_scale)
        if self.mixed_precision:
            scale = self._loss_scale.value if self.built else self.initial_scale
            return keras.ops.multiply(loss, keras.ops.cast(scale, "float32") * factor)
        return loss if factor == 1.0 else keras.ops.multiply(loss, factor)

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

    # ------------------------------------------------------- the cycle's variables, fit

    def counter(self, name: str) -> Any:
        """One of the variables the cycle lives in, by name: ``"micro_step"``,
        ``"total_weight"``, ``"nonfinite"``, ``"batch_weight"`` (the weight of a micro-batch
        applied without one: 1 unless written; ``fit``'s step writes each batch's size there,
        except on TensorFlow without a strategy, where it hands the size to the fold
        directly), ``"loss_scale"``,
        ``"growth"`` or ``"skipped"``. Built optimizers only. On JAX the scalars are packed into
        two variables, and this is a view of one element, with a variable's ``value``,
        ``assign`` and ``numpy``. Discard a cycle with :meth:`reset_cycle`, not by writing
        ``micro_step``: on TensorFlow a cycle adds onto accumulators it expects at zero."""
        if name not in _config.SCALARS:
            raise ValueError(f"name must be one of {_config.SCALARS}, got {name!r}")
        if not self.built:
            raise ValueError("the optimizer is not built yet (call build() or apply() first)")
        return getattr(self, f"_{name}")

    def reset_cycle(self) -> None:
        """Discard the pending micro-batches: the next one starts a new cycle."""
        if self.built:
            self._micro_step.assign(0)
            self._total_weight.assign(0.0)
            self._nonfinite.assign(0.0)
            self._zero_between_cycles(idle=True)

    def save_own_variables(self, store: Any) -> None:
        """Keras's saving: the state in one layout on every backend (see ``_packed``)."""
        _packed.save(_packed.saved_entries(self), store)

    def load_own_variables(self, store: Any) -> None:
        """Keras's loading, from files of any backend and of versions before the packing."""
        _packed.load(_packed.saved_entries(self), store, self.name)
        self._zero_between_cycles()

    def _zero_between_cycles(self, idle: bool = False) -> None:
        """See :meth:`Shell.zero_between_cycles` (after a load, ``reset_cycle``)."""
        if self.built:
            self._shell.zero_between_cycles(idle)

    def _set_epoch_clock(self, epoch_steps: int, steps_left: int) -> bool:
        """Set fit's epoch clock: the steps of each epoch and the steps left in the fit (0:
        stop it). Returns False, and does nothing, where there is no clock: on the torch
        backend, under a ``tf.distribute`` strategy, before ``build``."""
        return self.built and self._shell.set_epoch_clock(epoch_steps, steps_left)

    def _cycle_counters(self) -> dict[str, int]:
        """``micro_step``, ``skipped`` and ``steps_left`` now (see :meth:`Shell.counters`)."""
        return self._shell.counters()

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
    def _build_own(self, var_list: list[Any]) -> None:
        """The shell, chosen once, and the variables it keeps the cycle in."""
        self._shell = _shells.make(self, var_list)
        self._shell.build(var_list)

    @no_automatic_dependency_tracking
    def _finish_build(self, var_list: list[Any]) -> None:
        super().build(var_list)
        self._agc_mask = _boundary_grads.agc_mask(var_list, self.agc_exclude)

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
                as much as it should. A number ≥ 0 or a scalar tensor. ``None``: the batch
                size inside ``fit``'s step (with either wrapper), else the value in
                ``counter("batch_weight")`` (1 unless written). A given weight counts for this
                call only.
        """
        if weight is not None:
            weight = _config.checked_weight(weight, self._options.reduction)
        grads, variables = self._all_variables(list(grads), trainable_variables)
        self._note_trace(next((g for g in grads if g is not None), None))
        self._shell.micro_step(grads, variables, weight)

    def _all_variables(
        self, grads: list[Any], trainable_variables: Sequence[Any] | None
    ) -> tuple[list[Any], list[Any]]:
        """``apply``'s gradients following the wrapper's variables (None for one left out),
        and those variables; the first call builds."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError("call build(trainable_variables) or pass trainable_variables")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
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
        return grads, trainable_variables

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any = None) -> Any:
        """``apply`` on ``(gradient, variable)`` pairs (and the micro-batch's ``weight``);
        returns the micro-step counter."""
        grads, variables = zip(*grads_and_vars)
        self.apply(list(grads), list(variables), weight=weight)
        return self._iterations

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Any
    ) -> tuple[list[Any], list[Any]]:
        """Functional ``apply`` (JAX): returns new trainable and optimizer variable values.

        Non-boundary micro-steps compute the accumulate only: the update runs in one branch of
        a conditional (``lax.cond``).
        """
        if not self.built:
            raise ValueError(
                "GradientAccumulateOptimizer must be built before stateless_apply: call "
                "build(trainable_variables)"
            )
        return self._shell.stateless_apply(optimizer_variables, grads, trainable_variables)

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
        self._shell.flush(present, overwrites)
        if overwrites:
            self._shell.flush_overwrites(present)
        self.report_nonfinite()
        return True

    # --------------------------------------------------------------------------- config

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Delegates to the inner optimizer (EMA)."""
        self.optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict[str, Any]:
        """Serializable config: the inner optimizer's and the accumulation settings."""
        return _config.config_of(self)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """Inverse of :meth:`get_config`."""
        return cls(**_config.upgraded_config(config, custom_objects))
