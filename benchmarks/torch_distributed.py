"""CPU benchmark of distributed gradient accumulation with torch.distributed (Gloo, localhost).

Every rank trains the same MLP with AdamW on its own micro-batches, k = 4 micro-batches per
optimizer step, under each of these strategies, side by side in one process group:

* ddp every micro-batch:   DistributedDataParallel, loss / k, DDP all-reduces on every
                           micro-batch's backward, torch AdamW (fused) steps once per cycle;
* ddp no_sync:             the same with ``model.no_sync()`` on the k - 1 non-boundary
                           micro-batches (one reduction round, during the last backward);
* ddp accumulate() + GA:   DDP inside the package's ``accumulate(model, opt)`` context with
                           ``GradientAccumulateOptimizer(AdamW, k)`` over the same group: DDP
                           is silenced on every micro-batch and the optimizer's one weighted
                           round per cycle replaces DDP's reduction;
* GA reduce (overlap):     ``GradientAccumulateOptimizer(AdamW, k, process_group=WORLD)`` on an
                           unwrapped model: one bucketed all-reduce of the fp32 accumulators per
                           cycle, buckets started during the last backward (the package's row,
                           the one the ratios refer to);
* GA reduce (no overlap):  the same with ``overlap_reduce=False`` (reduced inside ``step()``);
* local only:              ``process_group=False`` on an unwrapped model: no communication at
                           all, a floor for compute + update (its weights differ across ranks).

DDP and the package get the same bucket cap (--bucket-cap-mb; given explicitly, DDP makes every
bucket that size instead of its default 1 MiB first bucket).

Counting collectives and bytes (a separate, untimed pass on fresh copies of the models, after
one warm-up cycle so that DDP has rebuilt its buckets): the torch.distributed collectives
(all_reduce, all_gather, reduce_scatter, broadcast, barrier, ...) are wrapped, in both
``torch.distributed`` and ``torch.distributed.distributed_c10d``, by counters of calls and of the
bytes of the tensors handed to them on this rank (the payload; Gloo's ring all-reduce moves
about 2 (W - 1) / W times that per rank). DDP's reducer calls its collectives from C++, past
those wrappers, so the counting copies of the DDP models get a communication hook
(``register_comm_hook``) that tallies each bucket's bytes and then calls torch's stock
``allreduce_hook``, which all-reduces through the (wrapped) Python API. The hook's tally must
equal the wrappers', and the package's own counters (``opt.collectives``,
``opt.bytes_reduced``) must equal the wrappers' for its rows; the script stops otherwise.
The timed copies have no hooks and no wrappers.

Weight check: after the counting pass (3 cycles from the same initial weights and data), every
strategy's parameters are compared with "ddp every micro-batch" on each rank
(max |w - w_ref| / max |w_ref|, worst rank) and with rank 0's copy of the same strategy.

Timing: each rank runs torch.set_num_threads(1) (the ranks share the machine's cores, so with
4 ranks on a 2-core machine the ranks time-slice). Cycles of the strategies alternate
(round-robin, so that machine noise hits all of them alike), each preceded by a barrier; a
cycle's time is the slowest rank's (k forwards + backwards + optimizer steps), and the figure
is the median over the timed cycles after warm-up cycles.

FSDP2 (``--fsdp2``): the same MLP sharded with ``fully_shard`` (each Linear, then the root),
AdamW, k micro-batches per step, two strategies side by side:

* fsdp2 loss/k:            FSDP2's own recipe: each loss divided by k, FSDP2 reduce-scatters every
                           micro-batch and accumulates the sharded gradients, torch AdamW steps
                           once per cycle;
* fsdp2 + GA:              ``GradientAccumulateOptimizer(AdamW, k, model=model)``: FSDP2's
                           reduce-scatter (weighted) every micro-batch, the shards folded into
                           the fp32 accumulators, the fused update on each rank's shard;
* fsdp2 + GA nosync:       the same with FSDP2's gradient sync off until each cycle's last
                           backward (``set_requires_gradient_sync``): one reduce-scatter per
                           cycle, unsharded gradients held between micro-batches.

It prints the time per cycle (median, slowest rank), the bytes each rank holds between
micro-batches for the accumulated gradient (ours: the flat fp32 accumulator buffer; FSDP2's: the
sharded fp32 ``.grad``) against 4 × parameters ÷ world, and the weights' difference after a few
cycles (the two must agree to 1e-5).

Usage:
    python benchmarks/torch_distributed.py                 # world sizes 2 and 4, ~4.2M params
    python benchmarks/torch_distributed.py --fsdp2         # FSDP2: ours against loss/k
    python benchmarks/torch_distributed.py --small         # small model, few cycles (smoke test)
    python benchmarks/torch_distributed.py --cycles 20 --json results.json
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate
except ImportError:  # run from a checkout: benchmarks/ sits next to the package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate

try:
    from cpu_core import machine_info as host_info
except ImportError:  # not run as a script from benchmarks/: cpu_core sits next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_core import machine_info as host_info

K = 4  # micro-batches per optimizer step
LR, WD = 1e-3, 0.01
TOL = 1e-5  # max|Δw| / max|w| against the reference strategy
COUNT_WARMUP, COUNT_CYCLES = 1, 2  # counting pass: cycles skipped, cycles counted

# name, label; REF is the reference of the weight check, OURS the reference of the time ratios
STRATEGIES = [
    ("ddp_every", "ddp every micro-batch"),
    ("ddp_no_sync", "ddp no_sync"),
    ("ddp_accumulate", "ddp accumulate() + GA"),
    ("ga_overlap", "GA reduce (overlap)"),
    ("ga_no_overlap", "GA reduce (no overlap)"),
    ("local", "local only (no comm)"),
]
REF, OURS = "ddp_every", "ga_overlap"

MODELS = {  # d_in, hidden, hidden layers (hidden x hidden), micro-batch size
    "full": dict(d_in=512, hidden=1024, depth=3, batch=32),  # 4.2 M parameters, 16.8 MB fp32
    "small": dict(d_in=64, hidden=256, depth=2, batch=8),  # 0.17 M parameters
}


# ---- model and data ----


def _time_cycles(strategies: list, x: Any, y: Any, n: int) -> torch.Tensor:
    """Seconds per cycle, round-robin over ``strategies`` (rows) for ``n`` cycles (columns):
    each rank's time behind a barrier, the slowest rank's kept."""
    times = torch.zeros(len(strategies), n, dtype=torch.float64)
    for c in range(n):
        for i, s in enumerate(strategies):
            dist.barrier()
            t0 = time.perf_counter()
            s.cycle(x[c], y[c])
            times[i, c] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times


def make_net(d_in: int, hidden: int, depth: int, **_: Any) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    layers.append(nn.Linear(hidden, d_in))
    return nn.Sequential(*layers)


def make_data(rank: int, cycles: int, d_in: int, batch: int, **_: Any):
    """This rank's micro-batches: cycles × K pairs (x, y), different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(cycles, K, batch, d_in, generator=g)
    y = torch.randn(cycles, K, batch, d_in, generator=g)
    return x, y


