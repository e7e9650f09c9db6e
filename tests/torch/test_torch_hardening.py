"""Hardening of the PyTorch wrapper: what it must refuse, skip, hold back or keep in phase.

Autograd's version counter, overflow of the fp32 accumulator, zero-weight cycles, the
non-finite policy, atomic steps (Ctrl-C and retried micro-batches), checks made at construction,
the state dict's layout fingerprint, float64 batch-norm moments under ``model.to(dtype)``, and
batch norm flushed with the optimizer — down to the README's loop, run as written.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from gradient_accumulator import core  # noqa: E402
from gradient_accumulator.nonfinite import (  # noqa: E402
    NonFiniteGradientError,
    NonFiniteGradientWarning,
)
from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    GradientAccumulateOptimizer,
    accumulate,
    convert_batchnorm,
)

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---- 1. autograd's version counter ----


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_bumps_version_counter_like_torch_optim(name):
    cls, kw = OPTIMIZERS[name]
    for wrap in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        inner = cls(model.parameters(), **kw)
        opt = GradientAccumulateOptimizer(inner, 1) if wrap else inner
        # pow saves the weight for its backward: a later in-place update must be detected.
        loss = model.weight.pow(2).sum() + model(torch.randn(4, 3)).sum()
        loss.backward(retain_graph=True)
        version = model.weight._version
        opt.step()
        assert model.weight._version > version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


# ---- 2. overflow of the accumulated result, zero-weight cycles ----


def _big_grads(model, value):
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def test_finite_gradients_whose_sum_overflows_skip_the_cycle():
    model = nn.Linear(3, 2)
    before = _snapshot(model)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    for _ in range(2):  # 3e38 is finite in fp32; 3e38 + 3e38 is not
        _big_grads(model, 3e38)
        if opt.is_boundary_next():
            with pytest.warns(NonFiniteGradientWarning, match="1 cycle skipped"):
                opt.step()
        else:
            opt.step()
    assert not opt.update_applied
    assert _same(_snapshot(model), before)
    assert opt.accumulation_state == (0, 0.0, False, 0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_finite_result_whose_norm_passes_float32_updates():
    """Every element of the cycle's gradient is finite (1e38) though its norm (1.05e39) is
    past float32's range: the cycle updates, as on Keras's TensorFlow and JAX paths (the norm
    alone used to drop it)."""
    model = nn.Linear(10, 10)
    before = _snapshot(model)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=1e-37), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteGradientWarning)
        for _ in range(2):
            _big_grads(model, 1e38)
            opt.step()
    assert opt.update_applied and not opt.step_was_skipped
    # mean of 1e38 and 1e38, times lr: w - 10 (to float32 rounding)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b - 10.0, rtol=0, atol=1e-5 * 10)


def test_huge_weight_never_reaches_the_weights():
    model = nn.Linear(3, 2)
    before = _snapshot(model)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    _big_grads(model, 1.0)
    # Either refused up front (naming the weight) or skipped as a non-finite cycle.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step(weight=1e308)
        except ValueError as e:
            assert "weight" in str(e)
    assert not opt.update_applied
    assert _same(_snapshot(model), before)
    if not any(issubclass(w.category, NonFiniteGradientWarning) for w in caught):
        assert opt.micro_step == 0


def test_growing_loss_scale_overflowing_the_accumulator_is_skipped_silently():
    """GradScaler-scaled gradients, finite per micro-batch, whose sum overflows fp32."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    before = _snapshot(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**124, growth_interval=10**6)
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), 4, grad_scaler=scaler
    )
    x = torch.full((8, 3), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scaler's signal: no warning
        for _ in range(4):
            loss = model(x).square().mean() + 10.0 * model.weight.sum()
            scaler.scale(loss).backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            opt.step()
            opt.zero_grad()
    assert not opt.update_applied
    assert _same(_snapshot(model), before)
    assert scaler.get_scale() == 2.0**123  # lowered once
    assert len(opt.optimizer.state) == 0  # AdamW did not step


@pytest.mark.parametrize("reduction", ["mean", "sum", "running_mean"])
def test_zero_weight_cycle_does_not_step(reduction):
    model = nn.Linear(3, 2)
    before = _snapshot(model)
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5), 3, reduction
    )
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step(weight=0)
        opt.zero_grad()
    assert not opt.update_applied
    assert _same(_snapshot(model), before)  # no weight decay on a zero gradient
    assert len(opt.optimizer.state) == 0
    assert opt.accumulation_state == (0, 0.0, False, 0)


