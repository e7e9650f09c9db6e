"""Keras on JAX: the compiled train step alone, without ``fit``'s loop around it.

``keras_step.py`` times whole ``fit`` epochs, where Keras's host work per batch (its iterator,
callbacks, the state it hands back to the model) is most of a small model's step. This script
jits each model's ``train_step`` as Keras's JAX trainer does (the state donated) and calls it
in a loop on one batch, so the figure is the step's own cost: the executable and JAX's
handling of its arguments, one per state array. Three optimizers on the digits-sized MLP of
``keras_step.py`` (64 → 64 → 10, batches of 32): plain Adam (an update every step), Keras's
``gradient_accumulation_steps=k`` and ``GradientAccumulateOptimizer`` over the same Adam, with
``k`` micro-steps per update; ``--k 0`` sets k to 10**9, so that only micro-steps are timed.
Implementations run round-robin, the order rotated every repeat; the figure is the median
over repeats, its ratio to the built-in's the median of the ratios within each repeat.

Usage:
    python benchmarks/keras_jax_executable.py            # k = 4 and micro-steps only
    python benchmarks/keras_jax_executable.py --k 8 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import keras_step  # beside this script: the same models as its per-epoch table


def time_steps(k: int, steps: int, repeats: int) -> list[dict]:
    import jax
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * 4, 64)).astype("float32")
    y = rng.integers(0, 10, size=(32 * 4,)).astype("int32")
    kinds = ["plain Adam", "built-in", "GradientAccumulateOptimizer"]
    names = dict(zip(kinds, ("plain", "builtin", "optimizer")))  # keras_step.adam's
    steps_fn, states, arrays = {}, {}, {}
    for kind in kinds:
        model = keras_step.small_model(keras, names[kind], k)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)  # builds, compiles
        state = tuple(
            [jax.numpy.array(v.value, copy=True) for v in group]
            for group in (
                model.trainable_variables,
                model.non_trainable_variables,
                model.optimizer.variables,
                model.metrics_variables,
            )
        )
        steps_fn[kind] = jax.jit(model.train_step, donate_argnums=0)
        data = (jax.numpy.asarray(x[:32]), jax.numpy.asarray(y[:32]))
        _, state = steps_fn[kind](state, data)  # compiles
        jax.block_until_ready(state)
        states[kind] = state
        arrays[kind] = len(jax.tree_util.tree_leaves(state))
        keras.backend.clear_session()
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(repeats):
        for kind in kinds[r % 3 :] + kinds[: r % 3]:
            fn, state = steps_fn[kind], states[kind]
            t0 = time.perf_counter()
            for _ in range(steps):
                _, state = fn(state, data)
            jax.block_until_ready(state)
            times[kind].append((time.perf_counter() - t0) / steps)
            states[kind] = state
    return [
        {
            "implementation": kind,
            "state_arrays": arrays[kind],
            "us_per_step": 1e6 * statistics.median(times[kind]),
            "vs_builtin": statistics.median(a / b for a, b in zip(times[kind], times["built-in"])),
        }
        for kind in kinds
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="*", default=[4, 0], help="micro-steps per update")
    p.add_argument("--steps", type=int, default=400, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit("KERAS_BACKEND must be jax (or unset) for this script")
    print(f"JAX {jax.__version__}, Keras {keras.__version__}, {jax.devices()[0].platform}")
    for k in args.k:
        label = "micro-steps only" if k == 0 else f"k = {k}"
        rows = time_steps(k if k > 0 else 10**9, args.steps, args.repeats)
        print(f"\n{label} ({args.repeats} repeats of {args.steps} steps)")
        print(f"{'implementation':30s} {'state arrays':>12s} {'us/step':>9s} {'÷ built-in':>10s}")
        for row in rows:
            print(
                f"{row['implementation']:30s} {row['state_arrays']:12d} "
                f"{row['us_per_step']:9.1f} {row['vs_builtin']:9.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
