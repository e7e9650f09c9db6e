"""Keras 3 step time on the CPU: our accumulation against plain ``fit`` and Keras's built-in one.

For each backend (one subprocess each, since Keras fixes its backend at import) the same MLP is
trained with micro-batches of ``--batch`` through ``model.fit``:

* ``plain fit``: no accumulation, one optimizer update per batch (the floor of the loop);
* ``keras gradient_accumulation_steps``: the optimizer's built-in accumulation (k batches per
  update);
* ``GradientAccumulateOptimizer``: ours, wrapping the same Adam (k batches per update);
* ``GradientAccumulateModel``: ours, the original package's model wrapper.

Implementations are timed round-robin in the same process (one epoch of each per repeat, the order
rotated every repeat, after a warm-up epoch that compiles the step), and the figure is the median
over repeats of the time per micro-batch, in wall time and in the process's CPU time; its ratio to
Keras's built-in accumulation's is the median over repeats of the ratio within each repeat, so
that a change of the machine's load between repeats moves both sides of a ratio. The load average
is printed at each backend's start and end. A second table times whole epochs of a digits-sized
run (1,437 samples of 64 features, an MLP 64 → 64 → 10, micro-batches of 32, k = 4: 45 batches,
the last one short), where a fixed cost per batch (a read of the device's state after each step)
shows: the ratio of each accumulation to Keras's built-in one, per epoch, in wall time and in the
process's CPU time (all threads; steadier than wall time on a shared machine). Before timing, each
accumulating run's weights after one epoch are compared with the built-in accumulation's (same
data, Adam, same k): the cross-check column shows max|Δw| / max|w| (large for plain fit, which
updates every batch). Ours checks each cycle's result for NaN and Inf by default
(``on_nonfinite="skip"``), which Keras's built-in accumulation does not; ``--on-nonfinite apply``
times ours without the check, the same work as the built-in's.

Usage:
    python benchmarks/keras_step.py                       # tensorflow, jax and torch
    python benchmarks/keras_step.py --backends jax --small
    python benchmarks/keras_step.py --json results.json
    python benchmarks/keras_step.py --epoch-only          # the per-epoch table alone
    python benchmarks/keras_step.py --on-nonfinite apply  # ours without the non-finite check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def timed_round_robin(fns: dict, repeats: int, scale: float = 1.0) -> tuple[dict, dict]:
    """Times each of ``fns`` once per repeat, the order rotated every repeat (so no implementation
    always runs right after the same other one), in wall and CPU time (divided by ``scale``)."""
    kinds = list(fns)
    wall: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(repeats):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[kind]()
            wall[kind].append((time.perf_counter() - t0) / scale)
            cpu[kind].append((time.process_time() - c0) / scale)
    return wall, cpu


def paired_ratio(times: dict, kind: str, ref: str = "builtin") -> float:
    """Median over repeats of ``kind``'s time ÷ ``ref``'s in the same repeat: a change of load
    between repeats moves both sides of each ratio, unlike a ratio of medians."""
    return statistics.median(a / b for a, b in zip(times[kind], times[ref]))


def load() -> str:
    try:
        return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "load average unknown"


def run_backend(args: argparse.Namespace) -> dict:
    """Runs inside a subprocess whose KERAS_BACKEND is already set."""
    import keras
    import numpy as np

    try:
        import gradient_accumulator.keras  # noqa: F401
    except ImportError:  # run from a checkout
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import gradient_accumulator.keras  # noqa: F401

    if args.jax_flat_max is not None:
        from gradient_accumulator.keras import _packed

        _packed.FLAT_MAX_ELEMENTS = args.jax_flat_max
    if args.epoch_only:
        return dict(
            backend=keras.backend.backend(),
            rows=[],
            epoch_rows=per_epoch(args, build_small(keras, args), keras, np),
        )
    k, batch, width = args.accum_steps, args.batch, args.width
    steps = args.steps - args.steps % k
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, args.features)).astype("float32")
    y = rng.integers(0, 10, size=(steps * batch,)).astype("int32")

    def layers():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((args.features,))
        h = inputs
        for _ in range(args.depth):
            h = keras.layers.Dense(width, activation="relu")(h)
        return inputs, keras.layers.Dense(10)(h)

    def build(kind: str):
        return compiled(keras, kind, k, *layers(), args.on_nonfinite)

    labels = {
        "plain": "plain fit (update every batch)",
        "builtin": f"keras gradient_accumulation_steps={k}",
        "optimizer": f"*GradientAccumulateOptimizer(k={k})",
        "model": f"*GradientAccumulateModel(k={k})",
    }
    models = {kind: build(kind) for kind in labels}

    def flat(model):
        return np.concatenate([np.ravel(w).astype(np.float64) for w in model.get_weights()])

    def fit(model):
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    # Warm-up epoch (compiles the step) doubles as the cross-check: one epoch from equal weights.
    for model in models.values():
        fit(model)
    ref = flat(models["builtin"])
    # The plain run updates every batch: its (large) difference shows that the check can fail.
    check = {
        kind: float(np.abs(flat(m) - ref).max() / np.abs(ref).max()) for kind, m in models.items()
    }
    times, cpu = timed_round_robin(
        {kind: (lambda m=m: fit(m)) for kind, m in models.items()}, args.repeats, steps
    )
    params = sum(int(np.prod(w.shape)) for w in models["plain"].trainable_weights)
    epochs = per_epoch(args, build_small(keras, args), keras, np)
    return dict(
        epoch_rows=epochs,
        backend=keras.backend.backend(),
        params=params,
        steps=steps,
        rows=[
            dict(
                kind=kind,
                label=labels[kind],
                ms=1e3 * statistics.median(times[kind]),
                ratio=paired_ratio(times, kind),
                cpu_ms=1e3 * statistics.median(cpu[kind]),
                cpu_ratio=paired_ratio(cpu, kind),
                check=check[kind],
            )
            for kind in labels
        ],
    )


def adam(keras, kind: str, k: int, on_nonfinite: str = "skip"):
    """Adam as each implementation runs it: ``"plain"``, Keras's ``"builtin"`` accumulation
    over ``k`` micro-batches, or ours (``"optimizer"``, with ``on_nonfinite``)."""
    from gradient_accumulator.keras import GradientAccumulateOptimizer

    if kind == "plain":
        return keras.optimizers.Adam(1e-3)
    if kind == "builtin":
        return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k)
    return GradientAccumulateOptimizer(
        keras.optimizers.Adam(1e-3), accum_steps=k, on_nonfinite=on_nonfinite
    )


def small_model(keras, kind: str, k: int, on_nonfinite: str = "skip"):
    """The digits-sized MLP (64 → 64 → 10) compiled for ``kind`` (see :func:`compiled`), from
    the same initial weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    outputs = keras.layers.Dense(10)(keras.layers.Dense(64, activation="relu")(inputs))
    return compiled(keras, kind, k, inputs, outputs, on_nonfinite)


