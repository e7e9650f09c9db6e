"""The CUDA kernels against fp64 references (and the CPU core) on fresh random data: odd sizes,
unaligned views, every dtype, NaN/Inf injection, determinism. Skipped without a GPU.

Run under compute-sanitizer for the memcheck of the op tests:
    compute-sanitizer --tool memcheck python -m pytest tests/cuda/test_cuda_ops.py
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rand
from gpu_helpers import close as _close

from gradient_accumulator import core

SIZES = [1, 7, 8, 9, 255, 2048, 16383, 16384, 16385, 40000, 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROUND = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("gdtype", DTYPES)
def test_accumulate_overwrite_add_and_sumsq(dev, gdtype, offset):
    g1 = [rand(n, gdtype, dev, 10 + i, -2, 2, offset) for i, n in enumerate(SIZES)]
    g2 = [rand(n, gdtype, dev, 50 + i, -2, 2, offset) for i, n in enumerate(SIZES)]
    acc = [torch.full((n + offset,), 7.0, device=dev)[offset:] for n in SIZES]
    r1 = core.accumulate(acc, g1, weight=0.75, overwrite=True)
    r2 = core.accumulate(acc, g2, weight=1.5, compute_sumsq=True)
    for a, x, y in zip(acc, g1, g2):
        want = 0.75 * x.double() + 1.5 * y.double()
        mag = (0.75 * x.double()).abs() + (1.5 * y.double()).abs()
        diff = (a.double() - want).abs()
        assert bool((diff <= 2**-22 * mag).all())
    assert float(r1.nonfinite) == 0.0 and float(r2.nonfinite) == 0.0
    want_sumsq = sum(float((a.double() ** 2).sum()) for a in acc)
    assert math.isclose(float(r2.sumsq), want_sumsq, rel_tol=1e-12)


def test_accumulate_running_mean_matches_cpu(dev):
    acc = [rand(n, torch.float32, dev, i) for i, n in enumerate(SIZES)]
    g = [rand(n, torch.bfloat16, dev, 100 + i, -3, 3) for i, n in enumerate(SIZES)]
    acc_cpu = [a.cpu() for a in acc]
    core.accumulate(acc, g, weight=2.0, weight_before=6.0, mode="running_mean")
    core.accumulate(
        acc_cpu, [x.cpu() for x in g], weight=2.0, weight_before=6.0, mode="running_mean"
    )
    for a, b in zip(acc, acc_cpu):
        _close(a, b, 2**-23)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_flag_is_set_and_never_cleared(dev, bad):
    acc = [torch.zeros(n, device=dev) for n in (100, 40000)]
    g = [torch.ones(n, dtype=torch.float16, device=dev) for n in (100, 40000)]
    flag = torch.zeros((), device=dev)
    core.accumulate(acc, g, overwrite=True, nonfinite_out=flag)
    assert float(flag) == 0.0
    g[1][39999] = bad
    core.accumulate(acc, g, nonfinite_out=flag)
    assert float(flag) == 1.0
    g[1][39999] = 1.0
    core.accumulate(acc, g, nonfinite_out=flag)
    assert float(flag) == 1.0


def test_sum_of_squares_is_deterministic_and_exact_to_fp64(dev):
    xs = [rand(1 + (i * 977) % 50000, DTYPES[i % 3], dev, i, -4, 4) for i in range(130)]
    want = sum(float((x.double() ** 2).sum()) for x in xs)
    got = [float(core.sum_of_squares(xs)) for _ in range(3)]
    assert math.isclose(got[0], want, rel_tol=1e-12)
    assert got[0] == got[1] == got[2]
    assert math.isclose(float(core.global_norm(xs)), math.sqrt(want), rel_tol=1e-12)


@pytest.mark.parametrize(
    "shape,layout",
    [
        ((64, 72), "leading"),
        ((33, 7), "leading"),
        ((5, 3000), "leading"),
        ((20000,), "leading"),
        ((3, 3, 16, 70), "trailing"),
        ((9, 33), "trailing"),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unitwise_norm_matches_cpu(dev, shape, layout, dtype):
    n = math.prod(shape)
    x = rand(n, dtype, dev, 3, -2, 2, offset=1).view(shape)
    got = core.unitwise_norm(x, layout=layout)
    want = core.unitwise_norm(x.cpu(), layout=layout)
    _close(got, want, 1e-6)


def _apply_both(dev, optimizer, pdtype, sdtype, clip, **kw):
    sizes = [72 * 64, 9, 16385, 3000, 40000]
    p = [rand(n, pdtype, dev, i, offset=i % 2) for i, n in enumerate(sizes)]
    a = [rand(n, torch.float32, dev, 20 + i, -3, 3, offset=i % 2) for i, n in enumerate(sizes)]
    s1 = [rand(n, sdtype, dev, 40 + i, -0.1, 0.1) for i, n in enumerate(sizes)]
    s2 = [rand(n, sdtype, dev, 60 + i, 0, 0.01) for i, n in enumerate(sizes)]
    cpu = [[t.cpu().clone() for t in ts] for ts in (p, a, s1, s2)]
    uses_s1 = optimizer != "none"
    uses_s2 = optimizer in ("adam", "adamw")
    out = [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in sizes]
    out_cpu = [t.cpu().clone() for t in out]
    common = dict(
        optimizer=optimizer,
        lr=0.1,
        grad_scale=0.25,
        weight_decay=0.01,
        momentum=0.9,
        dampening=0.1,
        betas=(0.9, 0.999),
        eps=1e-8,
        step=3,
        reset=True,
        **kw,
    )
    if clip == "global":
        common["max_norm"] = 5.0
    elif clip == "agc":
        common.update(
            agc=True,
            clip_factor=0.05,
            agc_eps=1e-3,
            layout=[
                (64, "leading"),
                (1, "leading"),
                (29, "trailing"),
                (3, "leading"),
                (40000, "trailing"),
            ],
        )
    r_dev = core.apply(
        p,
        a,
        state1=s1 if uses_s1 else None,
        state2=s2 if uses_s2 else None,
        grads_out=out if optimizer == "none" else None,
        **common,
    )
    r_cpu = core.apply(
        cpu[0],
        cpu[1],
        state1=cpu[2] if uses_s1 else None,
        state2=cpu[3] if uses_s2 else None,
        grads_out=out_cpu if optimizer == "none" else None,
        **common,
    )
    # One unit in the last place of 16-bit results: the unit norms of AGC are summed in
    # another order on the GPU than on the CPU, and a last-bit difference of a unit's fp32
    # coefficient can round an fp16 parameter the other way (seen: 1 of 40,000 on an H200).
    for got, want in zip(p + s1 + s2 + out, cpu[0] + cpu[2] + cpu[3] + out_cpu):
        _close(got, want, 2e-6, floor=1e-2, ulps=1)
    for x in a:
        assert not bool(x.any())
    return r_dev, r_cpu


@pytest.mark.parametrize(
    "optimizer,pdtype,sdtype,clip",
    [
        ("sgd", torch.float32, torch.float32, "none"),
        ("sgd", torch.bfloat16, torch.bfloat16, "agc"),
        ("adam", torch.float32, torch.float32, "global"),
        ("adamw", torch.bfloat16, torch.float32, "none"),
        ("adamw", torch.float16, torch.float16, "agc"),
        ("adamw", torch.float32, torch.float32, "global"),
        ("none", torch.float32, torch.float32, "agc"),
    ],
)
def test_fused_apply_matches_cpu_core(dev, optimizer, pdtype, sdtype, clip):
    r_dev, r_cpu = _apply_both(dev, optimizer, pdtype, sdtype, clip)
    assert float(r_dev.skipped) == 0.0
    if clip == "global":
        assert math.isclose(float(r_dev.grad_norm), r_cpu.grad_norm, rel_tol=1e-6)
        assert math.isclose(float(r_dev.clip_coef), r_cpu.clip_coef, rel_tol=1e-6)
        assert r_cpu.clip_coef < 1.0


def test_apply_with_device_clip_coefficient(dev):
    p, a = rand(3000, torch.float32, dev, 1), rand(3000, torch.float32, dev, 2)
    want = p.double() - 0.25 * a.double()
    coef = torch.full((1,), 0.125, device=dev)
    core.apply([p], [a], optimizer="sgd", lr=1.0, grad_scale=2.0, clip_coef=coef)
    _close(p, want, 1e-6)


def test_apply_skips_nonfinite_and_resets(dev):
    p = [rand(n, torch.float32, dev, n) for n in (500, 20000)]
    a = [rand(n, torch.float32, dev, n + 1) for n in (500, 20000)]
    a[1][12345] = float("nan")
    before = [x.clone() for x in p]
    r = core.apply(p, a, optimizer="sgd", lr=0.1, skip_nonfinite=True, reset=True)
    assert float(r.skipped) == 1.0 and math.isnan(float(r.grad_norm))
    for x, y in zip(p, before):
        assert torch.equal(x, y)
    for x in a:
        assert not bool(x.any())


def test_adaptive_clip_matches_cpu(dev):
    p = [rand(128 * 96, torch.bfloat16, dev, 1).view(128, 96), rand(96, torch.bfloat16, dev, 2)]
    g = [
        rand(128 * 96, torch.float32, dev, 3, -5, 5).view(128, 96),
        rand(96, torch.float32, dev, 4, -5, 5),
    ]
    g_cpu = [x.cpu() for x in g]
    core.adaptive_clip(p, g, clip_factor=0.01, eps=1e-3)
    core.adaptive_clip([x.cpu() for x in p], g_cpu, clip_factor=0.01, eps=1e-3)
    for x, y in zip(g, g_cpu):
        _close(x, y, 1e-6)


def test_zero_every_dtype(dev):
    sizes = [5, 16384, 999, 33]
    xs = [rand(n, DTYPES[i % 3], dev, i, 0.5, 1.5, offset=1) for i, n in enumerate(sizes)]
    assert all(bool(x.all()) for x in xs)  # unaligned views, no element zero to begin with
    core.zero(xs)
    assert all(not bool(x.any()) for x in xs)


def test_batchnorm_merge_and_running(dev):
    ma, qa = rand(37, torch.float64, dev, 1, 0.1, 2), rand(37, torch.float64, dev, 2, 0.1, 2)
    mb, qb = rand(37, torch.float32, dev, 3, 0.1, 2), rand(37, torch.float32, dev, 4, 0.1, 2)
    cpu = [t.cpu() for t in (ma, qa, mb, qb)]
    n = core.bn_merge(24, ma, qa, 8, mb, qb)
    n_cpu = core.bn_merge(24, cpu[0], cpu[1], 8, cpu[2], cpu[3])
    assert n == n_cpu == 32
    _close(ma, cpu[0], 1e-15)
    _close(qa, cpu[1], 1e-15)
    rm, rv = rand(37, torch.float32, dev, 5), rand(37, torch.float32, dev, 6, 0, 1)
    rm_c, rv_c = rm.cpu(), rv.cpu()
    core.bn_update_running(rm, rv, ma, qa, n, momentum=0.1, unbiased=True)
    core.bn_update_running(rm_c, rv_c, cpu[0], cpu[1], n, momentum=0.1, unbiased=True)
    _close(rm, rm_c, 1e-7)
    _close(rv, rv_c, 1e-7)


def test_runs_on_the_current_stream(dev):
    # On a busy side stream: a torch write to g, then our accumulate reading g. Launched on any
    # other stream, the accumulate would read g before the write lands (3.0 instead of 6.0).
    side = torch.cuda.Stream()
    a = [torch.zeros(1 << 20, device=dev)]
    g = [torch.ones(1 << 20, dtype=torch.bfloat16, device=dev)]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        g[0].fill_(2.0)
        core.accumulate(a, g, weight=3.0, overwrite=True)
    side.synchronize()
    assert float(a[0].min()) == 6.0 == float(a[0].max())


def test_torch_adapter_enqueues_on_a_side_stream_like_the_cpu_core(dev):
    # The stream comes from PyTorch's CUDA adapter (gradient_accumulator.torch._device): on a
    # busy non-default stream the results, read after that stream alone, equal the CPU core's.
    from gradient_accumulator.torch._device import TorchCudaAdapter

    sizes = [3, 4097, 1 << 18]
    g = [rand(n, torch.bfloat16, dev, 70 + i, -2, 2) for i, n in enumerate(sizes)]
    acc = [torch.zeros(n, device=dev) for n in sizes]
    acc_c = [torch.zeros(n) for n in sizes]
    g_c = [x.cpu() for x in g]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert isinstance(core._cuda_adapter(acc[0]), TorchCudaAdapter)
        assert core._cuda_adapter(acc[0]).stream(acc[0]) == side.cuda_stream != 0
        torch.cuda._sleep(50_000_000)
        for x in g:
            x.mul_(2.0)
        r = core.accumulate(acc, g, weight=1.5, overwrite=True, compute_sumsq=True)
    for x in g_c:
        x.mul_(2.0)
    r_c = core.accumulate(acc_c, g_c, weight=1.5, overwrite=True, compute_sumsq=True)
    side.synchronize()
    assert r.nonfinite.shape == () and r.nonfinite.dtype == torch.float32
    assert r.sumsq.shape == () and r.sumsq.dtype == torch.float64
    assert r.nonfinite.device == r.sumsq.device == acc[0].device
    assert float(r.nonfinite) == 0.0 and r_c.nonfinite is False
    for a, a_c in zip(acc, acc_c):
        assert torch.equal(a.cpu(), a_c)
    _close(r.sumsq, r_c.sumsq, 1e-12)


def test_bad_input_raises_and_writes_nothing(dev):
    a = [torch.zeros(10, device=dev)]
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        core.accumulate(a, [torch.ones(10)])  # a CPU gradient for a CUDA accumulator
    with pytest.raises(TypeError, match=r"accumulators\[0\]"):
        core.accumulate(
            [torch.zeros(10, dtype=torch.float64, device=dev)], [torch.ones(10, device=dev)]
        )
    with pytest.raises(ValueError, match="weight"):
        core.accumulate(a, [torch.ones(10, device=dev)], weight=-1.0)
    assert not bool(a[0].any())
