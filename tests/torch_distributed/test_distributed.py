"""Multi-process tests of the once-per-cycle reduction (Gloo on localhost, 2 and 4 ranks).

Every rank trains the same model on its own uneven micro-batches; the result must equal one
process training on the global big batch of every cycle (all ranks' micro-batches together),
with exactly one reduction round per optimizer step and none on other micro-batches.
"""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gloo_harness import init_gloo, reporting_errors, run_ranks, spawn  # noqa: E402
from torch import nn  # noqa: E402

from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    GradientAccumulateOptimizer,
    accumulate,
    fuse_accumulation,
)

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs Gloo")

TOL = 1e-5  # max|Δw| / max|w| against the single-process big batch, fp32


def _sizes(cfg: dict, cycle: int, rank: int) -> list[int]:
    """Uneven micro-batch sizes, different on every rank and cycle."""
    base = cfg["sizes"]
    return [base[(cycle + rank + j) % len(base)] + rank for j in range(cfg["k"])]


def _data(cfg: dict):
    g = torch.Generator().manual_seed(123)
    n = 4096
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _slices(cfg: dict):
    """Per cycle: per rank: list of index tensors (one per micro-batch)."""
    out, pos = [], 0
    for c in range(cfg["cycles"]):
        per_rank = []
        for r in range(cfg["world"]):
            mbs = []
            for s in _sizes(cfg, c, r):
                mbs.append(torch.arange(pos, pos + s))
                pos += s
            per_rank.append(mbs)
        out.append(per_rank)
    return out


class _Net(nn.Module):
    def __init__(self, bn: str):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        if bn == "accum":
            self.bn = AccumBatchNorm1d(16, accum_steps=1)
        elif bn == "ref":
            self.bn = _RefBN(16)
        else:
            self.bn = nn.Identity()
        self.fc2 = nn.Linear(16, 3)
        self.extra = nn.Linear(16, 3)  # a head used only where the config says

    def forward(self, x, extra: bool = False):
        h = torch.relu(self.bn(self.fc1(x)))
        return self.fc2(h) + self.extra(h) if extra else self.fc2(h)


class _RefBN(nn.BatchNorm1d):
    """Normalises each micro-batch by itself, updates running stats from the whole cycle."""

    def __init__(self, c: int):
        super().__init__(c)
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.detach().double())
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self):
        x = torch.cat(self.seen)
        self.seen = []
        self.running_mean.mul_(1 - self.momentum).add_(self.momentum * x.mean(0).float())
        self.running_var.mul_(1 - self.momentum).add_(self.momentum * x.var(0).float())
        self.num_batches_tracked += 1