# ---- 7. the non-finite policy ----


def _nan_cycle(model, opt, k):
    for j in range(k):
        model(torch.randn(4, 3)).sum().backward()
        if j == 1:
            model.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()


def test_nonfinite_skip_warns_rate_limited():
    model = nn.Linear(3, 2)
    before = _snapshot(model)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            _nan_cycle(model, opt, 2)
    msgs = [str(w.message) for w in caught if issubclass(w.category, NonFiniteGradientWarning)]
    assert [re.search(r"\((\d+) cycles? skipped", m).group(1) for m in msgs] == ["1", "2", "4"]
    assert _same(_snapshot(model), before)
    assert opt.accumulation_state.updates == 0


def test_nonfinite_raise_writes_nothing_and_drops_the_cycle():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    before = _snapshot(model)
    opt = GradientAccumulateOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1), 2, on_nonfinite="raise"
    )
    with pytest.raises(NonFiniteGradientError):
        _nan_cycle(model, opt, 2)
    assert _same(_snapshot(model), before)
    assert len(opt.optimizer.state) == 0
    assert opt.micro_step == 0  # the next micro-batch starts a fresh cycle
    # ... which is then exact: one clean cycle equals the plain optimizer on its mean gradient.
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    xs = [torch.randn(4, 3) for _ in range(2)]
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    (sum(ref(x).square().mean() for x in xs) / 2).backward()
    ref_opt.step()
    assert all(
        torch.allclose(a, b, rtol=0, atol=1e-6)
        for a, b in zip(model.parameters(), ref.parameters())
    )


def test_nonfinite_apply_applies_it():
    model = nn.Linear(3, 2)
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 2, on_nonfinite="apply"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _nan_cycle(model, opt, 2)
    assert opt.update_applied
    assert torch.isnan(model.weight[0, 0])


@pytest.mark.parametrize("bad, exc", [("ignore", ValueError), (None, TypeError)])
def test_on_nonfinite_is_validated(bad, exc):
    model = nn.Linear(3, 2)
    with pytest.raises(exc, match="on_nonfinite"):
        GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), 2, on_nonfinite=bad
        )


# ---- 3. atomic steps ----


def _interrupt_after(monkeypatch, name, at_call):
    """Wrap ``core.<name>``: on its ``at_call``-th call, run it, then deliver a real SIGINT."""
    real = getattr(core, name)
    calls = {"n": 0}

    def wrapper(*a, **kw):
        out = real(*a, **kw)
        calls["n"] += 1
        if calls["n"] == at_call:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(core, name, wrapper)
    return calls


def _train(model, opt, batches, retry_interrupted=False):
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        try:
            opt.step(weight=len(x))
        except KeyboardInterrupt:
            if not retry_interrupted:
                raise
        opt.zero_grad()


def _batches(n, seed=3, sizes=(3, 5, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(sizes[i % len(sizes)], 6, generator=g),
            torch.randn(sizes[i % len(sizes)], 2, generator=g),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "where, at_call", [("accumulate", 2), ("accumulate", 3), ("accumulate", 4), ("apply", 1)]
)
def test_ctrl_c_during_step_leaves_counters_and_buffers_together(monkeypatch, where, at_call):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    ref = copy.deepcopy(model)
    batches = _batches(8)
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05), 4, max_grad_norm=0.5
    )
    ref_opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(ref.parameters(), lr=0.05), 4, max_grad_norm=0.5
    )
    calls = _interrupt_after(monkeypatch, where, at_call)
    interrupted = []
    for i, (x, y) in enumerate(batches):
        F.mse_loss(model(x), y).backward()
        before = opt.micro_step
        try:
            opt.step(weight=len(x))
        except KeyboardInterrupt:
            interrupted.append(i)
            # The step finished before the interrupt surfaced: the micro-batch counted once.
            assert opt.micro_step == (before + 1) % 4
            assert all(p.grad is None for p in model.parameters())
        opt.zero_grad()
    monkeypatch.undo()
    assert calls["n"] >= at_call and len(interrupted) == 1
    _train(ref, ref_opt, batches)
    assert opt.accumulation_state == ref_opt.accumulation_state
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_failed_step_counts_the_micro_batch_once_on_retry():
    """An error before anything is written: nothing moves, the weight given to accumulate()
    is kept, and the retried step counts the micro-batch once."""
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    ref = copy.deepcopy(model)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    ref_opt = GradientAccumulateOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1), 2)
    batches = _batches(4)
    for j, (x, y) in enumerate(batches):
        with accumulate(model, opt, weight=len(x)):
            F.mse_loss(model(x), y).backward()
        if j == 1:
            good = model.bias.grad
            model.bias.grad = good.to_sparse()  # refused
            acc_before = [a.clone() for a in opt.accumulators()]
            with pytest.raises(TypeError, match="'bias' has a sparse gradient"):
                opt.step()
            assert opt.micro_step == 1
            assert all(torch.equal(a, b) for a, b in zip(opt.accumulators(), acc_before))
            assert model.weight.grad is not None
            model.bias.grad = good
        opt.step()
        opt.zero_grad()
    _train(ref, ref_opt, batches)
    assert opt.accumulation_state == ref_opt.accumulation_state
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


