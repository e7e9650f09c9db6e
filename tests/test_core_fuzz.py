"""Property-based fuzzing of ``gradient_accumulator.core``.

Each example draws one core call (accumulate, apply, adaptive_clip, sum of
squares) on NumPy buffers of random sizes and dtypes, with scalars that are ordinary, extreme
for float32 (1e40, 1e-46, ...) or invalid, and possibly one injected fault (a size mismatch, a
wrong dtype, aliasing buffers, a read-only output, a bad scalar). The call must either

* succeed with every buffer equal to a float64 NumPy reference, rounded once to the stored
  dtype, within the tolerance of that dtype (``TOL``), or
* raise ValueError/TypeError whose message names the argument at fault, with every buffer
  byte-for-byte unchanged.

A fault must be refused; an ordinary call must succeed. Extreme scalars may go either way, but
never to a silently wrong value. The examples are derandomized (fixed seed), so CI sees the
same calls every run; ``max_examples`` bounds the run to well under a minute.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradient_accumulator import core  # noqa: E402

F32 = np.float32

#: Relative tolerance per stored dtype, on top of one rounding to it: a few roundings of
#: float32 (or float64) arithmetic on the way.
RTOL = {"float64": 1e-12, "float32": 4e-6, "float16": 2.0**-10}
#: Magnitudes the values are drawn at: far from every float16/float32 boundary but the ones a
#: scalar pushes them over.
MAGNITUDES = [1e-3, 1.0, 1e3]
ORDINARY = [0.0, 0.25, 0.5, 1.0, 3.0, 1e-3]
EXTREME = [1e40, -1e40, 1e-46, 3e-39, 1e-300, 1e300]
INVALID = [float("nan"), float("inf"), float("-inf")]

FUZZ = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


@dataclass
class Call:
    """A drawn call: the buffers it may touch, the function, and what it may raise."""

    buffers: list[np.ndarray]
    run: Callable[[], Any]
    check: Callable[[Any], None]
    #: Argument names a refusal may name; empty: the call must succeed.
    fault: list[str] = field(default_factory=list)
    #: Names that may be refused for precision reasons (extreme scalars), besides `fault`.
    may_refuse: list[str] = field(default_factory=list)


def _array(draw, n: int, dtype: str, special: bool) -> np.ndarray:
    mag = draw(st.sampled_from(MAGNITUDES))
    seed = draw(st.integers(0, 2**32 - 1))
    x = np.random.default_rng(seed).uniform(-1.0, 1.0, n) * mag
    if special and n and draw(st.booleans()):
        x[draw(st.integers(0, n - 1))] = draw(st.sampled_from(INVALID))
    return np.ascontiguousarray(x.astype(dtype))


def _scalar(draw, allow_extreme: bool = True, allow_invalid: bool = True) -> tuple[float, str]:
    kinds = (
        ["ordinary"] * 4
        + (["extreme"] * 2 if allow_extreme else [])
        + (["invalid"] if allow_invalid else [])
    )
    kind = draw(st.sampled_from(kinds))
    pool = {"ordinary": ORDINARY, "extreme": EXTREME, "invalid": INVALID}[kind]
    return draw(st.sampled_from(pool)), kind


def _sizes(draw) -> list[int]:
    return draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))


def _assert_stored(actual: np.ndarray, ref: np.ndarray, what: str) -> None:
    """``actual`` equals the float64 reference rounded once to its dtype, within RTOL."""
    dtype = actual.dtype.name
    with np.errstate(over="ignore", invalid="ignore"):
        expect = ref.astype(actual.dtype).astype(np.float64)
    got = actual.astype(np.float64)
    scale = np.max(np.abs(expect[np.isfinite(expect)]), initial=0.0)
    # The reference rounds once; the core may round a few times in float32 first, so values
    # that underflow to (sub)normals near 0 may differ by a float32 ulp of the largest value.
    atol = RTOL[dtype] * scale + (1e-44 if dtype != "float64" else 0.0)
    np.testing.assert_allclose(got, expect, rtol=RTOL[dtype], atol=atol, err_msg=what)


def _fault_kind(draw) -> str:
    return draw(st.sampled_from(["none"] * 5 + ["size", "dtype", "alias", "readonly"]))


def _inject(
    draw,
    kind: str,
    outs: list[np.ndarray],
    ins: list[np.ndarray],
    out_name: str,
    in_name: str,
    bad_out_dtype: str,
) -> list[str]:
    """Spoil one list entry in place for `kind`; the argument names a refusal may name."""
    if kind == "none" or not outs:
        return []
    i = draw(st.integers(0, len(outs) - 1))
    if kind == "size" and ins:
        j = min(i, len(ins) - 1)
        ins[j] = np.zeros(ins[j].size + 1, ins[j].dtype)
        return [f"{in_name}[{j}]", f"{out_name}[{j}]", in_name, out_name]
    if kind == "dtype":
        outs[i] = outs[i].astype(bad_out_dtype)
        return [f"{out_name}[{i}]"]
    if kind == "alias" and ins:
        j = min(i, len(ins) - 1)
        if outs[i].size == 0 or outs[i].dtype != ins[j].dtype or outs[i].size != ins[j].size:
            return []
        ins[j] = outs[i]
        return [f"{out_name}[{i}]", f"{in_name}[{j}]"]
    if kind == "readonly":
        outs[i].flags.writeable = False
        return [f"{out_name}[{i}]"]
    return []


# ---- the calls -----------------------------------------------------------------------------


@st.composite
def accumulate_calls(draw) -> Call:
    sizes = _sizes(draw)
    acc_dt = draw(st.sampled_from(["float32", "float64"]))
    accs = [_array(draw, n, acc_dt, False) for n in sizes]
    grads = [
        _array(draw, n, draw(st.sampled_from(["float32", "float64", "float16"])), True)
        for n in sizes
    ]
    weight, wkind = _scalar(draw)
    mode = draw(st.sampled_from(["sum", "mean", "running_mean"]))
    before_w = draw(st.sampled_from([0.0, 1.0, 7.0]))
    overwrite = draw(st.booleans())
    fault = _inject(draw, _fault_kind(draw), accs, grads, "accumulators", "grads", "float16")
    if wkind == "invalid" or weight < 0:
        fault.append("weight")
    if mode == "running_mean" and (before_w if not overwrite else 0.0) + weight <= 0:
        fault.append("weight")
    a0 = [a.astype(np.float64) for a in accs]
    g0 = [g.astype(np.float64) for g in grads]

    def run():
        return core.accumulate(
            accs,
            grads,
            weight=weight,
            mode=mode,
            weight_before=before_w,
            overwrite=overwrite,
            compute_sumsq=True,
        )

    def check(result):
        total = (0.0 if overwrite else before_w) + weight
        with np.errstate(all="ignore"):
            refs = []
            for a, g in zip(a0, g0):
                if mode == "running_mean":
                    alpha, beta = (0.0 if overwrite else before_w) / total, weight / total
                    refs.append((0.0 if overwrite else a * alpha) + g * beta)
                else:
                    refs.append(weight * g if overwrite else a + weight * g)
        for i, (acc, ref) in enumerate(zip(accs, refs)):
            _assert_stored(acc, ref, f"accumulators[{i}]")
        assert result.nonfinite == any(not np.all(np.isfinite(g)) for g in g0)
        with np.errstate(over="ignore"):  # float64 accumulators near 1e300 square to inf
            want = sum(float(np.sum(a.astype(np.float64) ** 2)) for a in accs)
        if math.isfinite(want):
            assert result.sumsq == pytest.approx(want, rel=1e-9, abs=1e-300)

    may = ["weight", "weight_before"] if wkind == "extreme" else []
    return Call(accs + grads, run, check, fault, may)


def _ref_update(opt, p, g, s1, s2, *, lr, wd, momentum, step):
    """float64 torch.optim formulas (SGD with momentum, Adam, AdamW) and the "none" gradient."""
    if opt == "none":
        return None, g, None, None
    if opt == "sgd":
        g = g + wd * p
        if momentum:
            s1 = momentum * s1 + g
            g = s1
        return p - lr * g, None, s1, None
    b1, b2, eps = 0.9, 0.999, 1e-8
    if opt == "adamw":
        p = p * (1.0 - lr * wd)
    else:
        g = g + wd * p
    m = b1 * s1 + (1 - b1) * g
    v = b2 * s2 + (1 - b2) * g * g
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    return p - (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + eps), None, m, v


@st.composite
def apply_calls(draw) -> Call:
    sizes = _sizes(draw)
    opt = draw(st.sampled_from(["none", "sgd", "adam", "adamw"]))
    acc_dt = draw(st.sampled_from(["float32", "float64"]))
    p_dt = draw(st.sampled_from(["float32", "float32", "float16"]))
    accs = [_array(draw, n, acc_dt, True) for n in sizes]
    params = [_array(draw, n, p_dt, False) for n in sizes]
    momentum = draw(st.sampled_from([0.0, 0.9])) if opt == "sgd" else 0.0
    s1 = [np.zeros(n, p_dt) + 0.01 for n in sizes] if (opt != "sgd" or momentum) else None
    s2 = [np.zeros(n, p_dt) + 0.02 for n in sizes] if opt in ("adam", "adamw") else None
    if opt == "none":
        params, s1, s2 = None, None, None
    grad_scale, skind = _scalar(draw)
    lr = draw(st.sampled_from([0.1, 1e-3, 1.0]))
    wd = draw(st.sampled_from([0.0, 0.01]))
    skip = draw(st.booleans())
    step = draw(st.integers(1, 3))
    fault = _inject(
        draw, _fault_kind(draw), accs, params or [], "accumulators", "params", "float16"
    )
    if skind == "invalid":
        fault.append("grad_scale")
    a0 = [a.astype(np.float64) for a in accs]
    p0 = [p.astype(np.float64) for p in params] if params else None
    bufs = accs + (params or []) + (s1 or []) + (s2 or [])

    def run():
        kw = {"state1": s1, "state2": s2} if opt != "none" else {}
        return core.apply(
            params,
            accs,
            optimizer=opt,
            lr=lr,
            grad_scale=grad_scale,
            weight_decay=wd if opt != "none" else 0.0,
            momentum=momentum,
            skip_nonfinite=skip,
            step=step,
            reset=opt != "none",
            **kw,
        )

    def check(result):
        refs = []
        with np.errstate(all="ignore"):
            for i, a in enumerate(a0):
                g = a * grad_scale
                p = p0[i] if p0 else None
                first = 0.01 + np.zeros_like(g)  # the states' initial values
                if opt == "sgd":
                    refs.append(
                        _ref_update(
                            opt,
                            p,
                            g,
                            first if momentum else None,
                            None,
                            lr=lr,
                            wd=wd,
                            momentum=momentum,
                            step=step,
                        )
                    )
                else:
                    refs.append(
                        _ref_update(
                            opt, p, g, first, first + 0.01, lr=lr, wd=wd, momentum=0.0, step=step
                        )
                    )
        # What the update would store, rounded to its dtypes: all finite, or a skip.
        finite = True
        for i, (p_ref, g_ref, s1_ref, s2_ref) in enumerate(refs):
            for r, like in ((p_ref, params), (g_ref, accs), (s1_ref, s1), (s2_ref, s2)):
                if r is not None and like is not None:
                    with np.errstate(over="ignore", invalid="ignore"):
                        finite &= bool(np.all(np.isfinite(r.astype(like[i].dtype))))
        if skip and not finite:
            assert result.skipped
            return
        assert not result.skipped
        for i, (p_ref, g_ref, s1_ref, s2_ref) in enumerate(refs):
            if opt == "none":
                _assert_stored(accs[i], g_ref, f"accumulators[{i}]")
                continue
            _assert_stored(params[i], p_ref, f"params[{i}]")
            if s1 is not None and s1_ref is not None:
                _assert_stored(s1[i], s1_ref, f"state1[{i}]")
            if s2 is not None:
                _assert_stored(s2[i], s2_ref, f"state2[{i}]")
            np.testing.assert_array_equal(accs[i], 0.0)

    may = ["grad_scale"] if skind == "extreme" else []
    return Call(bufs, run, check, fault, may)


@st.composite
def adaptive_clip_calls(draw) -> Call:
    sizes = [
        draw(st.integers(1, 4)) * draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 3)))
    ]
    g_dt = draw(st.sampled_from(["float32", "float64"]))
    params = [_array(draw, n, "float32", False) for n in sizes]
    grads = [_array(draw, n, g_dt, False) for n in sizes]
    clip_factor, ckind = _scalar(draw, allow_extreme=False)
    fault = _inject(draw, _fault_kind(draw), grads, params, "grads", "params", "float16")
    if ckind == "invalid" or clip_factor <= 0:
        fault.append("clip_factor")
    p0 = [p.astype(np.float64) for p in params]
    g0 = [g.astype(np.float64) for g in grads]

    def run():
        core.adaptive_clip(params, grads, clip_factor=clip_factor, eps=1e-3, layout="trailing")

    def check(_):
        for i, (p, g) in enumerate(zip(p0, g0)):
            # "trailing": Keras layout, the last axis holds the units; a 1-D tensor is one unit.
            pn = max(math.sqrt(float(np.sum(p * p))), 1e-3) * clip_factor
            gn = math.sqrt(float(np.sum(g * g)))
            ref = g if gn <= pn else g * (pn / max(gn, 1e-6))
            _assert_stored(grads[i], ref, f"grads[{i}]")

    return Call(params + grads, run, check, fault, [])


@st.composite
def sum_of_squares_calls(draw) -> Call:
    sizes = _sizes(draw)
    ts = [
        _array(draw, n, draw(st.sampled_from(["float32", "float64", "float16"])), True)
        for n in sizes
    ]
    t0 = [t.astype(np.float64) for t in ts]

    def run():
        return core.sum_of_squares(ts)

    def check(result):
        with np.errstate(all="ignore"):
            want = sum(float(np.sum(t * t)) for t in t0)
        if math.isnan(want):
            assert math.isnan(result)
        else:
            assert result == pytest.approx(want, rel=1e-12, abs=0)

    return Call(ts, run, check, [], [])


# ---- the property ----------------------------------------------------------------------------


def _run(call: Call) -> None:
    before = [b.tobytes() for b in call.buffers]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = call.run()
    except (ValueError, TypeError) as e:
        named = call.fault + call.may_refuse
        assert named, f"an ordinary call was refused: {e!r}"
        assert any(
            re.search(re.escape(n) + r"(\W|$)", str(e)) for n in named
        ), f"the error does not name one of {named}: {e}"
        for i, (b, a) in enumerate(zip(before, call.buffers)):
            assert a.tobytes() == b, f"buffer {i} changed by a refused call ({e})"
        event("refused: fault" if call.fault else "refused: precision")
        return
    assert not call.fault, f"a call with a fault at {call.fault} was accepted"
    call.check(result)
    event("matched the reference" + (" (extreme scalar)" if call.may_refuse else ""))


@FUZZ
@given(accumulate_calls())
def test_fuzz_accumulate(call):
    _run(call)


@FUZZ
@given(apply_calls())
def test_fuzz_apply(call):
    _run(call)


@FUZZ
@given(adaptive_clip_calls())
def test_fuzz_adaptive_clip(call):
    _run(call)


@FUZZ
@given(sum_of_squares_calls())
def test_fuzz_sum_of_squares(call):
    _run(call)
