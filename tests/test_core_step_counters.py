"""Adam's step counters and the skip flag in the tensors' memory (``core.apply``'s
``step_counters`` and ``skip_flag``): what lets a CUDA boundary decide without the host. On CPU
the same arguments run through the CPU core, compared here bit for bit with the host-step path."""

from __future__ import annotations

import pytest
import torch

from gradient_accumulator import core

SIZES = [3, 17, 0, 64, 5, 1]


def _tensors(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "params": [torch.randn(n, generator=g) for n in SIZES],
        "accumulators": [torch.randn(n, generator=g) for n in SIZES],
        "state1": [0.1 * torch.randn(n, generator=g) for n in SIZES],
        "state2": [0.01 * torch.rand(n, generator=g) for n in SIZES],
    }


def _clone(ts: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {k: [t.clone() for t in v] for k, v in ts.items()}


def _apply(ts: dict[str, list[torch.Tensor]], **kw):
    return core.apply(
        ts["params"], ts["accumulators"], state1=ts["state1"], state2=ts["state2"], **kw
    )


KW = dict(lr=1e-2, weight_decay=0.1, grad_scale=0.5, betas=(0.9, 0.99), eps=1e-8)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_each_tensor_uses_its_own_step_bit_for_bit(optimizer):
    # Steps made so far per tensor (joined at different times); the reference applies each
    # group of one step with the host step, the counters' call applies all at once.
    steps = [0.0, 4.0, 4.0, 1.0, 0.0, 9.0]
    ours, ref = _tensors(), _tensors()
    counters = [torch.tensor([s]) for s in steps]
    r = core.apply(
        ours["params"],
        ours["accumulators"],
        state1=ours["state1"],
        state2=ours["state2"],
        optimizer=optimizer,
        step_counters=counters,
        **KW,
    )
    assert r.skipped is False
    for s in sorted(set(steps)):
        idx = [i for i, x in enumerate(steps) if x == s]
        core.apply(
            [ref["params"][i] for i in idx],
            [ref["accumulators"][i] for i in idx],
            state1=[ref["state1"][i] for i in idx],
            state2=[ref["state2"][i] for i in idx],
            optimizer=optimizer,
            step=int(s) + 1,
            **KW,
        )
    for k in ours:
        for a, b in zip(ours[k], ref[k]):
            assert torch.equal(a, b), k
    assert [c.item() for c in counters] == [s + 1 for s in steps]


def test_equal_counters_match_one_host_step_with_global_clipping():
    ours, ref = _tensors(1), _tensors(1)
    counters = [torch.tensor([2.0]) for _ in SIZES]
    kw = dict(optimizer="adam", max_norm=0.3, skip_nonfinite=True, **KW)
    _apply(ours, step_counters=counters, **kw)
    _apply(ref, step=3, **kw)
    for k in ours:
        for a, b in zip(ours[k], ref[k]):
            assert torch.equal(a, b), k
    assert all(c.item() == 3.0 for c in counters)


@pytest.mark.parametrize("reset", [True, False])
def test_a_raised_skip_flag_writes_nothing_but_the_reset(reset):
    ts = _tensors(2)
    before = _clone(ts)
    counters = [torch.tensor([5.0]) for _ in SIZES]
    r = core.apply(
        ts["params"],
        ts["accumulators"],
        state1=ts["state1"],
        state2=ts["state2"],
        optimizer="adamw",
        step_counters=counters,
        skip_flag=torch.tensor([1.0]),
        reset=reset,
        **KW,
    )
    assert r.skipped is True
    for k in ("params", "state1", "state2"):
        for a, b in zip(ts[k], before[k]):
            assert torch.equal(a, b), k
    for a, b in zip(ts["accumulators"], before["accumulators"]):
        assert torch.equal(a, torch.zeros_like(b) if reset else b)
    assert all(c.item() == 5.0 for c in counters)
    # A lowered flag applies as if none were given.
    ref = _clone(ts)
    _apply(ts, optimizer="adamw", step_counters=counters, skip_flag=torch.tensor([0.0]), **KW)
    _apply(ref, optimizer="adamw", step=6, **KW)
    for k in ts:
        for a, b in zip(ts[k], ref[k]):
            assert torch.equal(a, b), k
    assert all(c.item() == 6.0 for c in counters)


def test_a_skipped_non_finite_call_leaves_the_counters():
    ts = _tensors(3)
    ts["accumulators"][3][7] = float("inf")
    counters = [torch.tensor([1.0]) for _ in SIZES]
    r = _apply(ts, optimizer="adam", skip_nonfinite=True, step_counters=counters, **KW)
    assert r.skipped is True
    assert all(c.item() == 1.0 for c in counters)


def _bad(counters, optimizer="adam", **extra):
    ts = _tensors(4)
    before = _clone(ts)
    saved = [c.clone() for c in counters if isinstance(c, torch.Tensor)]
    call = lambda: core.apply(  # noqa: E731
        ts["params"],
        ts["accumulators"],
        state1=ts["state1"],
        state2=ts["state2"],
        optimizer=optimizer,
        step_counters=counters,
        **{**KW, **extra},
    )
    return call, ts, before, saved


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: [torch.tensor([1.0])] * 2, ValueError, "step_counters has 2 tensors"),
        (lambda: [torch.tensor([1.5])] * len(SIZES), ValueError, r"step_counters\[0\] must hold"),
        (lambda: [torch.tensor([-1.0])] * len(SIZES), ValueError, r"step_counters\[0\] must hold"),
        (
            lambda: [torch.tensor([float(2**24)])] * len(SIZES),
            ValueError,
            r"step_counters\[0\] must hold",
        ),
        (lambda: [torch.tensor([1.0], dtype=torch.float64)] * len(SIZES), TypeError, "float32"),
        (lambda: [torch.tensor([1.0, 2.0])] * len(SIZES), TypeError, "1 element"),
        (lambda: "counters", TypeError, "list of tensors"),
    ],
)
def test_bad_counters_are_refused_writing_nothing(make, error, match):
    call, ts, before, saved = _bad(make())
    with pytest.raises(error, match=match):
        call()
    for k in ts:
        for a, b in zip(ts[k], before[k]):
            assert torch.equal(a, b), k


def test_one_counter_twice_or_inside_a_tensor_is_refused():
    shared = torch.tensor([1.0])
    call, ts, before, _ = _bad([shared] + [torch.tensor([1.0]) for _ in SIZES[1:-1]] + [shared])
    with pytest.raises(ValueError, match=r"step_counters\[\d\] overlaps step_counters\[\d\]"):
        call()
    assert shared.item() == 1.0
    ts = _tensors(5)
    inside = ts["state2"][1][4:5]
    inside.fill_(2.0)
    counters = [torch.tensor([1.0]) for _ in SIZES]
    counters[0] = inside
    with pytest.raises(ValueError, match=r"overlaps"):
        _apply(ts, optimizer="adam", step_counters=counters, **KW)
    assert inside.item() == 2.0


def test_counters_are_for_adam_only_and_the_flag_is_checked():
    call, *_ = _bad([torch.tensor([1.0]) for _ in SIZES], optimizer="sgd")
    with pytest.raises(ValueError, match="step_counters is for adam and adamw only"):
        call()
    ts = _tensors(6)
    with pytest.raises(TypeError, match="skip_flag must be a float32 tensor of 1 element"):
        core.apply(
            ts["params"],
            ts["accumulators"],
            optimizer="sgd",
            lr=0.1,
            skip_flag=torch.tensor([1.0, 0.0]),
        )
