"""Where the time of one core call goes on the GPU: kernels launched, their device time against
the bandwidth floor, and the host time of the call.

For each call — ``core.accumulate`` (bf16 gradients into fp32 accumulators: on registered tensor
sets as the torch wrapper calls it, on plain lists, and as one flat tensor),
``core.sum_of_squares``, ``core.apply`` (÷k + global-norm clip + AdamW + zero) and
``core.adaptive_clip`` — on GPT-2 shapes (124M: 148 tensors; 1B: 220 tensors), and torch's own
equivalent beside it (``_foreach_add_``, a flat ``add_``, the fused AdamW pipeline):

* kernels: device kernels (and memsets) that one call enqueues, from torch.profiler (CUPTI);
* kernel ms: the sum of their durations; ``x floor``: that over the floor — nominal bytes per
  parameter (benchmarks/cpu_core.py: BYTES) × parameters / the device-to-device copy bandwidth
  measured at the start;
* host ms: wall time of the call on the host without waiting for the device (median of
  repeats), i.e. what the Python thread pays before it can enqueue the next work;
* span ms: CUDA-event time of back-to-back calls (device and host overlapping, as in training).

Usage (a GPU and a CUDA build of gradient-accumulator):
    python benchmarks/gpu_profile.py               # 124M and 1B shapes
    python benchmarks/gpu_profile.py --small       # 1.1M shapes (seconds)
    python benchmarks/gpu_profile.py --json profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_core import BYTES, GPT2_SMALL, LR, MAX_NORM, SMALL, WD, K, gpt2_shapes, numel  # noqa: E402

from gradient_accumulator import core  # noqa: E402

DEV = "cuda"
GPT2_1B = gpt2_shapes(n_layer=24, d=1792, vocab=50257, ctx=2048)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), median of 20."""
    src = torch.empty(2**28, device=DEV).uniform_()
    dst = torch.empty_like(src)
    times = []
    for r in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        if r >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times)


def profile_call(fn: Callable[[], object], repeats: int) -> dict:
    """Kernels, kernel time, host time and span of one call of `fn` (warmed up first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()  # each call alone: host time without a queue backing up
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(repeats):
        fn()
    e.record()
    e.synchronize()
    span = s.elapsed_time(e) / 1e3 / repeats
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [
        ev
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() >= 0
    ]
    names: dict[str, list[float]] = {}
    for ev in kernels:
        names.setdefault(ev.name[:70], []).append(ev.time_range.elapsed_us() / 1e6)
    return dict(
        kernels=len(kernels),
        kernel_s=sum(sum(v) for v in names.values()),
        host_s=statistics.median(host),
        span_s=span,
        top=sorted(((sum(v), len(v), k) for k, v in names.items()), reverse=True)[:3],
    )


def calls(shapes) -> list[tuple[str, str, bool, Callable[[], object]]]:
    """(op, implementation, ours, call) over fresh random device tensors of `shapes`."""
    g = torch.Generator(device=DEV).manual_seed(0)
    grads = [torch.randn(s, generator=g, device=DEV).bfloat16() for s in shapes]
    accs = [torch.randn(s, generator=g, device=DEV) for s in shapes]
    params = [torch.randn(s, generator=g, device=DEV) * 0.02 for s in shapes]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    n = numel(shapes)
    flat_acc = torch.randn(n, generator=g, device=DEV)
    flat_g = torch.randn(n, generator=g, device=DEV).bfloat16()
    step = [0]
    # Ours as the torch wrapper calls it: registered tensor sets (see host_cost.py).
    s_params, s_accs = core.tensor_set(params), core.tensor_set(accs)
    s_m, s_v = core.tensor_set(m), core.tensor_set(v)
    alive = (params, accs, m, v)  # a tensor set does not keep its tensors alive

    def ours_apply(_alive=alive) -> None:
        step[0] += 1
        core.apply(
            s_params,
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

    tparams = [p.clone().requires_grad_() for p in params]
    topt = torch.optim.AdamW(tparams, lr=LR, weight_decay=WD, fused=True)
    for p, a in zip(tparams, accs):
        p.grad = a.clone()

    def torch_apply() -> None:  # torch's fastest pipeline for the same work
        grads_ = [p.grad for p in tparams]
        torch._foreach_mul_(grads_, 1.0 / K)
        torch.nn.utils.clip_grad_norm_(tparams, MAX_NORM, foreach=True)
        topt.step()
        torch._foreach_zero_(grads_)

    return [
        ("accumulate", "core.accumulate", True, lambda: core.accumulate(s_accs, grads)),
        ("accumulate", "core.accumulate, lists", True, lambda: core.accumulate(accs, grads)),
        (
            "accumulate",
            "core.accumulate, one flat tensor",
            True,
            lambda: core.accumulate([flat_acc], [flat_g]),
        ),
        ("accumulate", "torch._foreach_add_", False, lambda: torch._foreach_add_(accs, grads)),
        ("accumulate", "torch add_, one flat tensor", False, lambda: flat_acc.add_(flat_g)),
        ("global_norm", "core.sum_of_squares", True, lambda: core.sum_of_squares(s_accs)),
        ("global_norm", "torch._foreach_norm", False, lambda: torch._foreach_norm(accs)),
        ("apply_adamw", "core.apply adamw + clip", True, ours_apply),
        ("apply_adamw", "torch scale+clip+fused AdamW+zero", False, torch_apply),
        (
            "agc",
            "core.adaptive_clip",
            True,
            lambda: core.adaptive_clip(s_params, s_accs, clip_factor=0.01, eps=1e-3),
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="the 1.1M shapes only")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not core.has_cuda():
        sys.exit("needs a GPU and a CUDA build of gradient-accumulator (core.has_cuda())")
    props = torch.cuda.get_device_properties(0)
    print(
        f"machine: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}"
    )
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    sets = {"1.1M": SMALL} if args.small else {"124M": GPT2_SMALL, "1B": GPT2_1B}
    rows = []
    head = (
        f"{'op':<12} {'implementation':<36} {'kernels':>7} {'kernel ms':>9} {'floor':>7} "
        f"{'x floor':>7} {'host ms':>8} {'span ms':>8}"
    )
    for label, shapes in sets.items():
        n = numel(shapes)
        print(
            f"\n== {label}: {len(shapes)} tensors, {n:,} parameters ==\n{head}\n{'-' * len(head)}"
        )
        for op, impl, ours, fn in calls(shapes):
            r = profile_call(fn, args.repeats)
            floor = BYTES[op] * n / bw
            row = dict(
                shapes=label,
                op=op,
                impl=impl,
                ours=ours,
                floor_s=floor,
                x_floor=r["kernel_s"] / floor,
                **r,
            )
            rows.append(row)
            print(
                f"{op:<12} {'*' if ours else ' '}{impl:<35} {r['kernels']:>7} "
                f"{r['kernel_s'] * 1e3:>9.3f} {floor * 1e3:>7.3f} {row['x_floor']:>7.2f} "
                f"{r['host_s'] * 1e3:>8.3f} {r['span_s'] * 1e3:>8.3f}"
            )
            for t, c, name in r["top"]:
                print(f"{'':14}{t * 1e3:8.3f} ms x{c:<4d} {name}")
        torch.cuda.empty_cache()
    print("\n* = ours; floor = BYTES[op] x parameters / copy bandwidth (kernel time only)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, copy_bandwidth_tbs=bw / 1e12, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
