"""End-of-epoch handling of a cycle cut short by the end of the data.

``fit`` gets it by itself: importing this package hooks :class:`FlushAccumulation` into the
callbacks of every model whose optimizer is (or wraps) a :class:`GradientAccumulateOptimizer`,
plain ``keras.Model`` or :class:`GradientAccumulateModel` alike. The same hook gives such a
plain model a ``train_step`` that passes each batch's number of samples to the optimizer as the
batch's weight (:func:`weighing`), as :class:`GradientAccumulateModel`'s own step does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras

from gradient_accumulator.keras import _compat, _packed, _shells
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
    dispatch. On TensorFlow (without a ``tf.distribute`` strategy) and JAX, when ``fit`` knows
    the number of steps of an epoch, the epoch's last step ends the cycle itself, short or not,
    as the flush after it would: when the first epoch begins, the callback writes the steps of
    each epoch and the steps left in the fit into two counters of the optimizer (the epoch's
    clock, not saved), which the compiled step counts down, so the clock stops by itself after
    the fit's last step (an early stop clears it). At
    the end of the epoch (before validation, else at ``on_epoch_end``) it reads the
    optimizer's counters once, flushes what is still pending (no clock: the torch backend, a
    strategy, data of unknown length; or an epoch cut short) and every
    :class:`AccumBatchNormalization` of the model, and reports the cycles the compiled step
    dropped as non-finite (``on_nonfinite="skip"``: a ``NonFiniteGradientWarning``). With
    ``on_nonfinite="raise"`` it checks before every batch instead (one read of a counter per
    batch), so ``NonFiniteGradientError`` stops ``fit`` before the step after the one that
    dropped the cycle.

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
        self._batchnorms: list | None = None  # the model's AccumBatchNormalization layers
        self._epoch = 0
        self._epoch_done = False
        # The clock this fit set: its optimizer, the steps of each epoch, the steps it has left
        # after the current epoch.
        self._clock: GradientAccumulateOptimizer | None = None
        self._steps = 0
        self._left = 0
        self._start_later = False  # the optimizer was not built when the epoch began

    def _optimizer(self) -> GradientAccumulateOptimizer | None:
        # ``_model``: Keras's ``model`` property syncs JAX's whole training state each time.
        return find_accumulator(getattr(getattr(self, "_model", None), "optimizer", None))

    def on_train_begin(self, logs: Any = None) -> None:
        """Note that ``fit`` runs (validation inside it flushes first)."""
        self._training = True
        self._batchnorms = None

    def on_train_end(self, logs: Any = None) -> None:
        """End of ``fit``: stop the clock if steps are left on it (an early stop)."""
        self._training, self._start_later = False, False
        if self._clock is not None and self._left:
            self._clock._set_epoch_clock(0, 0)
        self._clock = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        """A new epoch: its end is still to come; the clock starts with the first one."""
        self._epoch, self._epoch_done, self._start_later = epoch, False, False
        if self._clock is None and self._training:
            self._start_clock(done=0)

    def _start_clock(self, done: int) -> None:
        """Set the clock for the rest of ``fit``, ``done`` steps into the current epoch."""
        opt = self._optimizer()
        steps = (self.params or {}).get("steps")
        if opt is None or not steps or opt.leftover != "apply":
            return
        if not opt.built:
            # TensorFlow builds the optimizer in the first step (without a strategy): the
            # clock starts before the second.
            self._start_later = _compat.builds_optimizer_in_step()
            return
        left = self._steps_left(int(steps), self._epoch) - done
        if opt._set_epoch_clock(int(steps), left):
            self._clock, self._steps, self._left = opt, int(steps), left

    def _steps_left(self, steps: int, epoch: int) -> int:
        """The steps of ``fit`` from epoch ``epoch`` on (within the counter's int32 range: a
        longer fit sets the clock again where it ran out)."""
        epochs = int((self.params or {}).get("epochs") or 0)
        return min(max(epochs - epoch, 0) * steps, (2**31 - 1) // steps * steps)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        """With ``on_nonfinite="raise"``: raise for a cycle the previous step dropped. In the
        first epoch on TensorFlow: start the clock once the optimizer is built."""
        if self._start_later and batch > 0:
            self._start_later = False
            self._start_clock(done=batch)
        opt = self._optimizer()
        if opt is not None and opt.on_nonfinite == "raise":
            self._report_nonfinite(self._model, opt)

    def on_test_begin(self, logs: Any = None) -> None:
        """Validation inside ``fit``: the epoch's short cycle is applied first."""
        if self._training:
            self._end_of_epoch()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """Flush the epoch's short cycle (no-op when validation did) and report drops."""
        self._end_of_epoch()

    def _end_of_epoch(self) -> None:
        if self._epoch_done and self._training:
            return  # validation ended this epoch already
        opt = self._optimizer()
        if opt is None or not opt.built:
            return
        model = self._model
        self._epoch_done = True
        if _compat.stateless_trainer() and hasattr(model, "jax_state_sync"):
            model.jax_state_sync()
        counters = opt._cycle_counters()
        flushed = False
        if opt.leftover == "apply":
            if counters["micro_step"]:  # no clock, or an epoch cut short
                flushed = opt.flush()  # reports the dropped cycles itself
            if self._batchnorms is None:  # found once per fit
                self._batchnorms = _batchnorm_layers(model)
            for layer in self._batchnorms:
                layer.flush()
        if self._clock is opt:
            self._wind_clock(opt, counters["steps_left"])
        if not flushed:
            opt.report_nonfinite(counters["skipped"])

    def _wind_clock(self, opt: GradientAccumulateOptimizer, left_now: int) -> None:
        """At the end of an epoch: set the clock again where it is not where a whole epoch
        leaves it (an epoch cut short, the int32 range; on TensorFlow, whose clock counts one
        epoch, at every epoch but the last), or stop it (``leftover`` set to ``"carry"`` during
        ``fit``)."""
        self._left = 0
        if opt.leftover == "apply":
            self._left = self._steps_left(self._steps, self._epoch + 1)
        if left_now != self._left:
            opt._set_epoch_clock(self._steps, self._left)

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
    if _compat.stateless_trainer():
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
        if _compat.eager_trainer():
            # Eager: the size is a number, written in place (a Keras assign converts and
            # checks it first, a visible share of a small model's step).
            weight.value.fill_(float(_first_input(data).shape[0]))
        else:
            weight.assign(_batch_size(data))
    return None


