"""Mid-cycle save/resume, and bad input: clear errors that leave weights and accumulators alone."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    GradientAccumulateOptimizer,
    accumulate,
)

K = 4
SIZES = [5, 11, 3, 13, 7, 2, 9, 4, 6, 10, 8, 2]


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = AccumBatchNorm1d(16, accum_steps=K)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


CONFIGS = {
    "adamw_clip": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {"max_grad_norm": 0.3}),
    "sgd_running_mean": (
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9},
        {"reduction": "running_mean"},
    ),
    "rmsprop_agc": (torch.optim.RMSprop, {"lr": 1e-3}, {"use_agc": True, "clip_factor": 0.02}),
}


def _micro_steps(model, opt, data, mse, indices):
    x, y = data
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    for i in indices:
        sl = slice(starts[i], starts[i] + SIZES[i])
        mse(model, x[sl], y[sl]).backward()
        opt.step(weight=SIZES[i])
        opt.zero_grad()


def _build(name, seed):
    cls, kw, wkw = CONFIGS[name]
    torch.manual_seed(seed)
    model = _BNNet()
    return model, GradientAccumulateOptimizer(cls(model.parameters(), **kw), K, **wkw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mid_cycle_save_and_resume(name, tmp_path, make_data, mse):
    data = make_data(sum(SIZES))
    model, opt = _build(name, seed=0)
    _micro_steps(model, opt, data, mse, range(len(SIZES)))
    assert opt.accumulation_state.updates == 3

    first, opt1 = _build(name, seed=0)
    _micro_steps(first, opt1, data, mse, range(6))  # one cycle and 2 micro-steps
    assert opt1.micro_step == 2
    path = tmp_path / "ckpt.pt"
    torch.save({"opt": opt1.state_dict(), "model": first.state_dict()}, path)
    ckpt = torch.load(path)

    resumed, opt2 = _build(name, seed=123)  # different initial weights, fresh optimizer
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.accumulation_state == opt1.accumulation_state
    assert int(resumed.bn.accum_step) == 2
    _micro_steps(resumed, opt2, data, mse, range(6, len(SIZES)))

    assert opt2.accumulation_state == opt.accumulation_state
    for a, b in zip(resumed.state_dict().values(), model.state_dict().values()):
        assert torch.allclose(a.double(), b.double(), rtol=0, atol=1e-7)
    for p, q in zip(resumed.parameters(), model.parameters()):
        for key, value in opt.optimizer.state[q].items():
            got = opt2.optimizer.state[p][key]
            assert torch.allclose(got.double(), value.double(), rtol=0, atol=1e-7)
    # Resuming without the accumulators (a fresh cycle) gives a different result.
    lost, opt3 = _build(name, seed=123)
    lost.load_state_dict(ckpt["model"])
    opt3.optimizer.load_state_dict(ckpt["opt"]["optimizer"])
    _micro_steps(lost, opt3, data, mse, range(6, len(SIZES)))
    assert (
        max((p - q).abs().max().item() for p, q in zip(lost.parameters(), model.parameters()))
        > 1e-5
    )


# ---- bad input ----


def _snapshot(model, opt=None, inner=None):
    snap = {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [
            None if p.grad is None else p.grad.clone().to_dense() for p in model.parameters()
        ],
    }
    if opt is not None:
        snap["accs"] = [a.clone() for a in opt.accumulators()]
        snap["cycle"] = opt.accumulation_state
    inner = inner if inner is not None else (opt.optimizer if opt is not None else None)
    if inner is not None:
        snap["state"] = {
            id(p): {k: v.clone() for k, v in s.items()} for p, s in inner.state.items()
        }
        snap["lr"] = [g["lr"] for g in inner.param_groups]
    return snap


def _assert_unchanged(before, after):
    assert before.keys() == after.keys()
    for a, b in zip(before["params"], after["params"]):
        assert torch.equal(a, b)
    for a, b in zip(before["grads"], after["grads"]):
        assert (a is None and b is None) or torch.equal(a, b)  # .grad left in place
    if "accs" in before:
        assert all(torch.equal(a, b) for a, b in zip(before["accs"], after["accs"]))
        assert before["cycle"] == after["cycle"]
    if "state" in before:
        assert before["state"].keys() == after["state"].keys()
        for pid, s in before["state"].items():
            for k, v in s.items():
                assert torch.equal(v, after["state"][pid][k])
        assert before["lr"] == after["lr"]


def _used_inner(model, make_data, mse):
    """An Adam that has already stepped (non-empty state)."""
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = make_data(8)
    mse(model, x, y).backward()
    inner.step()
    return inner


@pytest.mark.parametrize(
    ("kwargs", "exc", "arg"),
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": -1}, ValueError, "accum_steps"),
        ({"accum_steps": 2.5}, TypeError, "accum_steps"),
        ({"accum_steps": True}, TypeError, "accum_steps"),
        ({"accum_steps": "4"}, TypeError, "accum_steps"),
        ({"reduction": "median"}, ValueError, "reduction"),
        ({"leftover": "drop"}, ValueError, "leftover"),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": float("inf")}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": "1"}, TypeError, "max_grad_norm"),
        ({"use_agc": True, "max_grad_norm": 1.0}, ValueError, "use_agc"),
        ({"use_agc": True, "clip_factor": 0.0}, ValueError, "clip_factor"),
        ({"use_agc": True, "eps": -1.0}, ValueError, "eps"),
        ({"use_agc": True, "agc_exclude": "last"}, ValueError, "agc_exclude"),
        ({"use_agc": True, "agc_exclude": "foreign"}, ValueError, "agc_exclude"),
        ({"grad_scaler": 1024.0}, TypeError, "grad_scaler"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, exc, arg, make_pair, make_data, mse):
    model, _ = make_pair()
    inner = _used_inner(model, make_data, mse)
    kwargs = dict(kwargs)
    if kwargs.get("agc_exclude") == "foreign":
        kwargs["agc_exclude"] = [nn.Parameter(torch.zeros(3))]
    accum_steps = kwargs.pop("accum_steps", K)
    before = _snapshot(model, inner=inner)
    with pytest.raises(exc, match=arg):
        GradientAccumulateOptimizer(inner, accum_steps, **kwargs)
    _assert_unchanged(before, _snapshot(model, inner=inner))


def test_constructor_rejects_bad_optimizers(make_pair, make_data, mse):
    model, _ = make_pair()
    inner = _used_inner(model, make_data, mse)
    with pytest.raises(TypeError, match="optimizer"):
        GradientAccumulateOptimizer(list(model.parameters()), K)
    with pytest.raises(TypeError, match="optimizer"):
        GradientAccumulateOptimizer(model, K)
    opt = GradientAccumulateOptimizer(inner, K)
    before = _snapshot(model, opt)
    with pytest.raises(TypeError, match="GradientAccumulateOptimizer"):
        GradientAccumulateOptimizer(opt, K)
    with pytest.raises(RuntimeError, match="inner optimizer"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    _assert_unchanged(before, _snapshot(model, opt))
    # float64 parameters are not supported by the core: a clear TypeError naming the dtype.
    double = nn.Linear(2, 2).double()
    with pytest.raises(TypeError, match="dtype"):
        GradientAccumulateOptimizer(torch.optim.SGD(double.parameters(), lr=0.1), K)


def _half_cycle(make_pair, make_data, mse):
    """A wrapper one micro-step into a cycle, with the next micro-batch's .grad in place."""
    model, _ = make_pair()
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), K, max_grad_norm=0.5
    )
    x, y = make_data(8 * (K + 1))
    mse(model, x[:8], y[:8]).backward()
    opt.step(weight=8)
    mse(model, x[8:16], y[8:16]).backward()
    return model, opt, (x, y)


