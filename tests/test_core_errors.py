"""Bad input: every public core function raises ValueError/TypeError naming the argument and
leaves every buffer exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_unchanged, need_torch, snapshot

from gradient_accumulator import core

F32 = np.float32
CASES = []


def case(case_id: str, exc: type, match: str):
    """Register a builder returning (call, buffers) for a call that must fail."""

    def register(build):
        CASES.append(pytest.param(build, exc, match, id=case_id))
        return build

    return register


def f32(*shape, fill=1.0):
    return np.full(shape, fill, F32)


def read_only(a):
    a.flags.writeable = False
    return a


def overlap(a: str, b: str) -> str:
    """A message that names both aliasing buffers, in either order."""
    a, b = a.replace("[", r"\[").replace("]", r"\]"), b.replace("[", r"\[").replace("]", r"\]")
    return rf"({a} overlaps {b}|{b} overlaps {a})"


# ---- accumulate ----
# two accumulators of 4 and 5 elements; an accepted call would change them


def acc_pair():
    return [f32(4), f32(5)], [f32(4, fill=2.0), f32(5, fill=3.0)]


def acc_call(accs, grads, **kw):
    return lambda: core.accumulate(accs, grads, weight=1.0, **kw)


@case("accumulate-accumulators-not-a-list", TypeError, "accumulators must be a list or tuple")
def _():
    a, g = acc_pair()
    return acc_call(a[0], g[:1]), a + g


@case("accumulate-grads-a-string", TypeError, "grads must be a list or tuple")
def _():
    a, g = acc_pair()
    return acc_call(a, "grads"), a + g


@case("accumulate-grads-a-dict", TypeError, "grads must be a list or tuple")
def _():
    a, g = acc_pair()
    return acc_call(a, {0: g[0], 1: g[1]}), a + g


@case("accumulate-accumulators-none", TypeError, "accumulators must be a list or tuple")
def _():
    a, g = acc_pair()
    return acc_call(None, g), a + g


@case("accumulate-grad-none", TypeError, r"grads\[1\] is None")
def _():
    a, g = acc_pair()
    return acc_call(a, [g[0], None]), a + g


@case("accumulate-no-dlpack", TypeError, r"grads\[1\] of type object does not support DLPack")
def _():
    a, g = acc_pair()
    return acc_call(a, [g[0], object()]), a + g


@case("accumulate-python-list-item", TypeError, r"accumulators\[1\] of type list")
def _():
    a, g = acc_pair()
    return acc_call([a[0], [1.0] * 5], g), a + g


@case("accumulate-length-mismatch", ValueError, "grads has 1 tensors but accumulators has 2")
def _():
    a, g = acc_pair()
    return acc_call(a, g[:1]), a + g


@case("accumulate-size-mismatch", ValueError, r"grads\[1\] has 6 elements")
def _():
    a, g = acc_pair()
    g[1] = f32(6)
    return acc_call(a, g), a + g


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.complex64, np.bool_, np.uint8])
def test_accumulate_unsupported_grad_dtype(dtype):
    a, g = acc_pair()
    g[1] = np.ones(5, dtype)
    before = snapshot(a + g)
    with pytest.raises(TypeError, match=r"grads\[1\] has an unsupported dtype"):
        core.accumulate(a, g)
    assert_unchanged(before, a + g)


@case("accumulate-fp16-accumulator", TypeError, r"accumulators\[1\] has dtype float16")
def _():
    a, g = acc_pair()
    a[1] = np.ones(5, np.float16)
    return acc_call(a, g), a + g


@case("accumulate-int-accumulator", TypeError, r"accumulators\[0\] has an unsupported dtype")
def _():
    a, g = acc_pair()
    a[0] = np.ones(4, np.int32)
    return acc_call(a, g), a + g


@case("accumulate-transposed-grad", ValueError, r"grads\[1\] is not contiguous")
def _():
    a, g = [f32(4), f32(6)], [f32(4), np.arange(6, dtype=F32).reshape(2, 3).T]
    return acc_call(a, g), a + g


@case("accumulate-strided-accumulator", ValueError, r"accumulators\[1\] is not contiguous")
def _():
    base = f32(10)
    a, g = [f32(4), base[::2]], [f32(4, fill=2.0), f32(5, fill=2.0)]
    return acc_call(a, g), [base, a[0]] + g


@case("accumulate-torch-transposed-grad", ValueError, r"grads\[1\] is not contiguous")
def _():
    torch = need_torch()
    a = [torch.ones(4), torch.ones(6)]
    g = [torch.ones(4), torch.arange(6.0).reshape(2, 3).t()]
    return acc_call(a, g), a + g


@case("accumulate-torch-strided-accumulator", ValueError, r"accumulators\[0\] is not contiguous")
def _():
    torch = need_torch()
    base = torch.ones(4, 4)
    a, g = [base[:, 1], torch.ones(5)], [torch.full((4,), 2.0), torch.full((5,), 2.0)]
    return acc_call(a, g), [base, a[1]] + g


@case("accumulate-read-only-accumulator", ValueError, r"accumulators\[1\] is read-only")
def _():
    a, g = acc_pair()
    a[1] = read_only(a[1])
    return acc_call(a, g), a + g


@case("accumulate-accumulator-is-a-grad", ValueError, overlap("accumulators[1]", "grads[1]"))
def _():
    a, g = acc_pair()
    return acc_call(a, [g[0], a[1]]), a + g


@case(
    "accumulate-same-accumulator-twice", ValueError, overlap("accumulators[1]", "accumulators[0]")
)
def _():
    a = f32(4)
    g = [f32(4, fill=2.0), f32(4, fill=3.0)]
    return acc_call([a, a], g), [a] + g


@case("accumulate-overlapping-slices", ValueError, overlap("accumulators[1]", "accumulators[0]"))
def _():
    base = f32(20)
    g = [f32(10, fill=2.0), f32(10, fill=2.0)]
    return acc_call([base[:10], base[5:15]], g), [base] + g


@case(
    "accumulate-torch-accumulator-shares-a-numpy-grad",
    ValueError,
    overlap("accumulators[0]", "grads[0]"),
)
def _():
    torch = need_torch()
    g = f32(4, fill=2.0)
    return acc_call([torch.from_numpy(g)], [g]), [g]


@case("accumulate-unknown-mode", ValueError, "mode must be one of")
def _():
    a, g = acc_pair()
    return acc_call(a, g, mode="avg"), a + g


@pytest.mark.parametrize(
    ("weight", "exc"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-1.0, ValueError),
        ("2", TypeError),
        (True, TypeError),
        (None, TypeError),
        (np.array([1.0]), TypeError),
    ],
)
def test_accumulate_bad_weight(weight, exc):
    a, g = acc_pair()
    before = snapshot(a + g)
    with pytest.raises(exc, match="weight"):
        core.accumulate(a, g, weight=weight)
    assert_unchanged(before, a + g)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(weight_before=-1.0), ValueError, "weight_before"),
        (dict(weight_before=float("nan")), ValueError, "weight_before"),
        (dict(weight_before="0"), TypeError, "weight_before"),
        (dict(weight=0.0, weight_before=0.0), ValueError, "weight"),
    ],
)
def test_accumulate_bad_running_mean_weights(kw, exc, match):
    a, g = acc_pair()
    before = snapshot(a + g)
    kw = {"weight": 1.0, **kw}
    with pytest.raises(exc, match=match):
        core.accumulate(a, g, mode="running_mean", **kw)
    assert_unchanged(before, a + g)


# ---- apply ----
# two parameters; state1/state2 full; accumulators full: any write would show


def apply_set(n=(4, 6)):
    p = [f32(k, fill=1.0) for k in n]
    a = [f32(k, fill=2.0) for k in n]
    s1 = [f32(k, fill=0.5) for k in n]
    s2 = [f32(k, fill=0.25) for k in n]
    return p, a, s1, s2


def apply_case(case_id, exc, match, **kw):
    """A case calling core.apply on a fresh valid set with ``kw`` overriding the arguments."""

    @case(case_id, exc, match)
    def build():
        p, a, s1, s2 = apply_set()
        args = dict(optimizer="adam", lr=0.1, state1=s1, state2=s2, momentum=0.9)
        args.update(kw)
        return (lambda: core.apply(p, a, **args)), p + a + s1 + s2

    return build


apply_case("apply-unknown-optimizer", ValueError, "optimizer must be one of", optimizer="lamb")
apply_case("apply-optimizer-none-value", ValueError, "optimizer must be one of", optimizer=None)
apply_case("apply-negative-lr", ValueError, "lr must be", lr=-0.1)
apply_case("apply-nan-lr", ValueError, "lr must be", lr=float("nan"))
apply_case("apply-string-lr", TypeError, "lr must be a real number", lr="0.1")
apply_case("apply-beta1-one", ValueError, "beta1", betas=(1.0, 0.999))
apply_case("apply-beta1-negative", ValueError, "beta1", betas=(-0.1, 0.999))
apply_case("apply-beta2-one", ValueError, "beta2", betas=(0.9, 1.0))
apply_case("apply-betas-not-a-pair", TypeError, "betas must be a pair", betas=(0.9,))
apply_case("apply-beta-string", TypeError, r"betas\[1\]", betas=(0.9, "x"))
apply_case("apply-step-zero", ValueError, "step must be >= 1", step=0)
apply_case("apply-step-negative", ValueError, "step must be >= 1", step=-3)
apply_case("apply-step-bool", TypeError, "step must be an int", step=True)
apply_case("apply-step-float", TypeError, "step must be an int", step=1.0)
apply_case("apply-negative-eps", ValueError, "eps must be", eps=-1e-8)
apply_case("apply-negative-weight-decay", ValueError, "weight_decay must be", weight_decay=-0.1)
apply_case(
    "apply-sgd-negative-momentum", ValueError, "momentum must be", optimizer="sgd", momentum=-0.5
)
apply_case(
    "apply-sgd-nesterov-without-momentum",
    ValueError,
    "nesterov",
    optimizer="sgd",
    momentum=0.0,
    nesterov=True,
)
apply_case(
    "apply-sgd-nesterov-with-dampening",
    ValueError,
    "nesterov",
    optimizer="sgd",
    nesterov=True,
    dampening=0.1,
)
apply_case("apply-nan-grad-scale", ValueError, "grad_scale", grad_scale=float("nan"))
apply_case("apply-inf-grad-scale", ValueError, "grad_scale", grad_scale=float("inf"))
apply_case("apply-max-norm-zero", ValueError, "max_norm must be", max_norm=0.0)
apply_case("apply-max-norm-negative", ValueError, "max_norm must be", max_norm=-1.0)
apply_case("apply-max-norm-nan", ValueError, "max_norm must be", max_norm=float("nan"))
apply_case("apply-max-norm-and-agc", ValueError, "max_norm and agc", max_norm=1.0, agc=True)
apply_case(
    "apply-agc-clip-factor-zero", ValueError, "clip_factor must be", agc=True, clip_factor=0.0
)
apply_case("apply-agc-eps-negative", ValueError, "agc_eps must be", agc=True, agc_eps=-1.0)
apply_case("apply-agc-unknown-layout", ValueError, "layout must be", agc=True, layout="middle")
apply_case(
    "apply-agc-layout-count",
    ValueError,
    "layout has 1 entries but params has 2",
    agc=True,
    layout=[(1, "leading")],
)
apply_case(
    "apply-agc-layout-does-not-divide",
    ValueError,
    r"layout\[1\]: 4 units do not divide",
    agc=True,
    layout=[(2, "leading"), (4, "trailing")],
)
apply_case(
    "apply-agc-layout-bad-entry",
    ValueError,
    r"layout\[0\] must be a pair",
    agc=True,
    layout=[(2, "sideways"), (1, "leading")],
)
apply_case("apply-missing-state", ValueError, "state1 has 0 tensors but params has 2", state1=None)
apply_case(
    "apply-short-state2", ValueError, "state2 has 1 tensors but params has 2", state2=[f32(4)]
)
apply_case("apply-clip-coef-float64", TypeError, "clip_coef", clip_coef=np.array([0.5], np.float64))
apply_case(
    "apply-clip-coef-two-elements", TypeError, "clip_coef", clip_coef=np.array([0.5, 0.5], F32)
)
apply_case("apply-clip-coef-not-a-tensor", TypeError, "clip_coef", clip_coef=0.5)
apply_case("apply-optimizer-none-reset-in-place", ValueError, "reset", optimizer="none")


@case("apply-state1-aliases-params", ValueError, overlap("state1[1]", "params[1]"))
def _():
    p, a, s1, s2 = apply_set()
    return (
        lambda: core.apply(p, a, optimizer="sgd", lr=0.1, momentum=0.9, state1=[s1[0], p[1]])
    ), p + a + s1


@case("apply-state2-aliases-state1", ValueError, overlap("state2[0]", "state1[0]"))
def _():
    p, a, s1, s2 = apply_set()
    return (
        lambda: core.apply(p, a, optimizer="adamw", lr=0.1, state1=s1, state2=[s1[0], s2[1]])
    ), p + a + s1 + s2


@case("apply-params-alias-accumulators", ValueError, overlap("params[0]", "accumulators[0]"))
def _():
    p, a, _, _ = apply_set()
    return (lambda: core.apply([a[0], p[1]], a, optimizer="sgd", lr=0.1)), p + a


@case(
    "apply-grads-out-aliases-accumulators", ValueError, overlap("grads_out[1]", "accumulators[1]")
)
def _():
    _, a, s1, _ = apply_set()
    return (lambda: core.apply(None, a, optimizer="none", grads_out=[s1[0], a[1]])), a + s1


@case("apply-grads-out-size", ValueError, r"grads_out\[1\] has 5 elements")
def _():
    _, a, _, _ = apply_set()
    out = [f32(4, fill=7.0), f32(5, fill=7.0)]
    return (lambda: core.apply(None, a, optimizer="none", grads_out=out)), a + out


@case("apply-grads-out-int", TypeError, r"grads_out\[0\] has an unsupported dtype")
def _():
    _, a, _, _ = apply_set()
    out = [np.zeros(4, np.int32), f32(6)]
    return (lambda: core.apply(None, a, optimizer="none", grads_out=out)), a + out


@case("apply-state-dtype", TypeError, r"state1\[1\] has dtype float16")
def _():
    p, a, s1, s2 = apply_set()
    s1[1] = np.zeros(6, np.float16)
    return (
        lambda: core.apply(p, a, optimizer="adam", lr=0.1, state1=s1, state2=s2)
    ), p + a + s1 + s2


@case("apply-state2-dtype-differs", TypeError, r"state2\[0\]")
def _():
    torch = need_torch()
    p = [torch.ones(4, dtype=torch.bfloat16)]
    a = [torch.full((4,), 2.0)]
    s1 = [torch.zeros(4)]
    s2 = [torch.zeros(4, dtype=torch.bfloat16)]
    return (
        lambda: core.apply(p, a, optimizer="adam", lr=0.1, state1=s1, state2=s2)
    ), p + a + s1 + s2


@case("apply-bf16-accumulator", TypeError, r"accumulators\[0\] has dtype bfloat16")
def _():
    torch = need_torch()
    p = [torch.ones(4)]
    a = [torch.full((4,), 2.0, dtype=torch.bfloat16)]
    return (lambda: core.apply(p, a, optimizer="sgd", lr=0.1)), p + a


@case("apply-int-params", TypeError, r"params\[1\]")
def _():
    p, a, _, _ = apply_set()
    p[1] = np.ones(6, np.int32)
    return (lambda: core.apply(p, a, optimizer="sgd", lr=0.1)), p + a


@case("apply-complex-params", TypeError, r"params\[0\] has an unsupported dtype")
def _():
    p, a, _, _ = apply_set()
    p[0] = np.ones(4, np.complex64)
    return (lambda: core.apply(p, a, optimizer="sgd", lr=0.1)), p + a


@case("apply-params-none-for-sgd", ValueError, "params has 0 tensors but accumulators has 2")
def _():
    _, a, _, _ = apply_set()
    return (lambda: core.apply(None, a, optimizer="sgd", lr=0.1)), a


@case("apply-params-none-for-agc", ValueError, "params")
def _():
    _, a, _, _ = apply_set()
    out = [f32(4), f32(6)]
    return (lambda: core.apply(None, a, optimizer="none", grads_out=out, agc=True)), a + out


@case("apply-params-not-a-list-for-agc", TypeError, "params must be a list or tuple")
def _():
    p, a, _, _ = apply_set()
    return (lambda: core.apply(p[0], a[:1], optimizer="sgd", lr=0.1, agc=True)), p + a


@case(
    "apply-params-accumulators-count-for-agc",
    ValueError,
    "params has 1 tensors but accumulators has 2",
)
def _():
    p, a, _, _ = apply_set()
    return (lambda: core.apply(p[:1], a, optimizer="sgd", lr=0.1, agc=True)), p + a


@case("apply-read-only-params", ValueError, r"params\[1\] is read-only")
def _():
    p, a, _, _ = apply_set()
    p[1] = read_only(p[1])
    return (lambda: core.apply(p, a, optimizer="sgd", lr=0.1)), p + a


@case("apply-read-only-state", ValueError, r"state1\[0\] is read-only")
def _():
    p, a, s1, _ = apply_set()
    s1[0] = read_only(s1[0])
    return (lambda: core.apply(p, a, optimizer="sgd", lr=0.1, momentum=0.9, state1=s1)), p + a + s1


@case("apply-transposed-params", ValueError, r"params\[1\] is not contiguous")
def _():
    p, a, _, _ = apply_set()
    p[1] = f32(3, 2).T
    return (lambda: core.apply(p, a, optimizer="sgd", lr=0.1)), p + a


@case("apply-torch-transposed-state", ValueError, r"state1\[0\] is not contiguous")
def _():
    torch = need_torch()
    p, a = [torch.ones(2, 3)], [torch.full((2, 3), 2.0)]
    s1 = [torch.zeros(3, 2).t()]
    return (lambda: core.apply(p, a, optimizer="sgd", lr=0.1, momentum=0.9, state1=s1)), p + a + s1


@case("apply-accumulators-none", TypeError, "accumulators must be a list or tuple")
def _():
    p, a, _, _ = apply_set()
    return (lambda: core.apply(p, None, optimizer="sgd", lr=0.1)), p + a


@case("apply-accumulator-no-dlpack", TypeError, r"accumulators\[1\] of type str")
def _():
    p, a, _, _ = apply_set()
    return (lambda: core.apply(p, [a[0], "acc"], optimizer="sgd", lr=0.1)), p + a


# ---- norms and AGC ----


@case("sum-of-squares-not-a-list", TypeError, "tensors must be a list or tuple")
def _():
    return (lambda: core.sum_of_squares(f32(3))), []


@case("sum-of-squares-none-item", TypeError, r"tensors\[1\] is None")
def _():
    return (lambda: core.sum_of_squares([f32(3), None])), []


@case("sum-of-squares-int", TypeError, r"tensors\[0\] has an unsupported dtype")
def _():
    return (lambda: core.sum_of_squares([np.ones(3, np.int64)])), []


@case("global-norm-complex", TypeError, r"tensors\[0\] has an unsupported dtype")
def _():
    return (lambda: core.global_norm([np.ones(3, np.complex128)])), []


@case("unitwise-norm-out-size", ValueError, "out has 3 elements, expected 4")
def _():
    out = f32(3, fill=-1.0)
    return (lambda: core.unitwise_norm(f32(4, 3), out=out)), [out]


@case("unitwise-norm-out-fp16", TypeError, "out must be a float32 or float64")
def _():
    out = np.full(4, -1.0, np.float16)
    return (lambda: core.unitwise_norm(f32(4, 3), out=out)), [out]


@case("unitwise-norm-out-read-only", ValueError, "out is read-only")
def _():
    out = read_only(f32(4, fill=-1.0))
    return (lambda: core.unitwise_norm(f32(4, 3), out=out)), [out]


@case("unitwise-norm-out-aliases-tensor", ValueError, "out overlaps tensor")
def _():
    x = f32(3, 3)
    return (lambda: core.unitwise_norm(x, out=x[0])), [x]


@case("unitwise-norm-none", TypeError, "tensor must be a tensor")
def _():
    return (lambda: core.unitwise_norm(None)), []


@case("unitwise-norm-int", TypeError, "tensor has an unsupported dtype")
def _():
    return (lambda: core.unitwise_norm(np.ones((4, 3), np.int32))), []


@case("unitwise-norm-unknown-layout", ValueError, "layout must be")
def _():
    return (lambda: core.unitwise_norm(f32(4, 3), layout="middle")), []


@case("unitwise-norm-trailing-rank-6", ValueError, "rank")
def _():
    return (lambda: core.unitwise_norm(f32(2, 2, 2, 2, 2, 2), layout="trailing")), []


@case("unit-layout-unknown", ValueError, "layout must be")
def _():
    return (lambda: core.unit_layout((3, 4), "columns")), []


def agc_set():
    p = [f32(4, 3), f32(5)]
    g = [f32(4, 3, fill=100.0), f32(5, fill=100.0)]  # would be clipped
    return p, g


def agc_case(case_id, exc, match, **kw):
    @case(case_id, exc, match)
    def build():
        p, g = agc_set()
        args = dict(kw)
        params = args.pop("params", p)
        grads = args.pop("grads", g)
        if callable(params):
            params = params(p, g)
        if callable(grads):
            grads = grads(p, g)
        return (lambda: core.adaptive_clip(params, grads, **args)), p + g

    return build


agc_case("agc-clip-factor-zero", ValueError, "clip_factor must be", clip_factor=0.0)
agc_case("agc-clip-factor-nan", ValueError, "clip_factor must be", clip_factor=float("nan"))
agc_case("agc-eps-negative", ValueError, "eps must be", eps=-1.0)
agc_case("agc-eps-string", TypeError, "eps must be a real number", eps="0.1")
agc_case("agc-unknown-layout", ValueError, "layout must be", layout="middle")
agc_case(
    "agc-trailing-rank-6",
    ValueError,
    "rank",
    params=lambda p, g: [f32(1, 1, 1, 1, 1, 1), p[1]],
    grads=lambda p, g: [f32(1, 1, 1, 1, 1, 1), g[1]],
    layout="trailing",
)
agc_case(
    "agc-grads-fp16",
    TypeError,
    r"grads\[1\] has dtype float16",
    grads=lambda p, g: [g[0], np.ones(5, np.float16)],
)
agc_case(
    "agc-params-int",
    TypeError,
    r"params\[0\] has an unsupported dtype",
    params=lambda p, g: [np.ones((4, 3), np.int32), p[1]],
)
agc_case(
    "agc-length-mismatch",
    ValueError,
    "grads has 1 tensors but params has 2",
    grads=lambda p, g: g[:1],
)
agc_case(
    "agc-size-mismatch",
    ValueError,
    r"params\[1\] has 5 elements but grads\[1\] has 6",
    grads=lambda p, g: [g[0], f32(6)],
)
agc_case(
    "agc-params-alias-grads",
    ValueError,
    overlap("grads[1]", "params[1]"),
    params=lambda p, g: [p[0], g[1]],
)
agc_case("agc-params-none", TypeError, "params must be a list or tuple", params=None)
agc_case(
    "agc-param-none-item",
    TypeError,
    r"params\[1\] must be a tensor",
    params=lambda p, g: [p[0], None],
)
agc_case("agc-grads-none", TypeError, "grads must be a list or tuple", grads=None)
agc_case(
    "agc-read-only-grads",
    ValueError,
    r"grads\[0\] is read-only",
    grads=lambda p, g: [read_only(g[0]), g[1]],
)


# ---- batch norm ----


def bn_set():
    x = np.arange(24, dtype=F32).reshape(2, 3, 4)
    return x, f32(3, fill=-1.0), f32(3, fill=-2.0)


@case("bn-moments-rank-1", ValueError, "x must have rank >= 2")
def _():
    _, mean, m2 = bn_set()
    return (lambda: core.bn_moments(f32(6), mean=mean, m2=m2)), [mean, m2]


@case("bn-moments-x-none", TypeError, "x must be a tensor")
def _():
    _, mean, m2 = bn_set()
    return (lambda: core.bn_moments(None, mean=mean, m2=m2)), [mean, m2]


@case("bn-moments-x-int", TypeError, "x has an unsupported dtype")
def _():
    _, mean, m2 = bn_set()
    return (lambda: core.bn_moments(np.ones((2, 3), np.int32), mean=mean, m2=m2)), [mean, m2]


@case("bn-moments-x-transposed", ValueError, "x is not contiguous")
def _():
    x, mean, m2 = bn_set()
    return (lambda: core.bn_moments(x.transpose(0, 2, 1), channels_axis=-1, mean=mean, m2=m2)), [
        x,
        mean,
        m2,
    ]


@case("bn-moments-channels-axis-out-of-range", ValueError, "channels_axis")
def _():
    x, mean, m2 = bn_set()
    return (lambda: core.bn_moments(x, channels_axis=4, mean=mean, m2=m2)), [x, mean, m2]


@case("bn-moments-channels-axis-float", TypeError, "channels_axis")
def _():
    x, mean, m2 = bn_set()
    return (lambda: core.bn_moments(x, channels_axis=1.0, mean=mean, m2=m2)), [x, mean, m2]


@case("bn-moments-mean-size", ValueError, "mean has 4 elements, expected 3")
def _():
    x, _, m2 = bn_set()
    mean = f32(4, fill=-1.0)
    return (lambda: core.bn_moments(x, mean=mean, m2=m2)), [x, mean, m2]


@case("bn-moments-m2-fp16", TypeError, "m2 has dtype float16")
def _():
    x, mean, _ = bn_set()
    m2 = np.zeros(3, np.float16)
    return (lambda: core.bn_moments(x, mean=mean, m2=m2)), [x, mean, m2]


@case("bn-moments-mean-read-only", ValueError, "mean is read-only")
def _():
    x, mean, m2 = bn_set()
    mean = read_only(mean)
    return (lambda: core.bn_moments(x, mean=mean, m2=m2)), [x, mean, m2]


@case("bn-moments-mean-is-m2", ValueError, overlap("m2", "mean"))
def _():
    x, mean, _ = bn_set()
    return (lambda: core.bn_moments(x, mean=mean, m2=mean)), [x, mean]


@case("bn-moments-mean-inside-x", ValueError, "overlaps")
def _():
    x, _, m2 = bn_set()
    return (lambda: core.bn_moments(x, mean=x[0, 0, :3], m2=m2)), [x, m2]


def merge_set():
    return f32(3, fill=1.0), f32(3, fill=2.0), f32(3, fill=5.0), f32(3, fill=6.0)


def merge_case(case_id, exc, match, count_a=4.0, count_b=2.0, change=None):
    @case(case_id, exc, match)
    def build():
        bufs = list(merge_set())
        if change:
            change(bufs)
        ma, qa, mb, qb = bufs
        return (lambda: core.bn_merge(count_a, ma, qa, count_b, mb, qb)), bufs

    return build


merge_case("bn-merge-count-a-negative", ValueError, "count_a", count_a=-1.0)
merge_case("bn-merge-count-b-nan", ValueError, "count_b", count_b=float("nan"))
merge_case("bn-merge-count-a-string", TypeError, "count_a", count_a="4")
merge_case(
    "bn-merge-mean-b-size",
    ValueError,
    "mean_b has 4 elements",
    change=lambda b: b.__setitem__(2, f32(4)),
)
merge_case(
    "bn-merge-m2-a-read-only", ValueError, "m2_a is read-only", change=lambda b: read_only(b[1])
)
merge_case(
    "bn-merge-mean-a-is-m2-a",
    ValueError,
    overlap("m2_a", "mean_a"),
    change=lambda b: b.__setitem__(1, b[0]),
)
merge_case(
    "bn-merge-m2-b-int",
    TypeError,
    "m2_b has an unsupported dtype",
    change=lambda b: b.__setitem__(3, np.ones(3, np.int32)),
)


def running_case(case_id, exc, match, count=10.0, momentum=0.1, unbiased=True, change=None):
    @case(case_id, exc, match)
    def build():
        bufs = [f32(3, fill=1.0), f32(3, fill=2.0), f32(3, fill=5.0), f32(3, fill=6.0)]
        if change:
            change(bufs)
        rm, rv, mean, m2 = bufs
        return (
            lambda: core.bn_update_running(
                rm, rv, mean, m2, count, momentum=momentum, unbiased=unbiased
            )
        ), bufs

    return build


running_case("bn-running-momentum-above-1", ValueError, "momentum", momentum=1.5)
running_case("bn-running-momentum-negative", ValueError, "momentum", momentum=-0.1)
running_case("bn-running-count-1-unbiased", ValueError, "count", count=1.0)
running_case("bn-running-count-0-biased", ValueError, "count", count=0.0, unbiased=False)
running_case("bn-running-count-string", TypeError, "count", count="10")
running_case(
    "bn-running-var-fp16",
    TypeError,
    "running_var has dtype float16",
    change=lambda b: b.__setitem__(1, np.ones(3, np.float16)),
)
running_case(
    "bn-running-mean-aliases-mean",
    ValueError,
    overlap("running_mean", "mean"),
    change=lambda b: b.__setitem__(2, b[0]),
)
running_case(
    "bn-running-m2-size", ValueError, "m2 has 2 elements", change=lambda b: b.__setitem__(3, f32(2))
)


# ---- zero ----


@case("zero-same-tensor-twice", ValueError, overlap("tensors[1]", "tensors[0]"))
def _():
    a = f32(5)
    return (lambda: core.zero([a, a])), [a]


@case("zero-read-only", ValueError, r"tensors\[1\] is read-only")
def _():
    a, b = f32(5), read_only(f32(5))
    return (lambda: core.zero([a, b])), [a, b]


@case("zero-strided", ValueError, r"tensors\[1\] is not contiguous")
def _():
    a, base = f32(5), f32(10)
    return (lambda: core.zero([a, base[::2]])), [a, base]


@case("zero-none", TypeError, "tensors must be a list or tuple")
def _():
    return (lambda: core.zero(None)), []


# ---- arena ----


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(numels=[4, 5], alignment=3), ValueError, "alignment"),
        (dict(numels=[4, 5], alignment=0), ValueError, "alignment"),
        (dict(numels=[4, 5], bucket_numel=0), ValueError, "bucket_numel"),
        (dict(numels=[4, -1]), ValueError, r"numels\[1\]"),
        (dict(numels=5), TypeError, "numels"),
    ],
)
def test_arena_plan_bad_input(kw, exc, match):
    with pytest.raises(exc, match=match):
        core.arena_plan(**kw)


# ---- the table ----


@pytest.mark.parametrize(("build", "exc", "match"), CASES)
def test_bad_input_is_rejected_and_changes_nothing(build, exc, match):
    call, buffers = build()
    before = snapshot(buffers)
    with pytest.raises(exc, match=match) as info:
        call()
    assert type(info.value) in (ValueError, TypeError)
    assert_unchanged(before, buffers)


def test_a_rejected_call_leaves_the_core_usable():
    a, g = acc_pair()
    with pytest.raises(ValueError):
        core.accumulate(a, [g[0], a[1]])
    r = core.accumulate(a, g, weight=2.0, compute_sumsq=True)
    np.testing.assert_array_equal(a[0], 5.0)
    np.testing.assert_array_equal(a[1], 7.0)
    assert r.sumsq == 4 * 25.0 + 5 * 49.0