@contextlib.contextmanager
def weighing(model: Any, data: Any, stash: bool = True) -> Iterator[None]:
    """TensorFlow and torch: the ``train_step`` run inside weighs its micro-batch by
    ``data``'s number of samples, as :func:`weigh_batch`. TensorFlow without a strategy hands
    the size to the optimizer's fold as a tensor of the step instead of writing it into
    ``counter("batch_weight")``, which the fold would read back: a write, a read and their
    ordering less per step (a strategy's replicas each write their own). Not with ``stash``
    False (a user's own ``train_step``, which may apply from a ``tf.function`` of its own,
    where the step's tensor cannot be used): the size is written into the counter."""
    opt = find_accumulator(getattr(model, "optimizer", None))
    # The optimizer's shell takes the size (TensorFlow without a strategy: see _shells).
    if opt is None or not stash or not _shells.takes_step_weight():
        weigh_batch(model, data)
        yield
        return
    opt.__dict__["_step_weight"] = _batch_size(data)  # untracked: a tensor of this step only
    try:
        yield
    finally:
        opt.__dict__.pop("_step_weight", None)


def flush_batchnorm(model: Any) -> int:
    """Flush every :class:`AccumBatchNormalization` layer of ``model`` (see its ``flush``).

    Returns:
        The number of layers that had a short cycle pending.
    """
    return sum(bool(layer.flush()) for layer in _batchnorm_layers(model))


def _batchnorm_layers(model: Any) -> list[Any]:
    """The :class:`AccumBatchNormalization` layers of ``model`` (an empty list for ``None``)."""
    from gradient_accumulator.keras.layers import AccumBatchNormalization

    layers = model._flatten_layers(include_self=False) if model is not None else []
    return [layer for layer in layers if isinstance(layer, AccumBatchNormalization)]


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
    ``train_step`` that passes each batch's number of samples as its weight to Keras's own
    step (:func:`weighing`), as :class:`GradientAccumulateModel` does, so that ``fit``'s
    short last batch counts as much as it should. Set on the instance, once; the step is
    looked up when ``fit`` makes its train function, which it does after setting the
    callbacks' model. ``fresh``: the compiled
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
    # Keras's own step applies in the step's graph; a user's may apply from a nested function.
    own = getattr(step, "__func__", None) is keras.Model.train_step

    def train_step(*args: Any) -> Any:
        if _compat.stateless_trainer():
            return step(weigh_batch(model, *args), args[1])
        with weighing(model, *args, stash=own):
            return step(*args)

    object.__setattr__(model, "train_step", train_step)
    object.__setattr__(model, "_weighs_batches", True)
    # A train function made before (train_on_batch, predict is unaffected) calls the old step.
    object.__setattr__(model, "train_function", None)


# Every fit puts FlushAccumulation first when the model's optimizer accumulates.
_compat.install_fit_hook(_with_flush)
