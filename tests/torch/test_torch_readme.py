"""The README's PyTorch loop, run as written: the scheduler counts every update, the one that
``flush()`` applies for a short last cycle included; and ``update_applied`` after ``flush()``."""

from __future__ import annotations

import math
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _readme_torch_loop() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## PyTorch") :]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert "for x, y in loader:" in block and "opt.flush()" in block
    return block


@pytest.mark.parametrize("micro_batches", [30, 32])  # a short last cycle of 6; none
def test_readme_loop_steps_the_scheduler_once_per_update(micro_batches):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))
    loader = [(torch.randn(8, 5), torch.randint(0, 3, (8,))) for _ in range(micro_batches)]
    scope = {"model": model, "loader": loader}
    exec(compile(_readme_torch_loop(), str(README), "exec"), scope)  # noqa: S102
    opt, sched = scope["opt"], scope["sched"]
    updates = math.ceil(micro_batches / 8)  # accum_steps=8 in the README
    steps = {int(s["step"]) for s in opt.optimizer.state.values()}
    assert steps == {updates}  # AdamW's own count of the updates applied
    assert sched.last_epoch == updates
    bn = scope["model"][1]  # registered with opt: one merge per update, the flush's included
    assert bn.registered_optimizer() is opt and int(bn.num_batches_tracked) == updates
    lr = 1e-3 * (1 + math.cos(math.pi * updates / 1000)) / 2  # CosineAnnealingLR, T_max=1000
    assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-9)


def test_update_applied_after_flush():
    """True after a flush() that applied a short cycle, False after one with nothing to apply
    and with leftover="carry" (which applies nothing)."""
    torch.manual_seed(1)
    for leftover, micro_batches, applied in (
        ("apply", 3, True),
        ("apply", 4, False),  # the cycle ended on the 4th step(): nothing left to flush
        ("carry", 3, False),
    ):
        model = nn.Linear(4, 2)
        opt = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=4, leftover=leftover
        )
        before = model.weight.detach().clone()
        for _ in range(micro_batches):
            model(torch.randn(2, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert opt.update_applied is (micro_batches == 4)
        moved_by_steps = not torch.equal(model.weight, before)
        assert opt.flush() is applied
        assert opt.update_applied is applied
        assert (not torch.equal(model.weight, before)) is (applied or moved_by_steps)