# ---- counting collectives ----


_PAYLOAD = {  # collective -> (positional index, keyword) of the tensor(s) this rank hands over
    "all_reduce": (0, "tensor"),
    "all_reduce_coalesced": (0, "tensors"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_coalesced": (1, "input_tensor_list"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all": (1, "input_tensor_list"),
    "all_to_all_single": (1, "input"),
    "gather": (0, "tensor"),
    "scatter": (1, "scatter_list"),
    "barrier": (None, None),
}


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(u) for u in t)
    return 0


class CollectiveCounter:
    """Wraps torch.distributed's collectives; counts calls and payload bytes while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._saved: list[tuple[Any, str, Callable]] = []

    def _wrap(self, name: str, real: Callable) -> Callable:
        idx, kw = _PAYLOAD[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if idx is not None:
                self.bytes += _nbytes(args[idx] if len(args) > idx else kwargs.get(kw))
            return real(*args, **kwargs)

        return counted

    def install(self) -> None:
        for mod in (dist, c10d):
            for name in _PAYLOAD:
                real = getattr(mod, name, None)
                if real is not None:
                    self._saved.append((mod, name, real))
                    setattr(mod, name, self._wrap(name, real))

    def uninstall(self) -> None:
        for mod, name, real in reversed(self._saved):
            setattr(mod, name, real)
        self._saved = []

    def snapshot(self) -> tuple[int, int]:
        return self.calls, self.bytes


class HookTally:
    """DDP communication hook (``self.hook``): tallies bucket bytes, then torch's stock
    ``allreduce_hook``."""

    def __init__(self) -> None:
        self.buckets = 0
        self.bytes = 0

        # DDP inspects the hook: a plain function, annotations left out (they would be strings)
        def counting_allreduce_hook(state, bucket):
            buf = bucket.buffer()
            self.buckets += 1
            self.bytes += buf.numel() * buf.element_size()
            return allreduce_hook(state, bucket)

        self.hook = counting_allreduce_hook


# ---- strategies ----


class Strategy:
    """One model + optimizer, trained on this rank's micro-batches one cycle at a time."""

    def __init__(self, name: str, init: dict, cfg: dict, count: bool) -> None:
        self.name = name
        self.net = make_net(**cfg["model"])
        self.net.load_state_dict(init)
        cap = cfg["bucket_cap_mb"]
        self.hook: HookTally | None = None
        if name.startswith("ddp"):
            self.model: nn.Module = DDP(self.net, bucket_cap_mb=cap)
            if count:
                self.hook = HookTally()
                self.model.register_comm_hook(None, self.hook.hook)
        else:
            self.model = self.net
        adamw = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=WD, fused=True)
        if name in ("ddp_every", "ddp_no_sync"):
            self.opt: torch.optim.Optimizer = adamw
        elif name == "ddp_accumulate":
            self.opt = GradientAccumulateOptimizer(
                adamw, K, process_group=dist.group.WORLD, bucket_cap_mb=cap
            )
        elif name == "local":
            self.opt = GradientAccumulateOptimizer(adamw, K, process_group=False)
        else:
            self.opt = GradientAccumulateOptimizer(
                adamw,
                K,
                process_group=dist.group.WORLD,
                bucket_cap_mb=cap,
                overlap_reduce=name == "ga_overlap",
            )

    def micro(self, x: torch.Tensor, y: torch.Tensor, boundary: bool) -> None:
        if self.name in ("ddp_every", "ddp_no_sync"):
            ctx = self.model.no_sync() if self.name == "ddp_no_sync" and not boundary else None
            if ctx is not None:
                with ctx:
                    (F.mse_loss(self.model(x), y) / K).backward()
            else:
                (F.mse_loss(self.model(x), y) / K).backward()
            if boundary:
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            return
        assert isinstance(self.opt, GradientAccumulateOptimizer)
        if self.name == "ddp_accumulate":
            with accumulate(self.model, self.opt) as sync:
                assert sync == boundary
                F.mse_loss(self.model(x), y).backward()
        else:
            F.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()
        assert self.opt.update_applied == boundary

    def cycle(self, xs: torch.Tensor, ys: torch.Tensor, on_micro: Callable | None = None) -> None:
        for j in range(K):
            self.micro(xs[j], ys[j], j == K - 1)
            if on_micro is not None:
                on_micro()

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.net.parameters()])

    @property
    def pkg_counts(self) -> tuple[int, int] | None:
        if isinstance(self.opt, GradientAccumulateOptimizer):
            return self.opt.collectives, self.opt.bytes_reduced
        return None


