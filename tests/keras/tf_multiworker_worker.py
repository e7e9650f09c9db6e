"""One worker of test_keras_multiworker.py: ``tf.distribute.MultiWorkerMirroredStrategy`` over
worker processes on localhost (TF_CONFIG set by the test), one CPU replica each.

``python tf_multiworker_worker.py OUT_DIR`` trains, for each wrapper, a small model with
accumulation (4 global micro-batches of 8 per update, each split between the workers) and
writes ``OUT_DIR/worker{index}.json``: the weights after training, the all-reduces each
micro-step ran (their sizes, recorded as they run, not as they are traced), and the weights
after resuming from a ``ModelCheckpoint`` written in the middle of a cycle.

The helpers above ``main`` (data, initial weights, the model) are shared with the test, which
trains the big-batch reference in its own process.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

ACCUM, MICRO, SAMPLES, EPOCHS = 4, 8, 64, 2
CLIPNORM = 0.05  # below the gradients' global norm, so every update is clipped
AGC_FACTOR = 0.01  # small enough that AGC clips the updates
WRAPPERS = ("model", "optimizer")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    w = rng.normal(size=(6, 3)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(SAMPLES, 3))).astype("float32")
    return x, y


def initial_weights():
    rng = np.random.default_rng(1)
    shapes = [(6, 8), (8,), (8, 3), (3,)]
    return [(0.5 * rng.normal(size=s)).astype("float32") for s in shapes]


def build(wrapper: str, accum: int, global_clipnorm: float | None = None, use_agc: bool = False):
    """Dense(8, tanh) → Dense(3), compiled with Adam (traced, not XLA-compiled); with
    ``global_clipnorm``, clipped by Keras (plain) or by the wrapper (cycle's gradient); with
    ``use_agc``, the wrapper's AGC (``AGC_FACTOR``, every layer)."""
    import keras

    from gradient_accumulator.keras import GradientAccumulateModel, GradientAccumulateOptimizer

    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3)(h)
    clip = {} if global_clipnorm is None else {"global_clipnorm": global_clipnorm}
    inner = keras.optimizers.Adam(0.05, **(clip if wrapper == "plain" else {}))
    if wrapper == "plain":
        model = keras.Model(inputs, outputs)
        model.compile(inner, loss="mse", jit_compile=False)
    elif wrapper == "model":
        model = GradientAccumulateModel(accum_steps=accum, inputs=inputs, outputs=outputs)
        model.compile(inner, loss="mse", jit_compile=False)
    else:
        model = keras.Model(inputs, outputs)
        model.compile(
            GradientAccumulateOptimizer(
                inner,
                accum_steps=accum,
                **clip,
                **(
                    {"use_agc": True, "clip_factor": AGC_FACTOR, "agc_exclude": None}
                    if use_agc
                    else {}
                ),
            ),
            loss="mse",
            jit_compile=False,
        )
    model.set_weights(initial_weights())
    return model


def flat(model) -> list[float]:
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in model.get_weights()]).tolist()


class AllReduceCounter:
    """Records the collective all-reduces that run, by their number of elements.

    Every all-reduce of the strategy (packed or not) is built by TensorFlow's
    ``collective_ops.all_reduce_v2``; each op built through it gets a Python callback that runs
    after the op runs (inside a conditional only when its branch is taken), not when it is
    traced.
    """

    def __init__(self) -> None:
        from tensorflow.python.ops import collective_ops

        self.sizes: list[int] = []
        self._original = collective_ops.all_reduce_v2
        collective_ops.all_reduce_v2 = self._wrapped

    def _record(self, size) -> np.int64:
        self.sizes.append(int(size))
        return np.int64(len(self.sizes))

    def _wrapped(self, t, *args, **kwargs):
        import tensorflow as tf

        out = self._original(t, *args, **kwargs)
        with tf.control_dependencies([out]):
            ran = tf.numpy_function(self._record, [tf.size(out)], tf.int64, stateful=True)
        with tf.control_dependencies([ran]):
            return tf.identity(out)


