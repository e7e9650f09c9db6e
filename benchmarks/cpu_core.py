"""CPU benchmark of the C++ core against the same work done with PyTorch, side by side.

Operations (fp32 accumulators, parameters and optimizer state; bf16 micro-batch gradients):

* accumulate:  acc += g (bf16 → fp32), and the first micro-step's overwrite acc ← g;
* apply:       average (×1/k) + global-norm clipping + AdamW (or SGD momentum) + zeroing;
* agc:         adaptive gradient clipping (NFNets), unit norms over dims 1.. of each tensor;
* global_norm: L2 norm over all accumulators.

Each operation is timed for every implementation in the same process, round-robin (one run of
each per repeat, so that machine noise hits all of them alike), after warm-up runs; the figure
is the median of the repeats. Byte floors are nominal bytes moved over the bandwidth of an
in-place fp32 add of two 256 MiB arrays (a += b: read 2 + write 1 = 12 bytes per element),
measured at the start of the run. Every op here updates its buffers in place, so this is the
access pattern they share; a plain copy into another array pays a read-for-ownership of the
destination that in-place updates do not, and runs at about 60% of it on this kind of machine.

Usage:
    python benchmarks/cpu_core.py                 # GPT-2-small shapes (124M) and a small model
    python benchmarks/cpu_core.py --small         # small model only (CI smoke test, seconds)
    python benchmarks/cpu_core.py --repeats 20 --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

try:
    from gradient_accumulator import core
except ImportError:  # run from a checkout: benchmarks/ sits next to the package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from gradient_accumulator import core

K = 4  # micro-steps per cycle: the apply averages with 1/K
LR, WD, MAX_NORM = 1e-3, 0.01, 1.0
AGC_LAMBDA, AGC_EPS = 0.01, 1e-3

# Nominal bytes per parameter (fp32 = 4, bf16 = 2), no cache reuse.
BYTES = {
    "accumulate": 10,  # r g16, r acc, w acc
    "overwrite": 6,  # r g16, w acc
    "apply_adamw": 36,  # norm pass r g; fused pass r g,p,m,v + w p,m,v + w g (zero)
    "apply_sgd": 28,  # norm pass r g; fused pass r g,p,m + w p,m + w g (zero)
    "agc": 16,  # r p, r g (unit norms); r g, w g (scale)
    "global_norm": 4,  # r g
}


# ---- models ----


def gpt2_shapes(n_layer: int, d: int, vocab: int, ctx: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 (Hugging Face layout: Conv1D weights are (in, out))."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,)]  # ln_1
        shapes += [(d, 3 * d), (3 * d,)]  # attn.c_attn
        shapes += [(d, d), (d,)]  # attn.c_proj
        shapes += [(d,), (d,)]  # ln_2
        shapes += [(d, 4 * d), (4 * d,)]  # mlp.c_fc
        shapes += [(4 * d, d), (d,)]  # mlp.c_proj
    shapes += [(d,), (d,)]  # ln_f
    return shapes


def numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


GPT2_SMALL = gpt2_shapes(n_layer=12, d=768, vocab=50257, ctx=1024)
assert len(GPT2_SMALL) == 148, len(GPT2_SMALL)
assert numel(GPT2_SMALL) == 124_439_808, numel(GPT2_SMALL)
SMALL = gpt2_shapes(n_layer=4, d=128, vocab=2048, ctx=256)  # ≈ 1.1 M parameters, 4.4 MB fp32

MODELS = {"gpt2-small (124M)": GPT2_SMALL, "small (1.1M)": SMALL}


# ---- timing ----


def timed_round_robin(
    impls: dict[str, Callable[[], object]],
    setup: Callable[[], None] | dict[str, Callable[[], None] | None] | None,
    repeats: int,
    warmup: int,
) -> dict[str, float]:
    """Median seconds per call of every implementation.

    ``setup`` runs (untimed) before each call: one callable for all implementations, or a dict
    giving each implementation its own (None: no setup).
    """
    setups = setup if isinstance(setup, dict) else {name: setup for name in impls}
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(warmup + repeats):
        for name, fn in impls.items():
            if setups.get(name) is not None:
                setups[name]()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if r >= warmup:
                times[name].append(t1 - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def copy_bandwidth(repeats: int) -> float:
    """Nominal bytes/s of an in-place fp32 add of 2 × 256 MiB (12 bytes per element)."""
    n = 64 * 2**20
    src = torch.randn(n)
    dst = torch.randn(n)
    t = timed_round_robin({"add": lambda: dst.add_(src)}, None, max(repeats, 5), 2)["add"]
    return 12 * n / t


# ---- the torch reference implementations ----


def torch_agc(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """NFNets AGC, one tensor at a time: g ← g·min(1, λ·max(‖w‖, ε) / max(‖g‖, 1e-6))."""
    for p, g in zip(params, grads):
        if p.ndim > 1:
            dims = tuple(range(1, p.ndim))
            pn = torch.linalg.vector_norm(p, dim=dims, keepdim=True)
            gn = torch.linalg.vector_norm(g, dim=dims, keepdim=True)
        else:
            pn = torch.linalg.vector_norm(p)
            gn = torch.linalg.vector_norm(g)
        max_norm = pn.clamp_min(AGC_EPS).mul_(AGC_LAMBDA)
        g.mul_((max_norm / gn.clamp_min(1e-6)).clamp_max_(1.0))


def torch_cycle(params, grads, opt) -> Callable[[], None]:
    """The stock end-of-cycle pipeline: average, clip, step, zero."""

    def run() -> None:
        torch._foreach_mul_(grads, 1.0 / K)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return run


# ---- correctness cross-checks (untimed, small model) ----


def cross_check(shapes: list[tuple[int, ...]]) -> None:
    """Ours and torch agree on the benchmarked work, so the timings compare the same thing."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    ref = [torch.zeros(s) for s in shapes]
    acc = [torch.zeros(s) for s in shapes]
    torch._foreach_copy_(ref, grads)
    torch._foreach_add_(ref, grads)
    core.accumulate(acc, grads, overwrite=True)
    core.accumulate(acc, grads)
    assert all(torch.equal(a, b) for a, b in zip(acc, ref)), "accumulate differs from torch"

    gn_ref = float(torch.nn.utils.get_total_norm(acc, foreach=True))
    assert math.isclose(core.global_norm(acc), gn_ref, rel_tol=1e-5), "global norm differs"

    p0 = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    ga = [a.clone() for a in acc]
    torch_agc(p0, acc)
    core.adaptive_clip(p0, ga, clip_factor=AGC_LAMBDA, eps=AGC_EPS)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(acc, ga)), "AGC differs"

    for name in ("adamw", "sgd"):
        tp = [torch.nn.Parameter(p.clone()) for p in p0]
        op = [p.clone() for p in p0]
        oacc = [torch.zeros(s) for s in shapes]
        s1 = [torch.zeros(s) for s in shapes]
        s2 = [torch.zeros(s) for s in shapes]
        if name == "adamw":
            opt = torch.optim.AdamW(tp, lr=LR, weight_decay=WD, fused=True)
        else:
            opt = torch.optim.SGD(tp, lr=LR, momentum=0.9, foreach=True)
        for step in (1, 2):
            for p, gg, a in zip(tp, grads, oacc):
                p.grad = gg.float() * step
                a.copy_(p.grad)
            torch_cycle(tp, [p.grad for p in tp], opt)()
            kw = dict(state1=s1, state2=s2, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
            if name == "sgd":
                kw = dict(state1=s1, momentum=0.9, momentum_initialized=step > 1)
            core.apply(
                op,
                oacc,
                optimizer=name,
                lr=LR,
                grad_scale=1.0 / K,
                max_norm=MAX_NORM,
                reset=True,
                step=step,
                **kw,
            )
            assert all(float(a.abs().max()) == 0.0 for a in oacc), "apply did not zero"
        for a, b in zip(tp, op):
            assert torch.allclose(a.detach(), b, rtol=1e-5, atol=1e-7), f"{name} apply differs"


# ---- one model ----


def bench_model(
    label: str, shapes: list[tuple[int, ...]], repeats: int, warmup: int, bw: float
) -> list[dict]:
    n = numel(shapes)
    rows: list[dict] = []

    def record(op: str, res: dict[str, float], ours: str, bytes_key: str) -> None:
        floor = BYTES[bytes_key] * n / bw
        for impl, t in res.items():
            rows.append(
                dict(
                    model=label,
                    op=op,
                    impl=impl,
                    ms=t * 1e3,
                    ours=impl == ours,
                    bytes_per_param=BYTES[bytes_key],
                    floor_ms=floor * 1e3,
                    x_floor=t / floor,
                    vs_ours=t / res[ours],
                )
            )

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    accs = [torch.zeros(s) for s in shapes]
    for p, a in zip(params, accs):
        p.grad = a  # torch's pipeline and ours work on the very same gradient buffers
    pd = [p.detach() for p in params]

    # a. accumulate bf16 → fp32
    res = timed_round_robin(
        {
            "torch _foreach_add_(acc, [g.float()])": lambda: torch._foreach_add_(
                accs, [g.float() for g in grads]
            ),
            "torch _foreach_add_(acc, g_bf16)": lambda: torch._foreach_add_(accs, grads),
            "core.accumulate": lambda: core.accumulate(accs, grads),
        },
        None,
        repeats,
        warmup,
    )
    record("accumulate bf16→fp32", res, "core.accumulate", "accumulate")
    res = timed_round_robin(
        {
            "torch _foreach_copy_(acc, g_bf16)": lambda: torch._foreach_copy_(accs, grads),
            "core.accumulate(overwrite=True)": lambda: core.accumulate(accs, grads, overwrite=True),
        },
        None,
        repeats,
        warmup,
    )
    record("first micro-step (overwrite)", res, "core.accumulate(overwrite=True)", "overwrite")

    def refill() -> None:  # the accumulated gradient of a cycle (untimed)
        torch._foreach_copy_(accs, grads)
        torch._foreach_mul_(accs, float(K))

    # b. apply cycle, AdamW
    step = [0]
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]

    def ours_adamw() -> None:
        step[0] += 1
        core.apply(
            pd,
            accs,
            optimizer="adamw",
            lr=LR,
            weight_decay=WD,
            grad_scale=1.0 / K,
            max_norm=MAX_NORM,
            reset=True,
            state1=m,
            state2=v,
            step=step[0],
        )

    opt_fe = torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True)
    opt_fu = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    res = timed_round_robin(
        {
            "torch avg+clip+AdamW(foreach)+zero": torch_cycle(params, accs, opt_fe),
            "torch avg+clip+AdamW(fused)+zero": torch_cycle(params, accs, opt_fu),
            "core.apply(adamw)": ours_adamw,
        },
        refill,
        repeats,
        warmup,
    )
    record("apply AdamW cycle", res, "core.apply(adamw)", "apply_adamw")
    opt_fe = opt_fu = v = None  # free the state (the timed lambdas are done with it)
    gc.collect()

    # b'. apply cycle, SGD momentum
    for t in m:
        t.zero_()
    first = [True]

    def ours_sgd() -> None:
        core.apply(
            pd,
            accs,
            optimizer="sgd",
            lr=LR,
            momentum=0.9,
            grad_scale=1.0 / K,
            max_norm=MAX_NORM,
            reset=True,
            state1=m,
            momentum_initialized=not first[0],
        )
        first[0] = False

    opt_fe = torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=True)
    opt_fu = torch.optim.SGD(params, lr=LR, momentum=0.9, fused=True)
    res = timed_round_robin(
        {
            "torch avg+clip+SGD(foreach)+zero": torch_cycle(params, accs, opt_fe),
            "torch avg+clip+SGD(fused)+zero": torch_cycle(params, accs, opt_fu),
            "core.apply(sgd)": ours_sgd,
        },
        refill,
        repeats,
        warmup,
    )
    record("apply SGD-momentum cycle", res, "core.apply(sgd)", "apply_sgd")
    opt_fe = opt_fu = m = None
    gc.collect()

    # c. AGC
    res = timed_round_robin(
        {
            "torch per-tensor loop": lambda: torch_agc(pd, accs),
            "core.adaptive_clip": lambda: core.adaptive_clip(
                pd, accs, clip_factor=AGC_LAMBDA, eps=AGC_EPS
            ),
        },
        refill,
        repeats,
        warmup,
    )
    record("AGC", res, "core.adaptive_clip", "agc")

    # d. global norm
    res = timed_round_robin(
        {
            "torch get_total_norm(foreach)": lambda: float(
                torch.nn.utils.get_total_norm(accs, foreach=True)
            ),
            "core.global_norm": lambda: core.global_norm(accs),
        },
        None,
        repeats,
        warmup,
    )
    record("global norm", res, "core.global_norm", "global_norm")

    grads = params = accs = pd = None
    gc.collect()
    return rows