def _make_opt(cfg: dict, params):
    if cfg["opt"] == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def _worker(rank: int, port: int, out_dir: str, cfg: dict) -> None:
    with reporting_errors(rank, out_dir):
        init_gloo(rank, cfg["world"], port)
        torch.manual_seed(0)
        model = _Net("accum" if cfg["bn"] else "none")
        if cfg["bn"]:
            model.bn.accum_steps = cfg["k"]
        opt = GradientAccumulateOptimizer(
            _make_opt(cfg, model.parameters()),
            cfg["k"],
            max_grad_norm=cfg["clip"],
            overlap_reduce=cfg["overlap"],
            reduce_timeout=60,
            gradient_as_view=cfg.get("view", False),
        )
        net = model
        ddp_rounds = {"n": 0}
        if cfg.get("ddp"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model = nn.parallel.DistributedDataParallel(net)

            def counting_hook(state, bucket):  # DDP's own all-reduce, if it ever runs
                ddp_rounds["n"] += 1
                return default_hooks.allreduce_hook(None, bucket)

            model.register_comm_hook(None, counting_hook)
        if cfg.get("fuse"):
            assert fuse_accumulation(model, opt, min_size=0).fused == ["fc1", "fc2", "extra"]
        x, y = _data(cfg)
        calls = []
        count = {"n": 0}
        real = dist.all_reduce

        def counting(*a, **kw):
            count["n"] += 1
            return real(*a, **kw)

        dist.all_reduce = counting
        extra = cfg.get("extra", ())
        for cycle, per_rank in enumerate(_slices(cfg)):
            for idx in per_rank[rank]:
                before = count["n"]
                with accumulate(model, opt, weight=len(idx)):
                    kw = {"extra": True} if (cycle, rank) in extra else {}
                    F.mse_loss(model(x[idx], **kw), y[idx]).backward()
                opt.step(weight=len(idx))
                opt.zero_grad()
                calls.append((count["n"] - before, opt.update_applied))
        dist.all_reduce = real
        torch.save(
            {
                "state": {k: v.clone() for k, v in net.state_dict().items()},
                "calls": calls,
                "ddp_rounds": ddp_rounds["n"],
                "bytes": opt.bytes_reduced,
                "buckets": opt.num_buckets,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
        # Free DDP's reducer and the optimizer's hooks (reference cycles) while the group is
        # alive: left to interpreter shutdown, after the group is gone, Gloo can abort.
        del model, net, opt
        gc.collect()
        dist.destroy_process_group()


def _run(cfg: dict, tmp_path) -> list[dict]:
    return run_ranks(_worker, cfg["world"], tmp_path, cfg, timeout_s=180)


def _reference(cfg: dict) -> dict:
    """One process, the global big batch of every cycle (loss = mean over all its samples)."""
    torch.manual_seed(0)
    model = _Net("ref" if cfg["bn"] else "none")
    opt = _make_opt(cfg, model.parameters())
    x, y = _data(cfg)
    extra = cfg.get("extra", ())
    for cycle, per_rank in enumerate(_slices(cfg)):
        mbs = [
            (idx, (cycle, r) in extra) for r, rank_mbs in enumerate(per_rank) for idx in rank_mbs
        ]
        total = sum(len(i) for i, _ in mbs)
        loss = sum(F.mse_loss(model(x[i], e), y[i]) * (len(i) / total) for i, e in mbs)
        loss.backward()
        if cfg["clip"] is not None:
            nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        opt.zero_grad()
        if cfg["bn"]:
            model.bn.commit()
    return {k: v for k, v in model.state_dict().items()}


def _check(cfg: dict, tmp_path) -> list[dict]:
    results = _run(cfg, tmp_path)
    ref = _reference(cfg)
    wmax = max(v.abs().max().item() for k, v in ref.items() if v.is_floating_point())
    for res in results:
        for k, v in ref.items():
            if not v.is_floating_point():
                assert torch.equal(res["state"][k], v), k
                continue
            got = res["state"][k]
            if "running" in k:
                torch.testing.assert_close(got, v, rtol=1e-5, atol=1e-6, msg=k)
            else:
                err = (got - v).abs().max().item() / wmax
                assert err <= TOL, (k, err)
    # Exactly one reduction round (one collective per bucket) per update, none otherwise.
    for res in results:
        for n, applied in res["calls"]:
            assert n == (res["buckets"] if applied else 0), res["calls"]
    assert sum(a for _, a in results[0]["calls"]) == cfg["cycles"]
    assert all(res["ddp_rounds"] == 0 for res in results)  # DDP never reduces by itself
    return results


BASE = {"k": 3, "cycles": 4, "sizes": [5, 2, 7, 3], "clip": None, "bn": False, "overlap": True}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_uneven_ranks_match_global_big_batch(world, opt, tmp_path):
    _check({**BASE, "world": world, "opt": opt}, tmp_path)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after-backward"])
def test_ddp_model_inside_accumulate_matches(overlap, tmp_path):
    """A DDP-wrapped model: accumulate() silences DDP, the optimizer's round replaces it."""
    _check({**BASE, "world": 2, "opt": "adamw", "ddp": True, "overlap": overlap}, tmp_path)


@pytest.mark.parametrize("ddp", [False, True], ids=["plain", "ddp"])
def test_fused_layers_match_over_ranks(ddp, tmp_path):
    """fuse_accumulation: the GEMMs write the accumulators the one reduction per cycle sums."""
    _check(
        {**BASE, "world": 2, "opt": "adamw", "ddp": ddp, "overlap": False, "fuse": True}, tmp_path
    )


def test_reduce_after_backward_matches(tmp_path):
    _check({**BASE, "world": 2, "opt": "adamw", "overlap": False}, tmp_path)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after"])
def test_a_parameter_no_rank_used_in_a_cycle_is_left_alone(overlap, tmp_path):
    """The extra head has gradients on rank 1 only in cycle 1, on no rank in cycles 0, 2, 3:
    as in the big batch, where its .grad is None then, AdamW's decay must not move it (nor
    its moments). Before the fix every parameter took part in every distributed update."""
    cfg = dict(BASE, world=2, opt="adamw", overlap=overlap, extra=((1, 1),))
    _check(cfg, tmp_path)


@pytest.mark.parametrize("ddp", [False, True], ids=["plain", "ddp"])
def test_gradient_as_view_matches_over_ranks(ddp, tmp_path):
    """fp32 .grad as views of the accumulators on 2 ranks (weights named before each backward,
    uneven micro-batches, a head used on rank 1 in cycle 1 only, clipping): the reduction runs
    after the backward and the result is the global big batch's, one round per update."""
    cfg = dict(BASE, world=2, opt="adamw", view=True, ddp=ddp, clip=0.5, extra=((1, 1),))
    _check(cfg, tmp_path)


def test_clipping_acts_on_the_reduced_gradient(tmp_path):
    _check({**BASE, "world": 2, "opt": "sgd", "clip": 0.05}, tmp_path)


def test_accum_batchnorm_merges_across_ranks(tmp_path):
    _check({**BASE, "world": 2, "opt": "sgd", "bn": True}, tmp_path)


def _failing_worker(rank: int, port: int, out_dir: str, mode: str) -> None:
    import time

    init_gloo(rank, 2, port)
    model = nn.Linear(4, 2)
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 2, reduce_timeout=3
    )
    if rank == 1:
        if mode == "raise":
            raise SystemExit(3)  # a rank that dies before the boundary
        time.sleep(20)  # a rank that stalls past the timeout
        return
    start = time.monotonic()
    try:
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    elapsed = time.monotonic() - start
    with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
        f.write(f"{elapsed}\n{message}")
    os._exit(0)  # the group is broken; skip its teardown


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_failed_rank_gives_clear_error_not_hang(mode, tmp_path):
    procs = spawn(_failing_worker, 2, tmp_path, mode, timeout_s=60)
    assert procs[0].exitcode == 0
    elapsed, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "gradient reduction failed on rank 0" in message
    assert float(elapsed) < 15.0  # the 3 s timeout (or the peer's exit), not a hang


def _ddp_without_reduction_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 2, process_group=False
    )
    try:
        with accumulate(model, opt):
            model(torch.ones(3, 4)).sum().backward()
        message = "no error"
    except ValueError as e:
        message = str(e)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{unchanged}\n{message}")
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def test_ddp_model_with_process_group_false_is_refused(tmp_path):
    spawn(_ddp_without_reduction_worker, 2, tmp_path, timeout_s=60)
    for r in range(2):
        unchanged, message = (tmp_path / f"rank{r}.txt").read_text().split("\n", 1)
        assert unchanged == "True"
        assert "process_group=False" in message
