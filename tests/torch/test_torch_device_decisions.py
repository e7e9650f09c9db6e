"""Boundaries decided on the device: the CUDA path's skip and Adam steps left to the core.

On CUDA the wrapper does not read the non-finite flag at the boundary: the fused apply reads it
and skips there, Adam's ``step`` counters advance there, and the host learns the outcome when
asked (``update_applied``, ``updates``, ``flush()``, ``state_dict()``) or, for the warning, once
a copy of the skip count has arrived. Here that path runs on CPU tensors (the flag in host
memory, ``_loop.DEVICE_PATH_ON_CPU``) and is compared bit for bit with the same arithmetic
decided on the host, which reads the flag at every boundary as the CUDA path did before.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gradient_accumulator.nonfinite import NonFiniteGradientError, NonFiniteGradientWarning
from gradient_accumulator.torch import GradientAccumulateOptimizer, _loop, _outcomes

K = 3


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setattr(_loop, "DEVICE_PATH_ON_CPU", True)


def _host_decides(monkeypatch):
    monkeypatch.setattr(_loop.Loop, "decides_on_device", lambda self, hooks: False)


CONFIGS = {
    "adamw_clip": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), dict(max_grad_norm=0.3)),
    "adam_agc": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3), dict(use_agc=True)),
    "sgd_nesterov": (
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        dict(),
    ),
}
NAN_AT = {4, 5, 13}  # micro-steps whose loss is NaN: cycles 1 and 4 are skipped


def _run(cls, kw, wkw, steps=17, read_each=True, flush=True):
    """Train ``steps`` micro-batches with weights 1–3 (a short last cycle flushed); returns the
    model, the wrapper and what it reported after each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = GradientAccumulateOptimizer(cls(model.parameters(), **kw), K, **wkw)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(steps * 4, 6, generator=g), torch.randn(steps * 4, 3, generator=g)
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            loss = (model(x[4 * i : 4 * i + 4]) - y[4 * i : 4 * i + 4]).square().mean()
            if i in NAN_AT:
                loss = loss * float("nan")
            loss.backward()
            opt.step(weight=1.0 + i % 3)
            opt.zero_grad()
            if read_each:
                seen.append(opt.update_applied)
        if flush:
            seen.append(opt.flush())
    warned = [w for w in caught if issubclass(w.category, NonFiniteGradientWarning)]
    return model, opt, seen, len(warned)


