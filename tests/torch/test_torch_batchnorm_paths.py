"""AccumBatchNorm's code paths off the CPU, forced on the CPU by pretending where the core runs.

"device": moments with torch ops, the core's merge and running update on the layer's own
tensors (as on CUDA); "host": no core kernels on the device (mps, xpu, a CPU-only build on
CUDA): the merge and the update go through host copies. Both give the numbers of the CPU path.
"""

from __future__ import annotations

import pathlib

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator import core  # noqa: E402
from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    AccumBatchNorm2d,
    AccumBatchNorm3d,
    flush_batchnorm,
)
from gradient_accumulator.torch import batchnorm as bn_mod  # noqa: E402

C = 3
CASES = {
    "1d_nc": (AccumBatchNorm1d, nn.BatchNorm1d, ()),
    "2d": (AccumBatchNorm2d, nn.BatchNorm2d, (4, 3)),
    "3d": (AccumBatchNorm3d, nn.BatchNorm3d, (2, 3, 2)),
}
SIZES = [3, 5, 2, 6]
PATHS = {
    "cpu": None,
    "device": lambda device, moments=False: not moments,
    "host": lambda device, moments=False: False,
}


def _inputs(n, tail, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shift = torch.tensor([3.0, -2.0, 10.0]).view(1, C, *([1] * len(tail)))
    return (shift + 2 * torch.randn(n, C, *tail, generator=g)).to(dtype)


class _Spy:
    """Counts core.bn_merge / core.bn_update_running calls and records what they were given."""

    def __init__(self, monkeypatch):
        self.merges, self.updates = [], []
        merge, update = core.bn_merge, core.bn_update_running

        def bn_merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
            self.merges.append((mean_a, m2_a, mean_b))
            return merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b)

        def bn_update_running(running_mean, running_var, mean, m2, count, **kw):
            self.updates.append((running_mean, running_var, mean))
            update(running_mean, running_var, mean, m2, count, **kw)

        monkeypatch.setattr(core, "bn_merge", bn_merge)
        monkeypatch.setattr(core, "bn_update_running", bn_update_running)


def _force(monkeypatch, path):
    if PATHS[path] is not None:
        monkeypatch.setattr(bn_mod, "core_runs_on", PATHS[path])
    return _Spy(monkeypatch)


def _run(acc_cls, tail, momentum, dtype=torch.float32, cycles=3):
    """Cycles of micro-batches; the layer's state after every micro-step."""
    bn = acc_cls(C, momentum=momentum, accum_steps=len(SIZES)).to(dtype)
    states = []
    for cycle in range(cycles):
        for j, s in enumerate(SIZES):
            bn(_inputs(s, tail, seed=10 * cycle + j, dtype=dtype))
            states.append({k: v.clone() for k, v in bn.state_dict().items()})
    return bn, states


def _reference(plain_cls, tail, momentum, dtype=torch.float32, cycles=3):
    """fp64 BatchNorm over each cycle's concatenated big batch."""
    ref = plain_cls(C, momentum=momentum).double()
    for cycle in range(cycles):
        xs = [_inputs(s, tail, seed=10 * cycle + j, dtype=dtype) for j, s in enumerate(SIZES)]
        ref(torch.cat(xs).double())
    return ref


