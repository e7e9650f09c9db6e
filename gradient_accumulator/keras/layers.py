"""AccumBatchNormalization: batch norm whose moving statistics are those of the big batch."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import keras
import numpy as np
from keras import ops

from gradient_accumulator import _validation
from gradient_accumulator.keras._compat import after, to_numpy, warn_deprecated

__all__ = ["AccumBatchNormalization"]


@keras.saving.register_keras_serializable(package="gradient-accumulator")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization for gradient accumulation over ``accum_steps`` micro-batches.

    In training the layer normalises each micro-batch with that micro-batch's statistics (it
    cannot see the others), and merges the micro-batches' (count, mean, M2) with Chan's
    parallel formula. Once per ``accum_steps`` calls the moving statistics take one Keras
    update, ``moving = moving·momentum + batch·(1 − momentum)`` with the biased variance of the
    merged batch, so they equal those of a ``BatchNormalization`` that saw the ``accum_steps``
    micro-batches as one batch. With ``accum_steps=1`` it is ``BatchNormalization``. Inference,
    ``training=None`` and ``trainable=False`` behave as in ``BatchNormalization``, and the first
    four weights (gamma, beta, moving mean, moving variance) are the same.

    Weights transfer both ways: ``set_weights`` takes a ``BatchNormalization``'s weights (its
    ``get_weights()``, 4 arrays, or 2–3 without ``center``/``scale``) as well as this layer's
    own (8 arrays, the 4 cycle weights after them); :meth:`to_batchnorm` gives back a plain
    ``BatchNormalization`` with the same config and weights, for export or inference
    (:func:`~gradient_accumulator.keras.restore_batchnorm_layers` does it for a whole model).

    Inside a :class:`GradientAccumulateModel` the layer is registered with the model's
    optimizer when the model is compiled: it then takes the cycle's length from the
    optimizer (``optimizer.accum_steps``, read when the training step is traced) and the
    optimizer's cycle resets (``reinit_grad_accum()``) and flushes reach it, so a changed
    ``accum_steps`` moves both together. Elsewhere it counts its own ``accum_steps``.

    Args:
        accum_steps: micro-batches per moving-statistics update (the model's ``accum_steps``)
            when the layer is not registered with an optimizer.
        momentum: momentum of the moving average (Keras convention).
        epsilon: added to the variance.
        trainable: whether gamma and beta train and statistics update.
        axis: the channel axis (any axis of an input of rank ≥ 2): an int, or a list or
            tuple of one int.
        center: learn an offset beta.
        scale: learn a scale gamma.
        **kwargs: other ``BatchNormalization`` arguments (initializers, regularizers,
            constraints, ``name``, ``dtype``); ``renorm`` and ``synchronized`` are not supported.

    Example:
        >>> import numpy as np, keras
        >>> from gradient_accumulator.keras import AccumBatchNormalization
        >>> bn = AccumBatchNormalization(accum_steps=2, momentum=0.0)
        >>> x = np.arange(8, dtype="float32").reshape(4, 2)
        >>> _ = bn(x[:2], training=True)
        >>> _ = bn(x[2:], training=True)  # end of the cycle: statistics of all 4 rows
        >>> keras.ops.convert_to_numpy(bn.moving_mean).tolist()
        [3.0, 4.0]
    """

    _accumulator: Any = None  # weak reference to the registered optimizer

    def __init__(
        self,
        accum_steps: int = 1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        trainable: bool = True,
        axis: int = -1,
        center: bool = True,
        scale: bool = True,
        **kwargs: Any,
    ) -> None:
        accum_steps = _validation.check_accum_steps(accum_steps)
        for key in ("renorm", "synchronized"):
            if kwargs.pop(key, False):
                raise ValueError(f"AccumBatchNormalization does not support {key}=True")
        for key in ("renorm_clipping", "renorm_momentum"):
            kwargs.pop(key, None)
        if isinstance(axis, (list, tuple)):
            if len(axis) != 1:
                raise ValueError(f"axis must be a single axis, got {axis!r}")
            axis = axis[0]
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
        super().__init__(
            axis=axis,
            momentum=momentum,
            epsilon=epsilon,
            center=center,
            scale=scale,
            trainable=trainable,
            **kwargs,
        )
        self._own_accum_steps = accum_steps

    @property
    def accum_steps(self) -> int:
        """Micro-batches per moving-statistics update: the registered optimizer's
        ``accum_steps``, else the layer's own."""
        owner = self.registered_optimizer()
        return self._own_accum_steps if owner is None else owner.accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        value = _validation.check_accum_steps(value)
        if self.registered_optimizer() is not None:
            warnings.warn(
                "accum_steps set on an AccumBatchNormalization registered with an optimizer is "
                "ignored while it is registered: the layer follows the optimizer's accum_steps "
                "(set that one)",
                UserWarning,
                stacklevel=2,
            )
        self._own_accum_steps = value

    def registered_optimizer(self) -> Any:
        """The ``GradientAccumulateOptimizer`` whose cycle this layer follows, or None.

        A method, not a property: Keras's saving walks every attribute of a layer, and would
        reach the optimizer's state through the layer before the model's ``optimizer``."""
        ref = self._accumulator
        return None if ref is None else ref()

    def build(self, input_shape: Any) -> None:
        """Create BatchNormalization's weights, then the accumulated moments."""
        if len(input_shape) < 2:
            raise ValueError(f"inputs must have rank >= 2, got shape {tuple(input_shape)}")
        self._check_axis(len(input_shape))
        super().build(input_shape)
        shape = (input_shape[self.axis],)

        def state(name: str, shape: tuple, dtype: str = "float32", like: Any = None) -> Any:
            layout = getattr(like, "_layout", None)
            if layout is not None:
                # Under a Keras distribution, laid out like the moving statistic it merges
                # into (a LayoutMap's paths do not name these weights).
                with keras.name_scope(self.name, caller=self):
                    variable = keras.Variable(
                        initializer="zeros",
                        shape=shape,
                        dtype=dtype,
                        trainable=False,
                        autocast=False,
                        layout=layout,
                        name=name,
                    )
                self._track_variable(variable)
                return variable
            return self.add_weight(
                shape=shape,
                name=name,
                initializer="zeros",
                dtype=dtype,
                trainable=False,
                autocast=False,
            )

        # Only the channel axis is fixed, not the rank (BatchNormalization pins both): one layer
        # may follow a Dense and a Conv2D of the same width, as the original layer allowed.
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={self.axis: shape[0]})
        self.accum_mean = state("accum_mean", shape, like=self.moving_mean)
        self.accum_variance = state("accum_variance", shape, like=self.moving_variance)
        self.accum_count = state("accum_count", ())
        self.accum_step = state("accum_step", (), "int32")

    def __getattr__(self, name: str) -> Any:
        # 0.5's names, resolved here rather than as properties so that Keras's saving, which
        # reads every attribute dir() lists, does not trigger the warnings.
        if name == "accum_step_counter":
            warn_deprecated(
                "AccumBatchNormalization.accum_step_counter", "use accum_step (an int32 weight)"
            )
            return self.accum_step
        if name == "reset_accum":
            warn_deprecated(
                "AccumBatchNormalization.reset_accum()",
                "the merged statistics restart by themselves at each cycle; "
                "GradientAccumulateModel.reinit_grad_accum() discards a partial cycle",
            )
            return self._reset_accum
        getter = getattr(super(), "__getattr__", None)
        if getter is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getter(name)

    def _reset_accum(self) -> None:
        """Discard the micro-batches merged so far (the next call starts a cycle)."""
        self.accum_step.assign(0)
        self.accum_count.assign(0.0)
        self.accum_mean.assign(ops.zeros(self.accum_mean.shape, "float32"))
        self.accum_variance.assign(ops.zeros(self.accum_variance.shape, "float32"))

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        """Normalise with micro-batch statistics in training, moving statistics otherwise."""
        if not (training and self.trainable):
            return super().call(inputs, training=False, mask=mask)
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = ops.cast(inputs, compute_dtype)
        # Reduction axes of this call's rank; BatchNormalization's own helpers read them here.
        object.__setattr__(self, "_reduction_axes", self._axes_of(len(x.shape)))
        mean, variance = self._moments(x, mask)
        self._merge_and_update(mean, variance, self._count(x, mask))
        gamma = ops.cast(self.gamma, x.dtype) if self.scale else None
        beta = ops.cast(self.beta, x.dtype) if self.center else None
        outputs = ops.batch_normalization(
            x=x,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _check_axis(self, rank: int) -> None:
        """Refuse an ``axis`` that an input of ``rank`` does not have."""
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"axis={self.axis} is out of range for inputs of rank {rank} "
                f"(valid: {-rank} to {rank - 1})"
            )

    def _axes_of(self, rank: int) -> list[int]:
        """Every axis but the channel axis, for an input of ``rank``."""
        self._check_axis(rank)
        channel = self.axis % rank
        return [a for a in range(rank) if a != channel]

    def _count(self, x: Any, mask: Any) -> Any:
        """Values per channel in this micro-batch."""
        if mask is not None:
            return ops.sum(ops.cast(mask, "float32"))
        count = ops.convert_to_tensor(1.0, "float32")
        shape = ops.shape(x)
        for axis in self._reduction_axes:
            count = count * ops.cast(shape[axis], "float32")
        return count

    def _merge_and_update(self, mean_b: Any, var_b: Any, n_b: Any) -> None:
        """Chan's merge of (n, mean, biased var) into the cycle; moving update at its end."""
        mean_b = ops.cast(mean_b, "float32")
        var_b = ops.cast(var_b, "float32")
        step, count = self.accum_step.value, self.accum_count.value
        acc_mean, acc_var = self.accum_mean.value, self.accum_variance.value
        first = ops.equal(step, 0)
        n_a = ops.where(first, 0.0, count)
        n = n_a + n_b
        frac_b = n_b / ops.maximum(n, 1e-30)
        frac_a = n_a / ops.maximum(n, 1e-30)
        delta = mean_b - acc_mean
        mean = ops.where(first, mean_b, acc_mean + delta * frac_b)
        var = ops.where(
            first,
            var_b,
            frac_a * acc_var + frac_b * var_b + frac_a * frac_b * ops.square(delta),
        )
        step = step + 1
        boundary = ops.greater_equal(step, self.accum_steps)
        moving_mean = ops.cast(self.moving_mean.value, "float32")
        moving_var = ops.cast(self.moving_variance.value, "float32")
        # The counter updates read no data: tied to the batch's moments, so the step Keras runs
        # on an exhausted iterator of unknown size cannot tick them before it fails.
        with after([mean_b, var_b]):
            self.moving_mean.assign(
                ops.where(
                    boundary,
                    moving_mean * self.momentum + mean * (1.0 - self.momentum),
                    moving_mean,
                )
            )
            self.moving_variance.assign(
                ops.where(
                    boundary, moving_var * self.momentum + var * (1.0 - self.momentum), moving_var
                )
            )
            self.accum_mean.assign(mean)
            self.accum_variance.assign(var)
            self.accum_count.assign(n)
            self.accum_step.assign(ops.where(boundary, ops.zeros_like(step), step))

    def flush(self) -> bool:
        """Give the moving statistics the update of a cycle cut short (end of data), now.

        Keeps the statistics in phase with the optimizer, whose flush applies the same short
        cycle: the moving mean and variance take one update with the merged moments of the
        pending micro-batches, as a ``BatchNormalization`` seeing them as one batch would.
        Call it outside compiled functions (:class:`FlushAccumulation` does, for every such
        layer of the model).

        Returns:
            True if micro-batches were pending.
        """
        if not self.built or int(to_numpy(self.accum_step)) == 0:
            return False
        momentum = self.momentum
        for moving, merged in (
            (self.moving_mean, self.accum_mean),
            (self.moving_variance, self.accum_variance),
        ):
            value = ops.cast(moving.value, "float32") * momentum + merged.value * (1.0 - momentum)
            moving.assign(ops.cast(value, moving.dtype))
        self.accum_step.assign(0)
        return True

    def _batchnorm_weights(self) -> list[Any]:
        """The weights a ``BatchNormalization`` of this config has, in its order."""
        cycle = {id(w) for w in (self.accum_mean, self.accum_variance, self.accum_count)}
        cycle.add(id(self.accum_step))
        return [w for w in self.weights if id(w) not in cycle]

    def set_weights(self, weights: Any) -> None:
        """Set this layer's weights, or a ``BatchNormalization``'s.

        Args:
            weights: this layer's ``get_weights()`` (gamma, beta, moving mean and variance,
                then the cycle's merged moments and counters), or the 2–4 weights of a
                ``BatchNormalization`` with the same ``center``/``scale``: those are set and
                the cycle starts afresh (nothing pending).

        Raises:
            ValueError: ``weights`` has another length, or an array another shape; nothing
                is set then.
        """
        weights = list(weights)
        if not self.built or len(weights) == len(self.weights):
            super().set_weights(weights)
            return
        targets = self._batchnorm_weights()
        if len(weights) != len(targets):
            raise ValueError(
                f"weights must hold this layer's {len(self.weights)} weights or a "
                f"BatchNormalization's {len(targets)} (gamma, beta, moving_mean, moving_variance "
                f"as center={self.center}, scale={self.scale} give), got {len(weights)}"
            )
        for target, value in zip(targets, weights):
            if tuple(target.shape) != tuple(np.shape(value)):
                raise ValueError(
                    f"weights: {target.name} has shape {tuple(target.shape)}, got "
                    f"{tuple(np.shape(value))}"
                )
        for target, value in zip(targets, weights):
            target.assign(value)
        self._reset_accum()

    def to_batchnorm(self) -> Any:
        """A plain ``keras.layers.BatchNormalization`` with this layer's config and weights.

        For export and inference: the new layer normalises as this one does in inference, and
        trains as a ``BatchNormalization`` would. Micro-batches of an unfinished cycle are not
        in the moving statistics; call :meth:`flush` first to include them.

        Returns:
            A new layer (built, with copies of gamma, beta and the moving statistics, and this
            layer's name) if this one is built; an unbuilt one otherwise.

        Example:
            >>> import numpy as np
            >>> from gradient_accumulator.keras import AccumBatchNormalization
            >>> bn = AccumBatchNormalization(accum_steps=4)
            >>> _ = bn(np.ones((2, 3), "float32"))
            >>> plain = bn.to_batchnorm()
            >>> type(plain).__name__, len(plain.get_weights()), len(bn.get_weights())
            ('BatchNormalization', 4, 8)
        """
        config = self.get_config()
        config.pop("accum_steps")
        layer = keras.layers.BatchNormalization.from_config(config)
        if self.built:
            layer.build(self._build_shapes_dict.get("input_shape") or self._shape_for_build())
            layer.set_weights([keras.ops.convert_to_numpy(w) for w in self._batchnorm_weights()])
        return layer

    def _shape_for_build(self) -> tuple:
        """An input shape with this layer's channel count on its axis (rank 2 or more)."""
        channels = int(self.moving_mean.shape[0])
        rank = max(2, self.axis + 1 if self.axis >= 0 else -self.axis)
        shape = [None] * rank
        shape[self.axis] = channels
        return tuple(shape)

    def get_config(self) -> dict[str, Any]:
        """``BatchNormalization``'s config plus ``accum_steps``."""
        config = super().get_config()
        for key in ("renorm", "renorm_clipping", "renorm_momentum", "synchronized"):
            config.pop(key, None)
        config["accum_steps"] = self.accum_steps
        return config


def register_batchnorm(model: Any, optimizer: Any) -> int:
    """Register every :class:`AccumBatchNormalization` of ``model`` with ``optimizer`` (a
    ``GradientAccumulateOptimizer``): the layers take the cycle's length from it. A layer
    registered with another optimizer before moves to this one.

    Returns:
        The number of layers registered.
    """
    ref = weakref.ref(optimizer)
    n = 0
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, AccumBatchNormalization):
            layer._accumulator = ref
            n += 1
    return n


def reset_batchnorm(model: Any) -> int:
    """Discard the pending micro-batches of every :class:`AccumBatchNormalization` of
    ``model`` (with the optimizer's ``reset_cycle``: the next micro-batch starts a cycle for
    both).

    Returns:
        The number of built layers reset.
    """
    n = 0
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, AccumBatchNormalization) and layer.built:
            layer._reset_accum()
            n += 1
    return n
