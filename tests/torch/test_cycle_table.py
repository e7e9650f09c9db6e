"""The shared cycle table (tests/cycle_table.py) through the PyTorch adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cycle_table import LR, SCENARIOS, check, initial_params, replay  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402


@pytest.mark.parametrize("s", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_cycle_table_through_the_torch_adapter(s):
    kernel, bias = initial_params()
    # torch's Linear layout: the weight is (OUT, IN), the transpose of Keras's kernel.
    weight = torch.nn.Parameter(torch.from_numpy(kernel.T.copy()))
    b = torch.nn.Parameter(torch.from_numpy(bias.copy()))
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD([weight, b], lr=LR),
        s.accum_steps,
        reduction=s.reduction,
        max_grad_norm=s.max_grad_norm,
        use_agc=s.use_agc,
        clip_factor=s.clip_factor,
        eps=s.eps,
        agc_exclude=(),  # the table clips every parameter (both adapters exclude "final")
    )

    def micro_step(grads):
        weight.grad = torch.from_numpy(grads[0].T.copy())
        b.grad = torch.from_numpy(grads[1].copy())
        opt.step()
        opt.zero_grad()

    assert replay(s, micro_step, opt.flush) == s.nonfinite_cycles
    check(s, weight.detach().numpy().T, b.detach().numpy())