def _finish_and_compare(model, opt, data, mse, make_pair, make_data):
    """Complete the cycle; the result equals a run that never saw the failed calls."""
    x, y = data
    opt.step(weight=8)
    for i in range(2, K):
        mse(model, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]).backward()
        opt.step(weight=8)
    assert opt.update_applied
    clean, clean_opt, _ = _half_cycle(make_pair, make_data, mse)
    clean_opt.step(weight=8)
    for i in range(2, K):
        mse(clean, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]).backward()
        clean_opt.step(weight=8)
    for p, q in zip(model.parameters(), clean.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("weight", "exc"),
    [
        (float("nan"), ValueError),
        (-1.0, ValueError),
        (float("inf"), ValueError),
        ("a", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_step_rejects_bad_weights(weight, exc, make_pair, make_data, mse):
    model, opt, data = _half_cycle(make_pair, make_data, mse)
    before = _snapshot(model, opt)
    with pytest.raises(exc, match="weight"):
        opt.step(weight=weight)
    _assert_unchanged(before, _snapshot(model, opt))
    _finish_and_compare(model, opt, data, mse, make_pair, make_data)


def test_step_rejects_sparse_gradients():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), 2)
    emb(torch.tensor([1, 2])).sum().backward()
    before = _snapshot(emb, opt)
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    _assert_unchanged(before, _snapshot(emb, opt))


def test_load_state_dict_rejects_mismatches(make_pair, make_data, mse):
    model, opt, data = _half_cycle(make_pair, make_data, mse)
    other_model, _ = make_pair(seed=4)
    cases = [
        GradientAccumulateOptimizer(torch.optim.AdamW(other_model.parameters()), K + 1),
        GradientAccumulateOptimizer(
            torch.optim.AdamW(other_model.parameters()), K, reduction="sum"
        ),
        GradientAccumulateOptimizer(torch.optim.AdamW(nn.Linear(6, 3).parameters()), K),
    ]
    before = _snapshot(model, opt)
    for bad, arg in zip(cases, ["accum_steps", "reduction", "parameters"]):
        with pytest.raises(ValueError, match=arg):
            opt.load_state_dict(bad.state_dict())
        _assert_unchanged(before, _snapshot(model, opt))
    for junk in ({}, {"state": {}, "param_groups": []}, "ckpt"):
        with pytest.raises(ValueError, match="state_dict"):
            opt.load_state_dict(junk)
        _assert_unchanged(before, _snapshot(model, opt))
    _finish_and_compare(model, opt, data, mse, make_pair, make_data)


def test_accumulate_with_a_plain_optimizer_is_a_type_error(make_pair, make_data, mse):
    model, opt, data = _half_cycle(make_pair, make_data, mse)
    before = _snapshot(model, opt)
    with pytest.raises(TypeError, match="GradientAccumulateOptimizer"):
        with accumulate(model, opt.optimizer):
            pass
    _assert_unchanged(before, _snapshot(model, opt))
    _finish_and_compare(model, opt, data, mse, make_pair, make_data)


def test_inner_step_count_is_the_number_of_cycles(make_pair, make_data, mse):
    model, _ = make_pair()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = GradientAccumulateOptimizer(inner, 3)
    calls = []
    inner_rms = torch.optim.RMSprop(make_pair()[0].parameters())
    x, y = make_data(8)
    for _ in range(10):
        mse(model, x, y).backward()
        opt.step()
        calls.append(opt.update_applied)
    assert calls == [False, False, True] * 3 + [False]
    assert opt.accumulation_state.updates == 3
    assert all(float(inner.state[p]["step"]) == 3 for p in model.parameters())
    assert opt.flush() and float(inner.state[model.fc1.weight]["step"]) == 4
    # The fallback path calls the inner optimizer's own step once per cycle.
    rms_model = inner_rms.param_groups[0]["params"]
    counted = []
    inner_rms.register_step_post_hook(lambda o, a, k: counted.append(1))
    opt_rms = GradientAccumulateOptimizer(inner_rms, 3)
    for _ in range(9):
        sum(p.sum() for p in rms_model).backward()
        opt_rms.step()
    assert len(counted) == 3
    assert all(float(inner_rms.state[p]["step"]) == 3 for p in rms_model)


@pytest.mark.parametrize("inner_cls", [torch.optim.SGD, torch.optim.RMSprop])
def test_a_group_added_to_the_inner_optimizer_after_wrapping_is_refused(inner_cls):
    """inner.add_param_group() after wrapping: the new parameters' gradients were never folded
    in or freed, so they reached RMSprop's update summed over micro-steps and cycles (measured
    0.06-0.25 off the big batch after 3 cycles) and SGD's fused path raised a KeyError. Now the
    next step() refuses, before it counts anything."""
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    inner = inner_cls(a.parameters(), lr=0.1)
    opt = GradientAccumulateOptimizer(inner, 2)
    a(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    inner.add_param_group({"params": list(b.parameters())})
    (a(torch.ones(1, 3)).sum() + b(torch.ones(1, 3)).sum()).backward()
    grads = [p.grad.clone() for p in a.parameters()]
    with pytest.raises(RuntimeError, match="parameter groups changed"):
        opt.step()
    assert opt.micro_step == 1
    for p, g in zip(a.parameters(), grads):
        assert torch.equal(p.grad, g)  # the micro-batch is left in place, uncounted


def test_accum_steps_assigned_after_construction_is_checked_and_governs_the_cycle():
    """``opt.accum_steps`` is a public attribute (Lightning forwards it): an assignment is
    validated like the constructor's argument, and a valid one sets the next cycle's length —
    three micro-batches of weights 1, 2, 3 then make one update equal to SGD on their weighted
    mean gradient (fp64 reference, rtol 1e-6)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    start = [p.detach().double().clone() for p in model.parameters()]
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    for bad, err in ((0, ValueError), (2.5, TypeError), ("3", TypeError)):
        with pytest.raises(err, match="accum_steps"):
            opt.accum_steps = bad
    assert opt.accum_steps == 2
    opt.accum_steps = 3
    xs = [torch.randn(4, 3) for _ in range(3)]
    for j, x in enumerate(xs):
        model(x).square().mean().backward()
        opt.step(weight=j + 1.0)
        opt.zero_grad()
        assert opt.update_applied == (j == 2)
    ref = [p.clone().requires_grad_(True) for p in start]
    loss = sum(
        (j + 1.0) / 6.0 * (x.double() @ ref[0].T + ref[1]).square().mean() for j, x in enumerate(xs)
    )
    grads = torch.autograd.grad(loss, ref)
    for p, s, g in zip(model.parameters(), start, grads):
        torch.testing.assert_close(p.detach().double(), s - 0.1 * g, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "attr, before, after",
    [
        ("reduction", "mean", "sum"),
        ("reduction", "running_mean", "mean"),
        ("reduction", "sum", "running_mean"),
        ("use_agc", False, True),
        ("clip_factor", 0.01, 0.5),
        ("eps", 1e-3, 2.0),
        ("max_grad_norm", None, 1.0),
        ("max_grad_norm", 1.0, None),
    ],
)
def test_settings_changed_after_construction_take_effect(attr, before, after):
    """The wrapper's public settings (Lightning's proxy forwards them) set before a cycle give
    the update of a wrapper constructed with them (exactly); they used to be copied at
    construction, so a changed reduction divided twice and a changed clip_factor was ignored."""

    def run(value_at_construction):
        p = nn.Parameter(torch.tensor([[0.5, -0.5]]))
        kw = {attr: value_at_construction}
        if attr in ("clip_factor", "eps"):
            kw.update(use_agc=True, agc_exclude=())
        opt = GradientAccumulateOptimizer(torch.optim.SGD([p], lr=1.0), 2, **kw)
        if value_at_construction != after:
            setattr(opt, attr, after)
            assert getattr(opt, attr) == after
        w0 = p.detach().clone()
        for g, w in ((torch.tensor([[3.0, 4.0]]), 2.0), (torch.tensor([[1.0, 0.0]]), 1.0)):
            p.grad = g
            opt.step(weight=w)
            opt.zero_grad()
        return p.detach() - w0

    torch.testing.assert_close(run(before), run(after), rtol=0, atol=0)
    assert run(after).abs().max() > 0


@pytest.mark.parametrize(
    "attr, bad, error",
    [
        ("max_grad_norm", 0.0, ValueError),
        ("max_grad_norm", float("nan"), ValueError),
        ("max_grad_norm", "1.0", TypeError),
        ("leftover", "drop", ValueError),
        ("leftover", 1, TypeError),
        ("on_nonfinite", "ignore", ValueError),
        ("on_nonfinite", None, TypeError),
        ("clip_factor", -1.0, ValueError),
        ("eps", "small", TypeError),
    ],
)
def test_bad_settings_assigned_mid_cycle_are_refused_and_lose_nothing(attr, bad, error):
    """An assignment is checked like the constructor's argument, naming it (a bad max_grad_norm
    used to be stored and to fail at the boundary, after the micro-batch was counted); the
    cycle in progress then ends with the update of an untouched wrapper, bit for bit."""

    def run(assign):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), 2, max_grad_norm=1.0
        )
        for j in range(2):
            model(torch.full((2, 3), j + 1.0)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if assign and j == 0:
                before = getattr(opt, attr)
                with pytest.raises(error, match=attr):
                    setattr(opt, attr, bad)
                assert getattr(opt, attr) == before
        assert opt.update_applied
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_max_grad_norm_assigned_beside_agc_is_refused():
    model = nn.Linear(3, 2)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, use_agc=True)
    with pytest.raises(ValueError, match="exclusive"):
        opt.max_grad_norm = 1.0
    assert opt.max_grad_norm is None and opt.use_agc


def test_reduction_changes_between_cycles_only():
    model = nn.Linear(2, 1)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="between cycles"):
        opt.reduction = "sum"
    with pytest.raises(ValueError, match="reduction"):
        opt.reduction = "median"
    assert opt.reduction == "mean" and opt.micro_step == 1


@pytest.mark.parametrize("inner", ["adamw", "sgd_momentum"])
def test_fp32_and_bf16_parameters_in_one_fused_group(inner):
    """One group holding fp32 and bf16 parameters: every boundary raised "mixed state dtypes
    in one call" after counting the micro-step (so micro_step grew past accum_steps). The
    fused update now runs per dtype: the same weights as with one group per dtype, bit for
    bit, over three cycles."""

    def run(split):
        torch.manual_seed(0)
        a = nn.Linear(4, 3)
        b = nn.Linear(3, 2).to(torch.bfloat16)
        params = [list(a.parameters()), list(b.parameters())]
        groups = [{"params": ps} for ps in params] if split else [{"params": sum(params, [])}]
        if inner == "adamw":
            opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
        else:
            opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        wrapper = GradientAccumulateOptimizer(opt, 2)
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            x = torch.randn(5, 4, generator=g)
            b(torch.tanh(a(x)).to(torch.bfloat16)).float().square().mean().backward()
            wrapper.step()
            wrapper.zero_grad()
        assert wrapper.micro_step == 0 and wrapper.accumulation_state.updates == 3
        return [p.detach().clone() for ps in params for p in ps]

    for x, y in zip(run(False), run(True)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_nonfinite_warning_points_at_the_users_step_and_flush_calls():
    """The skip warning names the line of the user's ``step()``/``flush()`` call, not a line
    inside the package or torch's ``no_grad`` decorator (the frames between them changed when
    the wrapper's loop moved into its own module)."""
    import inspect

    from gradient_accumulator import NonFiniteGradientWarning

    model = nn.Linear(3, 1)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)

    def nan_grads() -> None:
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan"))

    nan_grads()
    opt.step()
    nan_grads()
    with pytest.warns(NonFiniteGradientWarning) as step_warning:
        line = inspect.currentframe().f_lineno + 1
        opt.step()
    assert (step_warning[0].filename, step_warning[0].lineno) == (__file__, line)
    nan_grads()
    opt.step()
    with pytest.warns(NonFiniteGradientWarning) as flush_warning:
        line = inspect.currentframe().f_lineno + 1
        assert not opt.flush()
    assert (flush_warning[0].filename, flush_warning[0].lineno) == (__file__, line)
    assert opt.accumulation_state.updates == 0 and opt.micro_step == 0


