"""core.apply: SGD / Adam / AdamW against fp64 NumPy and torch.optim; clipping, AGC, skip, reset."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_unchanged,
    make,
    need_torch,
    ref_adam,
    ref_agc,
    ref_clip_coef,
    ref_global_norm,
    ref_sgd,
    rng,
    snapshot,
    to_f64,
)

from gradient_accumulator import core

# includes a tensor spanning two 16384-element chunks
SHAPES = [(5, 7), (13,), (3, 2, 4), (20_000,)]
F32 = np.float32


def _params(seed: int, shapes=SHAPES):
    r = rng(seed)
    return [r.standard_normal(s).astype(F32) for s in shapes]


def _accs(r: np.random.Generator, shapes=SHAPES, scale: float = 0.3):
    # O(0.1) gradients: fp32 rounding differences between the core and torch (FMA or not) stay
    # below the absolute tolerance even where momentum terms cancel
    return [(r.uniform(-1.0, 1.0, s) * scale).astype(F32) for s in shapes]


def _torch_copy(arrays):
    torch = need_torch()
    return [torch.tensor(a, requires_grad=True) for a in arrays]


def _set_torch_grads(tparams, accs, grad_scale):
    torch = need_torch()
    for tp, a in zip(tparams, accs):
        tp.grad = torch.from_numpy(a.copy()) * grad_scale  # fp32 product, like the core's


def _torch_clip(tparams, max_norm):
    torch = need_torch()
    if max_norm is not None:
        return float(torch.nn.utils.clip_grad_norm_(tparams, max_norm, foreach=False))
    return None


def _ref_grads(accs, grad_scale, max_norm):
    g = [to_f64(a) * grad_scale for a in accs]
    if max_norm is not None:
        coef = ref_clip_coef(ref_global_norm(g), max_norm)
        g = [x * coef for x in g]
    return g


SGD_CONFIGS = {
    "plain": dict(momentum=0.0),
    "momentum": dict(momentum=0.9),
    "dampening": dict(momentum=0.9, dampening=0.3),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "weight_decay": dict(momentum=0.5, weight_decay=0.01),
    "maximize_wd": dict(momentum=0.0, weight_decay=0.1, maximize=True),
    "all": dict(momentum=0.8, nesterov=True, weight_decay=0.02, maximize=True),
    "clip": dict(momentum=0.9, max_norm=1.0),
}


@pytest.mark.parametrize("name", list(SGD_CONFIGS))
def test_sgd_matches_fp64_and_torch(name):
    torch = need_torch()
    cfg = dict(SGD_CONFIGS[name])
    max_norm = cfg.pop("max_norm", None)
    lr, grad_scale = 0.1, 1.0 / 3.0
    r = rng(1)
    params = _params(0)
    tparams = _torch_copy(params)
    opt = torch.optim.SGD(tparams, lr=lr, foreach=False, **cfg)
    # garbage in the momentum buffers: the first step (momentum_initialized=False) ignores it
    bufs = [np.full(p.shape, np.nan, F32) for p in params] if cfg["momentum"] else None
    ref_p, ref_b = [to_f64(p) for p in params], [None] * len(params)
    for step in range(4):
        accs = _accs(r)
        _set_torch_grads(tparams, accs, grad_scale)
        g = _ref_grads(accs, grad_scale, max_norm)
        for i in range(len(params)):
            ref_p[i], ref_b[i] = ref_sgd(ref_p[i], g[i], ref_b[i], lr=lr, first=step == 0, **cfg)
        res = core.apply(
            params,
            accs,
            optimizer="sgd",
            lr=lr,
            grad_scale=grad_scale,
            state1=bufs,
            max_norm=max_norm,
            momentum_initialized=step > 0,
            **cfg,
        )
        total = _torch_clip(tparams, max_norm)
        opt.step()
        assert res.skipped is False
        if max_norm is None:
            assert res.grad_norm is None and res.clip_coef is None
        else:
            assert res.grad_norm == pytest.approx(total, rel=1e-5)
            assert res.clip_coef < 1.0  # the accumulators are large enough to be clipped
        for i, p in enumerate(params):
            assert_close(p, tparams[i], "torch", err_msg=f"param {i} step {step}")
            assert_close(p, ref_p[i], "float32", err_msg=f"param {i} step {step}")
            np.testing.assert_array_equal(accs[i], 0.0)  # reset in the same pass
            if cfg["momentum"]:
                tb = opt.state[tparams[i]]["momentum_buffer"]
                assert_close(bufs[i], tb, "torch", err_msg=f"buffer {i} step {step}")
                assert_close(bufs[i], ref_b[i], "float32", err_msg=f"buffer {i} step {step}")


ADAM_CONFIGS = {
    "adam": ("adam", dict()),
    "adam_wd": ("adam", dict(weight_decay=0.05)),
    "adam_betas_max": ("adam", dict(betas=(0.8, 0.95), eps=1e-6, maximize=True)),
    "adamw": ("adamw", dict(weight_decay=0.05)),
    "adamw_no_wd": ("adamw", dict()),
    "adamw_all": ("adamw", dict(weight_decay=0.1, betas=(0.5, 0.9), maximize=True)),
    "adamw_clip": ("adamw", dict(weight_decay=0.01, max_norm=2.0)),
}


@pytest.mark.parametrize("name", list(ADAM_CONFIGS))
def test_adam_matches_fp64_and_torch(name):
    torch = need_torch()
    optimizer, cfg = ADAM_CONFIGS[name]
    cfg = dict(cfg)
    max_norm = cfg.pop("max_norm", None)
    cfg.setdefault("weight_decay", 0.0)  # torch's AdamW defaults to 0.01; be explicit
    lr, grad_scale = 0.01, 0.25
    r = rng(2)
    params = _params(3)
    tparams = _torch_copy(params)
    cls = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
    opt = cls(tparams, lr=lr, foreach=False, **cfg)
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    ref = [(to_f64(p), np.zeros(p.shape), np.zeros(p.shape)) for p in params]
    for step in range(1, 6):
        accs = _accs(r)
        _set_torch_grads(tparams, accs, grad_scale)
        g = _ref_grads(accs, grad_scale, max_norm)
        ref = [
            ref_adam(rp, gi, rm, rv, lr=lr, step=step, decoupled=optimizer == "adamw", **cfg)
            for (rp, rm, rv), gi in zip(ref, g)
        ]
        res = core.apply(
            params,
            accs,
            optimizer=optimizer,
            lr=lr,
            grad_scale=grad_scale,
            state1=m,
            state2=v,
            step=step,
            max_norm=max_norm,
            **cfg,
        )
        total = _torch_clip(tparams, max_norm)
        opt.step()
        assert res.skipped is False
        if max_norm is not None:
            assert res.grad_norm == pytest.approx(total, rel=1e-5)
        for i, p in enumerate(params):
            st = opt.state[tparams[i]]
            assert int(st["step"]) == step
            what = f"tensor {i} step {step}"
            assert_close(p, tparams[i], "torch", err_msg="param " + what)
            assert_close(m[i], st["exp_avg"], "torch", err_msg="exp_avg " + what)
            assert_close(v[i], st["exp_avg_sq"], "torch", err_msg="exp_avg_sq " + what)
            assert_close(p, ref[i][0], "float32", err_msg="param " + what)
            assert_close(m[i], ref[i][1], "float32", err_msg="exp_avg " + what)
            assert_close(v[i], ref[i][2], "float32", err_msg="exp_avg_sq " + what)
            np.testing.assert_array_equal(accs[i], 0.0)


def test_adam_step_sets_the_bias_correction():
    p1, p3 = _params(4), _params(4)
    acc = _accs(rng(5))
    kw = dict(optimizer="adam", lr=0.1, reset=False)
    core.apply(
        p1,
        acc,
        state1=[np.zeros_like(p) for p in p1],
        state2=[np.zeros_like(p) for p in p1],
        step=1,
        **kw,
    )
    core.apply(
        p3,
        acc,
        state1=[np.zeros_like(p) for p in p3],
        state2=[np.zeros_like(p) for p in p3],
        step=3,
        **kw,
    )
    for a, b, p0, g in zip(p1, p3, _params(4), acc):
        assert_close(a, ref_adam(p0, g, 0, 0, lr=0.1, step=1)[0], "float32")
        assert_close(b, ref_adam(p0, g, 0, 0, lr=0.1, step=3)[0], "float32")
        assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_global_norm_clip_matches_clip_grad_norm(max_norm):
    torch = need_torch()
    accs = _accs(rng(6))
    grad_scale = 0.25
    tparams = _torch_copy([np.zeros_like(a) for a in accs])
    _set_torch_grads(tparams, accs, grad_scale)
    total = float(torch.nn.utils.clip_grad_norm_(tparams, max_norm, foreach=False))
    out = [np.full_like(a, np.nan) for a in accs]
    norm = ref_global_norm(accs) * grad_scale
    res = core.apply(
        None,
        [a.copy() for a in accs],
        optimizer="none",
        grad_scale=grad_scale,
        grads_out=out,
        max_norm=max_norm,
    )
    assert res.skipped is False
    assert res.grad_norm == pytest.approx(norm, rel=1e-12)
    assert res.grad_norm == pytest.approx(total, rel=1e-5)
    assert res.clip_coef == pytest.approx(ref_clip_coef(norm, max_norm), rel=1e-12)
    for o, tp, a in zip(out, tparams, accs):
        assert_close(o, tp.grad, "torch")
        assert_close(o, to_f64(a) * grad_scale * ref_clip_coef(norm, max_norm), "float32")
    if max_norm < norm:
        assert core.global_norm(out) == pytest.approx(max_norm, rel=1e-5)
    else:
        assert res.clip_coef == 1.0
        for o, a in zip(out, accs):
            np.testing.assert_array_equal(o, a * F32(grad_scale))


def test_precomputed_clip_coefficient():
    accs = _accs(rng(7))
    out = [np.empty_like(a) for a in accs]
    res = core.apply(
        None,
        [a.copy() for a in accs],
        optimizer="none",
        grad_scale=0.5,
        grads_out=out,
        clip_coef=np.array([0.25], F32),
    )
    assert res.clip_coef == 0.25 and res.grad_norm is None
    for o, a in zip(out, accs):
        np.testing.assert_array_equal(o, a * F32(0.125))  # exact: powers of two


@pytest.mark.parametrize("layout", ["leading", "trailing"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_agc_in_apply(layout, kind):
    shapes = [(8, 4, 3, 3), (6, 5), (6,)] if layout == "leading" else [(3, 3, 4, 8), (5, 6), (6,)]
    r = rng(8)
    p_np = [r.standard_normal(s).astype(F32) for s in shapes]
    # gradients growing along the first axis: some units pass, others are clipped
    a_np = []
    for s in shapes:
        ramp = np.linspace(0.001, 3, s[0]).reshape((-1,) + (1,) * (len(s) - 1))
        a_np.append((r.standard_normal(s) * ramp).astype(F32))
    params = [make(p, "float32", kind) for p in p_np]
    accs = [make(a, "float32", kind) for a in a_np]
    lr, grad_scale, cf, eps = 0.5, 2.0, 0.05, 1e-2
    g = [
        ref_agc(p, to_f64(a) * grad_scale, clip_factor=cf, eps=eps, layout=layout)
        for p, a in zip(p_np, a_np)
    ]
    assert any(np.abs(gi - to_f64(a) * grad_scale).max() > 1e-3 for gi, a in zip(g, a_np))
    # the same rule written to grads_out, then applied with SGD
    out = [np.empty_like(a) for a in a_np]
    core.apply(
        params,
        [make(a, "float32", kind) for a in a_np],
        optimizer="none",
        grad_scale=grad_scale,
        grads_out=out,
        agc=True,
        clip_factor=cf,
        agc_eps=eps,
        layout=layout,
    )
    core.apply(
        params,
        accs,
        optimizer="sgd",
        lr=lr,
        grad_scale=grad_scale,
        agc=True,
        clip_factor=cf,
        agc_eps=eps,
        layout=layout,
    )
    for i in range(len(shapes)):
        assert_close(out[i], g[i], "float32")
        assert_close(params[i], to_f64(p_np[i]) - lr * g[i], "float32")
        np.testing.assert_array_equal(to_f64(accs[i]), 0.0)


def test_agc_apply_equals_adaptive_clip():
    r = rng(9)
    p = [r.standard_normal((6, 10)).astype(F32), r.standard_normal(4).astype(F32)]
    a = [(r.standard_normal((6, 10)) * 5).astype(F32), (r.standard_normal(4) * 5).astype(F32)]
    g = [x.copy() for x in a]
    core.adaptive_clip(p, g, clip_factor=0.03, eps=1e-3)
    out = [np.empty_like(x) for x in a]
    core.apply(p, a, optimizer="none", grads_out=out, agc=True, clip_factor=0.03, agc_eps=1e-3)
    for x, y in zip(g, out):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("reset", [True, False])
@pytest.mark.parametrize("clip", ["none", "max_norm", "agc"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_skip_nonfinite(optimizer, reset, clip, bad):
    params = _params(10)
    accs = _accs(rng(11))
    accs[3][17_000] = bad  # in the second chunk of the last tensor
    s1 = [np.full_like(p, 0.5) for p in params]
    s2 = [np.full_like(p, 0.25) for p in params]
    kept = snapshot(params + s1 + s2)
    acc_before = snapshot(accs)
    kw = dict(max_norm=1.0) if clip == "max_norm" else dict(agc=clip == "agc")
    res = core.apply(
        params,
        accs,
        optimizer=optimizer,
        lr=0.1,
        momentum=0.9,
        state1=s1,
        state2=s2,
        step=2,
        skip_nonfinite=True,
        reset=reset,
        **kw,
    )
    assert res.skipped is True
    assert_unchanged(kept, params + s1 + s2)
    if reset:
        for a in accs:
            np.testing.assert_array_equal(a, 0.0)
    else:
        assert_unchanged(acc_before, accs)


def test_skip_nonfinite_with_finite_gradients_updates():
    params = _params(12)
    p0 = [p.copy() for p in params]
    accs = _accs(rng(13))
    norm = ref_global_norm(accs) * 0.5
    expect = [to_f64(p) - 0.1 * 0.5 * to_f64(a) for p, a in zip(p0, accs)]
    res = core.apply(params, accs, optimizer="sgd", lr=0.1, grad_scale=0.5, skip_nonfinite=True)
    assert res.skipped is False
    assert res.grad_norm == pytest.approx(norm, rel=1e-12)
    for p, e in zip(params, expect):
        assert_close(p, e, "float32")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_reset_false_keeps_the_accumulators(optimizer):
    params = _params(14)
    accs = _accs(rng(15))
    before = snapshot(accs)
    s = [np.zeros_like(p) for p in params]
    core.apply(
        params,
        accs,
        optimizer=optimizer,
        lr=0.1,
        state1=s,
        state2=[np.zeros_like(p) for p in params],
        reset=False,
    )
    assert_unchanged(before, accs)
    assert max(np.abs(p - q).max() for p, q in zip(params, _params(14))) > 1e-3


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("torch", "bfloat16"),
        ("torch", "float16"),
        ("numpy", "float16"),
        ("numpy", "float32"),
        ("numpy", "float64"),
    ],
)
def test_optimizer_none_writes_grads_out_in_any_dtype(kind, dtype):
    accs = _accs(rng(16))
    before = [a.copy() for a in accs]
    out = [make(np.full(a.shape, 7.0), dtype, kind) for a in accs]
    res = core.apply(None, accs, optimizer="none", grad_scale=0.3, grads_out=out)
    assert res == core.ApplyResult(False, None, None)
    for o, a, b in zip(out, accs, before):
        expect = to_f64(b * F32(0.3))  # the fp32 product, then one rounding to the out dtype
        assert_close(o, expect, dtype)
        if kind == "torch":
            torch = need_torch()
            ref = (torch.from_numpy(b) * 0.3).to(getattr(torch, dtype))
            np.testing.assert_array_equal(to_f64(o), to_f64(ref))  # same round-to-nearest-even
        np.testing.assert_array_equal(a, 0.0)


def test_optimizer_none_in_place():
    accs = _accs(rng(17))
    expect = [a * F32(0.25) for a in accs]
    core.apply(None, accs, optimizer="none", grad_scale=0.25, reset=False)
    for a, e in zip(accs, expect):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_bf16_params(optimizer, state_dtype):
    torch = need_torch()
    r = rng(18)
    shapes = [(9, 5), (20_000,)]
    params = [make(r.standard_normal(s), "bfloat16", "torch").requires_grad_() for s in shapes]
    s1 = [make(np.zeros(s), state_dtype, "torch") for s in shapes]
    s2 = [make(np.zeros(s), state_dtype, "torch") for s in shapes]
    lr = 0.1
    hp = dict(momentum=0.9, weight_decay=0.01) if optimizer == "sgd" else dict(weight_decay=0.01)
    for step in range(1, 4):
        accs = [torch.from_numpy(a) for a in _accs(r, shapes, scale=3.0)]
        p0, m0, v0 = [to_f64(p) for p in params], [to_f64(x) for x in s1], [to_f64(x) for x in s2]
        g = [to_f64(a) * 0.5 for a in accs]
        core.apply(
            params,
            accs,
            optimizer=optimizer,
            lr=lr,
            grad_scale=0.5,
            state1=s1,
            state2=s2,
            step=step,
            momentum_initialized=step > 1,
            **hp,
        )
        for i in range(len(shapes)):
            assert params[i].dtype == torch.bfloat16 and s1[i].dtype == getattr(torch, state_dtype)
            if optimizer == "sgd":
                ep, em = ref_sgd(p0[i], g[i], m0[i], lr=lr, first=step == 1, **hp)
            else:
                ep, em, ev = ref_adam(
                    p0[i],
                    g[i],
                    m0[i],
                    v0[i],
                    lr=lr,
                    step=step,
                    decoupled=optimizer == "adamw",
                    **hp,
                )
                assert_close(s2[i], ev, state_dtype)
            assert_close(params[i], ep, "bfloat16")
            assert_close(s1[i], em, state_dtype)
            # the update is several bf16 ulps: an update that did nothing would fail above
            assert np.mean(to_f64(params[i]) != p0[i]) > 0.5


def test_fp16_params_with_fp32_state():
    r = rng(19)
    p = [r.standard_normal((4, 6)).astype(np.float16)]
    p0 = to_f64(p[0])
    acc = [r.uniform(-1, 1, (4, 6)).astype(F32)]
    m = [np.zeros((4, 6), F32)]
    v = [np.zeros((4, 6), F32)]
    ep, em, ev = ref_adam(p0, acc[0], 0.0, 0.0, lr=0.05, step=1)
    core.apply(p, acc, optimizer="adam", lr=0.05, state1=m, state2=v, step=1)
    assert_close(p[0], ep, "float16")
    assert_close(m[0], em, "float32")
    assert_close(v[0], ev, "float32")


def test_apply_returns_nothing_computed_by_default():
    res = core.apply(_params(20), _accs(rng(21)), optimizer="sgd", lr=0.1)
    assert res == core.ApplyResult(skipped=False, grad_norm=None, clip_coef=None)
