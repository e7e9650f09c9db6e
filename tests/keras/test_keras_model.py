"""GradientAccumulateModel: the original package's model-wrapper scenarios on synthetic data,
with assertions on weights (not accuracy), plus epoch ends, saving and resuming mid-cycle."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import (
    BACKEND,
    OPTIMIZERS,
    TOL,
    data,
    flat,
    mlp,
    rel_diff,
    train_accumulated,
    train_big_batch,
)

from gradient_accumulator.keras import GradientAccumulateModel, GradientAccumulateOptimizer


def _sgd():
    return keras.optimizers.SGD(0.05)


def _fit_pair(
    x,
    y,
    *,
    accum,
    micro,
    epochs=1,
    builder=mlp,
    fit_kwargs=None,
    compile_kwargs=None,
    leftover="apply",
    sample_weight=None,
    run_eagerly=False,
):
    """(plain model trained with batch accum·micro, model wrapper trained with micro × accum),
    both compiled with ``run_eagerly`` (Keras's eager evaluate reports other per-output losses
    than its compiled one, so the pair is compared in one mode)."""
    fit_kwargs = dict(fit_kwargs or {}, epochs=epochs, shuffle=False, verbose=0)
    compile_kwargs = compile_kwargs or {"loss": "mse"}
    inputs, outputs = builder()
    big = keras.Model(inputs, outputs)
    big.compile(_sgd(), run_eagerly=run_eagerly, **compile_kwargs)
    big.fit(x, y, batch_size=accum * micro, sample_weight=sample_weight, **fit_kwargs)
    inputs, outputs = builder()
    acc = GradientAccumulateModel(
        accum_steps=accum, leftover=leftover, inputs=inputs, outputs=outputs
    )
    acc.compile(_sgd(), run_eagerly=run_eagerly, **compile_kwargs)
    acc.fit(x, y, batch_size=micro, sample_weight=sample_weight, **fit_kwargs)
    return big, acc


EAGER = pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])


@EAGER
def test_expected_result_both_wrappers(run_eagerly):
    """The original's test_expected_result: bs 16 plain = bs 8 × 2, model and optimizer wrapper."""
    x, y = data(64)
    big, acc = _fit_pair(x, y, accum=2, micro=8, epochs=2, run_eagerly=run_eagerly)
    inputs, outputs = mlp()
    opt_model = keras.Model(inputs, outputs)
    opt_model.compile(
        GradientAccumulateOptimizer(_sgd(), accum_steps=2), loss="mse", run_eagerly=run_eagerly
    )
    opt_model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(flat(acc), flat(big)) <= TOL
    assert rel_diff(flat(opt_model), flat(big)) <= TOL
    assert rel_diff(flat(big), flat(keras.Model(*mlp()))) > 1e-2  # training moved the weights


