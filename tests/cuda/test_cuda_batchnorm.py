"""AccumBatchNorm on CUDA: the core's merge and running update on the device give the CPU layer's
numbers (fp32 and fp16 running statistics, a flushed short cycle). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import f64

from gradient_accumulator import core
from gradient_accumulator.torch import AccumBatchNorm2d
from gradient_accumulator.torch import batchnorm as bn_mod


def _rel(a, b):
    den = float(f64(b).abs().max())
    return float((f64(a) - f64(b)).abs().max()) / max(den, 1e-300)


C = 4
SIZES = [3, 5, 2]


def _x(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    shift = torch.tensor([3.0, -2.0, 10.0, 0.5]).view(1, C, 1, 1)
    return (shift + 2 * torch.randn(n, C, 5, 4, generator=g)).to(dtype)


def _cycles(bn, dev, dtype, cycles=3, flush_after=None):
    """Run cycles of micro-batches; the state after each micro-step."""
    states = []
    for cycle in range(cycles):
        for j, s in enumerate(SIZES):
            bn(_x(s, 10 * cycle + j, dtype).to(dev))
            states.append({k: v.detach().cpu().clone() for k, v in bn.state_dict().items()})
            if flush_after is not None and j + 1 == flush_after:
                bn.flush()
                states.append({k: v.detach().cpu().clone() for k, v in bn.state_dict().items()})
                break
    return states


def _check(got_states, want_states, stats_tol, moments_tol=1e-12):
    """``moments_tol``: fp32 running statistics take each micro-batch's moments from torch's
    fused kernel (cuDNN's on the GPU, ATen's on the CPU), both rounded to fp32: 1e-6 apart;
    fp16/bf16 ones from an fp64 pass, 1e-12 apart."""
    assert len(got_states) == len(want_states)
    for got, want in zip(got_states, want_states):
        assert got.keys() == want.keys()
        assert torch.equal(got["num_batches_tracked"], want["num_batches_tracked"])
        assert torch.equal(got["accum_step"], want["accum_step"])
        assert float(got["accum_count"]) == float(want["accum_count"])
        for key in ("accum_mean", "accum_m2"):
            assert got[key].dtype == torch.float64
            assert _rel(got[key], want[key]) <= moments_tol, key
        for key in ("running_mean", "running_var"):
            assert got[key].dtype == want[key].dtype
            assert _rel(got[key], want[key]) <= stats_tol, key


class _Spy:
    def __init__(self, monkeypatch):
        self.merge_devices, self.update_args = [], []
        merge, update = core.bn_merge, core.bn_update_running

        def bn_merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
            self.merge_devices.append((mean_a.device.type, mean_b.device.type))
            return merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b)

        def bn_update_running(running_mean, running_var, mean, m2, count, **kw):
            self.update_args.append((running_mean, mean))
            update(running_mean, running_var, mean, m2, count, **kw)

        monkeypatch.setattr(core, "bn_merge", bn_merge)
        monkeypatch.setattr(core, "bn_update_running", bn_update_running)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_cuda_batchnorm_equals_cpu(dev, momentum, monkeypatch):
    want = _cycles(AccumBatchNorm2d(C, momentum=momentum, accum_steps=3), "cpu", torch.float32)
    spy = _Spy(monkeypatch)
    bn = AccumBatchNorm2d(C, momentum=momentum, accum_steps=3).to(dev)
    got = _cycles(bn, dev, torch.float32)
    _check(got, want, 1e-6, 1e-6)
    # Merged and updated on the device, on the layer's own tensors (no host round trip).
    assert spy.merge_devices == [("cuda", "cuda")] * len(got)
    assert len(spy.update_args) == 3
    for running_mean, mean in spy.update_args:
        assert running_mean.data_ptr() == bn.running_mean.data_ptr()
        assert mean.data_ptr() == bn.accum_mean.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_batchnorm_half_running_stats(dev, dtype, monkeypatch):
    want = _cycles(AccumBatchNorm2d(C, accum_steps=3).to(dtype), "cpu", dtype)
    spy = _Spy(monkeypatch)
    bn = AccumBatchNorm2d(C, accum_steps=3).to(dev, dtype)
    got = _cycles(bn, dev, dtype)
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    _check(got, want, ulp)
    assert all(d == ("cuda", "cuda") for d in spy.merge_devices)
    for running_mean, _ in spy.update_args:  # an fp64 copy on the device
        assert running_mean.device.type == "cuda" and running_mean.dtype == torch.float64


def test_cuda_batchnorm_flush_short_cycle(dev):
    want = _cycles(AccumBatchNorm2d(C, accum_steps=3), "cpu", torch.float32, 2, flush_after=2)
    bn = AccumBatchNorm2d(C, accum_steps=3).to(dev)
    got = _cycles(bn, dev, torch.float32, 2, flush_after=2)
    _check(got, want, 1e-6, 1e-6)
    assert int(bn.num_batches_tracked) == 2


def test_cuda_batchnorm_without_core_kernels_goes_through_the_host(dev, monkeypatch):
    """The path of devices the core has no kernels for, on a real device."""
    want = _cycles(AccumBatchNorm2d(C, accum_steps=3).half(), "cpu", torch.float16)
    monkeypatch.setattr(bn_mod, "core_runs_on", lambda device, moments=False: False)
    spy = _Spy(monkeypatch)
    got = _cycles(AccumBatchNorm2d(C, accum_steps=3).to(dev, torch.float16), dev, torch.float16)
    _check(got, want, 2.0**-10)
    assert all(d == ("cpu", "cpu") for d in spy.merge_devices)
