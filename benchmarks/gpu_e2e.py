"""End to end on a GPU: a GPT-2 trained with k micro-batches per update, ours against the naive
recipe, in ms per cycle and peak memory.

* naive: ``(loss / k).backward()`` k times, ``clip_grad_norm_``, fused AdamW ``step()``,
  ``zero_grad()`` — PyTorch's own gradient accumulation;
* ours: ``GradientAccumulateOptimizer(AdamW, k, max_grad_norm=1.0)``: ``backward()``,
  ``step()``, ``zero_grad()`` every micro-batch (fp32 accumulators, fused apply).

Configurations (models built from a ``transformers.GPT2Config``, random tokens):

* GPT-2 124M, k = 8 micro-batches of 8 × 512 tokens, bf16 autocast with fp32 parameters;
* the same with pure bf16 parameters (ours keeps fp32 accumulators; naive accumulates in bf16);
* a 1.3B configuration (24 layers, d = 2048) at micro-batch 2 × 1024, bf16 autocast.

Times are CUDA-event medians over cycles after warm-up cycles; peak memory is
``torch.cuda.max_memory_allocated`` over the timed cycles. The recipes run in rounds ordered
naive, ours, ours, naive (``--rounds``, default 2: ABBA), each in a fresh model, so that a drift of
the machine over the run (clocks, the host) falls on both alike; each round's time is printed,
and the ratio is that of the medians over rounds. ``--smoke`` runs a two-layer model for
one cycle on the CPU and checks that both recipes reach the same weights (what CI runs).

Usage:
    python benchmarks/gpu_e2e.py                    # all three configurations
    python benchmarks/gpu_e2e.py --only 124m        # 124M, both precisions
    python benchmarks/gpu_e2e.py --smoke            # CPU, seconds
    python benchmarks/gpu_e2e.py --only 124m --rounds 1 --profile   # and where a cycle goes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

try:
    from gradient_accumulator.torch import GradientAccumulateOptimizer
except ImportError:  # run from a checkout
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from gradient_accumulator.torch import GradientAccumulateOptimizer

LR, WD, CLIP = 3e-4, 0.01, 1.0

CONFIGS = {
    "124m-autocast": dict(layers=12, d=768, heads=12, ctx=512, micro=8, k=8, pure_bf16=False),
    "124m-bf16": dict(layers=12, d=768, heads=12, ctx=512, micro=8, k=8, pure_bf16=True),
    "1.3b-autocast": dict(layers=24, d=2048, heads=16, ctx=1024, micro=2, k=8, pure_bf16=False),
}
SMOKE = dict(layers=2, d=64, heads=2, ctx=32, micro=2, k=2, pure_bf16=False, vocab=256)


def make_model(cfg: dict, device: str) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=cfg.get("vocab", 50257),
        n_positions=cfg["ctx"],
        n_embd=cfg["d"],
        n_layer=cfg["layers"],
        n_head=cfg["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device)
    if cfg["pure_bf16"]:
        model = model.to(torch.bfloat16)
    return model


def make_batches(cfg: dict, cycles: int, device: str) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    vocab = cfg.get("vocab", 50257)
    return [
        [
            torch.randint(0, vocab, (cfg["micro"], cfg["ctx"]), generator=g).to(device)
            for _ in range(cfg["k"])
        ]
        for _ in range(cycles)
    ]


def run(kind: str, cfg: dict, batches, device: str, warmup: int, profile: bool = False) -> dict:
    """Train `kind` ("naive" or "ours") over `batches`; times of the cycles after `warmup`.
    With `profile`, the first timed cycle runs under torch.profiler, returned as "profile"."""
    model = make_model(cfg, device)
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=fused)
    acc = GradientAccumulateOptimizer(opt, cfg["k"], max_grad_norm=CLIP) if kind == "ours" else None
    autocast = device == "cuda" and not cfg["pure_bf16"]
    times = []
    cuda = device == "cuda"
    prof = None
    for c, cycle in enumerate(batches):
        if profile and c == warmup:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        if cuda and c == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for tokens in cycle:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = model(tokens, labels=tokens).loss
            if kind == "ours":
                loss.backward()
                acc.step()
                acc.zero_grad()
            else:
                (loss / cfg["k"]).backward()
        if kind == "ours":
            assert acc.update_applied
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            elapsed = time.perf_counter() - t0
        if c >= warmup:
            times.append(elapsed)
        if prof is not None and c == warmup:
            prof.__exit__(None, None, None)
    flat = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    del model, opt, acc
    if cuda:
        torch.cuda.empty_cache()
    return dict(
        ms=1e3 * statistics.median(times), peak_gib=peak / 2**30, weights=flat, profile=prof
    )


def print_profile(kind: str, r: dict, cuda: bool) -> None:
    """Where one cycle's time went: the top ops by device time and by host time."""
    table = r["profile"].key_averages()
    print(f"\n-- profile of one cycle, {kind} ({r['ms']:.1f} ms/cycle median) --")
    if cuda:
        print(table.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


def smoke(profile: bool = False) -> None:
    """Both recipes on a tiny model on the CPU: one cycle, the same weights (fp32, 1e-5)."""
    batches = make_batches(SMOKE, 2, "cpu")
    naive = run("naive", SMOKE, batches, "cpu", warmup=0)
    ours = run("ours", SMOKE, batches, "cpu", warmup=0, profile=profile)
    if profile:
        print_profile("ours", ours, cuda=False)
    rel = float((ours["weights"] - naive["weights"]).abs().max() / naive["weights"].abs().max())
    print(f"smoke: ours vs naive after 2 cycles: max rel diff {rel:.2e}")
    if not rel <= 1e-5:
        sys.exit("smoke: ours and the naive recipe disagree")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["124m", "1.3b"], help="one model size")
    ap.add_argument("--cycles", type=int, default=6, help="timed cycles per run (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--rounds", type=int, default=2, help="runs of each recipe, ordered ABBA (default 2)"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, then exit")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed rounds, one more run of each recipe with a cycle under "
        "torch.profiler: top ops by device and host time",
    )
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if args.smoke:
        smoke(args.profile)
        return
    if not torch.cuda.is_available():
        sys.exit("needs a GPU (or --smoke)")
    props = torch.cuda.get_device_properties(0)
    print(f"machine: {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    torch.backends.cuda.matmul.allow_tf32 = True  # both recipes alike: speed, not equivalence
    results = {}
    for name, cfg in CONFIGS.items():
        if args.only and not name.startswith(args.only):
            continue
        batches = make_batches(cfg, args.warmup + args.cycles, "cuda")
        order = [("naive", "ours")[(r + r // 2) % 2] for r in range(2 * args.rounds)]
        rounds: dict[str, list[float]] = {"naive": [], "ours": []}
        peak: dict[str, float] = {"naive": 0.0, "ours": 0.0}
        for kind in order:  # naive, ours, ours, naive, naive, ours, ...
            r = run(kind, cfg, batches, "cuda", args.warmup)
            rounds[kind].append(r["ms"])
            peak[kind] = max(peak[kind], r["peak_gib"])
        row = {
            k: dict(ms=statistics.median(v), rounds_ms=v, peak_gib=peak[k])
            for k, v in rounds.items()
        }
        row["ratio"] = row["ours"]["ms"] / row["naive"]["ms"]
        results[name] = row
        print(
            f"{name:<15} k={cfg['k']} micro {cfg['micro']}x{cfg['ctx']}: naive "
            f"{row['naive']['ms']:8.1f} ms {row['naive']['peak_gib']:6.2f} GiB | ours "
            f"{row['ours']['ms']:8.1f} ms {row['ours']['peak_gib']:6.2f} GiB | ours/naive "
            f"{row['ratio']:.3f}",
            flush=True,
        )
        for k, v in rounds.items():
            print(f"{'':<15} {k} per round (ms/cycle): " + ", ".join(f"{t:.1f}" for t in v))
        if args.profile:
            for kind in ("naive", "ours"):
                print_profile(kind, run(kind, cfg, batches, "cuda", args.warmup, True), cuda=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, torch=torch.__version__, results=results), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
