"""SyncBatchNorm under gradient accumulation, 2 Gloo ranks: ``convert_batchnorm`` of an
``nn.SyncBatchNorm`` and a later ``convert_sync_batchnorm`` of an AccumBatchNorm both give the
running statistics of torch's SyncBatchNorm on the global big batch (every rank's micro-batches
of the cycle together), updated once per cycle; each micro-batch is normalised by itself."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from gloo_harness import init_gloo, reporting_errors, run_ranks  # noqa: E402
from torch import nn  # noqa: E402

from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm2d,
    AccumSyncBatchNorm,
    convert_batchnorm,
)

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs Gloo")

C, K, CYCLES, WORLD = 3, 3, 2, 2
MOMENTUM = {"from_sync": 0.3, "sync_after": None}


def _x(rank: int, cycle: int, j: int) -> torch.Tensor:
    """Uneven micro-batches, other sizes on every rank; channel means far from 0."""
    g = torch.Generator().manual_seed(100 * rank + 10 * cycle + j)
    n = 2 + (rank + j + cycle) % 3 + rank
    return torch.tensor([3.0, -2.0, 10.0]).view(1, C, 1, 1) + 2 * torch.randn(
        n, C, 3, 2, generator=g
    )


def _worker(rank: int, port: int, out_dir: str) -> None:
    with reporting_errors(rank, out_dir):
        init_gloo(rank, WORLD, port)
        layers = {
            "from_sync": convert_batchnorm(nn.SyncBatchNorm(C, momentum=MOMENTUM["from_sync"]), K),
            "sync_after": nn.SyncBatchNorm.convert_sync_batchnorm(
                convert_batchnorm(nn.BatchNorm2d(C, momentum=MOMENTUM["sync_after"]), K)
            ),
        }
        out = {"types": {n: type(m).__name__ for n, m in layers.items()}}
        # A CPU model with the converted layer can be wrapped by DDP (a SyncBatchNorm cannot).
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(layers["from_sync"]))
        del ddp
        for name, bn in layers.items():
            plain = nn.BatchNorm2d(C)  # this rank's micro-batch normalised by itself
            plain.load_state_dict({k: v for k, v in bn.state_dict().items() if "accum" not in k})
            moved, out_err = [], 0.0
            for cycle in range(CYCLES):
                for j in range(K):
                    before = bn.running_var.clone()
                    x = _x(rank, cycle, j)
                    out_err = max(out_err, float((bn(x) - plain(x)).abs().max()))
                    moved.append(not torch.equal(bn.running_var, before))
            out[name] = {
                "moved": moved,
                "out_err": out_err,
                "state": {k: v.clone() for k, v in bn.state_dict().items()},
            }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a − b| / max|b| (fp64)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_sync_batchnorm_running_stats_equal_the_global_big_batch(tmp_path):
    results = run_ranks(_worker, WORLD, tmp_path, timeout_s=120)
    for res in results:
        assert res["types"] == {"from_sync": "AccumSyncBatchNorm", "sync_after": "AccumBatchNorm2d"}
    for name, momentum in MOMENTUM.items():
        # torch's SyncBatchNorm on the global big batch of each cycle (one process: torch's
        # own code path without a group to synchronise), fp64.
        ref = nn.SyncBatchNorm(C, momentum=momentum).double()
        for cycle in range(CYCLES):
            ref(torch.cat([_x(r, cycle, j) for r in range(WORLD) for j in range(K)]).double())
        for res in results:
            got = res[name]
            assert got["moved"] == [j == K - 1 for _ in range(CYCLES) for j in range(K)]
            assert got["out_err"] <= 1e-5
            state = got["state"]
            assert int(state["num_batches_tracked"]) == CYCLES and int(state["accum_step"]) == 0
            assert rel_err(state["running_mean"], ref.running_mean) <= 1e-6, name
            assert rel_err(state["running_var"], ref.running_var) <= 1e-6, name
        # Every rank holds the same statistics, bit for bit.
        for key in ("running_mean", "running_var"):
            assert torch.equal(results[0][name]["state"][key], results[1][name]["state"][key])


def test_accum_sync_batchnorm_is_a_batchnorm_but_not_a_sync_batchnorm():
    # DDP refuses SyncBatchNorm layers in a CPU model; ours merge statistics on any device.
    assert issubclass(AccumSyncBatchNorm, nn.modules.batchnorm._BatchNorm)
    assert not issubclass(AccumSyncBatchNorm, nn.SyncBatchNorm)
    assert not issubclass(AccumBatchNorm2d, nn.SyncBatchNorm)
