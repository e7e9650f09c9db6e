"""End-of-epoch handling of a cycle cut short by the end of the data.

``fit`` gets it by itself: importing this package hooks :class:`FlushAccumulation` into the
callbacks of every model whose optimizer is (or wraps) a :class:`GradientAccumulateOptimizer`,
plain ``keras.Model`` or :class:`GradientAccumulateModel` alike. The same hook gives such a
plain model a ``train_step`` that passes each batch's number of samples to the optimizer as the
batch's weight (:func:`weigh_batch`), as :class:`GradientAccumulateModel`'s own step does.
"""

from __future__ import annotations

from typing import Any

import keras

from gradient_accumulator.keras import _compat, _packed
from gradient_accumulator.keras.optimizer import GradientAccumulateOptimizer

__all__ = ["FlushAccumulation", "flush_batchnorm"]


def find_accumulator(optimizer: Any) -> GradientAccumulateOptimizer | None:
    """The GradientAccumulateOptimizer in ``optimizer`` (possibly inside a LossScaleOptimizer)."""
    while optimizer is not None:
        if isinstance(optimizer, GradientAccumulateOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


class FlushAccumulation(keras.callbacks.Callback):
    """Applies the leftover micro-batches of each epoch (``leftover="apply"``) before validation.

    ``fit`` adds it by itself to the callbacks of any model compiled with a
    :class:`GradientAccumulateOptimizer` (a plain ``keras.Model`` or a
    :class:`GradientAccumulateModel`), and runs it before the other callbacks; passing one in
    ``callbacks=`` is harmless. With ``leftover="carry"`` it applies nothing and the cycle goes
    on into the next epoch.

    It reads nothing from the device during the epoch, so ``fit`` keeps Keras's asynchronous
    dispatch: at the end of the epoch (before validation, else at ``on_epoch_end``) it flushes
    the optimizer and every :class:`AccumBatchNormalization` of the model, and reports the cycles
    the compiled step dropped as non-finite (``on_nonfinite="skip"``: a
    ``NonFiniteGradientWarning``). With ``on_nonfinite="raise"`` it checks before every batch
    instead (one read of a counter per batch), so ``NonFiniteGradientError`` stops ``fit`` before
    the step after the one that dropped the cycle.

    Example:
        >>> import numpy as np, keras
        >>> from gradient_accumulator.keras import GradientAccumulateOptimizer
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile(GradientAccumulateOptimizer("SGD", accum_steps=4), loss="mse")
        >>> x, y = np.ones((6, 2), "float32"), np.ones((6, 1), "float32")
        >>> _ = model.fit(x, y, batch_size=1, verbose=0)  # FlushAccumulation added by fit
        >>> int(model.optimizer.iterations)  # one full cycle, then 2 leftover micro-batches
        2
    """

    def __init__(self) -> None:
        super().__init__()
        self._training = False

    def on_train_begin(self, logs: Any = None) -> None:
        """Note that ``fit`` runs (validation inside it flushes first)."""
        self._training = True

    def on_train_end(self, logs: Any = None) -> None:
        """End of ``fit``."""
        self._training = False

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        """With ``on_nonfinite="raise"``: raise for a cycle the previous step dropped."""
        # ``_model``: Keras's ``model`` property syncs JAX's whole training state each time.
        model = getattr(self, "_model", None)
        opt = find_accumulator(getattr(model, "optimizer", None))
        if opt is not None and opt.on_nonfinite == "raise":
            self._report_nonfinite(model, opt)

    def on_test_begin(self, logs: Any = None) -> None:
        """Validation inside ``fit``: the epoch's short cycle is applied first."""
        if self._training:
            self._end_of_epoch()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """Flush the epoch's short cycle (no-op when validation did) and report drops."""
        self._end_of_epoch()

    def _end_of_epoch(self) -> None:
        opt = find_accumulator(getattr(self.model, "optimizer", None))
        if opt is None or not opt.built:
            return
        if keras.backend.backend() == "jax" and hasattr(self.model, "jax_state_sync"):
            self.model.jax_state_sync()
        flushed = False
        if opt.leftover == "apply":
            flushed = opt.flush()  # reports the dropped cycles itself
            flush_batchnorm(self.model)
        if not flushed:
            opt.report_nonfinite()

    @staticmethod
    def _report_nonfinite(model: Any, opt: GradientAccumulateOptimizer) -> None:
        if not opt.built or not opt.drops_nonfinite:
            return
        state = getattr(model, "_jax_state", None)
        if state and state.get("optimizer_variables") is not None:
            # JAX fit keeps the current values in the trainer's state until it syncs them.
            where = _packed.locate(model.optimizer.variables, opt.counter("skipped"))
            opt.report_nonfinite(int(_packed.read(state["optimizer_variables"], where)))
        else:
            opt.report_nonfinite()


def _first_input(data: Any) -> Any:
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    return next(t for t in keras.tree.flatten(x) if t is not None)


def _batch_size(data: Any) -> Any:
    return keras.ops.cast(keras.ops.shape(_first_input(data))[0], "float32")


def _relative_batch_size(model: Any, data: Any) -> Any:
    """JAX: the batch's number of samples relative to the first batch a step was traced for,
    a constant of the trace (JAX's shapes are static; a batch of another size is another
    trace). Weights only count relative to each other, and a full batch then weighs exactly 1,
    which leaves XLA's compiled step what it is without the wrapper: a weight such as 32 (an
    exact power of two) made XLA compile the backward differently and changed gradients in the
    last bit, where the plain optimizer must be matched bit for bit."""
    n = _first_input(data).shape[0]
    if not isinstance(n, int):  # not a static size: the size itself
        return _batch_size(data)
    unit = getattr(model, "_batch_weight_unit", None)
    if unit is None:
        unit = n
        object.__setattr__(model, "_batch_weight_unit", n)
    return keras.ops.convert_to_tensor(n / unit, "float32")


def weigh_batch(model: Any, *args: Any) -> Any:
    """Write the batch's number of samples into the accumulating optimizer's
    ``counter("batch_weight")`` before a ``train_step`` (``args``: its arguments).

    TensorFlow and torch backends: ``args`` is ``(data,)``; the counter is assigned (the
    optimizer is built first if it is not yet, as Keras's first ``apply`` would, so that the
    first batch of an eager run is weighed too). JAX: ``args`` is ``(state, data)`` and the
    state with the weight in its optimizer values is returned; the weight there is the size
    relative to the first batch traced (see :func:`_relative_batch_size`).
    """
    opt = find_accumulator(getattr(model, "optimizer", None))
    if keras.backend.backend() == "jax":
        state, data = args
        if opt is None:
            return state
        trainable, non_trainable, optimizer_values, metrics = state
        optimizer_values = list(optimizer_values)
        where = _packed.locate(model.optimizer.variables, opt.counter("batch_weight"))
        _packed.write(optimizer_values, where, _relative_batch_size(model, data))
        return trainable, non_trainable, optimizer_values, metrics
    (data,) = args
    if opt is not None:
        if not opt.built:
            model.optimizer.build(model.trainable_variables)
        weight = opt.counter("batch_weight")
        if keras.backend.backend() == "torch":
            # Eager: the size is a number, written in place (a Keras assign converts and
            # checks it first, a visible share of a small model's step).
            weight.value.fill_(float(_first_input(data).shape[0]))
        else:
            weight.assign(_batch_size(data))
    return None


def flush_batchnorm(model: Any) -> int:
    """Flush every :class:`AccumBatchNormalization` layer of ``model`` (see its ``flush``).

    Returns:
        The number of layers that had a short cycle pending.
    """
    from gradient_accumulator.keras.layers import AccumBatchNormalization

    layers = model._flatten_layers(include_self=False) if model is not None else []
    return sum(
        bool(layer.flush()) for layer in layers if isinstance(layer, AccumBatchNormalization)
    )


def _with_flush(callbacks: Any, model: Any) -> None:
    """Put a FlushAccumulation first in ``callbacks`` (a CallbackList) when ``model``'s
    optimizer accumulates: its epoch-end flush must come before the other callbacks see the
    epoch's weights (a checkpoint, an early stop)."""
    opt = find_accumulator(getattr(model, "optimizer", None))
    if opt is None:
        return
    retrace = opt._retrace_if_changed(model)  # a setting changed since fit compiled its step
    _weigh_batches(model, fresh=retrace)
    found = [c for c in callbacks.callbacks if isinstance(c, FlushAccumulation)]
    flush = found[0] if found else FlushAccumulation()
    callbacks.callbacks = [flush] + [c for c in callbacks.callbacks if c is not flush]
    if not found:
        flush.set_model(model)
        if getattr(callbacks, "params", None):
            flush.set_params(callbacks.params)


def _weigh_batches(model: Any, fresh: bool = False) -> None:
    """Give ``model`` (a plain ``keras.Model`` compiled with an accumulating optimizer) a
    ``train_step`` that writes each batch's number of samples as its weight before Keras's own
    step, as :class:`GradientAccumulateModel` does, so that ``fit``'s short last batch counts as
    much as it should. Set on the instance, once; the step is looked up when ``fit`` makes its
    train function, which it does after setting the callbacks' model. ``fresh``: the compiled
    step was dropped; a new function object is set, since ``jax.jit`` keeps its traces per
    function object and would otherwise hand back the step traced with the old settings."""
    if not hasattr(model, "train_step"):
        return
    if getattr(model, "_weighs_batches", False):
        step = getattr(model, "_plain_train_step", None)
        if not fresh or step is None:  # a GradientAccumulateModel weighs its batches itself
            return
    else:
        step = model.train_step
        object.__setattr__(model, "_plain_train_step", step)

    def train_step(*args: Any) -> Any:
        if keras.backend.backend() == "jax":
            return step(weigh_batch(model, *args), args[1])
        weigh_batch(model, *args)
        return step(*args)

    object.__setattr__(model, "train_step", train_step)
    object.__setattr__(model, "_weighs_batches", True)
    # A train function made before (train_on_batch, predict is unaffected) calls the old step.
    object.__setattr__(model, "train_function", None)


# Every fit puts FlushAccumulation first when the model's optimizer accumulates.
_compat.install_fit_hook(_with_flush)
