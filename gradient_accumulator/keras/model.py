"""GradientAccumulateModel: a functional Keras model whose optimizer steps once per k batches."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from gradient_accumulator import _validation
from gradient_accumulator.keras import _compat
from gradient_accumulator.keras._compat import model_being_cloned, warn_deprecated
from gradient_accumulator.keras.callbacks import (
    FlushAccumulation,
    find_accumulator,
    flush_batchnorm,
    weigh_batch,
    weighing,
)
from gradient_accumulator.keras.layers import register_batchnorm, reset_batchnorm
from gradient_accumulator.keras.optimizer import GradientAccumulateOptimizer
from gradient_accumulator.nonfinite import check_on_nonfinite

__all__ = ["GradientAccumulateModel"]


def _is_graph_io(value: Any) -> bool:
    """Whether ``value`` is a model's inputs or outputs (symbolic tensors, possibly nested)."""
    if isinstance(value, (bool, int, np.integer)):
        return False
    leaves = keras.tree.flatten(value)
    return bool(leaves) and all(isinstance(t, keras.KerasTensor) for t in leaves)


_SETTINGS = (
    "accum_steps",
    "mixed_precision",
    "use_agc",
    "clip_factor",
    "eps",
    "experimental_distributed_support",
    "leftover",
    "agc_exclude",
    "on_nonfinite",
)
_DEFAULTS = (1, False, False, 0.01, 1e-3, False, "apply", "final", "skip")


def _settings_of_original() -> tuple:
    """The accumulation settings of the model ``keras.models.clone_model`` is cloning.

    Keras clones a functional model by calling its class with the new inputs and outputs only
    (``cls(inputs, outputs, name=...)``); the model being cloned is a local of that call's
    caller. Without one (any other positional call), the defaults.
    """
    model = model_being_cloned(GradientAccumulateModel, skip=2)
    if model is not None:
        # As in get_config: variables and layers named in agc_exclude are the original's,
        # not the clone's; patterns carry over.
        return tuple(model.get_config()[name] for name in _SETTINGS)
    return _DEFAULTS


