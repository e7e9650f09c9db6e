"""Model surgery: swap BatchNormalization for AccumBatchNormalization and back, keeping every
weight."""

from __future__ import annotations

from typing import Any

import keras

from gradient_accumulator import _validation
from gradient_accumulator.keras._compat import to_numpy
from gradient_accumulator.keras.layers import AccumBatchNormalization

__all__ = ["replace_batchnorm_layers", "restore_batchnorm_layers"]

_BN_WEIGHTS = ("gamma", "beta", "moving_mean", "moving_variance")


def _accum_bn_from(layer: Any, accum_steps: int) -> AccumBatchNormalization:
    config = layer.get_config()
    if config.pop("renorm", False) or config.pop("synchronized", False):
        raise ValueError(
            f"layer {layer.name!r} uses renorm or synchronized batch norm, which "
            "AccumBatchNormalization does not support"
        )
    config.pop("accum_steps", None)
    return AccumBatchNormalization(accum_steps=accum_steps, **config)


def replace_batchnorm_layers(model: Any, accum_steps: int, position: str = "replace") -> Any:
    """A copy of ``model`` with every ``BatchNormalization`` replaced by AccumBatchNormalization.

    The copy has the same graph (all inputs and outputs, nested models included) and the same
    weights: gamma, beta and the moving statistics are copied by value (no variable is shared
    with ``model``), and each new layer keeps its layer's name, axis, momentum, epsilon,
    center/scale, initializers, regularizers and constraints.

    Args:
        model: a functional or ``Sequential`` Keras model.
        accum_steps: the new layers' ``accum_steps`` (the model wrapper's).
        position: only ``"replace"`` (the original package's single mode).

    Returns:
        The new model (``model`` is unchanged).

    Example:
        >>> import keras
        >>> from gradient_accumulator.keras import replace_batchnorm_layers
        >>> inputs = keras.Input((4,))
        >>> x = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
        >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
        >>> new = replace_batchnorm_layers(model, accum_steps=4)
        >>> type(new.layers[2]).__name__, new.layers[2].accum_steps
        ('AccumBatchNormalization', 4)
    """
    if position != "replace":
        raise ValueError(f"position must be 'replace', got {position!r}")
    accum_steps = _validation.check_accum_steps(accum_steps)
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
    pairs: list[tuple[Any, Any]] = []

    def clone(layer: Any) -> Any:
        if isinstance(layer, keras.layers.BatchNormalization):
            new = _accum_bn_from(layer, accum_steps)
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, new in pairs:
        if isinstance(old, keras.layers.BatchNormalization):
            for name in _BN_WEIGHTS:
                source, target = getattr(old, name, None), getattr(new, name, None)
                if source is not None and target is not None:
                    target.assign(to_numpy(source))
        elif old.weights:
            new.set_weights(old.get_weights())
    return new_model


def restore_batchnorm_layers(model: Any, flush: bool = True) -> Any:
    """A copy of ``model`` with every AccumBatchNormalization replaced by ``BatchNormalization``.

    The inverse of :func:`replace_batchnorm_layers`, for export and inference (a model that
    loads without this package, or a runtime that knows only Keras's layers): each new layer
    has its layer's name and config (less ``accum_steps``) and copies of gamma, beta and the
    moving statistics; every other layer keeps its weights, by value. A
    :class:`GradientAccumulateModel` comes back as a plain functional ``keras.Model``.

    Args:
        model: a functional or ``Sequential`` Keras model.
        flush: first give each layer's moving statistics the update of an unfinished cycle
            (:meth:`AccumBatchNormalization.flush`), as the end of an epoch does; ``False``
            leaves those micro-batches out.

    Returns:
        The new model (``model`` is unchanged unless ``flush`` applied a pending cycle).

    Example:
        >>> import keras
        >>> from gradient_accumulator.keras import (
        ...     AccumBatchNormalization, restore_batchnorm_layers)
        >>> inputs = keras.Input((4,))
        >>> x = AccumBatchNormalization(accum_steps=4)(keras.layers.Dense(8)(inputs))
        >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
        >>> plain = restore_batchnorm_layers(model)
        >>> type(plain.layers[2]).__name__
        'BatchNormalization'
    """
    from gradient_accumulator.keras.model import GradientAccumulateModel

    flush = _validation.check_bool(flush, "flush")
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
    if isinstance(model, GradientAccumulateModel):
        # Exported as the plain functional model it wraps (same layers, no accumulation).
        model = keras.Model(model.inputs, model.outputs, name=model.name)
    pairs: list[tuple[Any, Any]] = []

    def clone(layer: Any) -> Any:
        if isinstance(layer, AccumBatchNormalization):
            if flush:
                layer.flush()
            new = layer.to_batchnorm()
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, new in pairs:
        if not isinstance(old, AccumBatchNormalization) and old.weights:
            new.set_weights(old.get_weights())
    return new_model
