"""GPU benchmark of the CUDA kernels against PyTorch's own, side by side in one run.

Operations (fp32 accumulators, parameters and optimizer state; bf16 micro-batch gradients), on
GPT-2-small shapes (124M parameters, 148 tensors) and a 1B-parameter GPT-2-shaped set. Ours
is called on registered tensor sets (``core.tensor_set``), as the torch wrapper calls it; the
accumulate is also timed on plain lists:

* accumulate:  acc += g (bf16 → fp32): ``torch._foreach_add_`` vs ``core.accumulate``;
* apply:       average (×1/k) + global-norm clip + AdamW + zero: torch's foreach and fused
               pipelines vs ``core.apply`` (norm pass + one fused pass);
* agc:         adaptive gradient clipping: a per-tensor torch loop vs ``core.adaptive_clip``.

Each has its floor: nominal bytes moved over the device-to-device copy bandwidth measured at
the start of the run (``copy_`` of 1 GiB: 2 bytes moved per byte copied). Times are CUDA-event
medians of round-robin repeats (every implementation once per repeat). Then, on a small
transformer: the time of a non-boundary micro-step (forward + backward + our accumulate) against
a plain forward + backward, and the peak memory of k micro-batches of b against one batch of b
and one of k·b.

Usage (needs a CUDA build of gradient-accumulator and a GPU):
    python benchmarks/gpu_core.py                 # 124M and 1B shapes, transformer step
    python benchmarks/gpu_core.py --small         # the 1.1M-parameter shapes only (seconds)
    python benchmarks/gpu_core.py --json gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

try:
    from cpu_core import (
        AGC_EPS,
        AGC_LAMBDA,
        BYTES,
        LR,
        MAX_NORM,
        SMALL,
        WD,
        K,
        gpt2_shapes,
        numel,
        torch_agc,
        torch_cycle,
    )
except ImportError:  # not run as a script from benchmarks/: cpu_core sits next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_core import (
        AGC_EPS,
        AGC_LAMBDA,
        BYTES,
        LR,
        MAX_NORM,
        SMALL,
        WD,
        K,
        gpt2_shapes,
        numel,
        torch_agc,
        torch_cycle,
    )

try:
    from gradient_accumulator import core
    from gradient_accumulator.torch import GradientAccumulateOptimizer
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from gradient_accumulator import core
    from gradient_accumulator.torch import GradientAccumulateOptimizer

GPT2_SMALL = gpt2_shapes(n_layer=12, d=768, vocab=50257, ctx=1024)
GPT2_1B = gpt2_shapes(n_layer=18, d=2048, vocab=50257, ctx=1024)
MODELS = {"gpt2-small (124M)": GPT2_SMALL, "gpt2-1B": GPT2_1B, "small (1.1M)": SMALL}
DEV = torch.device("cuda")


def timed(
    impls: dict[str, Callable[[], object]],
    setup: Callable[[], None] | None,
    repeats: int,
    warmup: int,
) -> dict[str, float]:
    """Median seconds per call (CUDA events), implementations interleaved per repeat."""
    times: dict[str, list[float]] = {k: [] for k in impls}
    for r in range(warmup + repeats):
        for name, fn in impls.items():
            if setup is not None:
                setup()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if r >= warmup:
                times[name].append(start.elapsed_time(end) / 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth() -> float:
    """Bytes moved per second by a 1 GiB device-to-device copy (read + write)."""
    n = 2**28
    src = torch.empty(n, device=DEV).uniform_()
    dst = torch.empty_like(src)
    t = timed({"copy": lambda: dst.copy_(src)}, None, 20, 3)["copy"]
    return 2 * 4 * n / t


def cross_check() -> None:
    """Ours and torch compute the same thing on the device (small shapes), before any timing."""
    g = torch.Generator(device=DEV).manual_seed(1)
    grads = [torch.randn(s, generator=g, device=DEV).bfloat16() for s in SMALL]
    acc = [torch.zeros(s, device=DEV) for s in SMALL]
    core.accumulate(acc, grads, overwrite=True)
    core.accumulate(acc, grads)
    assert all(torch.equal(a, 2 * x.float()) for a, x in zip(acc, grads)), "accumulate differs"
    ref = float(torch.nn.utils.get_total_norm(acc, foreach=True))
    assert math.isclose(float(core.global_norm(acc)), ref, rel_tol=1e-5), "norm differs"
    p0 = [torch.randn(s, generator=g, device=DEV) * 0.02 for s in SMALL]
    ga = [a.clone() for a in acc]
    torch_agc(p0, acc)
    core.adaptive_clip(p0, ga, clip_factor=AGC_LAMBDA, eps=AGC_EPS)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(acc, ga)), "AGC"
    tp = [nn.Parameter(p.clone()) for p in p0]
    op = [p.clone() for p in p0]
    m = [torch.zeros_like(p) for p in p0]
    v = [torch.zeros_like(p) for p in p0]
    opt = torch.optim.AdamW(tp, lr=LR, weight_decay=WD, fused=True)
    for step in (1, 2):
        oacc = []
        for p, x in zip(tp, grads):
            p.grad = x.float() * step
            oacc.append(p.grad.clone())
        torch_cycle(tp, [p.grad for p in tp], opt)()
        core.apply(
            op,
            oacc,
            optimizer="adamw",
            lr=LR,
            weight_decay=WD,
            grad_scale=1.0 / K,
            max_norm=MAX_NORM,
            state1=m,
            state2=v,
            step=step,
        )
    for a, b in zip(tp, op):
        assert torch.allclose(a.detach(), b, rtol=1e-5, atol=1e-7), "AdamW apply differs"


def bench_shapes(label: str, shapes, repeats: int, warmup: int, bw: float) -> list[dict]:
    n = numel(shapes)
    rows: list[dict] = []

    def record(op: str, res: dict[str, float], ours: str, key: str) -> None:
        floor = BYTES[key] * n / bw
        for impl, t in res.items():
            rows.append(
                dict(
                    model=label,
                    op=op,
                    impl=impl,
                    ms=t * 1e3,
                    ours=impl == ours,
                    floor_ms=floor * 1e3,
                    x_floor=t / floor,
                    vs_ours=t / res[ours],
                )
            )

    g = torch.Generator(device=DEV).manual_seed(0)
    grads = [torch.randn(s, generator=g, device=DEV).bfloat16() for s in shapes]
    params = [nn.Parameter(torch.randn(s, generator=g, device=DEV) * 0.02) for s in shapes]
    accs = [torch.zeros(s, device=DEV) for s in shapes]
    for p, a in zip(params, accs):
        p.grad = a
    pd = [p.detach() for p in params]

    # Ours as the torch wrapper calls it: registered tensor sets (checked once; a call re-checks
    # data pointers and shapes), and as plain lists (every tensor exported and checked per call).
    s_accs, s_pd = core.tensor_set(accs), core.tensor_set(pd)
    res = timed(
        {
            "torch _foreach_add_(acc, g_bf16)": lambda: torch._foreach_add_(accs, grads),
            "core.accumulate, lists": lambda: core.accumulate(accs, grads),
            "core.accumulate": lambda: core.accumulate(s_accs, grads),
        },
        None,
        repeats,
        warmup,
    )
    record("accumulate bf16→fp32", res, "core.accumulate", "accumulate")

    def refill() -> None:
        torch._foreach_copy_(accs, grads)
        torch._foreach_mul_(accs, float(K))

    step = [0]
    m = [torch.zeros_like(p) for p in pd]
    v = [torch.zeros_like(p) for p in pd]
    s_m, s_v = core.tensor_set(m), core.tensor_set(v)

    def ours() -> None:
        step[0] += 1
        core.apply(
            s_pd,
            s_accs,
            optimizer="adamw",
            lr=LR,
            weight_decay=WD,
            grad_scale=1.0 / K,
            max_norm=MAX_NORM,
            reset=True,
            state1=s_m,
            state2=s_v,
            step=step[0],
        )

    opt_fe = torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True)
    opt_fu = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    res = timed(
        {
            "torch avg+clip+AdamW(foreach)+zero": torch_cycle(params, accs, opt_fe),
            "torch avg+clip+AdamW(fused)+zero": torch_cycle(params, accs, opt_fu),
            "core.apply(adamw, max_norm)": ours,
        },
        refill,
        repeats,
        warmup,
    )
    record("apply AdamW cycle", res, "core.apply(adamw, max_norm)", "apply_adamw")
    opt_fe = opt_fu = m = v = s_m = s_v = None
    gc.collect()
    torch.cuda.empty_cache()

    res = timed(
        {
            "torch per-tensor loop": lambda: torch_agc(pd, accs),
            "core.adaptive_clip": lambda: core.adaptive_clip(
                s_pd, s_accs, clip_factor=AGC_LAMBDA, eps=AGC_EPS
            ),
        },
        refill,
        repeats,
        warmup,
    )
    record("AGC", res, "core.adaptive_clip", "agc")
    grads = params = accs = pd = s_accs = s_pd = None
    gc.collect()
    torch.cuda.empty_cache()
    return rows


# ---- a training step: per-micro-step overhead and peak memory ----


class Transformer(nn.Module):
    def __init__(self, vocab=8192, d=512, layers=6, heads=8, ctx=256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)

    def forward(self, tok):
        x = self.emb(tok) + self.pos[: tok.shape[1]]
        return self.head(self.body(x))


def bench_step(repeats: int, warmup: int, b: int = 8, ctx: int = 256) -> dict:
    torch.manual_seed(0)
    model = Transformer(ctx=ctx).to(DEV)
    n = sum(p.numel() for p in model.parameters())
    tok = torch.randint(0, 8192, (b * K, ctx + 1), device=DEV)
    lossf = nn.CrossEntropyLoss()

    def fwd_bwd(sl) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tok[sl, :-1])
            loss = lossf(out.float().flatten(0, 1), tok[sl, 1:].flatten())
        loss.backward()

    plain_opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    never = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, fused=True), 2**31 - 1
    )

    def plain_micro() -> None:
        fwd_bwd(slice(0, b))
        plain_opt.zero_grad(set_to_none=True)

    def ours_micro() -> None:
        fwd_bwd(slice(0, b))
        never.step()

    res = timed(
        {"plain fwd+bwd": plain_micro, "fwd+bwd+accumulate": ours_micro}, None, repeats, warmup
    )
    overhead = res["fwd+bwd+accumulate"] / res["plain fwd+bwd"] - 1

    # Peak memory: one b step, k micro-batches of b (ours), one k·b step.
    never = None  # its accumulators would count towards the peaks below
    gc.collect()

    def peak(fn) -> int:
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    acc_opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, fused=True), K
    )

    def one_b() -> None:
        fwd_bwd(slice(0, b))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    def k_times_b() -> None:
        for i in range(K):
            fwd_bwd(slice(i * b, (i + 1) * b))
            acc_opt.step()

    def one_kb() -> None:
        fwd_bwd(slice(0, K * b))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    one_b(), k_times_b()  # optimizer states exist before measuring
    mem = {"one b": peak(one_b), f"{K} x b (ours)": peak(k_times_b), f"one {K}b": peak(one_kb)}
    return dict(
        params=n,
        micro_batch=b,
        ctx=ctx,
        ms=res,
        overhead=overhead,
        peak_bytes=mem,
        accumulator_bytes=4 * n,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="the 1.1M shapes only, no 1B set")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not core.has_cuda():
        sys.exit("needs a GPU and a CUDA build of gradient-accumulator (core.has_cuda())")
    props = torch.cuda.get_device_properties(0)
    info = dict(
        gpu=props.name,
        sms=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        torch=torch.__version__,
        cuda=torch.version.cuda,
    )
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    cross_check()
    print("cross-check: core and torch agree on the device")
    bw = copy_bandwidth()
    print(f"copy bandwidth (1 GiB device-to-device, read + write): {bw / 1e12:.2f} TB/s")
    t0 = time.perf_counter()
    rows: list[dict] = []
    for label, shapes in MODELS.items():
        if args.small != (shapes is SMALL):
            continue
        print(f"running {label}: {len(shapes)} tensors, {numel(shapes):,} parameters", flush=True)
        rows += bench_shapes(label, shapes, args.repeats, args.warmup, bw)
    head = f"{'op':<24} {'implementation':<38} {'ms':>8} {'floor':>7} {'x floor':>7} {'vs ours':>7}"
    model = None
    for r in rows:
        if r["model"] != model:
            model = r["model"]
            print(f"\n== {model} ==\n{head}\n{'-' * len(head)}")
        print(
            f"{r['op']:<24} {'*' if r['ours'] else ' '}{r['impl']:<37} {r['ms']:>8.3f} "
            f"{r['floor_ms']:>7.3f} {r['x_floor']:>7.2f} {r['vs_ours']:>6.2f}x"
        )
    step = None
    if not args.small:
        step = bench_step(args.repeats, args.warmup)
        print(
            f"\n== transformer step ({step['params']:,} parameters, micro-batch "
            f"{step['micro_batch']}x{step['ctx']}, bf16 autocast) =="
        )
        for k, v in step["ms"].items():
            print(f"  {k:<22} {v * 1e3:8.3f} ms")
        print(f"  accumulation overhead per micro-step: {100 * step['overhead']:+.2f}%")
        for k, v in step["peak_bytes"].items():
            print(f"  peak memory {k:<14} {v / 2**20:9.1f} MiB")
        print(f"  (fp32 accumulators: {step['accumulator_bytes'] / 2**20:.1f} MiB)")
    print(
        f"\n* = ours; floor = bytes per parameter x parameters / copy bandwidth; "
        f"total {time.perf_counter() - t0:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(machine=info, copy_bandwidth_tbs=bw / 1e12, k=K, results=rows, step=step),
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
