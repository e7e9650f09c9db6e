"""Reduce and buffer ops: pack/unpack, zero, arena_plan, and the DLPack-exported Arena."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from helpers import assert_close, make, need_torch, rng, to_f64

from gradient_accumulator import core

# ---- pack / unpack ----


def _mixed_sources(kind_low: str):
    """Tensors of several dtypes whose values are exact in every dtype used below."""
    r = rng(1)
    ints = [r.integers(-64, 64, s).astype(np.float64) / 8 for s in ((3, 4), (5,), (20_000,), (2,))]
    dtypes = ["float32", "float64", "float16", "bfloat16" if kind_low == "torch" else "float32"]
    kinds = ["numpy", "numpy", kind_low, kind_low]
    return [make(v, d, k) for v, d, k in zip(ints, dtypes, kinds)]


@pytest.mark.parametrize("kind_low", ["numpy", "torch"])
@pytest.mark.parametrize("flat_dtype", ["float32", "float64"])
def test_pack_unpack_round_trip(kind_low, flat_dtype):
    src = _mixed_sources(kind_low)
    total = sum(int(np.prod(s.shape)) for s in src)
    flat = make(np.full(total + 5, 123.0), flat_dtype)  # 5 extra elements
    core.pack(src, flat, scale=0.5)
    expect = np.concatenate([to_f64(s).reshape(-1) for s in src])
    np.testing.assert_array_equal(flat[:total], 0.5 * expect)  # exact: scaled by a power of 2
    np.testing.assert_array_equal(flat[total:], 123.0)  # the tail is not touched
    dst = [
        make(
            np.full(s.shape, np.nan),
            str(s.dtype).replace("torch.", ""),
            "torch" if hasattr(s, "detach") else "numpy",
        )
        for s in src
    ]
    core.unpack(flat, dst, scale=2.0)
    for d, s in zip(dst, src):
        assert d.dtype == s.dtype
        np.testing.assert_array_equal(to_f64(d), to_f64(s))


def test_pack_rounds_to_a_low_precision_flat():
    torch = need_torch()
    src = [rng(2).standard_normal(1000).astype(np.float32)]
    flat = torch.zeros(1000, dtype=torch.bfloat16)
    core.pack(src, flat, scale=3.0)
    expect = (torch.from_numpy(src[0]) * 3.0).to(torch.bfloat16)
    np.testing.assert_array_equal(to_f64(flat), to_f64(expect))
    back = [np.zeros(1000, np.float32)]
    core.unpack(flat, back, scale=1.0 / 3.0)
    assert_close(back[0], to_f64(src[0]), "bfloat16")


def test_pack_of_nothing():
    flat = np.full(3, 7.0, np.float32)
    core.pack([], flat)
    core.unpack(flat, [])
    np.testing.assert_array_equal(flat, 7.0)


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


# ---- Arena ----


def test_arena_is_zeroed_and_aligned():
    arena = core.Arena(1000)
    assert arena.numel == 1000
    v = np.from_dlpack(arena.view(0, (1000,)))
    assert v.dtype == np.float32 and v.flags.c_contiguous and v.flags.writeable
    np.testing.assert_array_equal(v, 0.0)
    assert v.ctypes.data % 64 == 0


def test_arena_views_share_memory_between_numpy_and_torch():
    torch = need_torch()
    arena = core.Arena(64)
    a_np = np.from_dlpack(arena.view(16, (2, 3)))
    a_t = torch.from_dlpack(arena.view(16, (2, 3)))
    whole = np.from_dlpack(arena.view(0, (64,)))
    assert a_np.shape == (2, 3) and tuple(a_t.shape) == (2, 3)
    a_t.fill_(3.0)  # write through torch, read through numpy
    np.testing.assert_array_equal(a_np, 3.0)
    a_np[1, 2] = -7.0  # write through numpy, read through torch
    assert a_t[1, 2].item() == -7.0
    expect = np.zeros(64, np.float32)
    expect[16:22] = [3, 3, 3, 3, 3, -7]
    np.testing.assert_array_equal(whole, expect)  # exactly elements [16, 22)


def test_arena_views_keep_the_memory_alive():
    torch = need_torch()
    arena = core.Arena(1 << 16)
    v_np = np.from_dlpack(arena.view(100, (300,)))
    v_t = torch.from_dlpack(arena.view(100, (300,)))
    del arena
    gc.collect()
    junk = [np.full(1 << 16, 9.0, np.float32) for _ in range(8)]  # reuse freed memory, if any
    v_t.copy_(torch.arange(300, dtype=torch.float32))
    np.testing.assert_array_equal(v_np, np.arange(300))
    del v_t
    gc.collect()
    v_np += 1  # still valid through the numpy view alone
    np.testing.assert_array_equal(v_np, np.arange(1, 301))
    assert all((j == 9.0).all() for j in junk)


def test_arena_views_as_accumulators_and_grads():
    torch = need_torch()
    numels = [6, 10]
    plan = core.arena_plan(numels, alignment=16)
    arena = core.Arena(plan.total)
    shapes = [(2, 3), (10,)]
    acc_np = [np.from_dlpack(arena.view(o, s)) for o, s in zip(plan.offsets, shapes)]
    grads = [torch.ones(s) * (i + 1) for i, s in enumerate(shapes)]
    # the core writes through DLPack views exported by the arena itself
    core.accumulate(
        [arena.view(o, s) for o, s in zip(plan.offsets, shapes)], grads, weight=2.0, overwrite=True
    )
    np.testing.assert_array_equal(acc_np[0], 2.0)
    np.testing.assert_array_equal(acc_np[1], 4.0)
    flat = np.from_dlpack(arena.view(0, (plan.total,)))
    assert np.count_nonzero(flat) == 16  # padding stays zero
    # a torch view of the arena can serve as .grad
    p = torch.zeros(10, requires_grad=True)
    p.grad = torch.from_dlpack(arena.view(plan.offsets[1], (10,)))
    p.grad.mul_(0.5)
    np.testing.assert_array_equal(acc_np[1], 2.0)


def test_arena_of_zero_elements():
    arena = core.Arena(0)
    assert arena.numel == 0
    assert np.from_dlpack(arena.view(0, (0,))).size == 0
