"""torch.compile: a compiled model with AccumBatchNorm and the wrapper gives the eager result,
with ``fullgraph=True`` (the layer's bookkeeping is a registered custom op: no graph break)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from gradient_accumulator.torch import AccumBatchNorm2d, GradientAccumulateOptimizer

K = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, bias=False),
        AccumBatchNorm2d(4, accum_steps=K),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 9, 1),
    )


def _train(compiled: bool):
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), K)
    run = torch.compile(model, fullgraph=True) if compiled else model
    g = torch.Generator().manual_seed(1)
    for _ in range(2 * K):
        x = torch.randn(5, 2, 5, 5, generator=g) * 2 + 3
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.accumulation_state.updates == 2
    return model


def test_compiled_fullgraph_model_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    eager = _train(False).state_dict()
    compiled = _train(True).state_dict()
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    assert breaks == 0, dict(counters["graph_break"])
    assert int(compiled["1.num_batches_tracked"]) == int(eager["1.num_batches_tracked"]) == 2
    assert int(compiled["1.accum_step"]) == 0
    # The statistics moved away from their initial values (0 and 1).
    assert eager["1.running_mean"].abs().max() > 0.1
    for name, ref in eager.items():
        # The compiled forward computes the batch moments with its own reductions: equal up
        # to fp32 rounding.
        diff = (compiled[name].double() - ref.double()).abs().max().item()
        assert diff <= 1e-6 * max(1.0, ref.double().abs().max().item()), f"{name}: {diff}"


def test_compiled_registered_batchnorm_follows_accum_steps_changes():
    """Layers registered through ``model=`` read the cycle from the optimizer inside the custom
    op, at run time: a compiled fullgraph model keeps batch norm and updates in phase across
    an ``accum_steps`` change (2 cycles of 3, then 2 of 2), without a graph break, and the
    statistics equal the eager run's."""
    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (False, True):
        model = _model()
        opt = GradientAccumulateOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), K, model=model
        )
        run = torch.compile(model, fullgraph=True) if compiled else model
        g = torch.Generator().manual_seed(1)
        for steps in (3, 3, 2, 2):
            opt.accum_steps = steps
            for _ in range(steps):
                x = torch.randn(5, 2, 5, 5, generator=g) * 2 + 3
                run(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        assert opt.accumulation_state.updates == 4
        results.append(model.state_dict())
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    assert breaks == 0, dict(counters["graph_break"])
    eager, compiled = results
    assert int(compiled["1.num_batches_tracked"]) == int(eager["1.num_batches_tracked"]) == 4
    assert int(compiled["1.accum_step"]) == 0
    for name, ref in eager.items():
        diff = (compiled[name].double() - ref.double()).abs().max().item()
        assert diff <= 1e-6 * max(1.0, ref.double().abs().max().item()), f"{name}: {diff}"
