"""An epoch's short last cycle: applied at the epoch end with its true weight and counted as an
update, for both wrappers, with or without the FlushAccumulation callback, before validation
and before the other callbacks see the epoch — and at no cost per batch.

36 samples in micro-batches of 4 with ``accum_steps=2``: 4 full cycles and one of a single
micro-batch per epoch, so 5 updates per epoch, as a plain model with batches of 8 (the last
of 4) makes. Equal micro-batches, so the short cycle's mean is the last big batch's.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND, TOL, data, flat, mlp, rel_diff

from gradient_accumulator.keras import (
    FlushAccumulation,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)

ACCUM, MICRO, N, EPOCHS = 2, 4, 36, 2
UPDATES_PER_EPOCH = 5  # ceil(36 / 8)


def _big_batch(validation=None, callbacks=()):
    inputs, outputs = mlp()
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.02), loss="mse")
    x, y = data(N)
    history = model.fit(
        x,
        y,
        batch_size=ACCUM * MICRO,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        validation_data=validation,
        callbacks=list(callbacks),
    )
    return model, history


def _accumulating(wrapper):
    inputs, outputs = mlp()
    if wrapper == "model":
        model = GradientAccumulateModel(accum_steps=ACCUM, inputs=inputs, outputs=outputs)
        model.compile(keras.optimizers.Adam(0.02), loss="mse")
    else:
        model = keras.Model(inputs, outputs)
        model.compile(GradientAccumulateOptimizer(keras.optimizers.Adam(0.02), ACCUM), loss="mse")
    return model


class _WeightsAtEpochEnd(keras.callbacks.Callback):
    """Records the model's weights when its on_epoch_end runs (as a checkpoint would save)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(flat(self.model))


@pytest.mark.parametrize("callback", [False, True], ids=["no-callback", "callback"])
@pytest.mark.parametrize("wrapper", ["optimizer", "model"])
def test_short_last_cycle_is_applied_and_counted(wrapper, callback):
    """A plain model compiled with the optimizer wrapper used to leave the short cycle pending
    without the callback: 8 updates in 2 epochs against the big batch's 10, weights 4e-2 off."""
    ref, _ = _big_batch()
    model = _accumulating(wrapper)
    x, y = data(N)
    model.fit(
        x,
        y,
        batch_size=MICRO,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[FlushAccumulation()] if callback else None,
    )
    opt = model.optimizer
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == EPOCHS * UPDATES_PER_EPOCH
    assert int(keras.ops.convert_to_numpy(ref.optimizer.iterations)) == EPOCHS * UPDATES_PER_EPOCH
    assert opt.pending() == 0
    assert rel_diff(flat(model), flat(ref)) <= TOL


@pytest.mark.parametrize("wrapper", ["optimizer", "model"])
def test_flush_comes_before_validation_and_the_other_callbacks(wrapper):
    """Validation and every callback's on_epoch_end (a checkpoint, early stopping) see the
    epoch's weights with its short cycle applied, whatever the order of ``callbacks``."""
    xv, yv = data(12, seed=5)
    ref_seen = _WeightsAtEpochEnd()
    _, ref_history = _big_batch(validation=(xv, yv), callbacks=[ref_seen])
    for explicit in (False, True):
        model = _accumulating(wrapper)
        seen = _WeightsAtEpochEnd()
        x, y = data(N)
        history = model.fit(
            x,
            y,
            batch_size=MICRO,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            validation_data=(xv, yv),
            callbacks=[seen, FlushAccumulation()] if explicit else [seen],
        )
        np.testing.assert_allclose(
            history.history["val_loss"], ref_history.history["val_loss"], rtol=1e-5
        )
        assert len(seen.seen) == EPOCHS
        for ours, ref in zip(seen.seen, ref_seen.seen):
            assert rel_diff(ours, ref) <= TOL