@EAGER
def test_multitask_two_inputs_two_outputs(run_eagerly):
    """The original's test_multitask: 2 inputs, 2 outputs (MSE + cross-entropy), loss weights."""
    rng = np.random.default_rng(5)
    n = 48
    xa = rng.normal(size=(n, 5)).astype("float32")
    xb = rng.normal(size=(n, 3)).astype("float32")
    y_reg = rng.normal(size=(n, 2)).astype("float32")
    y_cls = rng.integers(0, 4, size=(n,))

    def builder():
        keras.utils.set_random_seed(1)
        a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
        reg = keras.layers.Dense(2, name="reg")(h)
        cls = keras.layers.Dense(4, activation="softmax", name="cls")(h)
        return [a, b], [reg, cls]

    compile_kwargs = {
        "loss": ["mse", "sparse_categorical_crossentropy"],
        "loss_weights": [1.0, 0.5],
        "metrics": [["mae"], ["accuracy"]],
    }
    big, acc = _fit_pair(
        [xa, xb],
        [y_reg, y_cls],
        accum=2,
        micro=8,
        epochs=2,
        builder=builder,
        compile_kwargs=compile_kwargs,
        run_eagerly=run_eagerly,
    )
    assert rel_diff(flat(acc), flat(big)) <= TOL
    np.testing.assert_allclose(
        acc.evaluate([xa, xb], [y_reg, y_cls], verbose=0),
        big.evaluate([xa, xb], [y_reg, y_cls], verbose=0),
        rtol=1e-5,
    )
    pred_acc, pred_big = acc.predict([xa, xb], verbose=0), big.predict([xa, xb], verbose=0)
    for p, q in zip(pred_acc, pred_big):
        np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "use_agc"), [(name, False) for name in OPTIMIZERS] + [("Adam", True)]
)
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_eager_fit_matches_the_big_batch(wrapper, name, use_agc):
    """test_keras_equivalence's scenario (4 × 4 per update, 2 epochs, a decaying schedule) with
    ``run_eagerly=True``. The eager TensorFlow model wrapper used to weigh its very first
    micro-batch 1 and the others by their size (the optimizer was built in the first step,
    after the weight was written): 1.65e-2 off with Adam."""
    got, model = train_accumulated(wrapper, name, use_agc, 4, 4, run_eagerly=True)
    assert model.run_eagerly
    assert rel_diff(got, train_big_batch(name, use_agc, 4, 4)) <= TOL
    assert int(model.optimizer.iterations) == 8


@EAGER
def test_sample_weight_and_uneven_last_batch(run_eagerly):
    """60 samples: big batches 16,16,16,12 vs micro-batches 8×7 + 4, with sample weights.

    Each micro-batch counts by its number of samples, so the last cycle (8 + 4) matches the big
    batch of 12.
    """
    x, y = data(60)
    sw = np.random.default_rng(2).uniform(0.5, 2.0, size=60).astype("float32")
    big, acc = _fit_pair(
        x, y, accum=2, micro=8, epochs=2, sample_weight=sw, run_eagerly=run_eagerly
    )
    assert rel_diff(flat(acc), flat(big)) <= TOL


@EAGER
@pytest.mark.parametrize("sample_weight", [False, True], ids=["unweighted", "sample-weight"])
def test_plain_model_with_the_optimizer_wrapper_weighs_a_short_last_batch(
    run_eagerly, sample_weight
):
    """A plain keras.Model compiled with GradientAccumulateOptimizer, in ``fit``: 60 samples,
    micro-batches 8×7 + 4, k=2, Adam, 2 epochs. The last cycle (8 + 4) must match the big batch
    of 12; each batch used to count 1/k, so the 4 samples weighed as 8 (7e-3 off)."""
    x, y = data(60)
    sw = np.random.default_rng(2).uniform(0.5, 2.0, size=60).astype("float32")
    fit_kwargs = dict(
        epochs=2, shuffle=False, verbose=0, sample_weight=sw if sample_weight else None
    )
    models = []
    for batch, opt in (
        (16, keras.optimizers.Adam(0.02)),
        (8, GradientAccumulateOptimizer(keras.optimizers.Adam(0.02), accum_steps=2)),
    ):
        model = keras.Model(*mlp())
        model.compile(opt, loss="mse", run_eagerly=run_eagerly)
        model.fit(x, y, batch_size=batch, **fit_kwargs)
        models.append(model)
    big, acc = models
    assert int(acc.optimizer.iterations) == int(big.optimizer.iterations) == 8
    assert rel_diff(flat(acc), flat(big)) <= TOL