# ---- 4. refused at construction, named ----


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("clip", [None, "norm", "agc"])
def test_a_channels_last_model_trains_like_the_same_model_contiguous(kind, clip):
    torch.manual_seed(0)
    base = _Conv()
    xs = [torch.randn(2, 3, 6, 6) for _ in range(4)]
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    }[kind]
    kw = {"max_grad_norm": 0.5} if clip == "norm" else {}
    if clip == "agc":
        kw = {"use_agc": True, "clip_factor": 0.01}
    results = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = copy.deepcopy(base).to(memory_format=fmt)
        opt = GradientAccumulateOptimizer(make(model.parameters()), 2, model=model, **kw)
        # The same gradients in both runs: computed on the contiguous model's inputs and
        # copied into .grad, so that only the update's handling of the layout differs.
        for x in xs:
            ref = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
            ref.head(ref.stem(x).relu().mean((2, 3))).square().sum().backward()
            for p, r in zip(model.parameters(), ref.parameters()):
                p.grad = torch.empty_like(p).copy_(r.grad)
            opt.step()
            opt.zero_grad()
        assert model.stem.weight.is_contiguous(memory_format=fmt)
        results.append([p.detach().contiguous() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_non_dense_parameter_refused_and_agc_needs_its_units_consecutive():
    w = nn.Parameter(torch.randn(4, 12)[:, ::2])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is not contiguous"):
        GradientAccumulateOptimizer(torch.optim.SGD([w], lr=0.1), 2)
    t = nn.Parameter(torch.randn(6, 4).t())  # dense, but dimension 0 is the inner one
    GradientAccumulateOptimizer(torch.optim.SGD([t], lr=0.1), 2)  # accepted without AGC
    with pytest.raises(ValueError, match="adaptive-clipping units"):
        GradientAccumulateOptimizer(
            torch.optim.SGD([t, nn.Parameter(torch.randn(3, 2))], lr=0.1), 2, use_agc=True
        )


def test_parameter_converted_after_construction_refused_before_the_boundary_writes():
    torch.manual_seed(0)
    model = _Conv()
    ref = copy.deepcopy(model)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    ref_opt = GradientAccumulateOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1), 2)
    xs = [torch.randn(2, 3, 5, 5) for _ in range(2)]

    def loss(m, x):
        return m.head(m.stem(x).mean((2, 3))).square().sum()

    loss(model, xs[0]).backward()
    opt.step()
    opt.zero_grad()
    model.to(memory_format=torch.channels_last)
    loss(model, xs[1]).backward()
    before = [a.clone() for a in opt.accumulators()]
    with pytest.raises(ValueError, match=r"'stem\.weight' is channels-last"):
        opt.step()
    assert opt.micro_step == 1 and not opt.update_applied
    assert all(torch.equal(a, b) for a, b in zip(opt.accumulators(), before))
    model.to(memory_format=torch.contiguous_format)
    opt.step()  # the retry counts the micro-batch once
    assert opt.update_applied
    for x in xs:
        loss(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(
        torch.allclose(a, b, rtol=0, atol=1e-6)
        for a, b in zip(model.parameters(), ref.parameters())
    )


def test_parameters_sharing_storage_refused_at_construction_by_name():
    model = nn.Module()
    base = torch.randn(10)
    model.a = nn.Parameter(base[:6])
    model.b = nn.Parameter(base[4:])
    with pytest.raises(ValueError, match="'a' and 'b' share memory"):
        GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)


