"""Norms: sum_of_squares / global_norm (value, determinism), unit layouts, unit-wise norms, AGC."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import (
    KIND_DTYPES,
    KINDS,
    assert_close,
    make,
    need_torch,
    ref_agc,
    ref_global_norm,
    ref_unitwise_norm,
    rng,
    to_f64,
)

from gradient_accumulator import core
from gradient_accumulator._loader import load_core

SIZES = [(5,), (33, 17), (70_001,)]


@pytest.mark.parametrize(("kind", "dtype"), KIND_DTYPES)
def test_sum_of_squares_and_global_norm(kind, dtype):
    r = rng(1)
    ts = [make(r.standard_normal(s), dtype, kind) for s in SIZES]
    expect = sum(float(np.sum(to_f64(t) ** 2)) for t in ts)
    # fp64 accumulation of exactly upcast inputs: only the summation order differs
    assert core.sum_of_squares(ts) == pytest.approx(expect, rel=1e-12)
    assert core.global_norm(ts) == pytest.approx(ref_global_norm(ts), rel=1e-12)
    assert core.global_norm(ts) == pytest.approx(np.sqrt(expect), rel=1e-12)


def test_global_norm_of_mixed_dtypes_matches_torch():
    torch = need_torch()
    r = rng(2)
    ts = [
        make(r.standard_normal(s), d, "torch")
        for s, d in zip(SIZES, ("bfloat16", "float16", "float32"))
    ]
    ts.append(make(r.standard_normal(9), "float64", "numpy"))
    expect = torch.linalg.vector_norm(
        torch.cat([torch.as_tensor(to_f64(t)).reshape(-1) for t in ts])
    ).item()
    assert core.global_norm(ts) == pytest.approx(expect, rel=1e-12)


def test_sum_of_squares_is_exact_for_small_integers():
    ts = [np.array([3.0, 4.0], np.float32), np.array([[12.0]], np.float64)]
    assert core.sum_of_squares(ts) == 169.0
    assert core.global_norm(ts) == 13.0
    assert core.sum_of_squares([]) == 0.0
    assert core.sum_of_squares([np.zeros(0, np.float32)]) == 0.0


def test_sum_of_squares_propagates_nonfinite():
    x = np.ones(50_000, np.float32)
    x[40_000] = np.nan
    assert np.isnan(core.sum_of_squares([np.ones(3, np.float32), x]))
    x[40_000] = -np.inf
    assert core.sum_of_squares([x]) == np.inf


def test_repeated_calls_are_bitwise_identical():
    r = rng(3)
    ts = [r.standard_normal(s).astype(np.float32) * 1e3 for s in SIZES]
    first = core.sum_of_squares(ts)
    for _ in range(5):
        assert core.sum_of_squares(ts) == first


_DETERMINISM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from gradient_accumulator import core
    r = np.random.default_rng(7)
    ts = [r.standard_normal(n).astype(np.float32) * 100 for n in (3, 100_003, 250_000)]
    acc = [np.empty_like(t) for t in ts]
    s = core.accumulate(acc, ts, weight=0.3, overwrite=True, compute_sumsq=True).sumsq
    w = r.standard_normal((7, 9, 4000)).astype(np.float32)
    out = [core.sum_of_squares(ts), s]
    out += [float(v) for v in core.unitwise_norm(ts[2], out=np.empty(1))]
    out += [float(v) for v in core.unitwise_norm(w, layout="trailing", out=np.empty(36_000))]
    print(" ".join(float(v).hex() for v in out))
""")