def _state(opt):
    out = []
    for st in opt.optimizer.state.values():
        out.extend(v.detach().clone().reshape(-1) for v in st.values())
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_decisions_equal_host_decisions_bit_for_bit(name, device_path, monkeypatch):
    cls, kw, wkw = CONFIGS[name]
    recorded = []
    record = _outcomes.DeviceOutcomes.record

    def counting(self, flag):
        recorded.append(1)
        return record(self, flag)

    monkeypatch.setattr(_outcomes.DeviceOutcomes, "record", counting)
    m_dev, o_dev, seen_dev, warned_dev = _run(cls, kw, wkw)
    boundaries = len(recorded)
    _host_decides(monkeypatch)
    m_host, o_host, seen_host, warned_host = _run(cls, kw, wkw)
    assert boundaries == 6 and len(recorded) == boundaries  # 5 full cycles and the flush
    for p, q in zip(m_dev.parameters(), m_host.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(_state(o_dev), _state(o_host)):
        assert torch.equal(a, b)
    assert seen_dev == seen_host
    assert seen_dev.count(True) == 4  # cycles 0, 2, 3 and the flushed one
    assert o_dev.accumulation_state.updates == o_host.accumulation_state.updates == 4
    assert warned_dev == warned_host == 2
    if cls is not torch.optim.SGD:
        steps = {float(st["step"]) for st in o_dev.optimizer.state.values()}
        assert steps == {4.0}
        assert all(st["step"].dtype == torch.float32 for st in o_dev.optimizer.state.values())


def test_nothing_is_read_from_the_device_unless_asked(device_path, monkeypatch):
    reads = []
    for name in ("settle", "last_skipped"):
        real = getattr(_outcomes.DeviceOutcomes, name)

        def reading(self, real=real, name=name):
            reads.append(name)
            return real(self)

        monkeypatch.setattr(_outcomes.DeviceOutcomes, name, reading)
    _, opt, _, _ = _run(*CONFIGS["adamw_clip"], steps=16, read_each=False)
    # 16 micro-steps, 5 boundaries and a flush: read only by flush(), which returns the outcome.
    assert reads == ["last_skipped"]
    assert opt.accumulation_state.updates == 4
    assert reads[-1] == "settle"


def test_a_resumed_run_continues_bit_for_bit(device_path):
    cls, kw, wkw = CONFIGS["adamw_clip"]
    model, opt, _, _ = _run(cls, kw, wkw, steps=8, read_each=False, flush=False)  # mid-cycle
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved["accumulation"]["updates"] == 1
    torch.manual_seed(5)
    twin = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    twin.load_state_dict(saved_model)
    twin_opt = GradientAccumulateOptimizer(cls(twin.parameters(), **kw), K, **wkw)
    twin_opt.load_state_dict(saved)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, 3, generator=g)
    for m, o in ((model, opt), (twin, twin_opt)):
        for i in range(10):
            (m(x[4 * i : 4 * i + 4]) - y[4 * i : 4 * i + 4]).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert opt.accumulation_state.updates == twin_opt.accumulation_state.updates == 5


def test_what_needs_the_outcome_first_is_decided_on_the_host(device_path):
    # on_nonfinite="raise" must raise at the boundary itself; a step hook must not see a
    # skipped cycle; both read the flag instead.
    cls, kw, _ = CONFIGS["adamw_clip"]
    model = torch.nn.Linear(4, 2)
    opt = GradientAccumulateOptimizer(cls(model.parameters(), **kw), 2, on_nonfinite="raise")
    for i in range(2):
        loss = model(torch.ones(1, 4)).sum() * (float("nan") if i else 1.0)
        loss.backward()
        if i:
            with pytest.raises(NonFiniteGradientError):
                opt.step()
        else:
            opt.step()
    model = torch.nn.Linear(4, 2)
    opt = GradientAccumulateOptimizer(cls(model.parameters(), **kw), 2)
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(1))
    with pytest.warns(NonFiniteGradientWarning):
        for i in range(4):
            loss = model(torch.ones(1, 4)).sum() * (float("nan") if i == 1 else 1.0)
            loss.backward()
            opt.step()
    assert calls == [1] and opt.accumulation_state.updates == 1


def test_a_weightless_cycle_leaves_no_raised_flag_behind(device_path, monkeypatch):
    # A cycle whose micro-batches all weigh 0 updates nothing; a NaN in it still counts as a
    # skipped cycle, and the next cycle starts with the flag lowered.
    def run():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                loss = model(torch.full((1, 4), 1.0 + i)).sum()
                loss = loss * float("nan") if i == 0 else loss
                loss.backward()
                opt.step(weight=0.0 if i < 2 else 1.0)
        applied = opt.accumulation_state.updates
        return [p.detach().clone() for p in model.parameters()], applied, len(caught)

    dev = run()
    _host_decides(monkeypatch)
    host = run()
    assert dev[1:] == host[1:] == (2, 1)
    for p, q in zip(dev[0], host[0]):
        assert torch.equal(p, q)


def test_a_copy_made_after_a_device_boundary_knows_its_outcome(device_path):
    model = torch.nn.Linear(4, 2)
    opt = GradientAccumulateOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), 2)
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    twin = copy.deepcopy(opt)
    assert twin.update_applied and opt.update_applied
    assert twin.accumulation_state.updates == opt.accumulation_state.updates == 1