@pytest.mark.parametrize("cuda_build", [False, True])
def test_meta_device_model_refused_at_construction_by_name(monkeypatch, cuda_build):
    # A model built on the meta device has no memory to accumulate into. With a CUDA build it got
    # past the device check (which only asked "not CPU and no CUDA kernels") and failed later with
    # a bare BufferError from the DLPack export; without one the message blamed missing CUDA.
    monkeypatch.setattr(core, "has_cuda", lambda: cuda_build)
    model = nn.Linear(3, 2, device="meta")
    with pytest.raises(TypeError, match=r"'weight' is on meta.*to_empty"):
        GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"clip_factor": float("inf")}, "clip_factor"),
        ({"clip_factor": float("nan")}, "clip_factor"),
        ({"eps": float("inf")}, "eps"),
        ({"eps": -1.0}, "eps"),
    ],
)
def test_agc_settings_refused_at_construction(kw, name):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=rf"^{name} must be finite"):
        GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), 2, use_agc=True, **kw
        )


def test_model_argument_is_validated():
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="model"):
        GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=3)


# ---- 6. state dicts: layout fingerprint, truncation; float64 BN moments ----


def _opt_for(model):
    return GradientAccumulateOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), 2)


def _one_micro_step(model, opt, features):
    model(torch.randn(4, features)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_state_dict_of_another_layout_with_the_same_size_is_refused():
    a, b = nn.Linear(2, 4), nn.Linear(3, 3)  # 8 + 4 and 9 + 3 elements
    opt_a, opt_b = _opt_for(a), _opt_for(b)
    assert opt_a.accumulators()[0].numel() + 4 == 12 == opt_b.accumulators()[0].numel() + 3
    assert opt_a._loop.flat.numel() == opt_b._loop.flat.numel()
    for _ in range(3):
        _one_micro_step(a, opt_a, 2)
    before = opt_b.state_dict()
    with pytest.raises(ValueError, match="another parameter layout"):
        opt_b.load_state_dict(opt_a.state_dict())
    after = opt_b.state_dict()
    assert after["accumulation"]["micro_step"] == before["accumulation"]["micro_step"]
    assert after["optimizer"]["state"] == {}


@pytest.mark.parametrize("cut", ["seen", "accumulation", "layout", "seen_short", "groups"])
def test_truncated_state_dict_is_refused_at_load(cut):
    model = nn.Linear(3, 2)
    opt = _opt_for(model)
    for _ in range(3):
        _one_micro_step(model, opt, 3)
    sd = opt.state_dict()
    fresh_model = copy.deepcopy(model)
    fresh = _opt_for(fresh_model)
    if cut == "accumulation":
        del sd["accumulation"]
    elif cut == "seen_short":
        sd["accumulation"]["seen"] = sd["accumulation"]["seen"][:1]
    elif cut == "groups":
        sd["optimizer"]["param_groups"][0]["params"] = [0]
    else:
        del sd["accumulation"][cut]
    with pytest.raises(ValueError, match="state_dict"):
        fresh.load_state_dict(sd)
    assert fresh.micro_step == 0 and len(fresh.optimizer.state) == 0
    # The untouched wrapper still works.
    for _ in range(2):
        _one_micro_step(fresh_model, fresh, 3)
    assert fresh.update_applied


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_batchnorm_cycle_moments_survive_model_to_dtype(dtype):
    torch.manual_seed(0)
    bn = AccumBatchNorm1d(5, accum_steps=3)
    bn(torch.randn(7, 5) * 3 + 1)
    bn(torch.randn(4, 5))
    saved = {n: getattr(bn, n).clone() for n in ("accum_count", "accum_mean", "accum_m2")}
    bn.to(dtype)
    for n, v in saved.items():
        t = getattr(bn, n)
        assert t.dtype == torch.float64 and torch.equal(t, v), n
    assert bn.running_mean.dtype == dtype
    bn.float()
    for n, v in saved.items():
        assert torch.equal(getattr(bn, n), v), n


# ---- 8. batch norm flushed with the optimizer ----


class _RefBN(nn.BatchNorm1d):
    """Normalises each micro-batch by itself; running statistics from the whole cycle (fp64)."""

    def __init__(self, c):
        super().__init__(c)
        self.seen = []

    def forward(self, x):
        self.seen.append(x.detach())
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self):
        x = torch.cat(self.seen)
        self.seen = []
        m = self.momentum
        self.running_mean.mul_(1 - m).add_(m * x.mean(0))
        self.running_var.mul_(1 - m).add_(m * x.var(0))
        self.num_batches_tracked += 1


