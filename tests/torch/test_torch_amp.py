"""torch.amp.GradScaler through ``grad_scaler=``: scaled accumulation, unscaled once, inf skips."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402

K, B = 4, 8
CONFIGS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}),
}


def _scaler(init_scale=1024.0, **kw):
    kw.setdefault("growth_interval", 10**6)  # growth off
    return torch.amp.GradScaler("cpu", init_scale=init_scale, **kw)


def _run(model, opt, data, mse, cycles, scaler=None, inject=None):
    """Train on the given cycle indices; ``inject=(cycle, micro)`` puts an inf in one .grad."""
    x, y = data
    for c in cycles:
        for j in range(K):
            sl = slice((c * K + j) * B, (c * K + j + 1) * B)
            loss = mse(model, x[sl], y[sl])
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if inject == (c, j):
                model.fc1.weight.grad[0, 0] = float("inf")
            opt.step()
            opt.zero_grad()


def _clone_state(inner):
    return {
        id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for p, s in inner.state.items()
    }


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_scaled_run_equals_unscaled_run(name, clip, make_pair, make_data, mse, rel_err):
    cls, kw = CONFIGS[name]
    data = make_data(K * B * 5)
    plain, _ = make_pair()
    scaled, _ = make_pair()
    opt_p = GradientAccumulateOptimizer(cls(plain.parameters(), **kw), K, max_grad_norm=clip)
    scaler = _scaler()
    opt_s = GradientAccumulateOptimizer(
        cls(scaled.parameters(), **kw), K, max_grad_norm=clip, grad_scaler=scaler
    )
    _run(plain, opt_p, data, mse, range(5))
    _run(scaled, opt_s, data, mse, range(5), scaler=scaler)
    assert scaler.get_scale() == 1024.0
    assert opt_s.accumulation_state.updates == 5
    assert rel_err(list(scaled.parameters()), list(plain.parameters())) <= 1e-6
    if clip is not None:
        assert opt_s.last_grad_norm == pytest.approx(opt_p.last_grad_norm, rel=1e-6)
    # The scaled accumulators really held scaled gradients (the scale was not a no-op).
    x, y = data
    mse(scaled, x[:B], y[:B]).mul(scaler.get_scale()).backward()
    opt_s.step()
    mse(plain, x[:B], y[:B]).backward()
    opt_p.step()
    ratio = opt_s.accumulators()[0] / opt_p.accumulators()[0]
    assert torch.allclose(ratio, torch.full_like(ratio, 1024.0), rtol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inf_cycle_is_skipped_reset_and_halves_the_scale(name, make_pair, make_data, mse, rel_err):
    cls, kw = CONFIGS[name]
    data = make_data(K * B * 4)
    model, _ = make_pair()
    inner = cls(model.parameters(), **kw)
    scaler = _scaler()
    opt = GradientAccumulateOptimizer(inner, K, grad_scaler=scaler)
    _run(model, opt, data, mse, [0, 1], scaler=scaler)
    assert opt.accumulation_state.updates == 2
    weights = [p.detach().clone() for p in model.parameters()]
    state = _clone_state(inner)

    _run(model, opt, data, mse, [2], scaler=scaler, inject=(2, 1))
    assert not opt.update_applied
    assert opt.micro_step == 0
    assert opt.accumulation_state == (0, 0.0, False, 2)
    assert scaler.get_scale() == 512.0
    for w, p in zip(weights, model.parameters()):
        assert torch.equal(w, p)
    for p, s in inner.state.items():
        for k, v in s.items():
            before = state[id(p)][k]
            assert torch.equal(v, before) if isinstance(v, torch.Tensor) else v == before
    assert all(p.grad is None for p in model.parameters())

    # The next cycle is exact: as if cycle 2 had never been seen.
    _run(model, opt, data, mse, [3], scaler=scaler)
    assert opt.update_applied
    assert scaler.get_scale() == 512.0
    ref, _ = make_pair()
    ref_opt = GradientAccumulateOptimizer(cls(ref.parameters(), **kw), K)
    _run(ref, ref_opt, data, mse, [0, 1, 3])
    assert rel_err(list(model.parameters()), list(ref.parameters())) <= 1e-6
    for p, q in zip(model.parameters(), ref.parameters()):
        if "step" in inner.state[p]:
            assert float(inner.state[p]["step"]) == 3 == float(ref_opt.state[q]["step"])


def test_scale_grows_after_growth_interval_finite_cycles(make_pair, make_data, mse):
    data = make_data(K * B * 5)
    model, _ = make_pair()
    scaler = _scaler(init_scale=256.0, growth_interval=2, growth_factor=2.0, backoff_factor=0.25)
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), K, grad_scaler=scaler
    )
    scales = []
    for c in range(5):
        _run(model, opt, data, mse, [c], scaler=scaler, inject=(2, 3) if c == 2 else None)
        scales.append(scaler.get_scale())
    # Two finite cycles: ×2; an inf cycle: ×0.25 and the growth count restarts.
    assert scales == [256.0, 512.0, 128.0, 128.0, 256.0]


def test_resumed_scaler_that_scaled_nothing_yet_can_end_a_cycle(make_pair, make_data, mse):
    """A run saved mid-cycle and resumed with a fresh GradScaler loaded from the saved one, then
    ended at once with flush(): the scaler never scaled a loss since its load, and torch's
    update() asserted ("_scale is None"). The flush now applies the partial cycle exactly as
    the uninterrupted run's flush does (bit for bit), scale included."""
    data = make_data(K * B)
    results = []
    for resume in (False, True):
        model, _ = make_pair(0)
        scaler = _scaler()
        opt = GradientAccumulateOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), K, grad_scaler=scaler
        )
        x, y = data
        for j in range(2):
            sl = slice(j * B, (j + 1) * B)
            scaler.scale(mse(model, x[sl], y[sl])).backward()
            opt.step()
            opt.zero_grad()
        if resume:
            saved, saved_scaler = opt.state_dict(), scaler.state_dict()
            scaler = _scaler()
            scaler.load_state_dict(saved_scaler)
            opt = GradientAccumulateOptimizer(
                torch.optim.AdamW(model.parameters(), lr=1e-2), K, grad_scaler=scaler
            )
            opt.load_state_dict(saved)
        assert opt.flush()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert results[0][1] == results[1][1] == 1024.0
