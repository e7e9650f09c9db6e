"""Optimizers whose step() needs a closure (LBFGS, any other) are refused when wrapped, with the
reason."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402


class _NeedsClosure(torch.optim.SGD):
    """An optimizer of its own whose step() re-evaluates the loss, like LBFGS."""

    def step(self, closure):  # noqa: D102
        loss = closure()
        super().step()
        return loss


class _MyClosureOptimizer(torch.optim.Optimizer):
    """Not derived from a torch optimizer: its step requires the closure, with no line search."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure):  # noqa: D102
        with torch.enable_grad():
            loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])
        return loss


@pytest.mark.parametrize(
    ("make", "name", "why"),
    [
        (torch.optim.LBFGS, "LBFGS", r"several times per update \(a line search\)"),
        (lambda p: _NeedsClosure(p, lr=0.1), "_NeedsClosure", r"during its update"),
        (_MyClosureOptimizer, "_MyClosureOptimizer", r"during its update"),
    ],
    ids=["lbfgs", "sgd_subclass", "custom"],
)
def test_an_optimizer_whose_step_needs_a_closure_is_refused_at_construction(make, name, why):
    model = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in model.parameters()]
    inner = make(model.parameters())
    with pytest.raises(TypeError) as info:
        GradientAccumulateOptimizer(inner, 2)
    message = str(info.value)
    assert message.startswith(f"optimizer {name} needs a closure in step(): ")
    assert re.search(why, message)
    # Why accumulation rules the closure out, for any optimizer.
    assert "a closure re-evaluating it would have to replay the whole cycle" in message
    # Only LBFGS is said to run a line search.
    assert ("line search" in message) == (name == "LBFGS")
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
