"""The fused weight-gradient GEMM on a GPU against plain torch: per shape, the time of
``core.wgrad_accumulate(acc, dy, x)`` (one cuBLASLt matmul, beta = 1, fp32 accumulator) beside
``torch.mm(dy.t(), x)`` alone (what a fresh ``.grad`` costs) and ``torch.mm`` + ``acc.add_``
(today's unfused accumulation), as ratios from the same run. The GEMMs are timed on the device
alone (a sleep kernel queued first lets the host run ahead, so the Python cost of each call is
hidden); ``host_us`` is that Python cost, the host time of one call. Then GPT-2-sized Linear
stacks per micro-step, wall time (host included, as in training). The JSON is written after
each part, so a failure in the second keeps the first.

Usage: python benchmarks/gpu_wgrad.py [--json FILE]. Prints why and exits 0 without a GPU or
before the Python binding (``core.wgrad_accumulate``) exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SHAPES = [  # (tokens n, out, in): GPT-2 124M and 1.3B Linears at micro-batch 2 × 1024 tokens
    (2048, 768, 768),
    (2048, 3072, 768),
    (2048, 2048, 2048),
    (2048, 8192, 2048),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        import torch

        import gradient_accumulator.core as core
    except ImportError as e:
        print(f"skipped: {e}")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no GPU")
        return 0
    fused = getattr(core, "wgrad_accumulate", None)
    if fused is None:
        print("skipped: gradient_accumulator.core has no wgrad_accumulate yet")
        return 0

    def timed(fn, reps=50, ahead=False):
        """µs per call between CUDA events; ``ahead``: a sleep kernel first, so that the host
        queues all calls before the device reaches them (device time only)."""
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if ahead:
            torch.cuda._sleep(100_000_000)  # ~50 ms of device time: longer than the enqueueing
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps * 1e3  # µs

    def host_time(fn, reps=50):
        """µs of host time per call, the device left to run behind."""
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t) / reps * 1e6
        torch.cuda.synchronize()
        return host

    def save(out):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), **out}, f, indent=1)

    probe = torch.zeros(4, 4, device="cuda")
    done, why = fused(probe, torch.ones(2, 4, device="cuda"), torch.ones(2, 4, device="cuda"))
    if not done or probe[0, 0].item() != 2.0:
        print(f"no fused GEMM on this GPU: {why or 'wrong result'}")
        return 1
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for n, out, inp in SHAPES:
            dy = torch.randn(n, out, device="cuda", dtype=dtype)
            x = torch.randn(n, inp, device="cuda", dtype=dtype)
            acc = torch.zeros(out, inp, device="cuda", dtype=torch.float32)
            call = lambda acc=acc, dy=dy, x=x: fused(acc, dy, x, weight=1.0)  # noqa: E731
            t_fused = timed(call, ahead=True)
            t_mm = timed(lambda dy=dy, x=x: torch.mm(dy.t(), x), ahead=True)
            t_unfused = timed(lambda acc=acc, dy=dy, x=x: acc.add_(torch.mm(dy.t(), x)), ahead=True)
            t_host = host_time(call)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "n": n,
                "out": out,
                "in": inp,
                "fused_us": round(t_fused, 2),
                "mm_us": round(t_mm, 2),
                "mm_add_us": round(t_unfused, 2),
                "fused_over_mm": round(t_fused / t_mm, 3),
                "fused_over_mm_add": round(t_fused / t_unfused, 3),
                "host_us": round(t_host, 1),
            }
            rows.append(row)
            print(
                f"{row['dtype']:8s} n={n} {out}x{inp}: fused {t_fused:8.1f} us, torch.mm "
                f"{t_mm:8.1f} us (fused/mm {t_fused / t_mm:.3f}), mm + add {t_unfused:8.1f} us "
                f"(fused/(mm+add) {t_fused / t_unfused:.3f}); host {t_host:.1f} us a call"
            )
    save({"rows": rows})
    try:
        steps = micro_steps(torch, timed)
    except Exception as e:  # keep the GEMM rows; say what failed
        save({"rows": rows, "micro_steps_error": repr(e)})
        raise
    save({"rows": rows, "micro_steps": steps})
    return 0


def _stack(torch, width: int, layers: int):
    """The Linears of a GPT-2-like model (per block: qkv, proj, fc, fc-out), no attention."""
    from torch import nn

    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, 3 * width), nn.GELU(), nn.Linear(3 * width, width)]
        mods += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*mods).cuda()


def micro_steps(torch, timed) -> list:
    """Per micro-step (bf16 autocast, micro-batch 2 x 1024 tokens, mid-cycle): fused against
    unfused, and against a plain forward + backward writing fresh .grad."""
    from gradient_accumulator.torch import GradientAccumulateOptimizer, fuse_accumulation

    out = []
    for name, width, layers in (("124M-like", 768, 12), ("1.3B-like", 2048, 24)):
        x = torch.randn(2048, width, device="cuda")
        times = {}
        for variant in ("fresh", "unfused", "fused"):
            torch.manual_seed(0)
            model = _stack(torch, width, layers)
            opt = None
            if variant != "fresh":
                inner = torch.optim.SGD(model.parameters(), lr=1e-3)
                opt = GradientAccumulateOptimizer(inner, 10**9, overlap_reduce=False)
                if variant == "fused":
                    fuse_accumulation(model, opt, min_size=0)

            def step(model=model, opt=opt, x=x):
                if opt is None:
                    model.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x).float().square().mean()
                loss.backward()
                if opt is not None:
                    opt.step()
                    opt.zero_grad()

            times[variant] = timed(step, reps=10)
            del model, opt
            torch.cuda.empty_cache()
        row = {"model": name, **{f"{k}_us": round(v, 1) for k, v in times.items()}}
        row["fused_over_unfused"] = round(times["fused"] / times["unfused"], 3)
        row["fused_over_fresh"] = round(times["fused"] / times["fresh"], 3)
        out.append(row)
        print(
            f"{name}: micro-step fresh {times['fresh'] / 1e3:.2f} ms, unfused "
            f"{times['unfused'] / 1e3:.2f} ms, fused {times['fused'] / 1e3:.2f} ms; fused/unfused "
            f"{row['fused_over_unfused']:.3f}, fused/fresh {row['fused_over_fresh']:.3f}"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
