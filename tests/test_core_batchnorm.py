"""Batch-norm ops: per-channel moments, Chan's merge of micro-batches, running statistics."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    KIND_DTYPES,
    assert_close,
    make,
    need_torch,
    ref_bn_moments,
    ref_bn_update_running,
    rng,
    to_f64,
)

from gradient_accumulator import core


def _x(seed, shape, dtype="float32", kind="numpy"):
    # an offset mean per channel makes a one-pass (E[x²] − E[x]²) variance visibly wrong
    return make(rng(seed).standard_normal(shape) * 2.0 + 50.0, dtype, kind)


@pytest.mark.parametrize(("kind", "dtype"), KIND_DTYPES)
@pytest.mark.parametrize(
    ("shape", "axis"),
    [
        ((6, 3, 5, 4), 1),  # NCHW
        ((6, 5, 4, 3), -1),  # NHWC (channels-last)
        ((10, 7), 1),  # (N, C)
        ((10, 7), -1),
        ((2, 4, 9), 1),  # (N, C, L)
        ((3, 2, 2, 2, 5), -1),  # NDHWC
    ],
)
def test_bn_moments(kind, dtype, shape, axis):
    x = _x(1, shape, dtype, kind)
    mean, m2, count = core.bn_moments(x, channels_axis=axis)
    em, eq, ec = ref_bn_moments(x, axis)
    assert count == ec
    assert mean.dtype == np.float64 and m2.dtype == np.float64
    assert_close(mean, em, "float64")
    np.testing.assert_allclose(m2, eq, rtol=1e-9)  # centred sum: still fp64-accurate


def test_bn_moments_into_given_outputs():
    x = _x(2, (8, 4, 3, 3))
    mean, m2 = np.full(4, np.nan, np.float32), np.full(4, np.nan, np.float32)
    got = core.bn_moments(x, mean=mean, m2=m2)
    assert got[0] is mean and got[1] is m2 and got[2] == 72
    em, eq, _ = ref_bn_moments(x, 1)
    assert_close(mean, em, "float32")
    assert_close(m2, eq, "float32")


def test_bn_moments_of_a_large_offset_are_accurate():
    # variance 1e-4 on a mean of 1e4: catastrophic for a one-pass formula in any precision
    x = (1e4 + 1e-2 * rng(3).standard_normal((64, 2, 8, 8))).astype(np.float64)
    _, m2, count = core.bn_moments(x)
    _, eq, _ = ref_bn_moments(x, 1)
    np.testing.assert_allclose(m2 / count, eq / count, rtol=1e-8)


@pytest.mark.parametrize("axis", [1, -1])
def test_bn_merge_of_micro_batches_equals_the_big_batch(axis):
    shape = (16, 5, 3, 3) if axis == 1 else (16, 3, 3, 5)
    x = to_f64(_x(4, shape))
    sizes = [3, 5, 1, 7]  # uneven micro-batches along N
    parts = np.split(x, np.cumsum(sizes)[:-1], axis=0)
    count = 0.0
    mean, m2 = np.zeros(5), np.zeros(5)
    for part in parts:
        mb, qb, nb = core.bn_moments(part, channels_axis=axis)
        count = core.bn_merge(count, mean, m2, nb, mb, qb)
    em, eq, ec = ref_bn_moments(x, axis)
    assert count == ec
    assert_close(mean, em, "float64")
    np.testing.assert_allclose(m2, eq, rtol=1e-10)
    # the naive average of micro-batch variances is not what we computed
    naive = np.mean([core.bn_moments(p, channels_axis=axis)[1] / (p.size / 5) for p in parts], 0)
    assert np.abs(naive - eq / ec).max() > 1e-3


def test_bn_merge_edge_counts():
    mean, m2 = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    # merging nothing changes nothing
    assert core.bn_merge(10.0, mean, m2, 0.0, np.array([9.0, 9.0]), np.array([9.0, 9.0])) == 10.0
    np.testing.assert_array_equal(mean, [1.0, 2.0])
    np.testing.assert_array_equal(m2, [3.0, 4.0])
    # merging into nothing copies the right side
    mean0, m20 = np.zeros(2, np.float32), np.zeros(2, np.float32)
    assert core.bn_merge(0.0, mean0, m20, 4.0, mean, m2) == 4.0
    np.testing.assert_array_equal(mean0, [1.0, 2.0])
    np.testing.assert_array_equal(m20, [3.0, 4.0])
    # two single values: mean 2, M2 = 2·1²
    a_mean, a_m2 = np.array([1.0]), np.array([0.0])
    assert core.bn_merge(1.0, a_mean, a_m2, 1.0, np.array([3.0]), np.array([0.0])) == 2.0
    assert a_mean[0] == 2.0 and a_m2[0] == 2.0


def test_bn_update_running_unbiased_matches_torch_batchnorm():
    torch = need_torch()
    x = torch.from_numpy(to_f64(_x(5, (12, 4, 3, 3))).astype(np.float32))
    bn = torch.nn.BatchNorm2d(4, momentum=0.1)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        bn.running_var.copy_(torch.tensor([1.0, 2.0, 0.5, 3.0]))
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    bn.train()
    bn(x)
    # the same statistics from two micro-batches of 5 and 7 samples, merged
    count, mean, m2 = 0.0, np.zeros(4), np.zeros(4)
    for part in (x[:5], x[5:]):
        mb, qb, nb = core.bn_moments(part)
        count = core.bn_merge(count, mean, m2, nb, mb, qb)
    ref = ref_bn_update_running(rm, rv, mean, m2, count, momentum=0.1, unbiased=True)
    core.bn_update_running(rm, rv, mean, m2, count, momentum=0.1, unbiased=True)
    assert_close(rm, bn.running_mean, "float32")
    assert_close(rv, bn.running_var, "float32")
    assert_close(rm, ref[0], "float32")
    assert_close(rv, ref[1], "float32")


def test_bn_update_running_biased_keras_convention():
    # Keras: running ← momentum·running + (1 − momentum)·batch, variance M2/n
    keras_momentum = 0.99
    x = to_f64(_x(6, (20, 6)))
    rm, rv = np.full(6, 0.25), np.full(6, 2.0)
    mean, m2, count = core.bn_moments(x)
    core.bn_update_running(rm, rv, mean, m2, count, momentum=1 - keras_momentum, unbiased=False)
    assert_close(rm, keras_momentum * 0.25 + (1 - keras_momentum) * x.mean(0), "float64")
    assert_close(rv, keras_momentum * 2.0 + (1 - keras_momentum) * x.var(0), "float64")
    # and the unbiased variant differs by exactly the n/(n−1) factor on the batch part
    rv2 = np.full(6, 2.0)
    core.bn_update_running(np.zeros(6), rv2, mean, m2, count, momentum=0.01, unbiased=True)
    assert_close(rv2, 0.99 * 2.0 + 0.01 * x.var(0, ddof=1), "float64")
    assert np.abs(rv2 - rv).min() > 1e-6


@pytest.mark.parametrize("momentum", [0.0, 1.0])
def test_bn_update_running_momentum_bounds(momentum):
    rm, rv = np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)
    mean, m2 = np.array([5.0, 6.0]), np.array([8.0, 12.0])
    core.bn_update_running(rm, rv, mean, m2, 5.0, momentum=momentum, unbiased=True)
    if momentum == 0.0:
        np.testing.assert_array_equal(rm, [1.0, 2.0])
        np.testing.assert_array_equal(rv, [3.0, 4.0])
    else:
        np.testing.assert_array_equal(rm, [5.0, 6.0])
        np.testing.assert_array_equal(rv, [2.0, 3.0])
