"""accelerate with the real library: our prepare() and a plain accelerator.prepare(), weights,
flush, accumulate(), scheduler counts, refusals."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate  # noqa: E402
from gradient_accumulator.torch.accelerate import prepare  # noqa: E402

K, UPDATES, LR, WD, CLIP, WARMUP = 3, 10, 1e-2, 0.05, 0.5, 3
SIZES = [3, 5, 2, 4, 6, 1, 5, 3, 4]  # uneven micro-batches, repeated


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # accelerate's state is process-wide: every test starts and ends without it.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _micro_batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(UPDATES * K + 2):  # 10 full cycles and a short one of 2
        n = SIZES[i % len(SIZES)]
        out.append((torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)))
    return out


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _sched(opt):
    return transformers.get_linear_schedule_with_warmup(opt, WARMUP, UPDATES + 2)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _big_batch():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = _sched(opt)
    mbs = _micro_batches()
    for start in range(0, len(mbs), K):
        x = torch.cat([m[0] for m in mbs[start : start + K]])
        y = torch.cat([m[1] for m in mbs[start : start + K]])
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
    return _flat(model)


def _ours():
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), K, max_grad_norm=CLIP
    )
    sched = _sched(opt)
    model, opt, sched = prepare(accelerator, model, opt, sched)
    applied = 0
    for x, y in _micro_batches():
        with accumulate(model, opt, weight=len(x)):
            accelerator.backward(F.mse_loss(model(x), y))
        opt.step(weight=len(x))
        opt.zero_grad()
        sched.step()  # advances only after an update
        applied += opt.update_applied
        assert opt.update_applied == (opt.micro_step == 0)
    assert opt.micro_step == 2
    assert opt.flush()
    assert opt.update_applied and opt.micro_step == 0
    sched.step()
    assert applied == UPDATES
    assert opt.accumulation_state.updates == UPDATES + 1
    assert sched.scheduler.last_epoch == UPDATES + 1
    return _flat(model)


def _accelerate_own():
    """accelerate's own accumulation on the same micro-batches (each loss a micro-batch mean)."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=K)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = _sched(opt)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    mbs = _micro_batches()
    for i, (x, y) in enumerate(mbs):
        with accelerator.accumulate(model):
            if i == len(mbs) - 1:
                accelerator.gradient_state._set_sync_gradients(True)
            accelerator.backward(F.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad()
    return _flat(model)


def test_prepared_wrapper_matches_the_big_batch():
    ref = _big_batch()
    ours = _ours()
    own = _accelerate_own()
    scale = ref.abs().max().item()
    print(
        f"max|dw| ours {(ours - ref).abs().max().item():.3e}, "
        f"accelerate's own accumulation {(own - ref).abs().max().item():.3e}, "
        f"max|w| {scale:.3f}"
    )
    assert (ours - ref).abs().max().item() <= 1e-5 * scale


def test_accumulation_by_accelerate_and_the_wrapper_is_refused():
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), K)
    with pytest.raises(ValueError, match="accumulated twice"):
        prepare(accelerator, model, opt)
    # A plain prepare() is refused at the first step, before anything is accumulated.
    model, popt = accelerator.prepare(model, opt)
    assert popt is opt
    before = [p.detach().clone() for p in model.parameters()]
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.ones(2, 6)).sum())
        with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
            popt.step()
    assert opt.micro_step == 0 and opt.accumulation_state.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(float(a.abs().max()) == 0 for a in opt.accumulators())


def _plain_prepare():
    """accelerate's documented loop with a plain accelerator.prepare(): the scheduler is stepped
    on every micro-batch, the optimizer with each micro-batch's size."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), K, max_grad_norm=CLIP
    )
    sched = _sched(opt)
    model, popt, psched = accelerator.prepare(model, opt, sched)
    applied = 0
    for i, (x, y) in enumerate(_micro_batches()):
        with accumulate(model, popt, weight=len(x)):
            accelerator.backward(F.mse_loss(model(x), y))
        popt.step(weight=len(x))
        popt.zero_grad()
        psched.step()
        applied += popt.update_applied
        assert popt.micro_step == (i + 1) % K
        assert sched.last_epoch == applied  # one scheduler step per update
    assert popt.micro_step == 2
    assert popt.flush()
    assert popt.update_applied and popt.micro_step == 0
    psched.step()
    assert applied == UPDATES
    assert opt.accumulation_state.updates == UPDATES + 1
    assert sched.last_epoch == UPDATES + 1
    return _flat(model)


def test_plain_prepare_steps_the_scheduler_once_per_update_and_matches_the_big_batch():
    ref = _big_batch()
    ours = _plain_prepare()
    scale = ref.abs().max().item()
    print(f"plain prepare(): max|dw| {(ours - ref).abs().max().item():.3e}, max|w| {scale:.3f}")
    assert (ours - ref).abs().max().item() <= 1e-5 * scale


def test_plain_prepare_without_weights_counts_updates():
    """The plain loop, unweighted: 8 micro-batches at accum_steps=4 are 2 scheduler steps."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, popt, psched = accelerator.prepare(model, opt, sched)
    for _ in range(8):
        accelerator.backward(model(torch.ones(2, 6)).sum())
        popt.step()
        popt.zero_grad()
        psched.step()
    assert sched.last_epoch == 2 and opt.accumulation_state.updates == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25, rel=1e-12)


def test_plain_prepare_keeps_schedulers_on_the_live_groups():
    """prepare() round-trips the optimizer state: the scheduler must still drive the update."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = GradientAccumulateOptimizer(inner, 2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
    model, popt, psched = accelerator.prepare(model, opt, sched)
    for _ in range(3):
        for _ in range(2):
            model(torch.ones(2, 6)).sum().backward()
            popt.step()
            popt.zero_grad()
        psched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(LR, rel=1e-12)  # 4/4 after 3 updates
