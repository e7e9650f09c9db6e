"""CPU benchmark of fuse_accumulation: the weight-gradient GEMM writing the fp32 accumulator.

Model: four ``nn.Linear`` of widths 1024-2048 with GELU between them (a GPT-2-like MLP stack,
no bias on the widest), a fixed micro-batch of ``--tokens`` rows, fp32 and bf16 parameters,
1 and 2 threads. All rows of a section run round-robin in one process (median of the repeats; a
ratio is the median of the ratios within each round):

* ``fresh``: forward + backward writing fresh ``.grad`` (``zero_grad()`` before): no
  accumulation at all, the floor.
* ``torch .grad``: forward + ``loss.backward()`` adding into the existing ``.grad`` (plain
  torch accumulation, no wrapper).
* ``unfused``: forward + backward + ``opt.step()`` + ``opt.zero_grad()`` of a
  ``GradientAccumulateOptimizer`` whose cycle never ends (a mid-cycle micro-step: the step
  folds ``.grad`` into the fp32 accumulators, a second pass).
* ``fused``: the same with ``fuse_accumulation(model, opt)``: the GEMMs write the
  accumulators during the backward; ``step()`` has nothing left to fold.

Then the weight-gradient GEMM alone at 1024×1024×1024 (fp32): ``core.wgrad_accumulate``
against ``torch.mm`` + ``acc.add_``, and the gradient bytes alive after a backward (the
temporary the fused path does not make). Prints ratios; no asserts.

Run: ``python benchmarks/fused_wgrad.py`` (``--small`` for a quick check).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from gradient_accumulator import core
from gradient_accumulator.torch import GradientAccumulateOptimizer, fuse_accumulation, fused_path


def _model(dtype: torch.dtype, width: int) -> nn.Module:
    torch.manual_seed(0)
    w2 = 2 * width
    return nn.Sequential(
        nn.Linear(width, w2),
        nn.GELU(),
        nn.Linear(w2, width),
        nn.GELU(),
        nn.Linear(width, w2, bias=False),
        nn.GELU(),
        nn.Linear(w2, width),
    ).to(dtype)


class _Variant:
    def __init__(self, name: str, dtype: torch.dtype, width: int) -> None:
        self.name = name
        self.model = _model(dtype, width)
        self.opt = None
        if name in ("unfused", "fused"):
            inner = torch.optim.SGD(self.model.parameters(), lr=1e-3)
            self.opt = GradientAccumulateOptimizer(inner, 10**9, overlap_reduce=False)
            if name == "fused":
                fuse_accumulation(self.model, self.opt, min_size=0)

    def micro_step(self, x: torch.Tensor) -> None:
        if self.name == "fresh":
            self.model.zero_grad(set_to_none=True)
        self.model(x).float().square().mean().backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad()

    def grad_bytes(self) -> int:
        return sum(
            p.grad.numel() * p.grad.element_size()
            for p in self.model.parameters()
            if p.grad is not None
        )


def _time(fn, repeats: int) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def micro_steps(
    dtype: torch.dtype, threads: int, width: int, tokens: int, repeats: int
) -> dict[str, float]:
    """Times the four variants; returns fused ÷ each of them."""
    torch.set_num_threads(threads)
    names = ["fresh", "torch .grad", "unfused", "fused"]
    variants = [_Variant(n, dtype, width) for n in names]
    x = torch.randn(tokens, width, dtype=dtype)
    for v in variants:  # warm-up, and the .grad bytes alive after a backward
        for _ in range(2):
            v.micro_step(x)
    grad_bytes = {}
    for v in variants:
        v.model(x).float().square().mean().backward()
        grad_bytes[v.name] = v.grad_bytes()
        if v.opt is not None:
            v.opt.step()
            v.opt.zero_grad()
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for v in variants:
            times[v.name].append(_time(lambda v=v: v.micro_step(x), 1))
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}

    def ratio(a: str, b: str) -> float:
        # The median of the per-round ratios: the machine's speed drifts between rounds (a
        # shared VM), and a ratio of two times taken side by side in one round does not.
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    path = fused_path(variants[3].model[0], tokens)
    print(
        f"\n{str(dtype).replace('torch.', '')}, {threads} thread(s), {tokens} tokens, "
        f"width {width}; fused path: {path}"
    )
    print(f"{'variant':<14}{'ms / micro-step':>16}{'÷ fresh':>10}{'.grad MB alive':>16}")
    for n in names:
        print(f"{n:<14}{med[n]:>16.2f}{ratio(n, 'fresh'):>10.3f}{grad_bytes[n] / 2**20:>16.1f}")
    # The same micro-steps went through both wrappers: their accumulators must agree.
    acc_u, acc_f = variants[2].opt.accumulators(), variants[3].opt.accumulators()
    diff = max(
        ((a.double() - b.double()).abs().max() / a.double().abs().max()).item()
        for a, b in zip(acc_u, acc_f)
    )
    print(f"accumulators fused vs unfused: max rel diff {diff:.2e}")
    print(
        f"fused ÷ unfused {ratio('fused', 'unfused'):.3f}   "
        f"fused ÷ torch .grad {ratio('fused', 'torch .grad'):.3f}   "
        f"fused ÷ fresh {ratio('fused', 'fresh'):.3f}   "
        f"peak .grad bytes lower by {(grad_bytes['unfused'] - grad_bytes['fused']) / 2**20:.1f} MB"
    )
    return {n: ratio("fused", n) for n in names}


def gemm_alone(shapes: list[tuple[int, int, int]], repeats: int) -> None:
    """The weight-gradient GEMM alone, fp32, one thread: acc[out, in] += dyᵀx over n rows.
    Few rows per weight (a small micro-batch) is where the separate add weighs most."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print("\nweight-gradient GEMM alone, fp32, 1 thread (ms, median):")
    head = ("out x in, n rows", 20), ("fused", 9), ("mm + add_", 11), ("mm alone", 10)
    print("".join(f"{h:>{w}}" for h, w in head) + f"{'fused ÷ (mm + add)':>20}")
    for out, inp, n in shapes:
        dy, x = torch.randn(n, out, generator=g), torch.randn(n, inp, generator=g)
        acc = torch.zeros(out, inp)
        done, why = core.wgrad_accumulate(acc, dy, x)
        if not done:
            print(f"no fused path here ({why})")
            return
        calls = (
            lambda acc=acc, dy=dy, x=x: core.wgrad_accumulate(acc, dy, x),
            lambda acc=acc, dy=dy, x=x: acc.add_(torch.mm(dy.t(), x)),
            lambda dy=dy, x=x: torch.mm(dy.t(), x),
        )
        fused, plain, mm = [], [], []
        for _ in range(repeats):
            for times, call in zip((fused, plain, mm), calls):
                times.append(_time(call, 1))
        f, p, m = (statistics.median(t) * 1e3 for t in (fused, plain, mm))
        r = statistics.median(a / b for a, b in zip(fused, plain))
        print(f"{f'{out} x {inp}, {n}':>20}{f:>9.2f}{p:>11.2f}{m:>10.2f}{r:>20.3f}")


