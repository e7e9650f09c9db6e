"""Host cost of one core call over many small tensors: registered sets against lists.

A call's host cost is what it costs on top of the arithmetic: with tensors of 8 elements the
arithmetic is nothing, so the time per call is the host cost. Each core call is timed three
ways — on plain lists (every tensor exported through DLPack and checked, every call), on
registered sets (``core.tensor_set``: checked once, re-checked cheaply per call) — beside
PyTorch's own ``torch._foreach_add_`` over the same lists, and the Python costs a training step
cannot avoid (reading ``p.grad`` of every parameter).

Usage: python benchmarks/host_cost.py [--tensors 148] [--numel 8] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gradient_accumulator import core


def per_call_us(fn: Callable[[], object], repeat: int, budget_s: float = 0.2) -> float:
    """Median over ``repeat`` rounds of the mean time of one call, in microseconds."""
    fn()
    n, t0 = 1, time.perf_counter()
    while time.perf_counter() - t0 < budget_s / repeat:
        fn()
        n += 1
    rounds = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=148, help="tensors per call (GPT-2: 148)")
    ap.add_argument("--numel", type=int, default=8, help="elements per tensor")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    n, numel = args.tensors, args.numel
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
    accs = [torch.zeros(numel) for _ in range(n)]
    grads = [torch.randn(numel) for _ in range(n)]
    m1 = [torch.zeros(numel) for _ in range(n)]
    m2 = [torch.zeros(numel) for _ in range(n)]
    for p, g in zip(params, grads):
        p.grad = g
    plain = [p.detach() for p in params]
    s_params, s_accs = core.tensor_set(plain), core.tensor_set(accs)
    s_m1, s_m2, s_grads = core.tensor_set(m1), core.tensor_set(m2), core.tensor_set(grads)
    units = [(1, "leading")] * n
    adamw = dict(optimizer="adamw", lr=1e-6, grad_scale=1e-3, reset=False, step=1)
    r = args.repeat

    rows = [
        (
            "torch._foreach_add_(accs, grads)",
            per_call_us(lambda: torch._foreach_add_(accs, grads), r),
        ),
        ("[p.grad for p in params]", per_call_us(lambda: [p.grad for p in params], r)),
        ("[p.detach() for p in params]", per_call_us(lambda: [p.detach() for p in params], r)),
    ]
    calls = [
        (
            "accumulate",
            lambda: core.accumulate(accs, [p.grad for p in params]),
            lambda: core.accumulate(s_accs, [p.grad for p in params]),
        ),
        (
            "apply adamw",
            lambda: core.apply(plain, accs, state1=m1, state2=m2, **adamw),
            lambda: core.apply(s_params, s_accs, state1=s_m1, state2=s_m2, **adamw),
        ),
        (
            "adaptive_clip",
            lambda: core.adaptive_clip(plain, grads, layout=units),
            lambda: core.adaptive_clip(s_params, s_grads, layout=units),
        ),
    ]
    print(f"{n} tensors of {numel} elements, CPU, torch {torch.__version__}")
    print(f"{'call':46s} {'µs/call':>9s}")
    for name, us in rows:
        print(f"{name:46s} {us:9.1f}")
    foreach = rows[0][1]
    print(
        f"\n{'core call':22s} {'lists µs':>9s} {'sets µs':>9s} {'lists/sets':>10s} "
        f"{'sets/foreach':>12s}"
    )
    for name, old, new in calls:
        a, b = per_call_us(old, r), per_call_us(new, r)
        print(f"{name:22s} {a:9.1f} {b:9.1f} {a / b:10.1f} {b / foreach:12.2f}")
    print("(accumulate includes reading p.grad of every parameter; sets: core.tensor_set)")


if __name__ == "__main__":
    main()