class _Net(nn.Module):
    def __init__(self, bn_cls=nn.BatchNorm1d):
        super().__init__()
        self.fc1 = nn.Linear(6, 8, bias=False)  # batch norm follows
        self.bn = bn_cls(8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _loader(n, seed=11):
    g = torch.Generator().manual_seed(seed)
    sizes = [5, 3, 7, 4, 6]
    return [
        (
            torch.randn(sizes[i % 5], 6, generator=g),
            torch.randint(0, 4, (sizes[i % 5],), generator=g),
        )
        for i in range(n)
    ]


def _reference(model, loader, k, make_opt, clip=None, sched_factory=None):
    """fp64 big batch of every cycle (per-micro-batch normalisation, as AccumBatchNorm)."""
    ref = copy.deepcopy(model).double()
    ref.bn.__class__ = _RefBN
    ref.bn.seen = []
    opt = make_opt(ref.parameters())
    sched = sched_factory(opt) if sched_factory else None
    for c in range(0, len(loader), k):
        cycle = loader[c : c + k]
        total = sum(len(y) for _, y in cycle)
        loss = sum(F.cross_entropy(ref(x.double()), y) * (len(y) / total) for x, y in cycle)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        ref.bn.commit()
        if sched:
            sched.step()
    return ref


def _assert_close(model, ref, tol):
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        if n.endswith(("accum_count", "accum_mean", "accum_m2", "accum_step")):
            continue
        if a.is_floating_point():
            err = (a.double() - b.double()).abs().max().item() / max(
                b.double().abs().max().item(), 1e-12
            )
            assert err <= tol, (n, err)
        else:
            assert torch.equal(a, b), n


@pytest.mark.parametrize("give_model", [False, True])
def test_optimizer_flush_flushes_batchnorm_short_last_cycle(give_model):
    torch.manual_seed(0)
    base = _Net()
    model = convert_batchnorm(copy.deepcopy(base), accum_steps=3)
    loader = _loader(3 * 3 + 2)  # a short last cycle of 2 micro-batches
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 3, model=model if give_model else None
    )
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step(weight=len(y))
        opt.zero_grad()
    assert opt.flush()
    assert int(model.bn.num_batches_tracked) == 4 and int(model.bn.accum_step) == 0
    ref = _reference(base, loader, 3, lambda ps: torch.optim.SGD(ps, lr=0.1))
    _assert_close(model, ref, 2e-6)


def test_optimizer_flush_finds_non_affine_batchnorm_through_model():
    model = nn.Sequential(nn.Linear(3, 4), AccumBatchNorm1d(4, affine=False, accum_steps=2))
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    opt.flush()
    assert int(model[1].num_batches_tracked) == 1


def _readme_pytorch_loop() -> str:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("## PyTorch", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_pytorch_loop_is_exact_as_written():
    """The README's loop, run verbatim on a model with batch norm and a short last cycle."""
    code = _readme_pytorch_loop()
    assert "opt.flush()" in code and "convert_batchnorm" in code
    torch.manual_seed(0)
    base = _Net()
    loader = _loader(8 * 3 + 5)
    namespace = {"model": copy.deepcopy(base), "loader": loader}
    exec(compile(code, "README.md", "exec"), namespace)
    model, opt = namespace["model"], namespace["opt"]
    assert opt.accumulation_state.updates == 4
    ref = _reference(
        base,
        loader,
        8,
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        clip=1.0,
        sched_factory=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=1000),
    )
    assert int(model.bn.num_batches_tracked) == 4
    _assert_close(model, ref, 1e-5)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_storage_replaced_or_state_reloaded_between_cycles_trains_on_like_the_original(kind):
    # The wrapper calls the core on registered tensor sets: a parameter whose memory was
    # replaced (p.data = ...) and optimizer state replaced by load_state_dict are registered
    # again, never written through the old pointers.
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    xs = [torch.randn(3, 5) for _ in range(8)]

    def make(m):
        inner = (
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            if kind == "sgd"
            else torch.optim.AdamW(m.parameters(), lr=0.01)
        )
        return GradientAccumulateOptimizer(inner, 2, model=m)

    results = []
    for disturb in (False, True):
        model = copy.deepcopy(base)
        opt = make(model)
        for j, x in enumerate(xs):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            if disturb and j in (1, 3):
                old = [p.data for p in model.parameters()]
                kept = [t.clone() for t in old]
                for p in model.parameters():
                    p.data = p.data.clone()  # new storage, same values
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if disturb:  # the storage replaced after the fourth micro-step was written no more
            assert all(torch.equal(a, b) for a, b in zip(old, kept))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