def test_plain_model_fit_after_train_on_batch_weighs_batches():
    """A train function made before the first ``fit`` (by train_on_batch) is remade by it, so
    ``fit`` weighs the short last batch there too."""
    x, y = data(28)
    big = keras.Model(*mlp())
    big.compile(_sgd(), loss="mse")
    acc = keras.Model(*mlp())
    acc.compile(GradientAccumulateOptimizer(_sgd(), accum_steps=2), loss="mse")
    big.train_on_batch(x[:16], y[:16])
    acc.train_on_batch(x[:8], y[:8])
    acc.train_on_batch(x[8:16], y[8:16])
    big.fit(x, y, batch_size=16, shuffle=False, verbose=0)  # 16, 12
    acc.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # (8, 8), (8, 4)
    assert int(acc.optimizer.iterations) == int(big.optimizer.iterations) == 3
    assert rel_diff(flat(acc), flat(big)) <= TOL


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a train_step's nested tf.function")
@EAGER
def test_train_step_that_applies_from_a_nested_tf_function_weighs_every_batch(run_eagerly):
    """A ``train_step`` of a plain model that calls the wrapper's ``apply`` from a
    ``tf.function`` of its own. ``fit``'s step hands the wrapper the batch size as a tensor of
    the step; that function's first trace must not keep it: the second fit's short batch
    retraces the step (compiled: the kept tensor belonged to a dead graph and the fit raised;
    eager: the kept tensor weighed every later batch as the first). Two fits, cycles (8, 8)
    then (8, 4), against the plain model's big batches of 16 then 12 (SGD; 1e-6 relative)."""
    import tensorflow as tf

    class Nested(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            self._apply(tape.gradient(loss, self.trainable_variables))
            return {"loss": loss}

        @tf.function
        def _apply(self, grads):
            self.optimizer.apply(grads, self.trainable_variables)

    x, y = data(28)
    big = keras.Model(*mlp())
    big.compile(_sgd(), loss="mse", run_eagerly=run_eagerly)
    acc = Nested(*mlp())
    acc.compile(
        GradientAccumulateOptimizer(_sgd(), accum_steps=2), loss="mse", run_eagerly=run_eagerly
    )
    for part, batch in ((slice(0, 16), 16), (slice(16, 28), 12)):
        big.fit(x[part], y[part], batch_size=batch, shuffle=False, verbose=0)
        acc.fit(x[part], y[part], batch_size=8, shuffle=False, verbose=0)
    assert int(acc.optimizer.iterations) == int(big.optimizer.iterations) == 2
    assert rel_diff(flat(acc), flat(big)) <= 1e-6


@EAGER
def test_short_last_cycle_applied_with_true_weight(run_eagerly):
    """40 samples, k=4, micro 4: cycles 16, 16 and a short one of 8, applied at the epoch end."""
    x, y = data(40)
    big, acc = _fit_pair(x, y, accum=4, micro=4, epochs=3, run_eagerly=run_eagerly)
    assert rel_diff(flat(acc), flat(big)) <= TOL
    assert int(acc.optimizer.iterations) == 9 and acc.optimizer.pending() == 0


@EAGER
def test_short_last_cycle_carried_over(run_eagerly):
    """leftover="carry": the 2 leftover micro-batches open the next epoch's first cycle."""
    x, y = data(40)
    inputs, outputs = mlp()
    carry = GradientAccumulateModel(accum_steps=4, leftover="carry", inputs=inputs, outputs=outputs)
    carry.compile(_sgd(), loss="mse", run_eagerly=run_eagerly)
    carry.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(carry.optimizer.iterations) == 2 and carry.optimizer.pending() == 2
    carry.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(carry.optimizer.iterations) == 5 and carry.optimizer.pending() == 0
    # Same stream of 20 micro-batches in 5 full cycles as one fit over the data twice, k·b = 16.
    inputs, outputs = mlp()
    big = keras.Model(inputs, outputs)
    big.compile(_sgd(), loss="mse")
    xx, yy = np.concatenate([x, x]), np.concatenate([y, y])
    big.fit(xx, yy, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(flat(carry), flat(big)) <= TOL


def test_validation_sees_the_flushed_weights():
    x, y = data(40)
    inputs, outputs = mlp()
    model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    model.compile(_sgd(), loss="mse")
    hist = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, validation_data=(x, y))
    assert hist.history["val_loss"][0] == pytest.approx(model.evaluate(x, y, verbose=0), rel=1e-5)


def test_param_count_unchanged():
    """The original's test_param_count: wrapping adds no weight."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10,))
    x = keras.layers.Dense(32)(inputs)
    x = keras.layers.Dense(16)(x)
    outputs = keras.layers.Dense(1)(x)
    plain = keras.Model(inputs, outputs)
    wrapped = GradientAccumulateModel(accum_steps=4, inputs=plain.input, outputs=plain.output)
    assert wrapped.count_params() == plain.count_params() == 10 * 32 + 32 + 32 * 16 + 16 + 17
    assert len(wrapped.weights) == len(plain.weights)


def test_save_and_load_keras_format(tmp_path):
    x, y = data(32)
    inputs, outputs = mlp()
    model = GradientAccumulateModel(
        accum_steps=4, use_agc=True, clip_factor=0.05, inputs=inputs, outputs=outputs
    )
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, GradientAccumulateModel)
    config = loaded.get_config()
    assert (config["accum_steps"], config["use_agc"], config["clip_factor"]) == (4, True, 0.05)
    assert isinstance(loaded.optimizer, GradientAccumulateOptimizer)
    assert loaded.optimizer.accum_steps == 4
    np.testing.assert_allclose(flat(loaded), flat(model))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


@EAGER
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_resume_mid_cycle(tmp_path, name, run_eagerly):
    """Saved after 6 micro-batches (k=4), reloaded, 2 more: same as 8 without stopping."""
    x, y = data(32)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 32, 4)]

    def new_model():
        inputs, outputs = mlp()
        model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
        opt = (
            keras.optimizers.SGD(0.05, momentum=0.9)
            if name == "SGD"
            else keras.optimizers.Adam(0.01)
        )
        model.compile(opt, loss="mse", run_eagerly=run_eagerly)
        return model

    straight = new_model()
    for xb, yb in batches:
        straight.train_on_batch(xb, yb)
    first = new_model()
    for xb, yb in batches[:6]:
        first.train_on_batch(xb, yb)
    assert first.optimizer.pending() == 2
    first.save(tmp_path / "mid.keras")
    resumed = keras.models.load_model(tmp_path / "mid.keras")
    resumed.run_eagerly = run_eagerly
    assert resumed.optimizer.pending() == 2
    for xb, yb in batches[6:]:
        resumed.train_on_batch(xb, yb)
    assert int(resumed.optimizer.iterations) == 2
    assert rel_diff(flat(resumed), flat(straight)) <= 1e-6


def test_apply_and_reinit_like_the_original():
    x, y = data(8)
    inputs, outputs = mlp()
    model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    model.compile(_sgd(), loss="mse")
    model.train_on_batch(x[:4], y[:4])
    before = flat(model)
    model.reinit_grad_accum()
    assert model.optimizer.pending() == 0 and not model.apply_accu_gradients()
    model.train_on_batch(x[4:], y[4:])
    assert model.apply_accu_gradients()
    assert int(model.optimizer.iterations) == 1
    # Only the second batch was applied: same as one plain step on it.
    inputs, outputs = mlp()
    plain = keras.Model(inputs, outputs)
    plain.compile(_sgd(), loss="mse")
    plain.train_on_batch(x[4:], y[4:])
    assert rel_diff(flat(model), flat(plain)) <= TOL
    assert rel_diff(flat(model), before) > 1e-4


def test_compile_with_a_wrapped_optimizer():
    inputs, outputs = mlp()
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    opt = GradientAccumulateOptimizer("adam", accum_steps=2)
    model.compile(opt, loss="mse")
    assert model.optimizer is opt
    with pytest.raises(ValueError, match="accum_steps"):
        model.compile(GradientAccumulateOptimizer("adam", accum_steps=3), loss="mse")


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": 1.5}, TypeError, "accum_steps"),
        ({"use_agc": "no"}, TypeError, "use_agc"),
        ({"clip_factor": 0}, ValueError, "clip_factor"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"leftover": "x"}, ValueError, "leftover"),
        ({"mixed_precision": 2}, TypeError, "mixed_precision"),
    ],
)
def test_bad_arguments(kwargs, error, name):
    inputs, outputs = mlp()
    with pytest.raises(error, match=name):
        GradientAccumulateModel(inputs=inputs, outputs=outputs, **kwargs)


def _settings(model):
    return {
        name: getattr(model, name)
        for name in ("accum_steps", "mixed_precision", "use_agc", "leftover", "on_nonfinite")
    }


@pytest.mark.parametrize("compiled", [False, True])
def test_clone_model_keeps_the_accumulation(compiled):
    """keras.models.clone_model calls the class with (inputs, outputs): the clone is a
    GradientAccumulateModel with the original's settings, and trains like it."""
    x, y = data(24)
    inputs, outputs = mlp()
    model = GradientAccumulateModel(
        accum_steps=3, leftover="carry", on_nonfinite="raise", inputs=inputs, outputs=outputs
    )
    if compiled:
        model.compile(_sgd(), loss="mse")
    clone = keras.models.clone_model(model)
    assert type(clone) is GradientAccumulateModel
    assert _settings(clone) == _settings(model)
    clone.set_weights(model.get_weights())
    if not compiled:
        model.compile(_sgd(), loss="mse")
        clone.compile(_sgd(), loss="mse")
    assert clone.optimizer is not model.optimizer and clone.optimizer.accum_steps == 3
    for m in (model, clone):
        m.fit(x, y, batch_size=4, shuffle=False, verbose=0)  # 6 batches, 2 cycles
    assert int(clone.optimizer.iterations) == int(model.optimizer.iterations) == 2
    np.testing.assert_allclose(flat(clone), flat(model), rtol=0, atol=1e-6)


def test_config_round_trips_keep_the_settings(tmp_path):
    inputs, outputs = mlp()
    model = GradientAccumulateModel(
        accum_steps=3, use_agc=True, leftover="carry", inputs=inputs, outputs=outputs
    )
    again = GradientAccumulateModel.from_config(model.get_config())
    assert type(again) is GradientAccumulateModel and _settings(again) == _settings(model)
    model.compile(_sgd(), loss="mse")
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is GradientAccumulateModel and _settings(loaded) == _settings(model)
    np.testing.assert_array_equal(flat(loaded), flat(model))


_WARNINGS_SCRIPT = """
import numpy as np, keras
from gradient_accumulator.keras import (
    AccumBatchNormalization, FlushAccumulation, GradientAccumulateModel,
    GradientAccumulateOptimizer,
)
from gradient_accumulator.keras.callbacks import find_accumulator
rng = np.random.default_rng(0)
x = rng.normal(size=(14, 4)).astype("float32")
y = rng.normal(size=(14, 2)).astype("float32")

def head():
    inputs = keras.Input((4,))
    h = AccumBatchNormalization(accum_steps=2)(keras.layers.Dense(5)(inputs))
    return inputs, keras.layers.Dense(2, dtype="float32")(h)

for policy in ("float32", "mixed_float16"):
    keras.config.set_dtype_policy(policy)
    for inner in ("adam",):  # the torch core's fused Adam reads the learning rate
        inputs, outputs = head()
        model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
        model.compile(inner, loss="mse")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y))
        plain = keras.Model(*head())
        plain.compile(GradientAccumulateOptimizer(inner, accum_steps=2), loss="mse")
        plain.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[FlushAccumulation()])
        find_accumulator(plain.optimizer).report_nonfinite()
print("done")
"""


def test_no_deprecation_warning_with_warnings_as_errors(backend, tmp_path):
    """Both wrappers' fit (flushes, batch norm, mixed precision, the torch core's Adam) under
    ``python -W error::DeprecationWarning``: NumPy 2 warns when an ``__array__`` without the
    ``copy`` keyword is used (keras.Variable's, tf.Variable's, torch.Tensor's)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "fit.py"
    script.write_text(_WARNINGS_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The checkout first, then whatever the caller's path holds (a GPU machine's carried wheels).
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