def _check_states(states, expected, rel_err):
    for got, want in zip(states, expected):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key.startswith("accum_") and got[key].is_floating_point():
                assert got[key].dtype == torch.float64, key
                assert rel_err(got[key], value) <= 1e-12, key
            elif key == "num_batches_tracked" or key == "accum_step":
                assert torch.equal(got[key], value), key
            else:
                assert got[key].dtype == value.dtype, key
                assert rel_err(got[key], value) <= 1e-6, key


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["device", "host"])
def test_forced_paths_give_the_cpu_numbers(path, case, momentum, rel_err, monkeypatch):
    acc_cls, plain_cls, tail = CASES[case]
    _, expected = _run(acc_cls, tail, momentum)  # the CPU path: core moments and merge
    spy = _force(monkeypatch, path)
    bn, states = _run(acc_cls, tail, momentum)
    _check_states(states, expected, rel_err)
    ref = _reference(plain_cls, tail, momentum)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 3
    assert rel_err(bn.running_mean, ref.running_mean) <= 1e-6
    assert rel_err(bn.running_var, ref.running_var) <= 1e-6
    # Every micro-step merged with the core, every cycle updated with it.
    assert len(spy.merges) == len(states) and len(spy.updates) == 3
    for mean_a, m2_a, _ in spy.merges:
        on_layer = mean_a.data_ptr() == bn.accum_mean.data_ptr()
        assert on_layer == (path == "device")  # the host path merges copies
        assert mean_a.dtype == m2_a.dtype == torch.float64
    for running_mean, _, mean in spy.updates:
        assert (running_mean.data_ptr() == bn.running_mean.data_ptr()) == (path == "device")
        assert (mean.data_ptr() == bn.accum_mean.data_ptr()) == (path == "device")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["device", "host"])
def test_forced_paths_with_half_running_stats(path, dtype, rel_err, monkeypatch):
    acc_cls, plain_cls, tail = CASES["2d"]
    cpu_bn, expected = _run(acc_cls, tail, 0.1, dtype=dtype)
    spy = _force(monkeypatch, path)
    bn, states = _run(acc_cls, tail, 0.1, dtype=dtype)
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    for got, want in zip(states, expected):
        for key in ("accum_count", "accum_mean", "accum_m2"):
            assert got[key].dtype == torch.float64
            assert rel_err(got[key], want[key]) <= 1e-12, key
        for key in ("running_mean", "running_var"):
            assert got[key].dtype == dtype
            assert torch.allclose(got[key].double(), want[key].double(), rtol=ulp, atol=0), key
    ref = _reference(plain_cls, tail, 0.1, dtype=dtype)
    assert rel_err(bn.running_mean, ref.running_mean) <= 2 * ulp
    assert rel_err(bn.running_var, ref.running_var) <= 2 * ulp
    # fp16/bf16 statistics are updated through an fp64 copy: on the layer's device on the
    # "device" path, on the host otherwise; never the layer's own tensor.
    assert len(spy.updates) == 3
    for running_mean, running_var, _ in spy.updates:
        assert running_mean.dtype == running_var.dtype == torch.float64
        assert running_mean.device == bn.running_mean.device
        assert running_mean.data_ptr() != bn.running_mean.data_ptr()


@pytest.mark.parametrize("path", ["cpu", "device", "host"])
def test_forced_paths_flush_a_short_cycle(path, rel_err, monkeypatch):
    spy = _force(monkeypatch, path)
    layers = [AccumBatchNorm1d(C, accum_steps=4), AccumBatchNorm1d(C, accum_steps=4, momentum=None)]
    model = nn.ModuleList(layers)
    ref = [nn.BatchNorm1d(C).double(), nn.BatchNorm1d(C, momentum=None).double()]
    xs = [_inputs(n, (), seed=20 + n) for n in (5, 7)]
    for x in xs:
        for m in layers:
            m(x)
    assert len(spy.merges) == 4 and not spy.updates
    assert [int(m.num_batches_tracked) for m in layers] == [0, 0]
    flush_batchnorm(model)
    assert len(spy.updates) == 2
    for m, r in zip(layers, ref):
        r(torch.cat(xs).double())
        assert int(m.num_batches_tracked) == 1 and int(m.accum_step) == 0
        assert float(m.accum_count) == 0 and not m.accum_mean.any() and not m.accum_m2.any()
        assert rel_err(m.running_mean, r.running_mean) <= 1e-6
        assert rel_err(m.running_var, r.running_var) <= 1e-6
    flush_batchnorm(model)  # nothing pending
    assert len(spy.updates) == 2 and [int(m.num_batches_tracked) for m in layers] == [1, 1]
    ys = [_inputs(4, (), seed=40 + j) for j in range(4)]
    for y in ys:
        for m in layers:
            m(y)
    for m, r in zip(layers, ref):
        r(torch.cat(ys).double())
        assert int(m.num_batches_tracked) == 2
        assert rel_err(m.running_mean, r.running_mean) <= 1e-6
        assert rel_err(m.running_var, r.running_var) <= 1e-6