# ---- one world size (runs in every rank) ----


def count_and_check(rank: int, world: int, cfg: dict, init: dict, data) -> dict:
    """Untimed pass: collectives and bytes per step, then the weight check."""
    x, y = data
    counter = CollectiveCounter()
    out: dict[str, Any] = {}
    flats: dict[str, torch.Tensor] = {}
    for name, _ in STRATEGIES:
        s = Strategy(name, init, cfg, count=True)
        for c in range(COUNT_WARMUP):
            s.cycle(x[c], y[c])
        counter.install()
        try:
            per_micro: list[list[int]] = []
            per_cycle: list[tuple[int, int]] = []
            hook0 = (s.hook.buckets, s.hook.bytes) if s.hook else None
            pkg0 = s.pkg_counts
            for c in range(COUNT_WARMUP, COUNT_WARMUP + COUNT_CYCLES):
                start = counter.snapshot()
                last = [start[0]]
                marks: list[int] = []

                def mark(marks: list[int] = marks, last: list[int] = last) -> None:
                    marks.append(counter.calls - last[0])
                    last[0] = counter.calls

                s.cycle(x[c], y[c], mark)
                end = counter.snapshot()
                per_micro.append(marks)
                per_cycle.append((end[0] - start[0], end[1] - start[1]))
        finally:
            counter.uninstall()
        calls = sum(c for c, _ in per_cycle)
        nbytes = sum(b for _, b in per_cycle)
        pkg = s.pkg_counts
        if s.hook is not None:  # DDP: the comm hook's tally against the wrappers'
            assert hook0 is not None
            got = (s.hook.buckets - hook0[0], s.hook.bytes - hook0[1])
            # Under accumulate() DDP stays silent and every collective is the package's.
            want = (0, 0) if pkg is not None else (calls, nbytes)
            assert got == want, (name, "hook", got, want)
        if pkg is not None and pkg0 is not None:  # the package's counters
            got = (pkg[0] - pkg0[0], pkg[1] - pkg0[1])
            assert got == (calls, nbytes), (name, "package counters", got, (calls, nbytes))
        if len(set(per_cycle)) != 1 or len({tuple(m) for m in per_micro}) != 1:
            print(
                f"[rank {rank}] {name}: counts differ between cycles: {per_cycle} {per_micro}",
                flush=True,
            )
        out[name] = dict(
            collectives_per_step=calls / COUNT_CYCLES,
            bytes_per_step=nbytes / COUNT_CYCLES,
            per_micro=per_micro[-1],
            buckets=(
                s.opt.num_buckets
                if isinstance(s.opt, GradientAccumulateOptimizer) and s.opt.num_buckets
                else None
            ),
        )
        flats[name] = s.flat_params()
        del s

    # weight check: against the reference strategy on this rank, and against rank 0's copy
    ref = flats[REF]
    scale = float(ref.abs().max())
    for name, _ in STRATEGIES:
        w = flats[name]
        vs_ref = torch.tensor([float((w - ref).abs().max()) / scale], dtype=torch.float64)
        r0 = w.clone()
        dist.broadcast(r0, src=0)
        vs_rank0 = torch.tensor([float((w - r0).abs().max()) / scale], dtype=torch.float64)
        dist.all_reduce(vs_ref, op=dist.ReduceOp.MAX)
        dist.all_reduce(vs_rank0, op=dist.ReduceOp.MAX)
        out[name]["err_vs_ref"] = float(vs_ref)
        out[name]["err_vs_rank0"] = float(vs_rank0)
    return out