def test_nonfinite_warning_names_the_users_line_through_a_scheduler():
    """A scheduler attached to the wrapper patches its step(): the frames of torch's scheduler
    stand between the user's call and the warning, which still names the user's line."""
    import inspect

    from gradient_accumulator import NonFiniteGradientWarning

    model = nn.Linear(3, 1)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.warns(NonFiniteGradientWarning) as caught:
        line = inspect.currentframe().f_lineno + 1
        opt.step()
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


@pytest.mark.parametrize("inner", ["sgd-momentum", "adamw", "rmsprop"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_wrapper_trains_like_the_original(inner, how):
    """A deep copy or pickle round trip of model and wrapper, mid-cycle, goes on exactly as the
    original (the fused update looked its parameters up by id(): the copy raised KeyError at
    its first boundary)."""
    import copy
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    make = {
        "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    }[inner]
    opt = GradientAccumulateOptimizer(make(model.parameters()), 3, max_grad_norm=1.0)
    data = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(8)]

    def run(m, o, batches):
        for x, y in batches:
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()

    run(model, opt, data[:4])  # one update, then one micro-step into the second cycle
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    run(model, opt, data[4:])
    run(model2, opt2, data[4:])
    assert opt2.accumulation_state == opt.accumulation_state == (2, 2.0, False, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    s1, s2 = opt.optimizer.state_dict()["state"], opt2.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name, v in s1[k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(s2[k][name])), (k, name)
    for a, b in zip(opt.accumulators(), opt2.accumulators()):
        assert torch.equal(a, b)
