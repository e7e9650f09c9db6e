"""The shared cycle table (tests/cycle_table.py) through the PyTorch adapter."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cycle_table import LR, SCENARIOS, check, initial_params, replay  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402


@pytest.mark.parametrize("s", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_cycle_table_through_the_torch_adapter(s):
    kernel, bias = initial_params()
    scaler = None
    if s.loss_scale is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=s.loss_scale)
        scaler.scale(torch.ones(()))  # what scaling a loss does first: creates the scale
    # torch's Linear layout: the weight is (OUT, IN), the transpose of Keras's kernel.
    live = {}

    def build(weight: np.ndarray, b: np.ndarray) -> None:
        live["params"] = [
            torch.nn.Parameter(torch.from_numpy(weight.copy())),
            torch.nn.Parameter(torch.from_numpy(b.copy())),
        ]
        live["opt"] = GradientAccumulateOptimizer(
            torch.optim.SGD(live["params"], lr=LR),
            s.accum_steps,
            grad_scaler=scaler,
            reduction=s.reduction,
            max_grad_norm=s.max_grad_norm,
            use_agc=s.use_agc,
            clip_factor=s.clip_factor,
            eps=s.eps,
            agc_exclude=(),  # the table clips every parameter (both adapters exclude "final")
        )

    def micro_step(grads, weight):
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        for p, g in zip(live["params"], (grads[0] if grads[0] is None else grads[0].T, grads[1])):
            p.grad = None if g is None else torch.from_numpy(g * np.float32(scale))
        live["opt"].step(weight=weight)
        live["opt"].zero_grad()

    def resume():
        state = copy.deepcopy(live["opt"].state_dict())
        build(*(p.detach().numpy() for p in live["params"]))
        live["opt"].load_state_dict(state)

    build(kernel.T, bias)
    assert replay(s, micro_step, lambda: live["opt"].flush(), resume) == s.nonfinite_cycles
    weight, b = live["params"]
    check(s, weight.detach().numpy().T, b.detach().numpy())
