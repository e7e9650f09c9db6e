"""Learning-rate schedulers and step hooks on GradientAccumulateOptimizer.

Every scheduler of ``torch.optim.lr_scheduler`` (and transformers' warm-up schedules) is built on
the wrapper before or after a ``load_state_dict`` round trip and stepped once per update; the
weights must match a plain AdamW with the same scheduler on the big batch.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.optim import lr_scheduler as L
from torch.optim.optimizer import register_optimizer_step_post_hook

from gradient_accumulator.torch import GradientAccumulateOptimizer

K, B, UPDATES = 3, 4, 10


def _factories() -> dict:
    return {
        "LambdaLR": lambda o: L.LambdaLR(o, lambda s: 1.0 / (1.0 + s)),
        "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda s: 0.8),
        "StepLR": lambda o: L.StepLR(o, 2, 0.5),
        "MultiStepLR": lambda o: L.MultiStepLR(o, [2, 5], 0.3),
        "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=3),
        "LinearLR": lambda o: L.LinearLR(o, start_factor=0.1, total_iters=5),
        "ExponentialLR": lambda o: L.ExponentialLR(o, 0.8),
        "SequentialLR": lambda o: L.SequentialLR(
            o, [L.LinearLR(o, 0.1, total_iters=3), L.ExponentialLR(o, 0.9)], milestones=[3]
        ),
        "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
        "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=6),
        "ChainedScheduler": lambda o: L.ChainedScheduler(
            [L.StepLR(o, 2, 0.5), L.ExponentialLR(o, 0.9)], optimizer=o
        ),
        "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, factor=0.5, patience=0),
        "CyclicLR": lambda o: L.CyclicLR(
            o, base_lr=1e-3, max_lr=1e-2, step_size_up=3, cycle_momentum=False
        ),
        "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3),
        # Also cycles Adam's beta1, which the fused update must read from the group.
        "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=1e-2, total_steps=UPDATES + 2),
    }


def _transformers_factories() -> dict:
    transformers = pytest.importorskip("transformers")
    return {
        "hf_linear_warmup": lambda o: transformers.get_linear_schedule_with_warmup(o, 3, UPDATES),
        "hf_cosine_warmup": lambda o: transformers.get_cosine_schedule_with_warmup(o, 3, UPDATES),
    }


def test_every_torch_scheduler_is_covered():
    found = {
        name
        for name, obj in vars(L).items()
        if inspect.isclass(obj)
        and issubclass(obj, L.LRScheduler)
        and obj is not L.LRScheduler
        and not name.startswith("_")
        and obj.__module__ == L.__name__
    }
    assert found <= set(_factories()), f"schedulers without a test: {found - set(_factories())}"


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(UPDATES, K * B, 6, generator=g)
    y = torch.randn(UPDATES, K * B, 2, generator=g)
    return x, y


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _sched_step(sched, metric=1.0):
    if isinstance(sched, L.ReduceLROnPlateau):
        sched.step(metric)  # a constant metric: a plateau on every update
    else:
        sched.step()


def _resume(opt, sched):
    """torch's documented resume order: build both, then load both states."""
    opt.load_state_dict(opt.state_dict())
    if sched is not None:
        sched.load_state_dict(sched.state_dict())


def _run(make_sched, accumulate: bool, order: str):
    x, y = _data()
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = GradientAccumulateOptimizer(inner, K, max_grad_norm=0.5) if accumulate else inner
    if order == "before":
        sched = make_sched(opt)
        _resume(opt, sched)
    else:
        _resume(opt, None)
        sched = make_sched(opt)
    lrs = []
    for u in range(UPDATES):
        if accumulate:
            for m in range(K):
                sl = slice(m * B, (m + 1) * B)
                torch.nn.functional.mse_loss(model(x[u, sl]), y[u, sl]).backward()
                opt.step(weight=B)
                opt.zero_grad()
            assert opt.update_applied
            lrs.append(inner.param_groups[0]["lr"])
        else:
            torch.nn.functional.mse_loss(model(x[u]), y[u]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            lrs.append(inner.param_groups[0]["lr"])
        _sched_step(sched)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), lrs


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("name", sorted(_factories()) + ["hf_linear_warmup", "hf_cosine_warmup"])
def test_scheduler_drives_the_update(name, order):
    factories = {**_factories(), **(_transformers_factories() if name.startswith("hf_") else {})}
    ref_w, ref_lrs = _run(factories[name], accumulate=False, order=order)
    w, lrs = _run(factories[name], accumulate=True, order=order)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12, abs=0.0)
    assert len(set(ref_lrs)) > 1, "the schedule must change the learning rate"
    tol = 1e-5 * ref_w.abs().max().item()
    assert (w - ref_w).abs().max().item() <= tol


def test_step_lr_after_state_round_trip_reaches_the_update():
    """The reported failure: a scheduler built after load_state_dict changed dead groups."""
    model = torch.nn.Linear(2, 1)
    opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), 2)
    opt.load_state_dict(opt.state_dict())
    sched = L.StepLR(opt, 1, 0.1)
    for _ in range(3):
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
        sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(1e-5, rel=1e-9)
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    assert opt.defaults is opt.optimizer.defaults


@pytest.mark.parametrize("inner_cls", [torch.optim.AdamW, torch.optim.RMSprop])
def test_step_hooks_fire_once_per_update(inner_cls):
    model = torch.nn.Linear(3, 2)
    inner = inner_cls(model.parameters(), lr=1e-2)
    opt = GradientAccumulateOptimizer(inner, 3)
    calls: list[str] = []

    def pre(o, args, kwargs):
        # A pre-hook sees the weights before the update.
        calls.append(("pre", o is opt, model.weight.detach().clone()))

    def post(o, args, kwargs):
        calls.append(("post", o is opt, model.weight.detach().clone()))

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    inner_calls = []
    inner.register_step_post_hook(lambda o, a, k: inner_calls.append(o is inner))
    glob = []
    handle = register_optimizer_step_post_hook(lambda o, a, k: glob.append(o is inner))
    try:
        for i in range(7):
            model(torch.full((2, 3), float(i))).square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert opt.flush()
    finally:
        handle.remove()
    kinds = [c[0] for c in calls]
    assert kinds == ["pre", "post"] * 3  # two full cycles and the flushed one
    assert all(c[1] for c in calls)
    for pre_call, post_call in zip(calls[::2], calls[1::2]):
        assert not torch.equal(pre_call[2], post_call[2])
    assert inner_calls == [True] * 3
    assert glob == [True] * 3
