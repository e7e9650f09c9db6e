"""bf16 gradients accumulated over k=64 micro-batches stay within one bf16 rounding of fp64.

The reference is the fp64 mean of the very bf16 gradients autograd produces per micro-batch, so
the only error left is the accumulation's. The wrapper's fp32 accumulators keep it at fp32 level;
the final bf16 ``.grad`` handed to a non-fused optimizer adds one bf16 rounding. Plain torch
(autograd summing ``.grad`` in bf16 over 64 backward calls) is measurably worse.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402

U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
K, B = 64, 16


class _Capture(torch.optim.Optimizer):
    """An optimizer whose step only records the gradients it is given (a non-fused optimizer)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.seen: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    # Inputs with a non-zero mean and a common target offset: per-element gradients keep their
    # sign across micro-batches, so sums grow and relative errors are well defined.
    x = (1 + 0.5 * torch.randn(K * B, 32, generator=g)).to(torch.bfloat16)
    y = (3 + 0.1 * torch.randn(K * B, 16, generator=g)).to(torch.bfloat16)

    def loss(i):
        sl = slice(i * B, (i + 1) * B)
        return (model(x[sl]) - y[sl]).square().mean()

    params = list(model.parameters())
    grads = [torch.autograd.grad(loss(i), params) for i in range(K)]
    assert grads[0][0].dtype == torch.bfloat16
    return model, params, loss, grads


def _max_rel(got, want) -> float:
    """Largest element-wise relative error, over a list of tensors (fp64)."""
    return max(((g.double() - w).abs() / w.abs()).max().item() for g, w in zip(got, want))


def test_bf16_accumulation_within_one_rounding_plain_bf16_is_worse():
    model, params, loss, grads = _setup()
    ref = [sum(gi[j].double() for gi in grads) / K for j in range(len(params))]
    assert all(bool((r != 0).all()) for r in ref)

    cap = _Capture(params)
    opt = GradientAccumulateOptimizer(cap, K)
    assert not opt.uses_fused_apply
    for i in range(K):
        loss(i).backward()
        opt.step()
        if i == K - 2:
            # Before the boundary: the fp32 accumulators hold Σ gᵢ to fp32 accuracy.
            acc = opt.accumulators()
            assert all(a.dtype == torch.float32 for a in acc)
            partial = [sum(gi[j].double() for gi in grads[: K - 1]) for j in range(len(params))]
            assert _max_rel(acc, partial) <= 1e-5
    assert opt.update_applied and len(cap.seen) == 1
    got = cap.seen[0]
    assert all(g.dtype == torch.bfloat16 for g in got)
    ours = _max_rel(got, ref)
    assert ours <= 2 * U_BF16

    # Plain torch: 64 backward calls summing .grad in bf16.
    for p in params:
        p.grad = None
    for i in range(K):
        loss(i).backward()
    naive = [p.grad / K for p in params]  # dividing by 64 is exact
    plain = _max_rel(naive, ref)
    assert plain > 2 * U_BF16
    assert plain > 3 * ours


def test_bf16_parameters_with_the_fused_update():
    """SGD on bf16 parameters: w ← bf16(w − lr·ḡ) with ḡ the fp32 mean, one rounding of w."""
    model, params, loss, grads = _setup()
    lr = 0.5
    ref = [sum(gi[j].double() for gi in grads) / K for j in range(len(params))]
    want = [p.detach().double() - lr * r for p, r in zip(params, ref)]
    opt = GradientAccumulateOptimizer(torch.optim.SGD(params, lr=lr), K)
    assert opt.uses_fused_apply
    for i in range(K):
        loss(i).backward()
        opt.step()
    assert opt.update_applied
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert _max_rel(params, want) <= 2 * U_BF16
