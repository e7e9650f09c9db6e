"""The fused weight-gradient GEMM on a GPU against plain torch: per shape, the time of
``core.wgrad_accumulate(acc, dy, x)`` (one cuBLASLt matmul, beta = 1, fp32 accumulator) beside
``torch.mm(dy.t(), x)`` alone (what a fresh ``.grad`` costs) and ``torch.mm`` + ``acc.add_``
(today's unfused accumulation), as ratios from the same run.

Usage: python benchmarks/gpu_wgrad.py [--json FILE]. Prints why and exits 0 without a GPU or
before the Python binding (``core.wgrad_accumulate``) exists.
"""

from __future__ import annotations

import argparse
import json
import sys

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

    def timed(fn, reps=50):
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps * 1e3  # µs

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for n, out, inp in SHAPES:
            dy = torch.randn(n, out, device="cuda", dtype=dtype)
            x = torch.randn(n, inp, device="cuda", dtype=dtype)
            acc = torch.zeros(out, inp, device="cuda", dtype=torch.float32)
            t_fused = timed(lambda acc=acc, dy=dy, x=x: fused(acc, dy, x, weight=1.0))
            t_mm = timed(lambda dy=dy, x=x: torch.mm(dy.t(), x))
            t_unfused = timed(lambda acc=acc, dy=dy, x=x: acc.add_(torch.mm(dy.t(), x)))
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
            }
            rows.append(row)
            print(
                f"{row['dtype']:8s} n={n} {out}x{inp}: fused {t_fused:8.1f} us, torch.mm "
                f"{t_mm:8.1f} us (fused/mm {t_fused / t_mm:.3f}), mm + add {t_unfused:8.1f} us "
                f"(fused/(mm+add) {t_fused / t_unfused:.3f})"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
