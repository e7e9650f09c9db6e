"""One table of accumulation cycles, run through every path that accumulates.

Each scenario is a sequence of micro-steps (a gradient per parameter, as given to the wrapper)
and flushes, with the wrapper's options, and an fp64 NumPy reference of what the parameters must
be afterwards under plain SGD. The PyTorch adapter (``tests/torch/test_cycle_table.py``) and the
Keras wrapper on each backend and path (``tests/keras/test_keras_cycle_table.py``, run once per
``KERAS_BACKEND``) replay the same table against the same reference, so the semantics of a cycle
(mean, sum, running mean, micro-batch weights, a short cycle, a dropped non-finite cycle, loss
scaling, global-norm clipping, AGC, missing gradients, a resume from a checkpoint mid-cycle) are
written once here and held identical across paths.

The parameters are a dense layer's: ``kernel`` of shape (IN, OUT) in Keras's layout (torch gets
its transpose, (OUT, IN), so that both frameworks' AGC units are the OUT output units) and
``bias`` of shape (OUT,).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gradient_accumulator import NonFiniteGradientWarning

IN, OUT = 3, 4
LR = 0.1
TOL = 2e-6  # max |Δw| against the fp64 reference: float32 accumulation and update of O(1) values

FLUSH = "flush"
RESUME = "resume"  # save the wrapper's state, rebuild the wrapper and parameters, load it


@dataclass
class Scenario:
    name: str
    steps: list  # micro-steps: (kernel_grad, bias_grad) tuples (None: no gradient), or FLUSH/RESUME
    accum_steps: int = 4
    reduction: str = "mean"
    max_grad_norm: float | None = None
    use_agc: bool = False
    clip_factor: float = 0.01
    eps: float = 1e-3
    nonfinite_cycles: int = 0  # cycles dropped as non-finite (each warns once in the table)
    weights: list | None = None  # one per micro-step (1 by default); mean and running mean only
    loss_scale: float | None = None  # dynamic loss scaling from this scale (halved on inf)
    expected: tuple = field(default=(), repr=False)  # (kernel, bias) in fp64


def initial_params() -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(7)
    kernel = r.uniform(-1, 1, (IN, OUT)).astype(np.float32)
    bias = r.uniform(-0.5, 0.5, OUT).astype(np.float32)
    return kernel, bias


def _grads(seed: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(100 + seed)
    return (
        (r.standard_normal((IN, OUT)) * scale).astype(np.float32),
        (r.standard_normal(OUT) * scale).astype(np.float32),
    )


def _f64(g):
    return [np.asarray(x, np.float64) for x in g]


def _agc(params, grads, clip_factor, eps):
    """AGC per output unit: kernel columns (Keras layout), the bias as one unit."""
    out = []
    for p, g in zip(params, grads):
        if p.ndim == 2:
            pn = np.maximum(np.sqrt((p**2).sum(axis=0, keepdims=True)), eps)
            gn = np.sqrt((g**2).sum(axis=0, keepdims=True))
        else:
            pn = np.maximum(np.sqrt((p**2).sum()), eps)
            gn = np.sqrt((g**2).sum())
        max_norm = pn * clip_factor
        coef = np.where(gn > max_norm, max_norm / np.maximum(gn, 1e-6), 1.0)
        out.append(g * coef)
    return out


def _reference(s: Scenario) -> tuple[np.ndarray, np.ndarray]:
    params = _f64(initial_params())
    cycle: list = []

    def boundary():
        if not cycle:
            return
        # A missing gradient counts as zero; a parameter with none in the cycle is left alone
        # (under plain SGD the same as a zero update).
        grads = []
        for i in range(2):
            present = [w * g[i] for w, g in cycle if g[i] is not None]
            grads.append(sum(present) if present else np.zeros_like(params[i]))
        if s.reduction in ("mean", "running_mean"):
            total = sum(w for w, _ in cycle)
            grads = [g / total for g in grads]
        if not all(np.isfinite(g).all() for g in grads):
            cycle.clear()
            return
        if s.max_grad_norm is not None:
            norm = np.sqrt(sum((g**2).sum() for g in grads))
            grads = [g * min(1.0, s.max_grad_norm / (norm + 1e-6)) for g in grads]
        if s.use_agc:
            grads = _agc(params, grads, s.clip_factor, s.eps)
        for p, g in zip(params, grads):
            p -= LR * g
        cycle.clear()

    weights = iter(s.weights or [])
    for step in s.steps:
        if step == RESUME:
            continue
        if step == FLUSH:
            boundary()
            continue
        w = float(next(weights, 1.0))
        cycle.append((w, [None if x is None else np.asarray(x, np.float64) for x in step]))
        if len(cycle) == s.accum_steps:
            boundary()
    return params[0], params[1]


def _no_bias(grads: tuple) -> tuple:
    return (grads[0], None)


def _scenarios() -> list[Scenario]:
    g = [_grads(i) for i in range(12)]
    nan = (g[5][0].copy(), g[5][1].copy())
    nan[0][1, 2] = np.nan
    out = [
        Scenario("mean", g[:8]),
        Scenario("sum", g[:8], reduction="sum"),
        Scenario("running_mean", g[:8], reduction="running_mean"),
        Scenario("short-cycle-flush", g[:6] + [FLUSH] + g[6:10]),
        Scenario("sum-short-cycle-flush", g[:6] + [FLUSH], reduction="sum"),
        Scenario("running-mean-short-cycle-flush", g[:7] + [FLUSH], reduction="running_mean"),
        Scenario("one-step-cycles", g[:3], accum_steps=1),
        Scenario("nonfinite-cycle-dropped", g[:5] + [nan] + g[6:12], nonfinite_cycles=1),
        Scenario("global-norm-clip", g[:8], max_grad_norm=0.5),
        Scenario("global-norm-no-clip", g[:8], max_grad_norm=100.0),
        Scenario("agc", [_grads(i, 5.0) for i in range(8)], use_agc=True, clip_factor=0.05),
        Scenario("agc-short-cycle", g[:3] + [FLUSH], use_agc=True, clip_factor=0.02),
        # The bias has a gradient in 2 of the 4 micro-steps of cycle 1, in none of cycle 2.
        Scenario(
            "missing-gradients",
            g[:2] + [_no_bias(g[2]), _no_bias(g[3])] + [_no_bias(x) for x in g[4:8]],
        ),
        Scenario(
            "missing-gradients-running-mean", [_no_bias(g[0])] + g[1:4], reduction="running_mean"
        ),
        Scenario("resume-mid-cycle", g[:2] + [RESUME] + g[2:6] + [RESUME] + g[6:8]),
        Scenario("weighted-mean", g[:8], weights=[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]),
        Scenario(
            "weighted-running-mean",
            g[:8],
            reduction="running_mean",
            weights=[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0],
        ),
        Scenario(
            "weighted-short-cycle-flush",
            g[:6] + [FLUSH],
            weights=[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0][:6],
        ),
        Scenario(
            "weighted-resume",
            g[:3] + [RESUME] + g[3:8],
            weights=[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0],
        ),
        Scenario("loss-scale", g[:8], loss_scale=1024.0),
        # Skipped silently (no warning: the loss scaler's skip), the scale halved for the rest.
        Scenario("loss-scale-nonfinite-cycle", g[:5] + [nan] + g[6:12], loss_scale=1024.0),
        Scenario(
            "resume-mid-cycle-missing-gradient",
            g[:1] + [RESUME] + [_no_bias(x) for x in g[1:4]] + [RESUME] + g[4:8],
        ),
    ]
    for s in out:
        s.expected = _reference(s)
    return out


SCENARIOS = _scenarios()


def replay(
    s: Scenario,
    micro_step: Callable[[tuple, float], None],
    flush: Callable[[], None],
    resume: Callable[[], None],
) -> int:
    """Feed the scenario to a wrapper: ``micro_step(grads, weight)`` per micro-step (with loss
    scaling, ``grads`` are unscaled: the runner multiplies them by its current scale),
    ``flush()`` where the table flushes, ``resume()`` where it saves and reloads. Returns how
    many non-finite cycles the wrapper reported (warnings)."""
    weights = iter(s.weights or [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NonFiniteGradientWarning)
        for step in s.steps:
            if step == RESUME:
                resume()
            elif step == FLUSH:
                flush()
            else:
                micro_step(step, float(next(weights, 1.0)))
    return sum(issubclass(w.category, NonFiniteGradientWarning) for w in caught)


def check(s: Scenario, kernel: np.ndarray, bias: np.ndarray) -> None:
    """Raise AssertionError unless (kernel, bias) match the scenario's fp64 reference."""
    for got, want, what in ((kernel, s.expected[0], "kernel"), (bias, s.expected[1], "bias")):
        got = np.asarray(got, np.float64)
        assert got.shape == want.shape, what
        err = np.abs(got - want).max()
        assert err <= TOL, f"{s.name}: {what} is {err:.3e} from the fp64 reference (tol {TOL})"
    # The scenario moved the parameters: a path that applied nothing would not pass.
    start = initial_params()
    assert np.abs(s.expected[0] - start[0]).max() > 100 * TOL