def time_cycles(cfg: dict, init: dict, data) -> dict[str, list[float]]:
    """Round-robin timed cycles; per cycle the slowest rank's seconds."""
    x, y = data
    strategies = [Strategy(name, init, cfg, count=False) for name, _ in STRATEGIES]
    n = cfg["warmup"] + cfg["cycles"]
    times = _time_cycles(strategies, x, y, n)
    return {s.name: times[i, cfg["warmup"] :].tolist() for i, s in enumerate(strategies)}


def worker(rank: int, world: int, cfg: dict, port: int, out_path: str) -> None:
    faulthandler.enable()  # a rank that aborts in C++ (Gloo) prints where it was
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        torch.manual_seed(0)
        init = {k: v.clone() for k, v in make_net(**cfg["model"]).state_dict().items()}
        total = max(COUNT_WARMUP + COUNT_CYCLES, cfg["warmup"] + cfg["cycles"])
        data = make_data(rank, total, **cfg["model"])
        counts = count_and_check(rank, world, cfg, init, data)
        times = time_cycles(cfg, init, data)
        if rank == 0:
            with open(out_path + ".tmp", "w") as f:
                json.dump(dict(counts=counts, times=times), f)
            os.replace(out_path + ".tmp", out_path)  # appears whole or not at all
        dist.barrier()
    finally:
        gc.collect()  # DDP reducers and optimizer hooks sit in reference cycles: free them now
        dist.destroy_process_group()


# ---- FSDP2 ----

FSDP2_STRATEGIES = [
    ("fsdp2_own", "fsdp2 loss/k"),
    ("fsdp2_ga", "fsdp2 + GA"),
    ("fsdp2_ga_nosync", "fsdp2 + GA nosync"),
]
OURS_FSDP2 = ("fsdp2_ga", "fsdp2_ga_nosync")