def test_carry_keeps_the_short_cycle_pending_across_epochs():
    inputs, outputs = mlp()
    model = keras.Model(inputs, outputs)
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.02), ACCUM, leftover="carry")
    model.compile(opt, loss="mse")
    x, y = data(N)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 4
    assert opt.pending() == 1
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 9  # 18 micro-batches, 9 cycles
    assert opt.pending() == 0


def test_the_hook_leaves_other_models_alone():
    inputs, outputs = mlp()
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.02), loss="mse")
    callbacks = keras.callbacks.CallbackList([], model=model)
    assert not any(isinstance(c, FlushAccumulation) for c in callbacks.callbacks)
    model.compile(GradientAccumulateOptimizer(keras.optimizers.Adam(0.02), ACCUM), loss="mse")
    callbacks = keras.callbacks.CallbackList([keras.callbacks.History()], model=model)
    assert isinstance(callbacks.callbacks[0], FlushAccumulation)
    assert callbacks.callbacks[0]._model is model


@pytest.mark.skipif(
    BACKEND == "tensorflow",
    reason="this backend's fit calls batch-end callbacks synchronously anyway",
)
@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_callback_keeps_kerass_asynchronous_batch_end(on_nonfinite):
    """The callback used to override on_train_batch_end: Keras then ran every batch-end
    callback synchronously, converting the step's logs to Python numbers after each batch (a
    device-to-host sync), and the callback read a counter of the optimizer too: a JAX epoch of
    the model wrapper cost 3.7x to 45x Keras's built-in accumulation."""
    model = _accumulating("optimizer")
    model.optimizer.on_nonfinite = on_nonfinite
    callbacks = keras.callbacks.CallbackList(
        [FlushAccumulation()], add_history=True, model=model, epochs=1, steps=9
    )
    assert callbacks._async_train


def test_no_device_read_per_batch_with_skip(monkeypatch):
    """With ``on_nonfinite="skip"`` the callback reads the optimizer's state once per epoch, not
    once per batch (it used to read the dropped-cycle counter after every batch)."""
    model = _accumulating("optimizer")
    opt = model.optimizer
    reads = []
    original = GradientAccumulateOptimizer.report_nonfinite

    def counting(self, *args, **kwargs):
        reads.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GradientAccumulateOptimizer, "report_nonfinite", counting)
    x, y = data(N)
    model.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    # One report per epoch end, inside the flush of the short cycle (9 batches an epoch: it
    # used to be 9 + 2, then 2: the callback read the counter again after the flush).
    assert len(reads) == EPOCHS
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == EPOCHS * UPDATES_PER_EPOCH


def _unknown_length(n=N, size=MICRO):
    """One epoch of ``data(n)`` in batches of ``size`` from a generator: ``fit`` does not know
    the number of steps, so no epoch clock runs and the callback's flush applies the short
    cycle."""
    x, y = data(n)
    return ((x[i : i + size], y[i : i + size]) for i in range(0, n, size))


def _counting_flushes(monkeypatch):
    calls = []
    original = GradientAccumulateOptimizer.flush

    def counting(self):
        calls.append(self.pending())
        return original(self)

    monkeypatch.setattr(GradientAccumulateOptimizer, "flush", counting)
    return calls


# Where the last step of an epoch ends the cycle itself (fit's epoch clock).
CLOCK = BACKEND in ("tensorflow", "jax")


@pytest.mark.parametrize("steps_per_execution", [1, 3])
@pytest.mark.parametrize("wrapper", ["optimizer", "model"])
def test_the_epochs_last_step_ends_the_short_cycle(wrapper, steps_per_execution, monkeypatch):
    """On TensorFlow and JAX the epoch's last step ends the short cycle, so the epoch-end
    flush, a compiled update and its host reads after the epoch (about 0.4 ms of a 12 ms JAX
    epoch, benchmarks/README.md), has nothing left to do; before, it applied the short cycle
    at every epoch end. The same weights as the big batch, and no clock left after ``fit``."""
    if steps_per_execution > 1 and BACKEND == "torch":
        pytest.skip("Keras's torch backend runs one step per execution")
    ref, _ = _big_batch()
    model = _accumulating(wrapper)
    model.compile(model.optimizer, loss="mse", steps_per_execution=steps_per_execution)
    flushes = _counting_flushes(monkeypatch)
    x, y = data(N)
    model.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    opt = model.optimizer
    assert flushes == ([] if CLOCK else [1] * EPOCHS)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == EPOCHS * UPDATES_PER_EPOCH
    assert opt._cycle_counters()["micro_step"] == 0
    assert opt._cycle_counters()["steps_left"] == 0
    assert rel_diff(flat(model), flat(ref)) <= TOL


