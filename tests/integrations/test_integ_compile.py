"""torch.compile: a compiled model with AccumBatchNorm and the wrapper gives the eager result."""

from __future__ import annotations

import pytest
import torch

from gradient_accumulator.torch import AccumBatchNorm1d, GradientAccumulateOptimizer

K = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6, bias=False),
        AccumBatchNorm1d(6, accum_steps=K),
        torch.nn.ReLU(),
        torch.nn.Linear(6, 1),
    )


def _train(compiled: bool):
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), K)
    run = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(1)
    for _ in range(2 * K):
        x = torch.randn(5, 4, generator=g) * 2 + 1
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.accumulation_state.updates == 2
    return model


@pytest.mark.filterwarnings("ignore::UserWarning")  # Dynamo's notes on the graph break
def test_compiled_model_matches_eager():
    torch._dynamo.reset()
    eager = _train(False).state_dict()
    compiled = _train(True).state_dict()
    torch._dynamo.reset()
    assert int(compiled["1.num_batches_tracked"]) == 2
    # The statistics moved away from their initial values (0 and 1).
    assert eager["1.running_mean"].abs().max() > 0.1
    for name, ref in eager.items():
        diff = (compiled[name].double() - ref.double()).abs().max().item()
        assert diff <= 1e-6, f"{name} differs by {diff}"


def test_fullgraph_names_the_reason():
    torch._dynamo.reset()
    model = _model()
    with pytest.raises(Exception, match="AccumBatchNorm keeps its cycle bookkeeping"):
        torch.compile(model, fullgraph=True)(torch.randn(5, 4))
    torch._dynamo.reset()
    assert int(model[1].accum_step) == 0  # nothing was half-recorded
