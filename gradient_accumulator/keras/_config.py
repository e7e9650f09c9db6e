"""The wrapper's configuration: its constructor's arguments checked, and configs of this and
older versions upgraded to them (``from_config``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from gradient_accumulator._options import Options, check_agc_exclude
from gradient_accumulator.keras import _packed, _shells
from gradient_accumulator.keras._compat import warn_deprecated
from gradient_accumulator.keras._cycle import concrete

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
SCALARS = _packed.SCALARS
# Settings held by the options record (properties, checked on assignment).
SETTINGS = (
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


def resolve_inner(optimizer: Any) -> Any:
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


def upgraded_config(config: dict[str, Any], custom_objects: Any) -> dict[str, Any]:
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


def checked_arguments(
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
    inner = resolve_inner(optimizer)
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
    use_core = _shells.checked_use_core(use_core)
    agc_exclude = check_agc_exclude(agc_exclude)
    return inner, options, use_core, agc_exclude


def config_of(opt: Any) -> dict[str, Any]:
    """``opt.get_config()``: the inner optimizer's config and the accumulation settings."""
    exclude = opt.agc_exclude
    if exclude is not None and not isinstance(exclude, str):
        exclude = [e for e in exclude if isinstance(e, str)]
    return {
        "name": opt.name,
        "optimizer": keras.saving.serialize_keras_object(opt.optimizer),
        "accum_steps": opt.accum_steps,
        "reduction": opt.reduction,
        "mixed_precision": opt.mixed_precision,
        "use_agc": opt.use_agc,
        "clip_factor": opt.clip_factor,
        "eps": opt.eps,
        "agc_exclude": exclude,
        "leftover": opt.leftover,
        "initial_scale": opt.initial_scale,
        "dynamic_growth_steps": opt.dynamic_growth_steps,
        "use_core": opt.use_core,
        "on_nonfinite": opt.on_nonfinite,
        "clipnorm": opt.clipnorm,
        "clipvalue": opt.clipvalue,
        "global_clipnorm": opt.global_clipnorm,
    }


def checked_weight(weight: Any, reduction: str) -> Any:
    """``apply``'s micro-batch weight, checked where it is concrete (ValueError/TypeError)."""
    if reduction == "sum":
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
    value = concrete(weight) if hasattr(weight, "shape") else np.asarray(weight)
    if value is not None and not (np.isfinite(value).all() and (value >= 0).all()):
        raise ValueError(f"weight must be finite and >= 0, got {float(value.ravel()[0])}")
    return ops.reshape(ops.cast(weight, "float32"), ())


def setting(name: str, doc: str, shown: Callable[[Any], Any] | None = None) -> property:
    """A setting of the wrapper: read from its options record (through ``shown`` if given),
    assigned by replacing the record, which checks the value with the other settings and
    changes nothing when it refuses it (``TypeError``/``ValueError`` naming the setting)."""

    def get(self: Any) -> Any:
        value = getattr(self._options, name)
        return value if shown is None else shown(value)

    def set_(self: Any, value: Any) -> None:
        self._set(**{name: value})

    return property(get, set_, doc=doc)
