"""Pieces of GradientAccumulateOptimizer shared by its paths: its own variables, AGC's mask, the
boundary's gradient, micro-batch weights, ``overwrite_with_gradient`` variables and the torch
backend's core path.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src.utils.tracking import no_automatic_dependency_tracking

from gradient_accumulator import _validation
from gradient_accumulator._options import Options, check_agc_exclude
from gradient_accumulator.keras import _cycle, _packed, _tf_shell
from gradient_accumulator.keras._compat import to_numpy, warn_deprecated
from gradient_accumulator.keras._tf_shell import _strategy
from gradient_accumulator.keras.agc import clip_one

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
# Own scalar state, in the order the variables are created on TensorFlow and torch (after the
# base class's iteration counter and learning-rate variable; on JAX they are packed, see
# _packed). ``skipped`` counts the cycles dropped as non-finite under ``on_nonfinite`` (not the
# loss scaler's skips).
_SCALARS = _packed.SCALARS
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


# JAX: accumulators of at most this many elements share one flat variable. Keras's JAX step
# costs host time per state array (about 3 us on a 2-core CPU); folding into a flat variable
# costs a concatenation fused into the fold, about 0.3 ns more per element on XLA's CPU
# backend than a fold per variable (6x the fold at 662k parameters in 8 tensors), so only
# small tensors (biases, norms' scales, small kernels) gain from sharing one.
FLAT_MAX_ELEMENTS = 4096


def _flat_members(var_list: list[Any]) -> list[int]:
    """The variables whose accumulators share one flat variable (JAX), by position: those of
    at most FLAT_MAX_ELEMENTS elements, if two or more; none under a Keras distribution, where
    each accumulator is laid out (sharded) like its variable."""
    if keras.distribution.distribution() is not None:
        return []
    if any(getattr(v, "_layout", None) is not None for v in var_list):
        return []
    small = [i for i, v in enumerate(var_list) if math.prod(v.shape) <= FLAT_MAX_ELEMENTS]
    return small if len(small) >= 2 else []


def _accumulator_name(variable: Any) -> str:
    """The name of ``variable``'s accumulator: its path, then ``_accumulator``."""
    return getattr(variable, "path", variable.name).replace("/", "_") + "_accumulator"


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


def _upgraded_config(config: dict[str, Any], custom_objects: Any) -> dict[str, Any]:
    """A config as ``__init__`` takes it, from this or an older version."""
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
    return config


def _checked_arguments(
    cls: type, optimizer: Any, use_core: Any, agc_exclude: Any, kwargs: dict, **settings: Any
) -> tuple:
    """The constructor's arguments checked: ``(inner, options, use_core, agc_exclude)``;
    ``kwargs`` left with the base optimizer's."""
    mixed_precision = settings.pop("mixed_precision")
    initial_scale = settings.pop("initial_scale")
    dynamic_growth_steps = settings.pop("dynamic_growth_steps")
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
    if isinstance(inner, cls) or isinstance(getattr(inner, "inner_optimizer", None), cls):
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
        **settings,
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
    return inner, options, use_core, agc_exclude


