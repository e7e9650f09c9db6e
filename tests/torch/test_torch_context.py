"""accumulate(): the boundary flag, no_sync on exactly the non-boundary micro-steps, weights."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate  # noqa: E402


class _FakeDDP(nn.Module):
    """Wraps a module and offers DDP's ``no_sync()`` context manager, counting its entries."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.entries = 0
        self.inside = False

    @contextlib.contextmanager
    def no_sync(self):
        assert not self.inside
        self.entries += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, x):
        return self.module(x)


def test_accumulate_yields_the_boundary_and_enters_no_sync_off_boundary(make_pair, make_data, mse):
    net, _ = make_pair()
    model = _FakeDDP(net)
    k = 3
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), k)
    x, y = make_data(8 * 2 * k)
    flags, inside, applied = [], [], []
    for i in range(2 * k):
        sl = slice(8 * i, 8 * i + 8)
        with accumulate(model, opt) as sync:
            flags.append(sync)
            inside.append(model.inside)
            mse(model, x[sl], y[sl]).backward()
        assert not model.inside
        opt.step()
        opt.zero_grad()
        applied.append(opt.update_applied)
    assert flags == [False, False, True] * 2
    assert inside == [True, True, False] * 2  # no_sync exactly on the non-boundary steps
    assert model.entries == 2 * (k - 1)
    assert applied == flags


def test_accumulate_without_no_sync_and_flush_boundary(make_pair, make_data, mse):
    model, _ = make_pair()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = make_data(8)
    seen = []
    for _ in range(3):
        with accumulate(model, opt) as sync:
            seen.append(sync)
            mse(model, x, y).backward()
        opt.step()
    assert seen == [False, True, False]


def test_accumulate_weight_is_the_micro_batch_weight(make_pair, make_data, mse, rel_err):
    """``accumulate(model, opt, weight=n)`` then ``opt.step()`` weighs the micro-batch by n."""
    sizes = [5, 11, 3, 13]
    x, y = make_data(sum(sizes) * 2)
    via_context, _ = make_pair()
    via_step, _ = make_pair()
    opt_c = GradientAccumulateOptimizer(torch.optim.AdamW(via_context.parameters(), lr=1e-2), 4)
    opt_s = GradientAccumulateOptimizer(torch.optim.AdamW(via_step.parameters(), lr=1e-2), 4)
    pos = 0
    for n in sizes * 2:
        sl = slice(pos, pos + n)
        pos += n
        with accumulate(via_context, opt_c, weight=n):
            mse(via_context, x[sl], y[sl]).backward()
        opt_c.step()
        mse(via_step, x[sl], y[sl]).backward()
        opt_s.step(weight=n)
        assert opt_c.accumulation_state == opt_s.accumulation_state
    for p, q in zip(via_context.parameters(), via_step.parameters()):
        assert torch.equal(p, q)
    # Explicit different weights in both places are a contradiction.
    with accumulate(via_context, opt_c, weight=4):
        mse(via_context, x[:4], y[:4]).backward()
    with pytest.raises(ValueError, match="weight"):
        opt_c.step(weight=3)


def test_accumulate_rejects_bad_arguments(make_pair):
    model, _ = make_pair()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradientAccumulateOptimizer(inner, 2)
    with pytest.raises(TypeError, match="optimizer"):
        with accumulate(model, inner):
            pass
    with pytest.raises(TypeError, match="model"):
        with accumulate(lambda x: x, opt):
            pass
    for bad, exc in ((float("nan"), ValueError), (-1.0, ValueError), ("a", TypeError)):
        with pytest.raises(exc, match="weight"):
            with accumulate(model, opt, weight=bad):
                pass
    assert opt.micro_step == 0 and opt._loop.cycle.named_weight is None
