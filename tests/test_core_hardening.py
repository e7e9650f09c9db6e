"""Hardening of the core: overflow-checked sizes, scalars kept in the precision they are used
in, float64 computed in float64, skip_nonfinite catching every non-finite result, and no write
into what the caller cannot have written (immutable or negative-bit tensors).

Every refusal is a ValueError/TypeError naming the argument, with every buffer unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_unchanged, need_torch, ref_adam, ref_agc, snapshot

from gradient_accumulator import core
from gradient_accumulator._loader import load_core

F32, F64 = np.float32, np.float64


# ---- sizes ---------------------------------------------------------------------------------


def test_arena_plan_whose_total_overflows_is_refused():
    with pytest.raises(ValueError, match=r"numels\[0\]"):
        core.arena_plan([2**63 - 4, 16], reverse=False)
    with pytest.raises(ValueError, match=r"numels\[0\]"):
        load_core().arena_plan([2**63 - 4, 16], 16, 4, False)  # rounding up wraps
    with pytest.raises(ValueError, match=r"numels\[1\]"):
        load_core().arena_plan([2**62, 2**62], 16, 4, False)  # the running total wraps
    with pytest.raises(ValueError, match=r"numels\[0\]"):
        core.arena_plan([2**63, 1])
    plan = core.arena_plan([2**40, 3], alignment=16, reverse=False)
    assert plan.offsets == [0, 2**40] and plan.total == 2**40 + 16


def test_bn_moments_whose_shape_product_overflows_is_refused():
    # outer·channels·inner = 2^62·4 wraps to 0 = x's size: it must not pass as consistent.
    x = np.zeros(0, F32)
    mean, m2 = np.full(4, 7.0, F32), np.full(4, 7.0, F32)
    before = snapshot([mean, m2])
    with pytest.raises(ValueError, match="channels|inner"):
        load_core().bn_moments(x, 2**62, 4, 1, mean, m2)
    assert_unchanged(before, [mean, m2])


# ---- scalars in the precision they are used in ---------------------------------------------


@pytest.mark.parametrize("weight", [1e40, 1e-46, 1e-40])
def test_weight_outside_float32_is_refused_for_float32_accumulators(weight):
    acc, g = [np.full(5, 2.0, F32)], [np.full(5, 3.0, F32)]
    before = snapshot(acc)
    with pytest.raises(ValueError, match="weight"):
        core.accumulate(acc, g, weight=weight)
    assert_unchanged(before, acc)


def test_weight_outside_float32_is_used_in_double_for_float64_accumulators():
    acc, g = [np.full(5, 2.0, F64)], [np.full(5, 3.0, F64)]
    core.accumulate(acc, g, weight=1e40)
    assert_close(acc[0], 2.0 + 3e40, "float64")
    acc2 = [np.zeros(3, F64)]
    core.accumulate(acc2, [np.full(3, 1e30, F64)], weight=1e-46)
    assert_close(acc2[0] / 1e-16, np.ones(3), "float64")


@pytest.mark.parametrize("grad_scale", [1e-46, 1e40, -1e39])
def test_grad_scale_outside_float32_is_refused_for_float32_accumulators(grad_scale):
    params, accs = [np.ones(6, F32)], [np.full(6, 0.5, F32)]
    before = snapshot(params + accs)
    with pytest.raises(ValueError, match="grad_scale"):
        core.apply(params, accs, optimizer="sgd", lr=0.1, grad_scale=grad_scale)
    assert_unchanged(before, params + accs)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("lr", {"lr": 1e-50}),
        ("lr", {"lr": 1e39}),
        ("weight_decay", {"weight_decay": 1e-45}),
        ("momentum", {"momentum": 1e-39}),
    ],
)
def test_optimizer_scalars_outside_float32_are_refused(name, kwargs):
    params, accs = [np.ones(6, F32)], [np.full(6, 0.5, F32)]
    state = [np.zeros(6, F32)]
    kwargs = {"lr": 0.1, **kwargs}
    before = snapshot(params + accs + state)
    with pytest.raises(ValueError, match=name):
        core.apply(params, accs, optimizer="sgd", state1=state, **kwargs)
    assert_unchanged(before, params + accs + state)


# ---- float64 computed in float64 -----------------------------------------------------------


def test_float64_accumulators_apply_in_float64_for_optimizer_none():
    acc = [np.array([1.0 + 2.0**-40, 1e300, -3e-300, 7.0], F64)]
    out = [np.zeros(4, F64)]
    core.apply(None, acc, optimizer="none", grad_scale=1.0, grads_out=out)
    np.testing.assert_array_equal(out[0], [1.0 + 2.0**-40, 1e300, -3e-300, 7.0])
    acc = [np.array([1e300, 2e300], F64)]
    core.apply(None, acc, optimizer="none", grad_scale=1e-300, reset=False)  # in place
    np.testing.assert_allclose(acc[0], [1.0, 2.0], rtol=1e-15)


def test_float64_accumulators_drive_float32_params_in_float64():
    # 1e300 · 1e-300 = 1: in float32 that is inf · 0 = NaN.
    params = [np.full(3, 2.0, F32)]
    acc = [np.full(3, 1e300, F64)]
    m, v = [np.zeros(3, F32)], [np.zeros(3, F32)]
    core.apply(
        params,
        acc,
        optimizer="adamw",
        lr=0.01,
        grad_scale=1e-300,
        state1=m,
        state2=v,
        weight_decay=0.1,
    )
    p_ref, m_ref, v_ref = ref_adam(
        np.full(3, 2.0),
        np.ones(3),
        np.zeros(3),
        np.zeros(3),
        lr=0.01,
        weight_decay=0.1,
        decoupled=True,
    )
    assert_close(params[0], p_ref, "float32")
    assert_close(m[0], m_ref, "float32")
    assert_close(v[0], v_ref, "float32")
    np.testing.assert_array_equal(acc[0], 0.0)


def test_adaptive_clip_on_float64_grads_computes_in_float64():
    p = [np.full((2, 3), 0.5, F32)]
    # Unit 0's norm and its coefficient (~1e-153) exist only in double; float32 reads inf · 0.
    g = [np.array([[1e150, -1e150, 1e150], [1.0 + 2.0**-40, 0.0, 1e-3]], F64)]
    g0 = g[0].copy()
    core.adaptive_clip(p, g, clip_factor=0.01, eps=1e-3)
    expect = ref_agc(p[0], g0, clip_factor=0.01, eps=1e-3)
    assert np.all(np.isfinite(g[0]))
    np.testing.assert_allclose(g[0], expect, rtol=1e-12)


# ---- skip_nonfinite catches every non-finite result ----------------------------------------


def _adam_case(acc_value, grad_scale=1.0, dtype=F32):
    params = [np.ones(8, dtype)]
    accs = [np.full(8, acc_value, F32)]
    s1, s2 = [np.zeros(8, dtype)], [np.zeros(8, dtype)]
    return params, accs, s1, s2, grad_scale


@pytest.mark.parametrize(
    ("acc_value", "grad_scale", "why"),
    [
        (1e22, 1.0, "Adam's (1 − β2)·g² overflows float32"),
        (1e30, 1e10, "the scaled gradient overflows float32"),
    ],
)
def test_skip_nonfinite_catches_overflow_inside_the_update(acc_value, grad_scale, why):
    params, accs, s1, s2, scale = _adam_case(acc_value, grad_scale)
    before = snapshot(params + s1 + s2)
    r = core.apply(
        params,
        accs,
        optimizer="adam",
        lr=1e-3,
        grad_scale=scale,
        state1=s1,
        state2=s2,
        skip_nonfinite=True,
    )
    assert r.skipped, why
    assert_unchanged(before, params + s1 + s2)
    np.testing.assert_array_equal(accs[0], 0.0)  # reset, as for any skipped cycle


def test_skip_nonfinite_catches_a_float16_store_out_of_range():
    torch = need_torch()
    params = [torch.ones(8, dtype=torch.float16)]
    accs = [np.full(8, 1e5, F32)]  # p − lr·g = −99999: beyond float16's 65504
    before = snapshot(params)
    r = core.apply(params, accs, optimizer="sgd", lr=1.0, skip_nonfinite=True, reset=False)
    assert r.skipped
    assert_unchanged(before, params)
    np.testing.assert_array_equal(accs[0], 1e5)


def test_skip_nonfinite_applies_a_finite_update_unchanged():
    params, accs, s1, s2, _ = _adam_case(0.25)
    p2, a2, t1, t2, _ = _adam_case(0.25)
    r = core.apply(
        params, accs, optimizer="adam", lr=1e-3, state1=s1, state2=s2, skip_nonfinite=True
    )
    core.apply(p2, a2, optimizer="adam", lr=1e-3, state1=t1, state2=t2)
    assert not r.skipped
    for x, y in zip(params + s1 + s2, p2 + t1 + t2):
        np.testing.assert_array_equal(x, y)  # the dry run changes nothing in the result


# ---- nothing written that must not be --------------------------------------------------------


def test_jax_arrays_are_never_written():
    jnp = pytest.importorskip("jax.numpy")
    acc = jnp.ones(4, dtype=jnp.float32)
    g = [np.full(4, 2.0, F32)]
    with pytest.raises(ValueError, match=r"accumulators\[0\].*JAX"):
        core.accumulate([acc], g)
    np.testing.assert_array_equal(np.asarray(acc), 1.0)
    out = [np.zeros(4, F32)]
    core.accumulate(out, [acc], overwrite=True)  # read as a gradient: fine
    np.testing.assert_array_equal(out[0], 1.0)


def test_tensorflow_tensors_are_never_written():
    tf = pytest.importorskip("tensorflow")
    acc = tf.constant(np.ones(4, F32))
    with pytest.raises(ValueError, match=r"accumulators\[0\].*TensorFlow"):
        core.accumulate([acc], [np.full(4, 2.0, F32)])
    np.testing.assert_array_equal(acc.numpy(), 1.0)


def test_torch_inference_tensors_are_written_only_inside_inference_mode():
    torch = need_torch()
    with torch.inference_mode():
        acc = torch.ones(4)
    g = [torch.full((4,), 2.0)]
    with pytest.raises(ValueError, match=r"accumulators\[0\].*inference"):
        core.accumulate([acc], g)
    np.testing.assert_array_equal(acc.numpy(), 1.0)
    with torch.inference_mode():
        core.accumulate([acc], g)  # where torch itself allows in-place updates
    np.testing.assert_array_equal(acc.numpy(), 3.0)


def test_torch_negative_bit_views_are_read_with_their_sign_and_never_written():
    torch = need_torch()
    base = torch.arange(1.0, 5.0)
    neg = base._neg_view()
    assert neg.is_neg()
    acc = [torch.zeros(4)]
    core.accumulate(acc, [neg])
    np.testing.assert_array_equal(acc[0].numpy(), [-1.0, -2.0, -3.0, -4.0])
    z = torch.complex(torch.zeros(4), torch.arange(1.0, 5.0))
    imag = z.conj().imag  # a negative-bit view of z's imaginary parts
    acc = [torch.zeros(4)]
    core.accumulate(acc, [imag])
    np.testing.assert_array_equal(acc[0].numpy(), [-1.0, -2.0, -3.0, -4.0])
    with pytest.raises(ValueError, match=r"accumulators\[0\].*negative-bit"):
        core.accumulate([neg], [torch.ones(4)])
    np.testing.assert_array_equal(base.numpy(), [1.0, 2.0, 3.0, 4.0])