@pytest.mark.parametrize("wrapper", ["optimizer", "model"])
def test_data_of_unknown_length_is_flushed_at_the_epoch_end(wrapper, monkeypatch):
    inputs, outputs = mlp()
    ref = keras.Model(inputs, outputs)
    ref.compile(keras.optimizers.Adam(0.02), loss="mse")
    ref.fit(_unknown_length(size=ACCUM * MICRO), epochs=1, verbose=0)
    model = _accumulating(wrapper)
    flushes = _counting_flushes(monkeypatch)
    model.fit(_unknown_length(), epochs=1, verbose=0)
    assert flushes == [1]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == UPDATES_PER_EPOCH
    assert model.optimizer.pending() == 0
    assert rel_diff(flat(model), flat(ref)) <= TOL


class _StopAt(keras.callbacks.Callback):
    """Stops ``fit`` at the end of batch ``batch`` or of epoch ``epoch``."""

    def __init__(self, batch=None, epoch=None):
        super().__init__()
        self.batch, self.epoch = batch, epoch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.stop_training = True


@pytest.mark.parametrize(
    "stop, updates",
    [({"epoch": 0}, UPDATES_PER_EPOCH), ({"batch": 4}, 3)],  # 5 micro-batches: 2 cycles + 1
    ids=["after-epoch-0", "mid-epoch"],
)
def test_an_early_stop_leaves_no_clock_behind(stop, updates):
    """``fit`` stopped before its last step: the epoch's short cycle is applied at its end, and
    the steps that follow ``fit`` (``train_on_batch``) end a cycle after ``accum_steps``
    micro-batches only, not where the stopped fit's epoch would have ended."""
    model = _accumulating("optimizer")
    x, y = data(N)
    model.fit(
        x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0, callbacks=[_StopAt(**stop)]
    )
    opt = model.optimizer
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == updates
    assert opt.pending() == 0
    assert opt._cycle_counters()["steps_left"] == 0
    for i in range(9):  # one epoch's steps: 4 cycles and one micro-batch pending
        model.train_on_batch(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == updates + 4
    assert opt.pending() == 1


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX flush is a compiled function")
def test_jax_flush_is_compiled_once():
    """The JAX flush ran op by op, compiling its conditional afresh at every epoch end (1.7 s
    per epoch for a two-layer MLP); it is one jitted function, traced once (data of unknown
    length: the epoch clock does not end the cycle)."""
    model = _accumulating("optimizer")
    for _ in range(3):
        model.fit(_unknown_length(), epochs=1, verbose=0)
    cache = model.optimizer._shell._flush_cache
    assert len(cache) == 1
    assert next(iter(cache.values()))._cache_size() == 1


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the TensorFlow flush is a tf.function")
def test_tf_flush_is_traced_once():
    """The TensorFlow flush ran eagerly, op by op, at every epoch end (more than the rest of a
    small epoch's cost over Keras's own accumulation); it is one tf.function, traced once
    (data of unknown length: the epoch clock does not end the cycle)."""
    model = _accumulating("optimizer")
    for _ in range(3):
        model.fit(_unknown_length(), epochs=1, verbose=0)
    cache = model.optimizer._shell._flush_cache
    assert len(cache) == 1
    assert next(iter(cache.values())).experimental_get_tracing_count() == 1
