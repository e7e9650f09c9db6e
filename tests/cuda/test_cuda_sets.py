"""Registered tensor sets and channels-last parameters on the CUDA path."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradient_accumulator import core
from gradient_accumulator.torch import GradientAccumulateOptimizer


def test_a_cuda_set_matches_the_list_call_and_refuses_a_moved_tensor(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    accs = [torch.randn(6, device=dev, generator=g) for _ in range(4)]
    grads = [torch.randn(6, device=dev, generator=g) for _ in range(4)]
    want = [a.double() + 0.5 * x.double() for a, x in zip(accs, grads)]
    s = core.tensor_set(accs)
    assert s.is_cuda
    core.accumulate(s, grads, weight=0.5)
    for a, w in zip(accs, want):
        torch.testing.assert_close(a.double(), w, rtol=1e-7, atol=1e-7)
    accs[1].data = accs[1].data.cpu()
    with pytest.raises(ValueError, match=r"accumulators\[1\] was re-allocated or moved"):
        core.accumulate(s, grads)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_channels_last_conv_trains_like_the_contiguous_one(dev, kind):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(dev)
    xs = [torch.randn(2, 3, 8, 8, device=dev) for _ in range(4)]
    results = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = copy.deepcopy(base).to(memory_format=fmt)
        inner = (
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if kind == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=0.01)
        )
        opt = GradientAccumulateOptimizer(inner, 2, model=model, max_grad_norm=1.0)
        for x in xs:
            # The same gradients for both layouts: computed on a contiguous copy.
            ref = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
            ref(x).square().mean().backward()
            for p, r in zip(model.parameters(), ref.parameters()):
                p.grad = torch.empty_like(p).copy_(r.grad)
            opt.step()
            opt.zero_grad()
        results.append([p.detach().contiguous() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
