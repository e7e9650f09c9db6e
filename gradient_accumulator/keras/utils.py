"""Model surgery: swap BatchNormalization for AccumBatchNormalization, keeping every weight."""

from __future__ import annotations

from typing import Any

import keras

from gradient_accumulator import _validation
from gradient_accumulator.keras._compat import to_numpy
from gradient_accumulator.keras.layers import AccumBatchNormalization

__all__ = ["replace_batchnorm_layers"]

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
