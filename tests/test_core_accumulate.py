"""core.accumulate against an fp64 NumPy reference: dtypes, weights, modes, flags, precision."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    BF16_UNIT_ROUNDOFF,
    KIND_DTYPES,
    LOW_DTYPES,
    assert_close,
    make,
    need_torch,
    ref_accumulate,
    rng,
    to_f64,
    zeros,
)

from gradient_accumulator import core

# Sizes: tiny, not a multiple of any vector width, and one spanning several 16384-element chunks.
SIZES = [(3,), (7, 11), (40_003,)]
WEIGHTS = [2.0, 0.5, 3.0, 1.25]


def _grads(seed: int, dtype: str, kind: str, sizes=SIZES):
    r = rng(seed)
    data = [r.uniform(-1.0, 1.0, s) for s in sizes]
    return [make(d, dtype, kind) for d in data]


@pytest.mark.parametrize(("kind", "gdtype"), KIND_DTYPES)
def test_sum_over_a_cycle_matches_fp64(kind, gdtype):
    acc = [zeros(s, "float32", kind) for s in SIZES]
    ref = [to_f64(a) for a in acc]
    for step, w in enumerate(WEIGHTS):
        grads = _grads(10 + step, gdtype, kind)
        r = core.accumulate(acc, grads, weight=w, overwrite=step == 0)
        assert r.nonfinite is False and r.sumsq is None
        ref = [ref_accumulate(ra, g, weight=w, overwrite=step == 0) for ra, g in zip(ref, grads)]
        for a, e in zip(acc, ref):
            assert a.dtype == acc[0].dtype  # stays fp32
            assert_close(a, e, "float32", err_msg=f"step {step}")
    # the result is the weighted sum, not the plain sum: a wrong weight would be far off
    plain = sum(to_f64(g[0]) for g in (_grads(10 + s, gdtype, kind) for s in range(4)))
    assert np.max(np.abs(to_f64(acc[0]) - plain)) > 0.1


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_fp64_accumulators_keep_fp64_precision(kind):
    # 0.1 is not a float32 number: a pass through fp32 would be off by ~1e-9 relative.
    g = [make(rng(1).uniform(-1, 1, 1000), "float64", kind)]
    acc = [zeros(1000, "float64", kind)]
    core.accumulate(acc, g, weight=0.1, overwrite=True)
    core.accumulate(acc, g, weight=0.7)
    assert_close(acc[0], 0.8 * to_f64(g[0]), "float64")


def test_overwrite_never_reads_the_accumulator():
    # garbage (NaN, Inf) left in the buffer must not leak into the first micro-step
    acc = [np.full(100, np.nan, np.float32), np.full(40_000, np.inf, np.float32)]
    g = _grads(3, "float32", "numpy", [(100,), (40_000,)])
    r = core.accumulate(acc, g, weight=1.5, overwrite=True, compute_sumsq=True)
    assert r.nonfinite is False
    for a, gg in zip(acc, g):
        assert_close(a, 1.5 * to_f64(gg), "float32")
    assert np.isfinite(r.sumsq)


def test_mean_and_sum_store_the_same_thing():
    g1, g2 = _grads(4, "float32", "numpy"), _grads(5, "float32", "numpy")
    a_sum = [zeros(s) for s in SIZES]
    a_mean = [zeros(s) for s in SIZES]
    for acc, mode in ((a_sum, "sum"), (a_mean, "mean")):
        core.accumulate(acc, g1, weight=3.0, mode=mode, overwrite=True)
        core.accumulate(acc, g2, weight=5.0, mode=mode)
    for a, b in zip(a_sum, a_mean):
        np.testing.assert_array_equal(a, b)
    assert_close(a_sum[0], 3 * to_f64(g1[0]) + 5 * to_f64(g2[0]), "float32")


@pytest.mark.parametrize(("kind", "gdtype"), KIND_DTYPES)
def test_running_mean_is_the_weighted_mean_so_far(kind, gdtype):
    acc = [zeros(s, "float32", kind) for s in SIZES]
    weights = [3.0, 1.0, 4.0, 0.5]
    num = [np.zeros(s) for s in SIZES]
    total = 0.0
    for step, w in enumerate(weights):
        grads = _grads(20 + step, gdtype, kind)
        core.accumulate(
            acc, grads, weight=w, mode="running_mean", weight_before=total, overwrite=step == 0
        )
        total += w
        num = [n + w * to_f64(g) for n, g in zip(num, grads)]
        for a, n in zip(acc, num):
            assert_close(a, n / total, "float32", err_msg=f"step {step}")


def test_running_mean_overwrite_ignores_weight_before():
    g = _grads(6, "float32", "numpy")
    acc = [np.full(s, 9.0, np.float32) for s in SIZES]
    core.accumulate(acc, g, weight=2.0, mode="running_mean", weight_before=100.0, overwrite=True)
    for a, gg in zip(acc, g):
        assert_close(a, to_f64(gg), "float32")  # the mean of one micro-batch is its gradient


def test_zero_weight_adds_nothing():
    g = _grads(7, "float32", "numpy")
    acc = [np.full(s, 0.25, np.float32) for s in SIZES]
    core.accumulate(acc, g, weight=0.0)
    for a in acc:
        np.testing.assert_array_equal(a, 0.25)


@pytest.mark.parametrize(("kind", "gdtype"), KIND_DTYPES)
@pytest.mark.parametrize("overwrite", [True, False])
def test_nonfinite_flag(kind, gdtype, overwrite):
    clean = _grads(8, gdtype, kind)
    acc = [zeros(s, "float32", kind) for s in SIZES]
    assert core.accumulate(acc, clean, overwrite=overwrite).nonfinite is False
    # incl. the first element of a later chunk and the very last element
    for bad, tensor, pos in (
        (np.nan, 0, 1),
        (np.inf, 2, 40_002),
        (-np.inf, 2, 16_384),
        (np.nan, 1, 76),
    ):
        data = [to_f64(g) for g in clean]
        data[tensor].reshape(-1)[pos] = bad
        grads = [make(d, gdtype, kind) for d in data]
        r = core.accumulate(acc, grads, overwrite=overwrite)
        assert r.nonfinite is True, (bad, tensor, pos)
        assert core.accumulate(acc, clean, overwrite=overwrite).nonfinite is False


def test_nonfinite_flag_looks_at_gradients_only():
    acc = [np.full(5, np.nan, np.float32)]
    r = core.accumulate(acc, [np.ones(5, np.float32)])
    assert r.nonfinite is False
    assert np.isnan(acc[0]).all()


@pytest.mark.parametrize(("kind", "gdtype"), KIND_DTYPES)
def test_compute_sumsq_is_the_sum_of_squares_of_the_result(kind, gdtype):
    acc = [zeros(s, "float32", kind) for s in SIZES]
    r1 = core.accumulate(
        acc, _grads(30, gdtype, kind), weight=2.0, overwrite=True, compute_sumsq=True
    )
    expect1 = sum(float(np.sum(to_f64(a) ** 2)) for a in acc)
    r2 = core.accumulate(acc, _grads(31, gdtype, kind), weight=0.5, compute_sumsq=True)
    expect2 = sum(float(np.sum(to_f64(a) ** 2)) for a in acc)
    assert r1.sumsq == pytest.approx(expect1, rel=1e-12)
    assert r2.sumsq == pytest.approx(expect2, rel=1e-12)
    assert r1.sumsq != pytest.approx(r2.sumsq, rel=1e-3)
    assert core.sum_of_squares(acc) == pytest.approx(r2.sumsq, rel=1e-12)


def test_empty_lists_and_tensors():
    r = core.accumulate([], [], compute_sumsq=True)
    assert r.nonfinite is False and r.sumsq == 0.0
    acc = [np.zeros(0, np.float32), np.zeros(4, np.float32)]
    r = core.accumulate(
        acc, [np.zeros(0, np.float32), np.ones(4, np.float32)], weight=2.0, compute_sumsq=True
    )
    np.testing.assert_array_equal(acc[1], 2.0)
    assert r.sumsq == 16.0


def test_large_unaligned_overwrite():
    # ≥ 16 MiB written in one overwrite (the streaming-store path), starting off a 64-byte line
    n = (1 << 22) + 5
    base = np.zeros(n + 1, np.float32)
    acc = base[1:]
    assert acc.ctypes.data % 64 != 0
    g = rng(9).standard_normal(n).astype(np.float32)
    g[n // 2] = np.inf
    r = core.accumulate([acc], [g], weight=0.5, overwrite=True)
    assert r.nonfinite is True
    g[n // 2] = 1.0
    r = core.accumulate([acc], [g], weight=0.5, overwrite=True)
    assert r.nonfinite is False
    np.testing.assert_array_equal(acc, 0.5 * g)  # exact: scaling by 0.5
    assert base[0] == 0.0


def test_torch_tensor_requiring_grad_is_accepted():
    torch = need_torch()
    acc = torch.zeros(6, requires_grad=True)
    g = torch.arange(6, dtype=torch.float32)
    core.accumulate([acc], [g], weight=2.0, overwrite=True)
    np.testing.assert_array_equal(acc.detach().numpy(), 2.0 * np.arange(6))


def test_read_only_gradients_are_accepted():
    g = np.arange(4, dtype=np.float32)
    g.flags.writeable = False
    acc = [np.ones(4, np.float32)]
    core.accumulate(acc, [g], weight=2.0)
    np.testing.assert_array_equal(acc[0], 1.0 + 2.0 * np.arange(4))


@pytest.mark.parametrize(("kind", "gdtype"), LOW_DTYPES)
def test_low_precision_gradients_are_read_exactly(kind, gdtype):
    # upcasting 16-bit values to fp32 is exact: one overwrite with weight 1 reproduces them
    g = _grads(40, gdtype, kind)
    acc = [zeros(s, "float32", kind) for s in SIZES]
    core.accumulate(acc, g, overwrite=True)
    for a, gg in zip(acc, g):
        np.testing.assert_array_equal(to_f64(a), to_f64(gg))


def test_bf16_precision_over_64_micro_steps():
    """k = 64 bf16 gradients into fp32 stay within one bf16 rounding of the fp64 sum."""
    torch = need_torch()
    k, n = 64, 4096
    r = rng(42)
    # positive gradients, as for a consistently signed parameter: the sum grows to ~64 and a
    # bf16 running sum (ulp 0.25 near 64) rounds at every add
    grads = [make(r.uniform(0.25, 1.75, n), "bfloat16", "torch") for _ in range(k)]
    exact = sum(to_f64(g) for g in grads)  # bf16 values are exact in fp64

    acc = [torch.empty(n, dtype=torch.float32)]
    for i, g in enumerate(grads):
        core.accumulate(acc, [g], overwrite=i == 0)
    err_core = np.abs(to_f64(acc[0]) - exact) / np.abs(exact)

    s = torch.zeros(n, dtype=torch.bfloat16)
    for g in grads:
        s = s + g  # summing in bf16, as torch does for bf16 .grad
    err_bf16 = np.abs(to_f64(s) - exact) / np.abs(exact)

    assert err_core.max() <= BF16_UNIT_ROUNDOFF  # within one bf16 rounding, everywhere
    assert err_core.max() < 1e-5  # in fact at fp32 level
    assert err_bf16.max() > BF16_UNIT_ROUNDOFF  # bf16 sums drift past one rounding
    assert np.mean(err_bf16) > 100 * np.mean(err_core)