class CycleParts:
    """Mixin of GradientAccumulateOptimizer: the pieces its paths share."""

    @no_automatic_dependency_tracking
    def _build_own(self, var_list: list[Any]) -> None:
        """Counters, loss scale and one float32 accumulator per variable (on JAX the small
        ones share one flat variable, see :func:`_flat_members`)."""
        if _BACKEND == "jax":
            self._build_packed(len(var_list))
        else:
            initial = {"batch_weight": 1.0, "loss_scale": self.initial_scale}
            for name in _SCALARS:
                int_like = name in _packed.INTS
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
            self._build_epoch_clock()
        strategy = _strategy()
        self._build_strategy = strategy
        members = _flat_members(var_list) if _BACKEND == "jax" else []
        in_flat = dict(zip(members, self._build_flat_accumulators([var_list[i] for i in members])))
        self._accumulators = []
        for i, v in enumerate(var_list):
            if i in in_flat:
                self._accumulators.append(in_flat[i])
                continue
            if strategy is None:
                # Laid out like its variable under a Keras distribution (a sharded kernel gets
                # a sharded accumulator): the paths of a LayoutMap do not match ours.
                acc = self.add_variable(
                    shape=v.shape,
                    dtype="float32",
                    layout=getattr(v, "_layout", None),
                    name=_accumulator_name(v),
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
                        name=_accumulator_name(v),
                    )
                self._track_variable(acc)
            self._accumulators.append(acc)
        if _BACKEND != "jax":
            # 1.0 for each variable that had a gradient in the current cycle: one without any
            # is left alone at the boundary, as plain Keras leaves a variable whose gradient is
            # None.
            self._seen = self.add_variable(
                shape=(len(var_list),),
                dtype="float32",
                initializer="zeros",
                aggregation="only_first_replica",
                name="seen",
            )

    def _build_epoch_clock(self) -> None:
        """TensorFlow: the epoch's clock (``_packed.EPOCH``), two int variables that no file
        saves; the torch backend, which runs eagerly, flushes at the epoch's end instead (None).
        On JAX the clock is packed with the other counters. TensorFlow's step reads only
        ``steps_left`` (see :meth:`_set_epoch_clock`); ``epoch_steps`` keeps the variables'
        layout of earlier versions."""
        self._clock_after = 0  # TensorFlow: see _set_epoch_clock
        for name in _packed.EPOCH:
            clock = None
            if _BACKEND == "tensorflow":
                clock = self.add_variable(
                    shape=(),
                    dtype="int",
                    initializer="zeros",
                    aggregation="only_first_replica",
                    name=name,
                )
            setattr(self, f"_{name}", clock)

    def _set_epoch_clock(self, epoch_steps: int, steps_left: int) -> bool:
        """Set fit's epoch clock: the steps of each epoch and the steps left in the fit (0:
        stop it). Returns False, and does nothing, where there is no clock: on the torch
        backend, under a ``tf.distribute`` strategy, before ``build``."""
        if not self.built or self._epoch_steps is None or self._build_strategy is not None:
            return False
        if _BACKEND == "jax":  # both counters at once: EPOCH's two are adjacent in INTS
            self._ints.assign(
                _packed.set_ints(
                    self._ints.value, self._epoch_steps.index, np.array([epoch_steps, steps_left])
                )
            )
            return True
        # TensorFlow's step counts down the current epoch's steps only
        # (_cycle.epoch_countdown); the fit's steps after it are kept here, and the epoch-end
        # callback, finding the count run out, sets it again.
        now = (steps_left - 1) % epoch_steps + 1 if steps_left > 0 and epoch_steps > 0 else 0
        self._clock_after = steps_left - now if now else 0
        _tf_shell.write(self._steps_left, now)
        return True

    def _cycle_counters(self) -> dict[str, int]:
        """``micro_step``, ``skipped`` and ``steps_left`` (0 without a clock, and on
        TensorFlow once the current epoch's count ran out) now, read from the variables (on
        JAX in one read of the packed counters)."""
        if _BACKEND == "jax":
            return dict(zip(_packed.INTS, np.asarray(self._ints.value).tolist()))
        out = {name: int(to_numpy(getattr(self, f"_{name}"))) for name in ("micro_step", "skipped")}
        clock = self._steps_left
        now = 0 if clock is None else int(to_numpy(clock))
        out["steps_left"] = now + self._clock_after if now else 0
        return out

    def _build_flat_accumulators(self, var_list: list[Any]) -> list[Any]:
        """JAX: the accumulators of ``var_list`` (small variables, see :func:`_flat_members`)
        as slices of one float32 variable, each a :class:`_packed.Slot` with its variable's
        shape. No variable when ``var_list`` is empty."""
        self._acc_flat = None
        if not var_list:
            return []
        sizes = [math.prod(v.shape) for v in var_list]
        self._acc_flat = self.add_variable(
            shape=(sum(sizes),), dtype="float32", initializer="zeros", name="small_accumulators"
        )
        slots, offset = [], 0
        for v, size in zip(var_list, sizes):
            index = slice(offset, offset + size)
            slots.append(_packed.Slot(self._acc_flat, index, _accumulator_name(v), tuple(v.shape)))
            offset += size
        return slots

    def _build_packed(self, n_variables: int) -> None:
        """JAX: the counters in one variable, the float scalars and seen flags in another, each
        reachable as a :class:`_packed.Slot` under its own name."""
        self._ints = self.add_variable(
            shape=(len(_packed.INTS),), dtype="int", initializer="zeros", name="counters"
        )
        self._floats = self.add_variable(
            shape=(len(_packed.FLOATS) + n_variables,),
            dtype="float32",
            initializer=_packed.initial_floats(self.initial_scale),
            name="cycle_state",
        )
        for i, name in enumerate(_packed.INTS):
            setattr(self, f"_{name}", _packed.Slot(self._ints, i, name))
        for i, name in enumerate(_packed.FLOATS):
            setattr(self, f"_{name}", _packed.Slot(self._floats, i, name))
        self._seen = _packed.Slot(self._floats, slice(len(_packed.FLOATS), None), "seen")

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

    def _grad_scale(self, total_weight: Any, loss_scale: Any) -> Any:
        return _cycle.grad_scale(total_weight, loss_scale, self._options, self._static_scale)

    def _final_grads(
        self, accs: list[Any], variables: list[Any], params: list[Any], scale: Any | None
    ) -> list[Any]:
        """Averaged, unscaled, clipped gradients in the variables' dtypes.

        ``params`` are the variables' current values (traced values on the functional path).
        ``scale`` None: ``accs`` are scaled already. ``overwrite_with_gradient`` variables
        (whose "gradient" is their next value) are left out of AGC and of the clipping, as
        Keras leaves them out before it clips.
        """
        grads = list(accs) if scale is None else [a * scale for a in accs]
        overwrite = [getattr(v, "overwrite_with_gradient", False) for v in variables]
        if self.use_agc:
            index = [self._get_variable_index(v) for v in variables]
            grads = [
                clip_one(p, g, self.clip_factor, self.eps) if self._agc_mask[i] and not o else g
                for p, g, i, o in zip(params, grads, index, overwrite)
            ]
        if any(overwrite):
            ordinary = [i for i, o in enumerate(overwrite) if not o]
            if ordinary:
                for i, g in zip(ordinary, self._clip_gradients([grads[i] for i in ordinary])):
                    grads[i] = g
        else:
            grads = self._clip_gradients(grads)
        return [ops.cast(g, v.dtype) for g, v in zip(grads, variables)]

    def _zero_between_cycles(self, idle: bool = False) -> None:
        """TensorFlow: the accumulators (and the cycle's total weight and non-finite flag)
        zeroed if no cycle is pending, as after a load of a file from another backend, whose
        folds overwrite at a cycle's first micro-step and leave the last cycle's sums behind:
        TensorFlow's fold adds onto them. ``idle``: no cycle is pending and the counters are
        zeroed already (``reset_cycle``): the accumulators only."""
        if _BACKEND != "tensorflow" or not self.built:
            return
        if not idle and int(to_numpy(self._micro_step)) != 0:
            return
        self._zero_accumulators(True, plain=self._build_strategy is None)
        if not idle:
            self._total_weight.assign(0.0)
            self._nonfinite.assign(0.0)

    def _summing_accumulators(self) -> list[Any]:
        """The accumulators that hold sums: not those of ``overwrite_with_gradient`` variables,
        which hold the cycle's running maximum (set afresh at a cycle's first gradient, read
        by the boundary and the flush after the cycle's end, see :meth:`_overwrite_maxima`)."""
        return [
            acc
            for acc, v in zip(self._accumulators, self._trainable_variables)
            if not getattr(v, "overwrite_with_gradient", False)
        ]

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
        self,
        grads: Sequence[Any],
        micro_step: Any,
        seen: Any,
        acc_value: Callable[[int], Any] | None = None,
    ) -> list[tuple]:
        """``(index, accumulator, cycle maximum)`` of the ``overwrite_with_gradient`` variables.

        As in Keras's own accumulation, such a variable (a float8 scale or amax history) keeps
        its value during a cycle and is overwritten at the boundary with the elementwise maximum
        of the cycle's gradients; the accumulator holds the running maximum, not a sum. The
        maximum is over the micro-steps that have a gradient (``seen``: the flags before this
        one); one without any in the cycle is left alone. ``grads`` follow the wrapper's
        variables; ``acc_value(i)``: variable ``i``'s accumulator value on the functional path,
        asked only for the chosen variables (a slice of the flat one costs an op).
        """
        out: list[tuple] = []
        chosen = [
            i
            for i, v in enumerate(self._trainable_variables)
            if getattr(v, "overwrite_with_gradient", False)
        ]
        if not chosen:  # the usual case: no op at all
            return out
        first = ops.equal(micro_step, 0)
        for i in chosen:
            g = grads[i]
            acc = self._accumulators[i] if acc_value is None else acc_value(i)
            previous = acc.value if acc_value is None else acc
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

    def _eager(self) -> bool:
        """True when this call runs in Python on concrete values (not traced or compiled)."""
        return not _cycle.traced(self._skipped.value)

    def _apply_micro_batch(
        self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None, weight: Any
    ) -> None:
        """``apply`` after its docstring: check, fold, end the cycle on the backend's path."""
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
        # TensorFlow without a strategy folds the weight as a tensor of the step: this call's,
        # or the batch size fit's step hands over (callbacks.weighing, as the graph of this
        # call may hold it); else the counter's.
        direct = _BACKEND == "tensorflow" and _strategy() is None
        if weight is None and direct:
            weight = self._stashed_weight()
        if weight is not None and not direct:
            self._batch_weight.assign(weight)
        overwrite = self._overwrite_maxima(grads, self._micro_step.value, self._seen.value)
        core_path = _BACKEND == "torch" and not overwrite and self._core_enabled()
        if _BACKEND == "jax":
            self._jax_stateful(grads)
        elif core_path:
            self._core().apply(grads)  # reports a dropped cycle itself
        else:
            self._stateful_apply(grads, trainable_variables, weight if direct else None)
        if overwrite and _BACKEND != "jax":  # the JAX path does this in stateless_apply
            boundary = ops.equal(self._micro_step, 0)
            seen = self._seen.value
            for i, acc, maximum in overwrite:
                var = trainable_variables[i]
                write = ops.logical_and(boundary, ops.greater(seen[i], 0.0))
                var.assign(ops.where(write, ops.cast(maximum, var.dtype), var))
                acc.assign(maximum)
        if weight is not None and not direct:
            self._batch_weight.assign(1.0)
        if self._drops_nonfinite() and not core_path and self._eager():
            self.report_nonfinite()

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

    def _flush_cycle(self, variables: list[Any], present: list[bool], overwrites: bool) -> None:
        """End the pending cycle now on the backend's path (``flush``)."""
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