@keras.saving.register_keras_serializable(package="gradient-accumulator")
class GradientAccumulateModel(keras.Model):
    """A functional model that accumulates gradients over ``accum_steps`` batches per update.

    Build it from another model's inputs and outputs, then ``compile`` and ``fit`` as usual: the
    optimizer given to ``compile`` is wrapped in a :class:`GradientAccumulateOptimizer`, so any
    Keras optimizer updates once per ``accum_steps`` batches with the weights a batch
    ``accum_steps`` times larger would give. Each batch is weighted by its number of samples,
    so a short last batch counts as much as it should; a cycle cut short by the end of an epoch
    is applied with its true weight before validation (``leftover="apply"``) or carried into the
    next epoch (``leftover="carry"``). The model has exactly the weights of the wrapped one;
    ``keras.models.clone_model``, ``get_config``/``from_config`` and ``.keras`` files keep the
    accumulation settings.

    Args:
        accum_steps: batches per update, an int ≥ 1.
        mixed_precision: dynamic loss scaling per cycle (also switched on by a
            ``"mixed_float16"`` policy, as ``compile`` does for plain models).
        use_agc: adaptive gradient clipping of the accumulated gradient.
        clip_factor: AGC's λ.
        eps: AGC's ε.
        experimental_distributed_support: accepted for compatibility; distribution needs no
            switch (replicas accumulate locally and reduce once per cycle).
        *args: passed to ``keras.Model``.
        leftover: ``"apply"`` or ``"carry"``, see above.
        agc_exclude: variables AGC leaves alone; see :class:`GradientAccumulateOptimizer`.
        on_nonfinite: ``"skip"`` (default), ``"raise"`` or ``"apply"``: what a cycle whose
            gradient holds NaN or Inf does; see :class:`GradientAccumulateOptimizer`. ``fit``
            warns or raises at the end of the batch that ended such a cycle.
        **kwargs: passed to ``keras.Model`` (``inputs=``, ``outputs=``, ``name=``).

    Example:
        >>> import numpy as np, keras
        >>> from gradient_accumulator.keras import GradientAccumulateModel
        >>> inputs = keras.Input((3,))
        >>> outputs = keras.layers.Dense(1)(inputs)
        >>> model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
        >>> model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
        >>> x, y = np.ones((32, 3), "float32"), np.zeros((32, 1), "float32")
        >>> _ = model.fit(x, y, batch_size=4, verbose=0)
        >>> int(model.optimizer.iterations)
        2
    """

    def __init__(
        self,
        accum_steps: int = 1,
        mixed_precision: bool = False,
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        experimental_distributed_support: bool = False,
        *args: Any,
        leftover: str = "apply",
        agc_exclude: Any = "final",
        on_nonfinite: str = "skip",
        **kwargs: Any,
    ) -> None:
        if _is_graph_io(accum_steps):
            # keras.Model's own signature, (inputs, outputs, ...), as Keras's cloning calls it.
            (
                kwargs["inputs"],
                kwargs["outputs"],
                accum_steps,
                mixed_precision,
                use_agc,
                clip_factor,
                eps,
                experimental_distributed_support,
                leftover,
                agc_exclude,
                on_nonfinite,
            ) = (accum_steps, mixed_precision, *_settings_of_original())
        if "agc" in kwargs:  # the name 0.5's README used for use_agc
            warn_deprecated("GradientAccumulateModel(agc=...)", "use use_agc")
            use_agc = kwargs.pop("agc")
        accum_steps = _validation.check_accum_steps(accum_steps)
        mixed_precision = _validation.check_bool(mixed_precision, "mixed_precision")
        use_agc = _validation.check_bool(use_agc, "use_agc")
        clip_factor, eps = _validation.check_agc_args(clip_factor, eps)
        experimental_distributed_support = _validation.check_bool(
            experimental_distributed_support, "experimental_distributed_support"
        )
        if experimental_distributed_support:
            warn_deprecated(
                "experimental_distributed_support=True",
                "it has no effect; distribution works with any strategy without a switch",
            )
        leftover = _validation.check_choice(leftover, "leftover", ("apply", "carry"))
        on_nonfinite = check_on_nonfinite(on_nonfinite)
        super().__init__(*args, **kwargs)
        self.accum_steps = accum_steps
        self.mixed_precision = mixed_precision
        self.use_agc = use_agc
        self.clip_factor = clip_factor
        self.eps = eps
        self.experimental_distributed_support = experimental_distributed_support
        self.leftover = leftover
        self.agc_exclude = agc_exclude
        self.on_nonfinite = on_nonfinite

    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        """``keras.Model.compile`` with ``optimizer`` wrapped for accumulation.

        A :class:`GradientAccumulateOptimizer` is used as given (its ``accum_steps`` must
        match). A ``LossScaleOptimizer`` is unwrapped and its scaling done per cycle by the
        accumulating optimizer, whichever of the two wraps the other; so is the loss scaling
        Keras adds under a ``"mixed_float16"`` policy (``auto_scale_loss``).
        """
        auto_scale = kwargs.get("auto_scale_loss", True)
        mixed = self.mixed_precision or (auto_scale and self.dtype_policy.name == "mixed_float16")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and isinstance(
            optimizer.inner_optimizer, GradientAccumulateOptimizer
        ):
            optimizer = optimizer.inner_optimizer  # which took the scaling over
        if isinstance(optimizer, GradientAccumulateOptimizer):
            if optimizer.accum_steps != self.accum_steps:
                raise ValueError(
                    f"optimizer has accum_steps={optimizer.accum_steps} but the model "
                    f"accum_steps={self.accum_steps}"
                )
            if mixed:
                optimizer._use_loss_scaling(optimizer.initial_scale, optimizer.dynamic_growth_steps)
            wrapped = optimizer
        else:
            wrapped = GradientAccumulateOptimizer(
                optimizer,
                accum_steps=self.accum_steps,
                mixed_precision=mixed,
                use_agc=self.use_agc,
                clip_factor=self.clip_factor,
                eps=self.eps,
                agc_exclude=self.agc_exclude,
                leftover=self.leftover,
                on_nonfinite=self.on_nonfinite,
            )
        kwargs["auto_scale_loss"] = False
        register_batchnorm(self, wrapped)  # AccumBatchNormalization follows its cycle
        super().compile(wrapped, *args, **kwargs)

    def get_compile_config(self) -> dict[str, Any]:
        """The compile arguments, with the wrapped optimizer (used by ``.keras`` saving)."""
        return super().get_compile_config()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compile from :meth:`get_compile_config`'s output and build the optimizer's state."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """``keras.Model.fit``, plus the end-of-epoch handling of a short last cycle."""
        args = list(args)
        if len(args) > 5:
            args[5] = self._with_flush(args[5])
        else:
            kwargs["callbacks"] = self._with_flush(kwargs.get("callbacks"))
        return super().fit(*args, **kwargs)

    @staticmethod
    def _with_flush(callbacks: Any) -> Any:
        if isinstance(callbacks, keras.callbacks.CallbackList):
            return callbacks
        callbacks = list(callbacks or [])
        if not any(isinstance(c, FlushAccumulation) for c in callbacks):
            callbacks.append(FlushAccumulation())
        return callbacks

    # fit adds no per-instance step to this class (see callbacks._weigh_batches): its own
    # train_step passes the weight.
    _weighs_batches = True

    if _compat.stateless_trainer():

        def train_step(self, state: Any, data: Any) -> Any:
            """One micro-step; passes the batch size to the optimizer as the batch's weight."""
            return super().train_step(weigh_batch(self, state, data), data)

    else:

        def train_step(self, data: Any) -> Any:
            """One micro-step; passes the batch size to the optimizer as the batch's weight."""
            with weighing(self, data):
                return super().train_step(data)

    def apply_accu_gradients(self) -> bool:
        """Apply the pending micro-batches now, with their true weight (as the original's).

        Returns:
            True if anything was pending.
        """
        opt = find_accumulator(self.optimizer)
        if opt is None or opt.pending() == 0:
            return False
        leftover, opt.leftover = opt.leftover, "apply"
        try:
            return opt.flush()
        finally:
            opt.leftover = leftover
            flush_batchnorm(self)

    def reinit_grad_accum(self) -> None:
        """Discard the pending micro-batches (the next one starts a new cycle)."""
        opt = find_accumulator(self.optimizer)
        if opt is not None:
            opt.reset_cycle()
            reset_batchnorm(self)  # in phase with the optimizer's fresh cycle

    def get_config(self) -> dict[str, Any]:
        """The functional config plus the accumulation settings (``accum_steps`` included)."""
        config = super().get_config()
        exclude = self.agc_exclude
        if exclude is not None and not isinstance(exclude, str):
            exclude = [e for e in exclude if isinstance(e, str)]
        config.update(
            accum_steps=self.accum_steps,
            mixed_precision=self.mixed_precision,
            use_agc=self.use_agc,
            clip_factor=self.clip_factor,
            eps=self.eps,
            experimental_distributed_support=self.experimental_distributed_support,
            leftover=self.leftover,
            agc_exclude=exclude,
            on_nonfinite=self.on_nonfinite,
        )
        return config