def compiled(keras, kind: str, k: int, inputs, outputs, on_nonfinite: str = "skip"):
    """The model from ``inputs`` to ``outputs`` compiled for ``kind``: with :func:`adam`'s
    optimizer, or ``"model"``: a :class:`GradientAccumulateModel` over plain Adam (ours with
    ``on_nonfinite``)."""
    from gradient_accumulator.keras import GradientAccumulateModel

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "model":
        model = GradientAccumulateModel(
            accum_steps=k, on_nonfinite=on_nonfinite, inputs=inputs, outputs=outputs
        )
        model.compile(keras.optimizers.Adam(1e-3), loss=loss)
        return model
    model = keras.Model(inputs, outputs)
    model.compile(adam(keras, kind, k, on_nonfinite), loss=loss)
    return model


def build_small(keras, args):
    """The per-epoch run's models: a digits-sized MLP, each accumulation with k = 4."""
    k = args.epoch_accum_steps

    def build(kind: str):
        return small_model(keras, kind, k, args.on_nonfinite)

    return {
        kind: (label, build(kind))
        for kind, label in (
            ("builtin", f"keras gradient_accumulation_steps={k}"),
            ("optimizer", f"*GradientAccumulateOptimizer(k={k})"),
            ("model", f"*GradientAccumulateModel(k={k})"),
        )
    }


