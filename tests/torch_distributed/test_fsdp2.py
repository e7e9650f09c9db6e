"""FSDP2 (``fully_shard``) models through the wrapper: Gloo on localhost, 2 and 4 ranks.

Every rank trains its shard of the same model on its own uneven micro-batches, the weight of
each named before its backward; the result must equal one process training the unsharded model
on the global big batch of every cycle (all ranks' micro-batches together). One spawn per world
size runs every scenario, to keep the processes' start-up cost once.
"""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gloo_harness import init_gloo, reporting_errors, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate  # noqa: E402

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs Gloo")

TOL = 1e-5  # max|Δw| / max|w| against the single-process big batch
K = 3  # micro-batches per cycle
CYCLES = 2  # full cycles, then a short one ended by flush()

SCENARIOS = {
    # name: (inner optimizer, wrapper options)
    "adamw": ("adamw", {}),
    "sgd_clip": ("sgd", {"max_grad_norm": 0.05}),
    "adamw_agc": ("adamw", {"use_agc": True, "clip_factor": 0.02}),
}


def _net() -> nn.Module:
    # 16, 5 and 3 rows: uneven shards on 2 and 4 ranks, an empty shard on 4.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5), nn.Tanh(), nn.Linear(5, 3))


def _inner(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def _data():
    g = torch.Generator().manual_seed(123)
    return torch.randn(4096, 6, generator=g), torch.randn(4096, 3, generator=g)


def _plan(world: int) -> list[list[list[torch.Tensor]]]:
    """Per cycle, per rank: the index tensors of its micro-batches (uneven sizes, different on
    every rank; the last cycle is short: 2 micro-batches of K)."""
    sizes = [3, 7, 2, 5]
    out, pos = [], 0
    for c in range(CYCLES + 1):
        per_rank = []
        for r in range(world):
            mbs = []
            for j in range(K if c < CYCLES else 2):
                n = sizes[(c + r + j) % len(sizes)] + r
                mbs.append(torch.arange(pos, pos + n))
                pos += n
            per_rank.append(mbs)
        out.append(per_rank)
    return out


def _shard(model: nn.Module, mesh=None) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _train(rank: int, world: int, kind: str, options: dict, mesh=None) -> dict:
    model = _net()
    _shard(model, mesh)
    opt = GradientAccumulateOptimizer(_inner(kind, model.parameters()), K, model=model, **options)
    x, y = _data()
    for c, per_rank in enumerate(_plan(world)):
        for idx in per_rank[rank]:
            with accumulate(model, opt, weight=len(idx)):
                F.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step(weight=len(idx))
            opt.zero_grad()
        if c == CYCLES:
            assert opt.flush()
    state = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    del opt, model
    gc.collect()
    return state


def _reference(world: int, kind: str, options: dict) -> dict:
    """One process, the unsharded model, the global big batch of every cycle (fp32)."""
    model = _net()
    if options.get("use_agc"):
        # AGC of the big batch's gradient: the unsharded wrapper with one micro-batch a cycle.
        opt = GradientAccumulateOptimizer(_inner(kind, model.parameters()), 1, **options)
    else:
        opt = _inner(kind, model.parameters())
    x, y = _data()
    for per_rank in _plan(world):
        mbs = [idx for rank_mbs in per_rank for idx in rank_mbs]
        total = sum(len(i) for i in mbs)
        loss = sum(F.mse_loss(model(x[i]), y[i]) * (len(i) / total) for i in mbs)
        loss.backward()
        if options.get("max_grad_norm") is not None:
            nn.utils.clip_grad_norm_(model.parameters(), options["max_grad_norm"])
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _error(got: dict, ref: dict) -> float:
    wmax = max(v.abs().max().item() for v in ref.values())
    return max((got[n] - ref[n]).abs().max().item() for n in ref) / wmax


def _worker(rank: int, port: int, out_dir: str, world: int) -> None:
    with reporting_errors(rank, out_dir):
        init_gloo(rank, world, port, timeout_s=120)
        results = {}
        for name, (kind, options) in SCENARIOS.items():
            results[name] = _error(
                _train(rank, world, kind, options), _reference(world, kind, options)
            )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_matches_big_batch(world, tmp_path):
    results = run_ranks(_worker, world, tmp_path, world, timeout_s=240)
    for rank, res in enumerate(results):
        assert set(res) == set(SCENARIOS)
        for name, err in res.items():
            assert err <= TOL, f"rank {rank}, {name}: {err:.3g} of max|w|"
