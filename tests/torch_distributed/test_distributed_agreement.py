"""Ranks that disagree fail together and clearly; flushes and retried backwards stay paired.

Two Gloo ranks on localhost. Every scenario either trains to the single-process big batch or
ends with the same clear error on both ranks — never a backend abort, a hang or a silent mix.
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

from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    GradientAccumulateOptimizer,
    accumulate,
)

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs Gloo")

TOL = 1e-5  # max|Δw| / max|w| against the single-process big batch, fp32
WORLD = 2


class _Boom(torch.autograd.Function):
    """Identity whose backward raises while ``armed["on"]`` is set (a failing backward)."""

    armed = {"on": False}

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _Boom.armed["on"]:
            _Boom.armed["on"] = False
            raise RuntimeError("injected failure in the backward")
        return g


class _Net(nn.Module):
    def __init__(self, hidden=16, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.bn = AccumBatchNorm1d(hidden, accum_steps=2) if bn else nn.Identity()
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.relu(_Boom.apply(self.bn(self.fc1(x)))))


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(512, 6, generator=g), torch.randn(512, 3, generator=g)


def _plan(rank: int, n_micro: int) -> list[torch.Tensor]:
    """Micro-batch index sets of one rank: uneven sizes, disjoint from the other rank's."""
    out, pos = [], rank * 256
    for j in range(n_micro):
        size = 3 + (j + 2 * rank) % 4
        out.append(torch.arange(pos, pos + size))
        pos += size
    return out


def _worker(rank: int, port: int, out_dir: str, scenario: str) -> None:
    with reporting_errors(rank, out_dir):
        init_gloo(rank, WORLD, port, timeout_s=60)
        torch.manual_seed(0)
        hidden = 17 if (scenario == "sizes" and rank == 1) else 16
        model = _Net(hidden, bn=scenario == "flush_empty")
        k = 3 if (scenario == "accum_steps" and rank == 1) else 2
        result = {}
        try:
            opt = GradientAccumulateOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                k,
                overlap_reduce=scenario == "overlap_retry",
                bucket_cap_mb=1e-5,
                reduce_timeout=30,
            )
            x, y = _data()
            if scenario == "flush_empty":
                # rank 0: 5 micro-batches (a last cycle of 1); rank 1: 4 (an empty last cycle).
                for idx in _plan(rank, 5 - rank):
                    F.mse_loss(model(x[idx]), y[idx]).backward()
                    opt.step(weight=len(idx))
                    opt.zero_grad()
                result["flushed"] = opt.flush()
                result["flushed_again"] = opt.flush()  # every rank empty: no update, no stats
            elif scenario == "flush_vs_step":
                for j, idx in enumerate(_plan(rank, 2)):
                    F.mse_loss(model(x[idx]), y[idx]).backward()
                    if j == 1 and rank == 1:  # ends its cycle with flush() instead
                        opt.zero_grad()
                        opt.flush()
                    else:
                        opt.step(weight=len(idx))
                        opt.zero_grad()
            elif scenario == "changed_reduction":
                if rank == 1:
                    opt.reduction = "sum"
                for idx in _plan(rank, 2):
                    F.mse_loss(model(x[idx]), y[idx]).backward()
                    opt.step(weight=len(idx))
                    opt.zero_grad()
            elif scenario == "changed_accum_steps":
                if rank == 1:
                    opt.accum_steps = 3
                for idx in _plan(rank, 6):
                    F.mse_loss(model(x[idx]), y[idx]).backward()
                    opt.step(weight=len(idx))
                    opt.zero_grad()
            elif scenario == "overlap_retry":
                for j, idx in enumerate(_plan(rank, 4)):
                    for attempt in range(2):
                        _Boom.armed["on"] = rank == 0 and j == 3 and attempt == 0
                        try:
                            with accumulate(model, opt, weight=len(idx)):
                                F.mse_loss(model(x[idx]), y[idx]).backward()
                        except RuntimeError as e:
                            assert "injected" in str(e)
                            opt.zero_grad()
                            result["retried"] = j
                            continue
                        break
                    opt.step(weight=len(idx))
                    opt.zero_grad()
            result["state"] = {n: v.clone() for n, v in model.state_dict().items()}
            result["updates"] = opt.accumulation_state.updates
        except (ValueError, RuntimeError) as e:
            result["error"] = f"{type(e).__name__}: {e}"
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        del model
        gc.collect()
        dist.destroy_process_group()


def _run(scenario: str, tmp_path) -> list[dict]:
    return run_ranks(_worker, WORLD, tmp_path, scenario, timeout_s=150)


def _reference(cycles, bn=False) -> dict:
    """One process: per cycle, the mean loss over all ranks' micro-batches of that cycle."""
    torch.manual_seed(0)
    model = _Net(16, bn=bn)
    if bn:  # the reference sees each cycle's micro-batches as one accumulation cycle
        model.bn.accum_steps = 10**9
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    for mbs in cycles:
        total = sum(len(i) for i in mbs)
        loss = sum(F.mse_loss(model(x[i]), y[i]) * (len(i) / total) for i in mbs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if bn:
            model.bn.flush()
    return model.state_dict()


def _rel(a: dict, b: dict) -> float:
    num = max(
        (a[n].double() - b[n].double()).abs().max().item()
        for n in b
        if b[n].is_floating_point() and not n.startswith("bn.accum")
    )
    den = max(b[n].double().abs().max().item() for n in b if b[n].is_floating_point())
    return num / den


@pytest.mark.parametrize(
    "scenario, match",
    [
        ("accum_steps", "disagree on accum_steps"),
        ("sizes", "disagree on accumulator elements"),
    ],
)
def test_rank_disagreement_at_construction_is_one_clear_error(scenario, match, tmp_path):
    out = _run(scenario, tmp_path)
    for r in out:
        assert "error" in r and match in r["error"], r.get("error")
    assert out[0]["error"].split("; this rank")[0] == out[1]["error"].split("; this rank")[0]


@pytest.mark.parametrize(
    "scenario, match",
    [
        ("flush_vs_step", "disagreed on flush"),
        ("changed_accum_steps", "disagreed on accum_steps"),
        ("changed_reduction", "disagreed on reduction"),
    ],
)
def test_rank_disagreement_in_a_cycle_is_one_clear_error(scenario, match, tmp_path):
    out = _run(scenario, tmp_path)
    for r in out:
        assert "error" in r and match in r["error"], r.get("error")


def test_flush_with_an_empty_last_cycle_on_one_rank(tmp_path):
    out = _run("flush_empty", tmp_path)
    assert [r.get("error") for r in out] == [None, None]
    assert out[0]["flushed"] and out[1]["flushed"]
    assert not out[0]["flushed_again"] and not out[1]["flushed_again"]
    p0, p1 = _plan(0, 5), _plan(1, 4)
    cycles = [p0[0:2] + p1[0:2], p0[2:4] + p1[2:4], p0[4:5]]
    ref = _reference(cycles, bn=True)
    for r in out:
        assert r["updates"] == 3
        assert _rel(r["state"], ref) <= TOL
        assert int(r["state"]["bn.num_batches_tracked"]) == 3


def test_overlapped_backward_that_raises_then_retried_counts_once(tmp_path):
    out = _run("overlap_retry", tmp_path)
    assert [r.get("error") for r in out] == [None, None]
    assert out[0]["retried"] == 3
    p0, p1 = _plan(0, 4), _plan(1, 4)
    ref = _reference([p0[0:2] + p1[0:2], p0[2:4] + p1[2:4]])
    for r in out:
        assert r["updates"] == 2
        assert _rel(r["state"], ref) <= TOL