def test_reductions_do_not_depend_on_the_thread_count():
    here = subprocess.run(
        [sys.executable, "-c", _DETERMINISM_SCRIPT], capture_output=True, text=True, check=True
    ).stdout
    other = "3" if load_core().num_threads() == 1 else "1"
    env = dict(os.environ, OMP_NUM_THREADS=other)
    there = subprocess.run(
        [sys.executable, "-c", _DETERMINISM_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    assert len(here.split()) == 2 + 1 + 36_000
    assert here == there


# ---- unit layouts ----


@pytest.mark.parametrize(
    ("shape", "units"),
    [
        ((), 1),
        ((5,), 1),
        ((4, 3), 4),
        ((8, 3, 3, 3), 8),
        ((6, 2, 2, 2, 2), 6),
        ((2,) * 6, 2),
    ],
)
def test_unit_layout_leading(shape, units):
    assert core.unit_layout(shape, "leading") == (units, "leading")


@pytest.mark.parametrize(
    ("shape", "units"),
    [
        ((), 1),
        ((5,), 1),
        ((3, 4), 4),  # rank 2: norm over axis 0
        ((2, 3, 4), 12),  # rank 3: norm over axis 0
        ((3, 3, 2, 5), 5),  # rank 4: norm over axes 0, 1, 2
        ((2, 3, 3, 2, 7), 7),  # rank 5: norm over axes 0, 1, 2, 3
    ],
)
def test_unit_layout_trailing_follows_the_keras_package(shape, units):
    assert core.unit_layout(shape, "trailing") == (units, "trailing")


def test_unit_layout_trailing_rank_6_is_an_error():
    with pytest.raises(ValueError, match="rank"):
        core.unit_layout((2, 2, 2, 2, 2, 2), "trailing")


def test_unit_layout_default_is_leading():
    assert core.unit_layout((7, 3)) == (7, "leading")


LEADING_SHAPES = [(6,), (5, 7), (8, 4, 3, 3), (3, 2, 2, 2, 2), (2, 40_000)]
TRAILING_SHAPES = [(6,), (7, 5), (3, 4, 6), (3, 3, 4, 8), (2, 2, 2, 3, 5), (40_000, 3)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("layout", "shape"),
    [("leading", s) for s in LEADING_SHAPES] + [("trailing", s) for s in TRAILING_SHAPES],
)
def test_unitwise_norm(kind, layout, shape):
    x = make(rng(4).standard_normal(shape), "float32", kind)
    got = core.unitwise_norm(x, layout=layout)
    assert got.dtype == np.float32 and got.shape == (core.unit_layout(shape, layout)[0],)
    assert_close(got, ref_unitwise_norm(x, layout), "float32")
    out = np.full(got.shape, -1.0)
    assert core.unitwise_norm(x, layout=layout, out=out) is out
    assert_close(out, ref_unitwise_norm(x, layout), "float64")


def test_unitwise_norm_leading_matches_torch():
    torch = need_torch()
    x = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(0))
    expect = torch.linalg.vector_norm(x.double(), dim=(1, 2, 3)).numpy()
    assert_close(core.unitwise_norm(x, out=np.empty(8)), expect, "float64")


@pytest.mark.parametrize(("kind", "dtype"), KIND_DTYPES)
def test_unitwise_norm_reads_every_dtype_exactly(kind, dtype):
    x = make(rng(5).standard_normal((6, 50)), dtype, kind)
    assert_close(core.unitwise_norm(x, out=np.empty(6)), ref_unitwise_norm(x), "float64")


# ---- adaptive gradient clipping ----


def _agc_case(seed, shapes, kind, pdtype, layout):
    """Params and gradients where some units are clipped and some are not."""
    r = rng(seed)
    params, grads = [], []
    for shape in shapes:
        p = r.standard_normal(shape)
        g = r.standard_normal(shape) * 0.001
        n_units = core.unit_layout(shape, layout)[0]
        if n_units > 1:
            # blow up the gradient of every other unit so that it gets clipped
            view = g.reshape(n_units, -1) if layout == "leading" else g.reshape(-1, n_units).T
            view[::2] *= 1e4
            if layout == "leading":
                p[0] = 0.0  # a unit with zero weights: the eps floor decides
        else:
            g *= 1e4
        params.append(make(p, pdtype, kind))
        grads.append(make(g, "float32", kind))
    return params, grads


@pytest.mark.parametrize(
    ("kind", "pdtype"),
    [("numpy", "float32"), ("torch", "float32"), ("torch", "bfloat16"), ("numpy", "float16")],
)
@pytest.mark.parametrize("layout", ["leading", "trailing"])
def test_adaptive_clip_follows_the_nfnets_rule(kind, pdtype, layout):
    if kind == "torch":
        need_torch()
    shapes = LEADING_SHAPES[:4] if layout == "leading" else TRAILING_SHAPES[:5]
    params, grads = _agc_case(6, shapes, kind, pdtype, layout)
    before = [to_f64(g) for g in grads]
    expect = [
        ref_agc(p, g, clip_factor=0.02, eps=1e-3, layout=layout) for p, g in zip(params, grads)
    ]
    core.adaptive_clip(params, grads, clip_factor=0.02, eps=1e-3, layout=layout)
    clipped = kept = 0
    for g, e, b in zip(grads, expect, before):
        assert_close(g, e, "float32")
        changed = np.abs(e - b) > 1e-6 * np.abs(b)
        clipped += int(changed.sum())
        kept += int((~changed).sum())
    assert clipped > 0 and kept > 0  # the case exercises both branches of the rule


def test_adaptive_clip_with_explicit_units():
    p = rng(7).standard_normal((4, 6)).astype(np.float32)
    g = (rng(8).standard_normal((4, 6)) * 10).astype(np.float32)
    g1, g2 = g.copy(), g.copy()
    core.adaptive_clip([p], [g1], layout=[(4, "leading")])
    core.adaptive_clip([p], [g2], layout="leading")
    np.testing.assert_array_equal(g1, g2)
    assert_close(g1, ref_agc(p, g), "float32")
    # the same memory split into 6 trailing units is a different rule
    g3 = g.copy()
    core.adaptive_clip([p], [g3], layout=[(6, "trailing")])
    assert_close(g3, ref_agc(p, g, layout="trailing"), "float32")
    assert np.abs(g3 - g1).max() > 1e-3


def test_adaptive_clip_eps_floor_and_zero_gradients():
    p = np.zeros((2, 3), np.float32)
    g = np.array([[1.0, 2.0, 2.0], [0.0, 0.0, 0.0]], np.float32)
    core.adaptive_clip([p], [g], clip_factor=0.5, eps=0.1)
    # unit 0: max norm 0.5·0.1 = 0.05, gradient norm 3 → scaled by 0.05/3; unit 1 stays zero
    assert_close(g, [[0.05 / 3, 0.1 / 3, 0.1 / 3], [0, 0, 0]], "float32")