def per_epoch(args: argparse.Namespace, models: dict, keras, np) -> list[dict]:
    """Median time of one ``fit`` epoch of each model, and its ratio to the built-in's."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(args.epoch_samples, 64)).astype("float32")
    y = rng.integers(0, 10, size=(args.epoch_samples,)).astype("int32")

    def fit(model):
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)

    for _, model in models.values():  # warm-up: compiles the step
        fit(model)
    times, cpu = timed_round_robin(
        {kind: (lambda m=m: fit(m)) for kind, (_, m) in models.items()}, args.epoch_repeats
    )
    return [
        dict(
            kind=kind,
            label=label,
            ms=1e3 * statistics.median(times[kind]),
            ratio=paired_ratio(times, kind),
            cpu_ms=1e3 * statistics.median(cpu[kind]),
            cpu_ratio=paired_ratio(cpu, kind),
        )
        for kind, (label, _) in models.items()
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="tensorflow,jax,torch")
    p.add_argument("--accum-steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--steps", type=int, default=128, help="micro-batches per timed epoch")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epoch-samples", type=int, default=1437, help="samples per timed epoch")
    p.add_argument("--epoch-accum-steps", type=int, default=4)
    p.add_argument("--epoch-repeats", type=int, default=7)
    p.add_argument("--epoch-only", action="store_true", help="only the per-epoch table")
    p.add_argument("--small", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument(
        "--jax-flat-max",
        type=int,
        help="JAX: share one flat variable among accumulators of at most this many elements "
        "(the package's FLAT_MAX_ELEMENTS, 4096; -1: one variable each)",
    )
    p.add_argument(
        "--on-nonfinite",
        default="skip",
        choices=("skip", "raise", "apply"),
        help="our wrappers' on_nonfinite (default skip, theirs; apply: no check, as Keras's "
        "built-in accumulation makes none)",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.width, args.depth, args.steps, args.repeats = 64, 2, 32, 2
        args.epoch_repeats = 2
    if args.child:
        print(json.dumps(run_backend(args)))
        return 0

    print(
        f"machine: {platform.processor() or platform.machine()}, cores={os.cpu_count()}, "
        f"python={platform.python_version()}"
    )
    print(
        f"micro-batch {args.batch}, k={args.accum_steps}, MLP {args.features}→"
        f"{args.width}×{args.depth}→10, Adam; {args.repeats} repeats of one epoch each; "
        f"ours with on_nonfinite={args.on_nonfinite!r}"
    )
    results = []
    child, skip = [], False  # the same options, less --backends (and its value)
    for a in sys.argv[1:]:
        if skip or a.startswith("--backends"):
            skip = a == "--backends" and not skip
            continue
        child.append(a)
    for backend in args.backends.split(","):
        before = load()
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        out = subprocess.run(
            [sys.executable, __file__, "--child", *child], env=env, capture_output=True, text=True
        )
        if out.returncode != 0:
            print(f"\n== {backend}: failed ==\n{out.stderr[-2000:]}")
            continue
        res = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(res)
        print(f"\n== {backend} == ({before} at its start, {load()} at its end)")
        if res["rows"]:
            print(f"per micro-batch ({res['params']:,} parameters, {res['steps']} micro-batches)")
            header = (
                f"{'ms/micro-batch':>14s} {'÷ built-in':>10s} {'CPU ms':>8s} {'÷':>6s} "
                f"{'Δw vs built-in':>15s}"
            )
            print(f"{'implementation':42s} {header}")
            for r in res["rows"]:
                check = f"{r['check']:.1e}"
                print(
                    f"{r['label']:42s} {r['ms']:14.3f} {r['ratio']:9.2f}x {r['cpu_ms']:8.3f} "
                    f"{r['cpu_ratio']:5.2f}x {check:>15s}"
                )
        print(
            f"per epoch ({args.epoch_samples:,} samples, MLP 64→64→10, batches of 32, "
            f"k={args.epoch_accum_steps})"
        )
        print(
            f"{'implementation':42s} {'ms/epoch':>9s} {'÷ built-in':>10s} {'CPU ms':>9s} {'÷':>6s}"
        )
        for r in res["epoch_rows"]:
            print(
                f"{r['label']:42s} {r['ms']:9.2f} {r['ratio']:9.2f}x "
                f"{r['cpu_ms']:9.2f} {r['cpu_ratio']:5.2f}x"
            )
    print(
        "\n* = ours; '÷ built-in' = time / Keras's built-in accumulation's (< 1: ours faster), "
        "in wall time and in the process's CPU time (all threads)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if len(results) == len(args.backends.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