def main(out_dir: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    # Keras 3.15's fit cannot run under this strategy as it stands, with or without
    # accumulation: it reduces the (x, y) batch with one strategy.reduce call, which fails
    # across workers for a tuple ("Attempt to convert a value (PerReplica"), and its scalar logs
    # with axis=0 ("Invalid reduction dimension 0 for input with 0 dimensions"). Reduced here
    # leaf by leaf, scalars over replicas only; the training step itself is left alone.
    reduce = strategy.reduce

    def reduce_leaves(op, value, axis=None):
        def leaf(v):
            rank = len(strategy.experimental_local_results(v)[0].shape)
            return reduce(op, v, axis=axis if rank else None)

        return tf.nest.map_structure(leaf, value)

    strategy.reduce = reduce_leaves
    counter = AllReduceCounter()

    class PerStep(keras.callbacks.Callback):
        """The all-reduces each training step ran."""

        def on_train_begin(self, logs=None):
            self.counts, self.last = [], len(counter.sizes)

        def on_train_batch_end(self, batch, logs=None):
            self.counts.append(counter.sizes[self.last :])
            self.last = len(counter.sizes)

    x, y = data()

    def batches(start: int, stop: int, size: int):
        # Each global batch split between the workers (sharded by data, not by file).
        ds = tf.data.Dataset.from_tensor_slices((x[start:stop], y[start:stop])).batch(size)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        return ds.with_options(options)

    result: dict = {"replicas": strategy.num_replicas_in_sync}
    # The big batch under the same strategy: Keras's own all-reduces per update, for comparison.
    with strategy.scope():
        plain = build("plain", 1)
    steps = PerStep()
    plain.fit(batches(0, SAMPLES, ACCUM * MICRO), epochs=EPOCHS, verbose=0, callbacks=[steps])
    result["plain"] = {"weights": flat(plain), "all_reduces": steps.counts}
    for wrapper in WRAPPERS:
        with strategy.scope():
            model = build(wrapper, ACCUM)
        steps = PerStep()
        model.fit(batches(0, SAMPLES, MICRO), epochs=EPOCHS, verbose=0, callbacks=[steps])
        entry = {"weights": flat(model), "all_reduces": steps.counts}
        entry["iterations"] = int(model.optimizer.iterations.numpy())
        # Checkpoint after 6 micro-batches (half-way through the second cycle, accumulators
        # non-zero), on every worker (reading the replica-local accumulators is a collective);
        # the chief's file is the one resumed from, the other worker's goes to its own path.
        path = os.path.join(out_dir, f"{wrapper}-{index}.keras")
        with strategy.scope():
            model = build(wrapper, ACCUM)
        checkpoint = keras.callbacks.ModelCheckpoint(path, save_freq=6)
        model.fit(batches(0, 6 * MICRO, MICRO), verbose=0, callbacks=[checkpoint])
        with strategy.scope():
            resumed = keras.models.load_model(os.path.join(out_dir, f"{wrapper}-0.keras"))
        entry["pending_after_load"] = int(resumed.optimizer.pending())
        # The rest of the first epoch, then the second.
        resumed.fit(batches(6 * MICRO, SAMPLES, MICRO), verbose=0)
        resumed.fit(batches(0, SAMPLES, MICRO), epochs=EPOCHS - 1, verbose=0)
        entry["resumed_weights"] = flat(resumed)
        entry["resumed_iterations"] = int(resumed.optimizer.iterations.numpy())
        result[wrapper] = entry
    # The wrapper's global-norm clipping and AGC: the cycle's gradient summed over the workers,
    # then clipped.
    for name, settings in (("clipped", {"global_clipnorm": CLIPNORM}), ("agc", {"use_agc": True})):
        with strategy.scope():
            model = build("optimizer", ACCUM, **settings)
        steps = PerStep()
        try:
            model.fit(batches(0, SAMPLES, MICRO), epochs=EPOCHS, verbose=0, callbacks=[steps])
            result[name] = {"weights": flat(model), "all_reduces": steps.counts}
        except Exception as e:  # reported to the test
            result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    with open(os.path.join(out_dir, f"worker{index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
