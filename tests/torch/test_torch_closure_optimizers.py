"""Optimizers whose step() needs a closure (LBFGS) are refused when wrapped, with the reason."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402


class _NeedsClosure(torch.optim.SGD):
    """An optimizer of its own whose step() re-evaluates the loss, like LBFGS."""

    def step(self, closure):  # noqa: D102
        loss = closure()
        super().step()
        return loss


@pytest.mark.parametrize("make", [torch.optim.LBFGS, lambda p: _NeedsClosure(p, lr=0.1)])
def test_an_optimizer_whose_step_needs_a_closure_is_refused_at_construction(make):
    model = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in model.parameters()]
    inner = make(model.parameters())
    with pytest.raises(TypeError, match=r"needs a closure in step\(\).*line search"):
        GradientAccumulateOptimizer(inner, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not inner.state  # nothing built, nothing stepped


def test_an_optional_closure_is_still_accepted_and_called_once():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x = torch.randn(4, 3)
    calls = []

    def closure():
        calls.append(1)
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and loss is not None and opt.micro_step == 1