def sweep(tokens: int, repeats: int) -> None:
    """Where fusing starts to pay: fp32, one thread, widths 128-1024 (layers of width×2·width
    weights), the default min_size of fuse_accumulation marked."""
    from gradient_accumulator.torch.fused import MIN_SIZE

    rows = []
    for width in (128, 256, 384, 512, 1024):
        fused_over = micro_steps(torch.float32, 1, width, tokens, repeats)
        rows.append((width, 2 * width * width, fused_over))
    print(f"\nsweep, fp32, 1 thread, {tokens} tokens (min_size default {MIN_SIZE}):")
    print(f"{'width':>6}{'weights/layer':>15}{'÷ unfused':>11}{'÷ torch .grad':>15}{'÷ fresh':>9}")
    for width, size, r in rows:
        mark = "" if size >= MIN_SIZE else "  (left unfused by default)"
        print(
            f"{width:>6}{size:>15}{r['unfused']:>11.3f}{r['torch .grad']:>15.3f}"
            f"{r['fresh']:>9.3f}{mark}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, one repeat (a check)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="widths 128-1024, fp32, one thread")
    ap.add_argument(
        "--dtypes", default="float32,bfloat16", help="parameter dtypes, comma-separated"
    )
    args = ap.parse_args()
    if args.sweep:
        sweep(64 if args.small else args.tokens, 1 if args.small else args.repeats)
        return
    width, tokens, repeats = args.width, args.tokens, args.repeats
    if args.small:
        width, tokens, repeats = 64, 16, 1
    print(f"torch {torch.__version__}, core ISA {core.cpu_isa()}")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for threads in (1, 2):
            micro_steps(dtype, threads, width, tokens, repeats)
    shapes = (
        [(64, 64, 64)] if args.small else [(1024, 1024, 1024), (2048, 2048, 64), (2048, 1024, 256)]
    )
    gemm_alone(shapes, max(repeats, 3))


if __name__ == "__main__":
    main()
