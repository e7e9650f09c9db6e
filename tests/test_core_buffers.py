"""Buffer ops: zero and arena_plan."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import need_torch, to_f64

from gradient_accumulator import core

# ---- zero ----


def test_zero_every_dtype():
    torch = need_torch()
    ts = [
        np.ones((3, 3), np.float32),
        np.ones(40_000, np.float64),
        np.ones(5, np.float16),
        torch.ones(7, dtype=torch.bfloat16),
        torch.full((2, 2), np.nan),
    ]
    other = np.ones(4, np.float32)
    core.zero(ts)
    for t in ts:
        np.testing.assert_array_equal(to_f64(t), 0.0)
        assert not np.signbit(to_f64(t)).any()
    np.testing.assert_array_equal(other, 1.0)


def test_zero_touches_only_its_slice():
    base = np.ones(100, np.float32)
    core.zero([base[10:20], base[50:51]])
    expect = np.ones(100, np.float32)
    expect[10:20] = 0
    expect[50] = 0
    np.testing.assert_array_equal(base, expect)


# ---- arena_plan ----


def _check_plan(numels, plan, *, alignment, bucket_numel, reverse):
    n = len(numels)
    order = list(range(n))[::-1] if reverse else list(range(n))
    assert len(plan.offsets) == len(plan.bucket_of) == n
    # layout order, alignment, no overlap, no gap beyond padding
    pos = 0
    for i in order:
        assert plan.offsets[i] == pos
        assert plan.offsets[i] % alignment == 0
        pos += -(-numels[i] // alignment) * alignment
    assert plan.total == pos and plan.total % alignment == 0
    # buckets: contiguous, in layout order, each closed once it reaches bucket_numel
    starts = plan.bucket_start
    assert starts[0] == 0 and starts[-1] == plan.total
    assert len(starts) == (max(plan.bucket_of) + 2 if n else 1)
    for b in range(len(starts) - 1):
        members = [i for i in range(n) if plan.bucket_of[i] == b]
        assert members, "empty bucket"
        assert min(plan.offsets[i] for i in members) == starts[b]
        size = starts[b + 1] - starts[b]
        last = max(members, key=lambda i: (plan.offsets[i], numels[i]))
        if b < len(starts) - 2:
            assert size >= bucket_numel  # only the last bucket may be short
            assert size - (-(-numels[last] // alignment) * alignment) < bucket_numel
    # bucket indices never decrease along the layout
    seq = [plan.bucket_of[i] for i in order]
    assert seq == sorted(seq)


@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("alignment", [1, 16, 64])
@pytest.mark.parametrize("bucket_numel", [1, 100, 1000, 10**9])
def test_arena_plan(reverse, alignment, bucket_numel):
    numels = [10, 3, 400, 0, 17, 1, 250, 64, 999]
    plan = core.arena_plan(numels, alignment=alignment, bucket_numel=bucket_numel, reverse=reverse)
    _check_plan(numels, plan, alignment=alignment, bucket_numel=bucket_numel, reverse=reverse)


def test_arena_plan_small_example():
    plan = core.arena_plan([10, 3, 40], alignment=16, bucket_numel=20)
    # last tensor first: 40 → [0, 48), 3 → [48, 64), 10 → [64, 80); the first bucket closes
    # after the 48 elements of the last tensor
    assert plan == core.ArenaPlan(
        offsets=[64, 48, 0], bucket_of=[1, 1, 0], bucket_start=[0, 48, 80], total=80
    )
    fwd = core.arena_plan([10, 3, 40], alignment=16, bucket_numel=20, reverse=False)
    assert fwd == core.ArenaPlan(
        offsets=[0, 16, 32], bucket_of=[0, 0, 1], bucket_start=[0, 32, 80], total=80
    )


def test_arena_plan_defaults_and_empty():
    plan = core.arena_plan([5, 7])
    assert plan.offsets == [16, 0] and plan.total == 32 and plan.bucket_start == [0, 32]
    empty = core.arena_plan([])
    assert empty == core.ArenaPlan([], [], [0], 0)