# ---- report ----


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        core_isa=core.cpu_isa(),
        python=platform.python_version(),
        load_avg=os.getloadavg() if hasattr(os, "getloadavg") else None,
    )


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'op':<30} {'implementation':<40} {'ms':>9} {'B/par':>5} {'floor ms':>9} "
        f"{'x floor':>7} {'vs ours':>7}"
    )
    model = None
    for r in rows:
        if r["model"] != model:
            model = r["model"]
            print(f"\n== {model} ==")
            print(head)
            print("-" * len(head))
        mark = "*" if r["ours"] else " "
        print(
            f"{r['op']:<30} {mark}{r['impl']:<39} {r['ms']:>9.2f} {r['bytes_per_param']:>5} "
            f"{r['floor_ms']:>9.2f} {r['x_floor']:>7.2f} {r['vs_ours']:>6.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="only the small model (fast smoke test)")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per implementation")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    ap.add_argument("--json", metavar="PATH", help="write machine info and results here")
    args = ap.parse_args()
    torch.manual_seed(0)

    info = machine_info()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    cross_check(SMALL)
    print("cross-check: core and torch agree on the small model")
    bw = copy_bandwidth(args.repeats)
    print(f"bandwidth (in-place fp32 add of 256 MiB, read 2 + write 1): {bw / 1e9:.1f} GB/s")
    print(f"apply cycles: average 1/{K}, clip to {MAX_NORM}, lr {LR}; AGC lambda {AGC_LAMBDA}")

    rows: list[dict] = []
    t0 = time.perf_counter()
    for label, shapes in MODELS.items():
        if args.small and shapes is not SMALL:
            continue
        # the small model's calls take ~ms: more repeats, same wall time
        reps = args.repeats if shapes is not SMALL else max(args.repeats, 30)
        print(
            f"running {label}: {len(shapes)} tensors, {numel(shapes):,} parameters, "
            f"{reps} repeats ...",
            flush=True,
        )
        rows += bench_model(label, shapes, reps, args.warmup, bw)
    print_table(rows)
    print(
        "\n* = ours; 'vs ours' = time / our time (> 1: ours is faster); floor = bytes per "
        "parameter x parameters / in-place add bandwidth"
    )
    print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    machine=info,
                    copy_bandwidth_gbs=bw / 1e9,
                    k=K,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    results=rows,
                ),
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