@pytest.mark.parametrize("path", ["cpu", "device", "host"])
def test_forced_paths_merge_across_ranks_in_rank_order(path, rel_err, monkeypatch):
    """Three ranks simulated in one process (all_gather faked): each rank merges all of the
    cycle's moments in rank order, with the core, to the global big batch's statistics."""
    import torch.distributed as dist

    world, k = 3, 2
    ranks = [AccumBatchNorm1d(C, accum_steps=10, momentum=0.3).double() for _ in range(world)]
    xs = [[_inputs(2 + r + 3 * j, (), 60 + 10 * r + j) for j in range(k)] for r in range(world)]
    for bn, batch in zip(ranks, xs):
        for x in batch:
            bn(x.double())
    mine = [torch.cat([b.accum_count.view(1), b.accum_mean, b.accum_m2]) for b in ranks]
    spy = _force(monkeypatch, path)

    def all_gather(out, tensor, group=None):
        for o, m in zip(out, mine):
            o.copy_(m)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(AccumBatchNorm1d, "_multi_rank", lambda self: True)
    for bn in ranks:
        bn.flush()
    assert len(spy.merges) == world * (world - 1) and len(spy.updates) == world
    ref = nn.BatchNorm1d(C, momentum=0.3).double()
    ref(torch.cat([x for batch in xs for x in batch]).double())
    for bn in ranks:
        assert torch.equal(bn.running_mean, ranks[0].running_mean)
        assert torch.equal(bn.running_var, ranks[0].running_var)
        assert int(bn.num_batches_tracked) == 1 and float(bn.accum_count) == 0
        assert rel_err(bn.running_mean, ref.running_mean) <= 1e-12
        assert rel_err(bn.running_var, ref.running_var) <= 1e-12


def test_core_runs_on():
    assert bn_mod.core_runs_on(torch.device("cpu"))
    assert bn_mod.core_runs_on(torch.device("cpu"), moments=True)
    cuda = torch.device("cuda", 0)
    assert bn_mod.core_runs_on(cuda) == core.has_cuda()
    assert not bn_mod.core_runs_on(cuda, moments=True)
    for other in ("mps", "xpu", "meta"):
        assert not bn_mod.core_runs_on(torch.device(other))


def test_no_python_copy_of_chans_merge():
    """Chan's merge exists once in C++ (csrc/core/formulas.h) and once in Keras graph ops."""
    source = pathlib.Path(bn_mod.__file__).read_text()
    assert "delta * delta" not in source
    assert "accum_m2 +=" not in source and "accum_mean +=" not in source


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_and_fp64_moments_come_from_the_normalising_pass(dtype, rel_err, monkeypatch):
    """No second pass over the input: the micro-batch's moments are the ones torch's fused
    batch-norm kernel computes while normalising (fp32 running statistics: exact to fp32
    rounding; fp64: to fp64 rounding)."""
    passes = []
    moments = core.bn_moments

    def spy(*a, **kw):
        passes.append(1)
        return moments(*a, **kw)

    monkeypatch.setattr(core, "bn_moments", spy)
    monkeypatch.setattr(bn_mod, "_torch_moments", lambda x: pytest.fail("second pass"))
    acc_cls, plain_cls, tail = CASES["2d"]
    bn, _ = _run(acc_cls, tail, 0.1, dtype=dtype)
    assert not passes
    ref = _reference(plain_cls, tail, 0.1, dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert rel_err(bn.running_mean, ref.running_mean) <= tol
    assert rel_err(bn.running_var, ref.running_var) <= tol