class Fsdp2Strategy:
    """One FSDP2-sharded copy of the model and its optimizer, trained a cycle at a time."""

    def __init__(self, name: str, init: dict, model: dict) -> None:
        from torch.distributed.fsdp import fully_shard

        net = make_net(**model)
        net.load_state_dict(init)
        for m in net:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(net)
        self.name, self.net = name, net
        inner = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
        self.opt: Any = inner
        if name in OURS_FSDP2:
            self.opt = GradientAccumulateOptimizer(inner, K, model=net)

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> None:
        if self.name == "fsdp2_ga_nosync":  # one reduce-scatter per cycle
            self.net.set_requires_gradient_sync(last)
        loss = F.mse_loss(self.net(x), y)
        if self.name in OURS_FSDP2:
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        else:
            (loss / K).backward()

    def cycle(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        for j in range(K):
            self.micro_step(xs[j], ys[j], j == K - 1)
        if self.name not in OURS_FSDP2:
            self.opt.step()
            self.opt.zero_grad()

    def held_bytes(self) -> int:
        """Bytes this rank holds for the accumulated gradient between micro-batches."""
        if self.name in OURS_FSDP2:
            flat = self.opt._loop.flat
            held = flat.numel() * flat.element_size()
            if self.name == "fsdp2_ga_nosync":  # + FSDP2's unsharded gradients
                for m in self.net.modules():
                    if hasattr(m, "_get_fsdp_state"):
                        for g in m._get_fsdp_state()._fsdp_param_groups:
                            for fp in g.fsdp_params:
                                grad = getattr(fp, "_unsharded_param", None)
                                grad = None if grad is None else grad.grad
                                if grad is not None:
                                    held += grad.numel() * grad.element_size()
            return held
        return sum(
            p.grad.to_local().numel() * 4 for p in self.net.parameters() if p.grad is not None
        )

    def full(self) -> dict:
        return {n: p.full_tensor().detach() for n, p in self.net.named_parameters()}


def fsdp2_worker(rank: int, world: int, cfg: dict, port: int, out_path: str) -> None:
    faulthandler.enable()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        torch.manual_seed(0)
        init = {k: v.clone() for k, v in make_net(**cfg["model"]).state_dict().items()}
        n = cfg["warmup"] + cfg["cycles"]
        x, y = make_data(rank, max(n, COUNT_WARMUP + COUNT_CYCLES), **cfg["model"])
        # Weight check and held bytes (mid-cycle: after K - 1 micro-batches), fresh copies.
        check = [Fsdp2Strategy(name, init, cfg["model"]) for name, _ in FSDP2_STRATEGIES]
        held = {}
        for c in range(COUNT_WARMUP + COUNT_CYCLES):
            for s in check:
                s.cycle(x[c], y[c])
        for s in check:
            for j in range(K - 1):  # a partial cycle: what is held between micro-batches
                s.micro_step(x[0][j], y[0][j], False)
            held[s.name] = s.held_bytes()
        ref = check[0].full()
        wmax = max(v.abs().max().item() for v in ref.values())
        err = 0.0
        for s in check[1:]:
            got = s.full()
            err = max(err, max((got[k] - ref[k]).abs().max().item() for k in ref) / wmax)
        del check
        gc.collect()
        strategies = [Fsdp2Strategy(name, init, cfg["model"]) for name, _ in FSDP2_STRATEGIES]
        times = _time_cycles(strategies, x, y, n)
        held_t = torch.tensor([float(held[name]) for name, _ in FSDP2_STRATEGIES])
        dist.all_reduce(held_t, op=dist.ReduceOp.MAX)
        if rank == 0:
            out = dict(
                times={
                    s.name: times[i, cfg["warmup"] :].tolist() for i, s in enumerate(strategies)
                },
                held={name: held_t[i].item() for i, (name, _) in enumerate(FSDP2_STRATEGIES)},
                err=err,
            )
            with open(out_path + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(out_path + ".tmp", out_path)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def run_fsdp2(worlds: list[int], cfg: dict, n_params: int) -> list[dict]:
    """FSDP2 rows: ms per cycle, held bytes per rank against 4 × params ÷ world + 1 MiB."""
    rows = []
    for world in worlds:
        print(f"running FSDP2, world size {world} ...", flush=True)
        res = run_world(world, cfg, target=fsdp2_worker)
        ours = statistics.median(res["times"]["fsdp2_ga"]) * 1e3
        bound = 4 * n_params / world + 2**20
        for name, label in FSDP2_STRATEGIES:
            ms = statistics.median(res["times"][name]) * 1e3
            rows.append(
                dict(
                    world=world,
                    strategy=name,
                    label=label,
                    ms_per_cycle=ms,
                    vs_ours=ms / ours,
                    held_bytes=res["held"][name],
                    bound_bytes=bound,
                    err_vs_own=res["err"],
                )
            )
    print()
    head = (
        f"{'world':>5} {'strategy':<19} {'ms/cycle':>9} {'vs ours':>7} {'held MiB/rank':>13} "
        f"{'4P/W+1MiB':>10} {'Δw':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        mark = "*" if r["strategy"] in OURS_FSDP2 else " "
        print(
            f"{r['world']:>5} {mark}{r['label']:<18} {r['ms_per_cycle']:>9.1f} "
            f"{r['vs_ours']:>6.2f}x {r['held_bytes'] / 2**20:>13.3f} "
            f"{r['bound_bytes'] / 2**20:>10.3f} {r['err_vs_own']:>8.1e}"
        )
    print(
        "\n* = ours; 'vs ours' = ms / ours (> 1: ours is faster); held: bytes each rank holds "
        "for the accumulated gradient between micro-batches (max over ranks; nosync: FSDP2's "
        "unsharded gradients + our accumulators); Δw: max over ours of max|w_ours - "
        "w_loss/k| / max|w| after "
        f"{COUNT_WARMUP + COUNT_CYCLES} cycles"
    )
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, cfg: dict, target: Callable[..., None] | None = None) -> dict:
    """Spawns the ranks; rank 0 leaves the results in a file.

    A rank that fails before the results are written stops the others (they would otherwise
    wait for it until Gloo's timeout). A rank that dies in its teardown after the results are
    written (Gloo's threads at interpreter exit) is reported, and the results are kept.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        port = free_port()
        target = worker if target is None else target
        procs = [ctx.Process(target=target, args=(r, world, cfg, port, path)) for r in range(world)]
        for p in procs:
            p.start()
        running = list(procs)
        while running:
            wait([p.sentinel for p in running], timeout=1.0)
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode for p in procs) and not os.path.exists(path):
                for p in running:
                    p.terminate()
                for p in procs:
                    p.join()
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"world size {world}: a rank failed (exit codes {codes})")
        codes = [p.exitcode for p in procs]
        if any(codes):
            print(
                f"warning: world size {world}: rank exit codes {codes} after the results were "
                "written (teardown); results kept",
                flush=True,
            )
        with open(path) as f:
            return json.load(f)


# ---- report ----


def machine_info() -> dict:
    info = host_info()
    for key in ("torch_threads", "torch_cpu_capability"):
        info.pop(key, None)
    info.update(threads_per_rank=1, backend="gloo (127.0.0.1)")
    return info


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'world':>5} {'strategy':<24} {'coll/step':>9} {'per micro-batch':>15} "
        f"{'MB/step':>8} {'ms/cycle':>9} {'vs ours':>7} {'Δw vs ref':>9} {'Δw ranks':>9}"
    )
    world = None
    for r in rows:
        if r["world"] != world:
            world = r["world"]
            print()
            print(head)
            print("-" * len(head))
        mark = "*" if r["strategy"] == OURS else " "
        micro = "/".join(str(n) for n in r["per_micro"])
        print(
            f"{r['world']:>5} {mark}{r['label']:<23} {r['collectives_per_step']:>9.1f} "
            f"{micro:>15} {r['mb_per_step']:>8.2f} {r['ms_per_cycle']:>9.1f} "
            f"{r['vs_ours']:>6.2f}x {r['err_vs_ref']:>9.1e} {r['err_vs_rank0']:>9.1e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="small model, few cycles (smoke test)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes")
    ap.add_argument("--cycles", type=int, default=None, help="timed cycles per strategy")
    ap.add_argument("--warmup", type=int, default=None, help="untimed cycles first")
    ap.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=4.0,
        help="bucket cap (MiB) of DDP and of the package alike",
    )
    ap.add_argument("--json", metavar="PATH", help="write machine info and results here")
    ap.add_argument("--fsdp2", action="store_true", help="FSDP2 (fully_shard): ours against loss/k")
    args = ap.parse_args()

    model = "small" if args.small else "full"
    cfg = dict(
        model=MODELS[model],
        cycles=args.cycles if args.cycles is not None else (3 if args.small else 12),
        warmup=args.warmup if args.warmup is not None else (1 if args.small else 2),
        bucket_cap_mb=args.bucket_cap_mb,
    )
    n_params = sum(p.numel() for p in make_net(**cfg["model"]).parameters())
    info = machine_info()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(
        f"model: MLP {cfg['model']}, {n_params:,} parameters ({n_params * 4 / 1e6:.1f} MB "
        f"fp32); AdamW lr {LR}, k={K} micro-batches per step; bucket cap "
        f"{args.bucket_cap_mb:g} MiB; {cfg['warmup']} warm-up + {cfg['cycles']} timed cycles"
    )

    if args.fsdp2:
        t0 = time.perf_counter()
        rows = run_fsdp2(args.worlds, cfg, n_params)
        bad = [
            r
            for r in rows
            if r["err_vs_own"] > TOL
            or (r["strategy"] == "fsdp2_ga" and r["held_bytes"] > r["bound_bytes"])
        ]
        print(
            "check FAILED: " + str(bad)
            if bad
            else f"check passed: Δw ≤ {TOL:g}; ours holds ≤ 4 × params ÷ world + 1 MiB per rank"
        )
        print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=info, config=cfg, parameters=n_params, results=rows), f)
        return

    rows: list[dict] = []
    failures: list[str] = []
    t0 = time.perf_counter()
    for world in args.worlds:
        print(f"running world size {world} ({world} processes, 1 thread each) ...", flush=True)
        res = run_world(world, cfg)
        ours_ms = statistics.median(res["times"][OURS]) * 1e3
        for name, label in STRATEGIES:
            cnt = res["counts"][name]
            ms = statistics.median(res["times"][name]) * 1e3
            rows.append(
                dict(
                    world=world,
                    strategy=name,
                    label=label,
                    collectives_per_step=cnt["collectives_per_step"],
                    per_micro=cnt["per_micro"],
                    package_buckets=cnt["buckets"],
                    mb_per_step=cnt["bytes_per_step"] / 1e6,
                    ms_per_cycle=ms,
                    vs_ours=ms / ours_ms,
                    err_vs_ref=cnt["err_vs_ref"],
                    err_vs_rank0=cnt["err_vs_rank0"],
                    cycle_ms=[t * 1e3 for t in res["times"][name]],
                )
            )
            if name != "local" and (cnt["err_vs_ref"] > TOL or cnt["err_vs_rank0"] > TOL):
                failures.append(
                    f"world {world}, {label}: max|Δw|/max|w| vs '{REF}' "
                    f"{cnt['err_vs_ref']:.2e}, across ranks {cnt['err_vs_rank0']:.2e}"
                )
    print_table(rows)
    print(
        f"\n* = ours (the ratios' reference); 'vs ours' = ms / ours (> 1: ours is faster); "
        f"coll/step and MB/step: collectives and payload bytes handed to them per rank per "
        f"optimizer step (ring all-reduce moves ~2(W-1)/W x that); 'per micro-batch': "
        f"collectives in each of the {K} micro-batches; ms/cycle: median over cycles of the "
        f"slowest rank; Δw: max|w - w_ref|/max|w_ref| after {COUNT_WARMUP + COUNT_CYCLES} "
        f"cycles against '{dict(STRATEGIES)[REF]}' and across ranks"
    )
    if failures:
        print(f"\nweight check FAILED (tolerance {TOL:g}; 'local only' is exempt):")
        for f in failures:
            print("  " + f)
    else:
        print(
            f"\nweight check passed: every strategy but 'local only' matches "
            f"'{dict(STRATEGIES)[REF]}' within {TOL:g}"
        )
    print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    machine=info,
                    config=cfg,
                    k=K,
                    lr=LR,
                    weight_decay=WD,
                    parameters=n_params,
                    tolerance=TOL,
                    weight_check_failures=failures,
                    results=rows,
                ),
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
