"""adaptive_clip_grad and unitwise_norm against a plain-torch implementation of the NFNets rule."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradient_accumulator.torch import adaptive_clip_grad, unitwise_norm  # noqa: E402

SHAPES = [(), (5,), (4, 6), (3, 2, 5), (4, 2, 3, 3), (2, 3, 2, 2, 2)]
LAM, EPS = 0.05, 1e-3


def _unit_norms(t):
    t = t.double()
    if t.dim() <= 1:
        return torch.linalg.vector_norm(t).reshape(1)
    return torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim())))


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(SHAPES):
        w = torch.randn(shape, generator=g)
        # Gradients of very different sizes per unit: some units clipped, some not.
        scale = (
            torch.logspace(-3, 1, shape[0]).view(-1, *([1] * (len(shape) - 1)))
            if shape
            else torch.tensor(10.0 if i % 2 else 1e-3)
        )
        grad = torch.randn(shape, generator=g) * scale
        if len(shape) >= 2:
            w[0] = 0.0  # weight norm below ε: the floor applies
            grad[-1] = 0.0  # zero gradient: stays zero
        p = torch.nn.Parameter(w.to(dtype))
        p.grad = grad.to(dtype)
        out.append(p)
    return out


def test_unitwise_norm_matches_torch():
    for p in _params():
        got = unitwise_norm(p)
        assert got.dtype == torch.float32
        assert got.shape == (1 if p.dim() <= 1 else p.shape[0],)
        assert torch.allclose(got.double(), _unit_norms(p), rtol=1e-6, atol=0)


def test_unitwise_norm_example_and_bad_input():
    assert torch.equal(
        unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]])), torch.tensor([5.0, 1.0])
    )
    assert torch.equal(unitwise_norm(torch.tensor([3.0, 4.0])), torch.tensor([5.0]))
    with pytest.raises(TypeError, match="x"):
        unitwise_norm([1.0, 2.0])


def test_adaptive_clip_grad_matches_the_nfnets_rule(agc_reference):
    params = _params()
    ref = [torch.nn.Parameter(p.detach().double()) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.double()
    before = [p.grad.clone() for p in params]
    adaptive_clip_grad(params, clip_factor=LAM, eps=EPS)
    agc_reference(ref, LAM, EPS)
    clipped = kept = 0
    for p, r, b in zip(params, ref, before):
        assert torch.allclose(p.grad.double(), r.grad, rtol=1e-5, atol=1e-12)
        changed = _unit_norms(p.grad) < _unit_norms(b) * (1 - 1e-6)
        clipped += int(changed.sum())
        kept += int((~changed).sum())
        # A clipped unit ends with norm λ·max(‖w‖, ε).
        limit = LAM * _unit_norms(p.detach()).clamp_min(EPS)
        assert torch.allclose(_unit_norms(p.grad)[changed], limit[changed], rtol=1e-5)
        assert bool((_unit_norms(p.grad) <= limit * (1 + 1e-5)).all())
    assert clipped >= 5 and kept >= 5  # both branches of the rule are exercised
    # Zero weights: the ε floor, not zero, bounds the gradient; zero gradients stay zero.
    assert float(_unit_norms(params[2].grad)[0]) == pytest.approx(LAM * EPS, rel=1e-5)
    assert float(params[2].grad[-1].abs().max()) == 0.0


def test_adaptive_clip_grad_low_precision_noncontiguous_and_missing(agc_reference):
    params = _params(torch.bfloat16, seed=1)
    ref = [torch.nn.Parameter(p.detach().double()) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.double()
    adaptive_clip_grad(params, clip_factor=LAM, eps=EPS)
    agc_reference(ref, LAM, EPS)
    for p, r in zip(params, ref):
        assert p.grad.dtype == torch.bfloat16
        assert torch.allclose(p.grad.double(), r.grad, rtol=2 * 2.0**-8, atol=1e-30)

    w = torch.nn.Parameter(torch.randn(4, 6))
    w.grad = (100 * torch.randn(6, 4)).t()  # non-contiguous
    assert not w.grad.is_contiguous()
    ref_w = torch.nn.Parameter(w.detach().double())
    ref_w.grad = w.grad.double()
    untouched = torch.nn.Parameter(torch.randn(3))
    adaptive_clip_grad(w, clip_factor=LAM)  # a single tensor is accepted
    adaptive_clip_grad([untouched], clip_factor=LAM)  # no .grad: skipped
    agc_reference([ref_w], LAM, 1e-3)
    assert torch.allclose(w.grad.double(), ref_w.grad, rtol=1e-5)
    assert untouched.grad is None
