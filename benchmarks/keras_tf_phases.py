"""Keras on TensorFlow: the compiled train step, timed per micro-step of the cycle.

``keras_step.py`` times whole ``fit`` epochs, one figure per implementation. Here each model's
compiled ``train_function`` (Keras's own, one ``tf.function`` per step) is called in a loop on
a ``tf.data`` iterator, and each call is timed where it falls in the cycle: k − 1 micro-steps
that only accumulate, then the boundary that also updates. Four implementations over the same
Adam on the MLP of ``keras_step.py``'s per-micro-batch table (256 → 512 × 3 → 10, micro-batches
of 32):

* ``built-in``: Keras's ``gradient_accumulation_steps=k``;
* ``GradientAccumulateOptimizer``: ours, as shipped (the boundary checks the cycle's gradient
  for NaN and Inf by summing each tensor, and looks at the elements only if the total is not
  finite);
* ``elementwise check``: ours with the check the boundary made before (``is_finite`` and
  ``reduce_all`` on every tensor), set while that model's step is traced;
* ``no check``: ours with ``on_nonfinite="apply"`` (nothing checked: the check's floor).

Calls run round-robin, a block of 2k calls per model, the order rotated every repeat; each
phase's figure is the median of its calls. After the timing every model has taken the same
steps on the same batches: the last column is max|Δw| / max|w| against the built-in's
weights, 0 where the results are bit-identical.

Usage:
    python benchmarks/keras_tf_phases.py                # k = 8, 40 repeats
    python benchmarks/keras_tf_phases.py --k 4 --repeats 10 --width 64 --depth 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

KINDS = ("built-in", "GradientAccumulateOptimizer", "elementwise check", "no check")


def build(keras, kind: str, k: int, args: argparse.Namespace):
    import keras_step  # beside this script: the same models

    from gradient_accumulator.keras import GradientAccumulateOptimizer

    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.features,))
    h = inputs
    for _ in range(args.depth):
        h = keras.layers.Dense(args.width, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    if kind == "built-in":
        return keras_step.compiled(keras, "builtin", k, inputs, outputs)
    if kind != "no check":
        return keras_step.compiled(keras, "optimizer", k, inputs, outputs)
    model = keras.Model(inputs, outputs)
    model.compile(
        GradientAccumulateOptimizer(keras.optimizers.Adam(1e-3), k, on_nonfinite="apply"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def traces(model) -> int:
    """How many graphs ``model``'s train function has traced."""
    fn = model.train_function  # Keras's wrapper around its tf.function
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    (inner,) = [c for c in cells if hasattr(c, "get_concrete_function")]
    return len(inner._list_all_concrete_functions())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=8, help="micro-steps per cycle (>= 2)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    args = p.parse_args()
    if args.k < 2:
        p.error("--k must be at least 2 (a cycle with micro-steps and a boundary)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras
    import numpy as np
    import tensorflow as tf

    from gradient_accumulator.keras import _cycle

    k = args.k
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * 16 * k, args.features)).astype("float32")
    y = rng.integers(0, 10, size=(32 * 16 * k,)).astype("int32")
    by_sum = _cycle._all_finite_by_sum
    models, iterators, traced = {}, {}, {}
    for kind in KINDS:
        model = build(keras, kind, k, args)
        iterators[kind] = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat())
        if kind == "elementwise check":
            _cycle._all_finite_by_sum = _cycle._all_finite_exact
        try:
            # fit builds and traces; the first calls on the iterator trace again (its spec).
            model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
            for _ in range(k):
                model.train_function(iterators[kind])
        finally:
            _cycle._all_finite_by_sum = by_sum
        models[kind], traced[kind] = model, traces(model)
    per_phase = {kind: [[] for _ in range(k)] for kind in KINDS}
    cpu = {kind: [] for kind in KINDS}
    for r in range(args.repeats):
        for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
            fn, it = models[kind].train_function, iterators[kind]
            c0 = time.process_time()
            for j in range(2 * k):
                t0 = time.perf_counter()
                fn(it)
                per_phase[kind][j % k].append(time.perf_counter() - t0)
            cpu[kind].append(time.process_time() - c0)
    if any(traces(models[kind]) != traced[kind] for kind in KINDS):
        raise SystemExit("a train function traced again while timed: the variants are not valid")
    ref = np.concatenate([np.ravel(w) for w in models["built-in"].get_weights()])
    scale = float(np.abs(ref).max())
    median = {kind: [1e6 * statistics.median(t) for t in per_phase[kind]] for kind in KINDS}
    base = median["built-in"]
    print(
        f"Keras {keras.__version__}, TensorFlow {tf.__version__}, cores={os.cpu_count()}; "
        f"MLP {args.features}→{args.width}×{args.depth}→10, micro-batches of 32, k={k}, Adam; "
        f"{args.repeats} repeats of {2 * k} calls per implementation"
    )
    print(
        f"{'implementation':28s} {'micro-steps µs':>15s} {'boundary µs':>12s} {'÷':>6s} "
        f"{'per call µs':>12s} {'÷':>6s} {'CPU µs':>8s} {'÷':>6s}  Δw vs built-in"
    )
    for kind in KINDS:
        m = median[kind]
        mean = sum(m) / k
        ratio_cpu = statistics.median(a / b for a, b in zip(cpu[kind], cpu["built-in"]))
        cpu_call = 1e6 * statistics.median(cpu[kind]) / (2 * k)
        w = np.concatenate([np.ravel(v) for v in models[kind].get_weights()])
        dw = float(np.abs(w - ref).max()) / scale
        print(
            f"{kind:28s} {statistics.median(m[:-1]):15.0f} {m[-1]:12.0f} {m[-1] / base[-1]:5.2f}x "
            f"{mean:12.0f} {mean / (sum(base) / k):5.2f}x {cpu_call:8.0f} {ratio_cpu:5.2f}x  "
            f"{dw:.1e}"
        )
    print("micro-steps: the median over the cycle's first k−1 calls of their medians;")
    print("÷ = time / the built-in's (< 1: faster); CPU: the process's, all threads, per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
