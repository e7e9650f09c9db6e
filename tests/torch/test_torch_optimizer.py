"""GradientAccumulateOptimizer: k micro-batches give the big batch's update, state and schedule.

Every run is compared with a float64 copy of the model trained by the plain torch optimizer on
the concatenated big batch (loss = mean over the batch), within fp32 tolerance.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import (  # noqa: E402
    GradientAccumulateOptimizer,
    adaptive_clip_grad,
)

TOL = 1e-5  # max|Δw| / max|w| in fp32

CONFIGS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}, True),
    "sgd_momentum": (
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2},
        True,
    ),
    "sgd_nesterov": (
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
        True,
    ),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-2}, True),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, True),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "weight_decay": 1e-2}, False),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}, False),
}
SHORT = ["sgd_momentum", "adamw", "rmsprop"]  # one per path: fused SGD, fused Adam, fallback


def _slices(cycles):
    """Consecutive slices of the data: one list of micro-batch slices per cycle."""
    pos = 0
    for sizes in cycles:
        out = []
        for s in sizes:
            out.append(slice(pos, pos + s))
            pos += s
        yield out


def _train_accum(model, opt, cycles, data, mse, *, weighted=False, sched=None):
    x, y = data
    lrs = []
    for mbs in _slices(cycles):
        for j, sl in enumerate(mbs):
            mse(model, x[sl], y[sl]).backward()
            if weighted:
                opt.step(weight=sl.stop - sl.start)
            else:
                opt.step()
            opt.zero_grad()
            assert opt.update_applied == (j == len(mbs) - 1)
            if opt.update_applied and sched is not None:
                sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _train_ref(model, opt, cycles, data, mse, *, clip=None, sched=None):
    """Plain optimizer on the concatenated micro-batches of each cycle; returns clip results."""
    x, y = data
    clipped = []
    for mbs in _slices(cycles):
        sl = slice(mbs[0].start, mbs[-1].stop)
        opt.zero_grad()
        mse(model, x[sl], y[sl]).backward()
        if clip is not None:
            clipped.append(clip(list(model.parameters())))
        opt.step()
        if sched is not None:
            sched.step()
    return clipped


def _assert_same_state(inner, ref_opt, model, ref_model, rel_err, tol=TOL):
    """Optimizer state tensors (exp_avg, exp_avg_sq, momentum_buffer, step, ...) match."""
    compared = 0
    for p, q in zip(model.parameters(), ref_model.parameters()):
        mine, ref = inner.state[p], ref_opt.state[q]
        assert set(mine) == set(ref)
        for key, want in ref.items():
            got = mine[key]
            if key == "step":
                assert float(got) == float(want)
            elif isinstance(want, torch.Tensor):
                assert rel_err(got, want) <= tol, key
            else:
                assert got == want, key
            compared += 1
    return compared


@pytest.mark.parametrize("name", list(CONFIGS))
def test_k_micro_batches_equal_big_batch_with_schedule(name, make_pair, make_data, mse, rel_err):
    cls, kw, fused = CONFIGS[name]
    k, steps = 4, 20
    cycles = [[8] * k] * steps
    data = make_data(32 * steps)
    model, ref_model = make_pair()
    inner = cls(model.parameters(), **kw)
    opt = GradientAccumulateOptimizer(inner, k)
    assert opt.uses_fused_apply is fused
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    _train_accum(model, opt, cycles, data, mse, sched=sched)

    ref_opt = cls(ref_model.parameters(), **kw)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    _train_ref(ref_model, ref_opt, cycles, data, mse, sched=ref_sched)

    # The schedule counted optimizer steps, not micro-steps: 20 // 5 = 4 halvings.
    assert opt.param_groups[0]["lr"] == pytest.approx(kw["lr"] * 0.5**4)
    assert ref_opt.param_groups[0]["lr"] == pytest.approx(kw["lr"] * 0.5**4)
    assert inner.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= TOL
    n = _assert_same_state(inner, ref_opt, model, ref_model, rel_err)
    assert n > 0 or kw.get("momentum", 0) == 0
    # The inner optimizer stepped once per cycle.
    assert opt.accumulation_state.updates == steps
    assert opt.micro_step == 0
    for p in model.parameters():
        if "step" in inner.state[p]:
            assert float(inner.state[p]["step"]) == steps
    # And the run moved away from the initial weights (the comparison is not vacuous).
    fresh, _ = make_pair()
    assert rel_err(list(model.parameters()), list(fresh.parameters())) > 1e-3


@pytest.mark.parametrize("name", SHORT)
def test_scheduler_on_wrapper_or_inner_optimizer_act_the_same(name, make_pair, make_data, mse):
    cls, kw, _ = CONFIGS[name]
    k, steps = 3, 6
    cycles = [[4] * k] * steps
    data = make_data(12 * steps)
    results = {}
    for where in ("wrapper", "inner"):
        model, _ = make_pair()
        inner = cls(model.parameters(), **kw)
        opt = GradientAccumulateOptimizer(inner, k)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt if where == "wrapper" else inner, lambda s: 1.0 / (1.0 + s)
        )
        lrs = _train_accum(model, opt, cycles, data, mse, sched=sched)
        results[where] = (lrs, [p.detach().clone() for p in model.parameters()])
    lrs_w, params_w = results["wrapper"]
    lrs_i, params_i = results["inner"]
    assert lrs_w == pytest.approx([kw["lr"] / (1 + s) for s in range(1, steps + 1)])
    assert lrs_w == lrs_i
    for a, b in zip(params_w, params_i):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", SHORT)
def test_param_groups_keep_their_own_hyperparameters(name, make_pair, make_data, mse, rel_err):
    cls, kw, _ = CONFIGS[name]
    k, steps = 4, 5
    cycles = [[6] * k] * steps
    data = make_data(24 * steps)
    model, ref_model = make_pair()

    def groups(m):
        return [
            {"params": m.fc1.parameters(), "lr": kw["lr"] * 3, "weight_decay": 0.0},
            {"params": m.fc2.parameters()},
        ]

    inner = cls(groups(model), **kw)
    opt = GradientAccumulateOptimizer(inner, k)
    _train_accum(model, opt, cycles, data, mse)
    ref_opt = cls(groups(ref_model), **kw)
    _train_ref(ref_model, ref_opt, cycles, data, mse)
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= TOL
    _assert_same_state(inner, ref_opt, model, ref_model, rel_err)


@pytest.mark.parametrize("name", SHORT)
def test_global_norm_clipping_of_the_averaged_gradient(name, make_pair, make_data, mse, rel_err):
    cls, kw, _ = CONFIGS[name]
    k, steps = 4, 20
    cycles = [[8] * k] * steps
    data = make_data(32 * steps)
    model, ref_model = make_pair()
    # Clip at half the first big batch's gradient norm: clipping is active.
    probe = torch.autograd.grad(
        mse(ref_model, data[0][:32], data[1][:32]), list(ref_model.parameters())
    )
    max_norm = 0.5 * float(torch.sqrt(sum(g.square().sum() for g in probe)))

    inner = cls(model.parameters(), **kw)
    opt = GradientAccumulateOptimizer(inner, k, max_grad_norm=max_norm)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    norms = []
    x, y = data
    for mbs in _slices(cycles):
        for sl in mbs:
            mse(model, x[sl], y[sl]).backward()
            opt.step()
        assert opt.update_applied
        norms.append(opt.last_grad_norm)
        sched.step()

    ref_opt = cls(ref_model.parameters(), **kw)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    ref_norms = _train_ref(
        ref_model,
        ref_opt,
        cycles,
        data,
        mse,
        sched=ref_sched,
        clip=lambda ps: float(torch.nn.utils.clip_grad_norm_(ps, max_norm)),
    )
    assert sum(n > max_norm for n in ref_norms) >= 5  # clipping happened on several steps
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= TOL
    _assert_same_state(inner, ref_opt, model, ref_model, rel_err)

    # Without clipping the result is measurably different.
    unclipped, _ = make_pair()
    opt2 = GradientAccumulateOptimizer(cls(unclipped.parameters(), **kw), k)
    _train_accum(unclipped, opt2, cycles[:5], data, mse)
    clipped5, _ = make_pair()
    opt3 = GradientAccumulateOptimizer(cls(clipped5.parameters(), **kw), k, max_grad_norm=max_norm)
    _train_accum(clipped5, opt3, cycles[:5], data, mse)
    assert rel_err(list(unclipped.parameters()), list(clipped5.parameters())) > 1e-4


def _agc_params(model, exclude):
    """Parameters AGC clips for each exclusion choice of the wrapper."""
    if exclude == "final":
        return list(model.conv.parameters())
    if exclude == "conv":
        return list(model.fc.parameters())
    return list(model.parameters())


@pytest.mark.parametrize("name", SHORT)
def test_agc_on_the_averaged_gradient(
    name, make_pair, make_data, mse, rel_err, conv_cls, agc_reference
):
    cls, kw, _ = CONFIGS[name]
    k, steps, lam = 4, 10, 0.02
    cycles = [[8] * k] * steps
    data = make_data(32 * steps, features=32)
    finals = {}
    for exclude in ("final", "none", "conv"):
        model, ref64 = make_pair(cls=conv_cls)
        ref32, _ = make_pair(cls=conv_cls)
        if exclude == "final":
            arg = "final"
        elif exclude == "none":
            arg = ()
        else:
            arg = [model.conv]
        inner = cls(model.parameters(), **kw)
        opt = GradientAccumulateOptimizer(
            inner, k, use_agc=True, clip_factor=lam, eps=1e-3, agc_exclude=arg
        )
        _train_accum(model, opt, cycles, data, mse)

        # fp32 big batch clipped with the package's adaptive_clip_grad ...
        opt32 = cls(ref32.parameters(), **kw)
        _train_ref(
            ref32,
            opt32,
            cycles,
            data,
            mse,
            clip=lambda ps, m=ref32, e=exclude: adaptive_clip_grad(
                _agc_params(m, e), clip_factor=lam, eps=1e-3
            ),
        )
        # ... and fp64 big batch clipped by an independent implementation of the rule.
        opt64 = cls(ref64.parameters(), **kw)
        _train_ref(
            ref64,
            opt64,
            cycles,
            data,
            mse,
            clip=lambda ps, m=ref64, e=exclude: agc_reference(_agc_params(m, e), lam, 1e-3),
        )
        got = list(model.parameters())
        assert rel_err(got, list(ref32.parameters())) <= TOL
        assert rel_err(got, list(ref64.parameters())) <= TOL
        _assert_same_state(inner, opt64, model, ref64, rel_err)
        finals[exclude] = [p.detach().clone() for p in got]

    # The three exclusion choices lead to different weights, and the default "final" keeps the
    # classifier unclipped: its result differs from clipping everything.
    assert rel_err(finals["final"], finals["none"]) > 1e-4
    assert rel_err(finals["conv"], finals["none"]) > 1e-4
    # Unclipped training differs from AGC training: clipping was active.
    plain, _ = make_pair(cls=conv_cls)
    _train_accum(
        plain, GradientAccumulateOptimizer(cls(plain.parameters(), **kw), k), cycles, data, mse
    )
    assert rel_err(list(plain.parameters()), finals["none"]) > 1e-4


@pytest.mark.parametrize("name", SHORT)
def test_weighted_uneven_micro_batches(name, make_pair, make_data, mse, rel_err):
    cls, kw, _ = CONFIGS[name]
    base = [5, 11, 3, 13]
    cycles = [base[c % 4 :] + base[: c % 4] for c in range(8)]
    data = make_data(32 * 8)
    model, ref_model = make_pair()
    inner = cls(model.parameters(), **kw)
    opt = GradientAccumulateOptimizer(inner, 4)
    _train_accum(model, opt, cycles, data, mse, weighted=True)
    ref_opt = cls(ref_model.parameters(), **kw)
    _train_ref(ref_model, ref_opt, cycles, data, mse)
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= TOL
    _assert_same_state(inner, ref_opt, model, ref_model, rel_err)

    # Unweighted steps on the same uneven micro-batches do not give the big batch.
    unweighted, _ = make_pair()
    _train_accum(
        unweighted,
        GradientAccumulateOptimizer(cls(unweighted.parameters(), **kw), 4),
        cycles,
        data,
        mse,
    )
    assert rel_err(list(unweighted.parameters()), list(ref_model.parameters())) > 1e-4


@pytest.mark.parametrize(
    ("reduction", "weighted"),
    [
        ("mean", True),
        ("mean", False),
        ("sum", False),
        ("sum", True),
        ("running_mean", True),
        ("running_mean", False),
    ],
)
def test_reductions_follow_their_definitions(
    reduction, weighted, make_pair, make_data, mse, rel_err
):
    sizes, lr = [5, 11, 3, 13], 0.01
    data = make_data(64)
    x, y = data
    model, ref_model = make_pair()
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), 4, reduction=reduction
    )
    params = list(model.parameters())
    for cycle in _slices([sizes, sizes[::-1]]):
        # fp64 gradients of each micro-batch at this cycle's starting weights.
        with torch.no_grad():
            for p, q in zip(params, ref_model.parameters()):
                q.copy_(p)
        start = [q.detach().clone() for q in ref_model.parameters()]
        acc = [torch.zeros_like(q) for q in start]
        total = 0.0
        for j, sl in enumerate(cycle):
            w = float(sl.stop - sl.start) if weighted else 1.0
            g = torch.autograd.grad(mse(ref_model, x[sl], y[sl]), list(ref_model.parameters()))
            acc = [a + w * gi for a, gi in zip(acc, g)]
            total += w
            mse(model, x[sl], y[sl]).backward()
            opt.step(weight=w)
            opt.zero_grad()
            if j < 3:
                assert not opt.update_applied
                want = [a / total for a in acc] if reduction == "running_mean" else acc
                assert rel_err(opt.accumulators(), want) <= 1e-6
                assert opt.accumulation_state.total_weight == total
        assert opt.update_applied
        grad = acc if reduction == "sum" else [a / total for a in acc]
        want = [s - lr * g for s, g in zip(start, grad)]
        assert rel_err(params, want) <= TOL
        # The update is measurably different from the other reduction's.
        other = [a / total for a in acc] if reduction == "sum" else acc
        alt = [s - lr * g for s, g in zip(start, other)]
        if weighted or reduction == "sum":
            assert rel_err(params, alt) > 1e-4


@pytest.mark.parametrize(
    ("name", "clip"), [("adamw", None), ("rmsprop", 0.3), ("sgd_momentum", 0.3)]
)
def test_flush_applies_a_short_last_cycle(name, clip, make_pair, make_data, mse, rel_err):
    cls, kw, _ = CONFIGS[name]
    sizes = [5, 11, 3, 13, 7, 2, 9, 4, 6, 10]
    data = make_data(sum(sizes))
    x, y = data
    model, ref_model = make_pair()
    inner = cls(model.parameters(), **kw)
    opt = GradientAccumulateOptimizer(inner, 4, max_grad_norm=clip)
    flags = []
    for (sl,) in _slices([[s] for s in sizes]):
        mse(model, x[sl], y[sl]).backward()
        opt.step(weight=sl.stop - sl.start)
        flags.append(opt.update_applied)
    assert flags == [False, False, False, True] * 2 + [False, False]
    assert opt.micro_step == 2
    assert opt.flush() is True
    assert opt.update_applied
    assert opt.micro_step == 0
    assert opt.accumulation_state.updates == 3
    assert opt.flush() is False  # nothing left

    ref_opt = cls(ref_model.parameters(), **kw)
    clip_fn = None if clip is None else (lambda ps: torch.nn.utils.clip_grad_norm_(ps, clip))
    _train_ref(ref_model, ref_opt, [sizes[:4], sizes[4:8], sizes[8:]], data, mse, clip=clip_fn)
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= TOL
    _assert_same_state(inner, ref_opt, model, ref_model, rel_err)


@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_leftover_carry_continues_the_cycle(name, make_pair, make_data, mse, rel_err):
    cls, kw, _ = CONFIGS[name]
    first, second = [5, 11, 3, 13, 7, 2, 9, 4, 6, 10], [8, 1]
    data = make_data(sum(first) + sum(second))
    x, y = data
    model, ref_model = make_pair()
    inner = cls(model.parameters(), **kw)
    opt = GradientAccumulateOptimizer(inner, 4, leftover="carry")
    slices = [sl for (sl,) in _slices([[s] for s in first + second])]
    for sl in slices[:10]:
        mse(model, x[sl], y[sl]).backward()
        opt.step(weight=sl.stop - sl.start)
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.flush() is False
    assert not opt.update_applied
    assert opt.micro_step == 2
    assert opt.accumulation_state.total_weight == 16
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    flags = []
    for sl in slices[10:]:
        mse(model, x[sl], y[sl]).backward()
        opt.step(weight=sl.stop - sl.start)
        flags.append(opt.update_applied)
    assert flags == [False, True]
    assert opt.accumulation_state.updates == 3

    ref_opt = cls(ref_model.parameters(), **kw)
    _train_ref(ref_model, ref_opt, [first[:4], first[4:8], first[8:] + second], data, mse)
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= TOL
    _assert_same_state(inner, ref_opt, model, ref_model, rel_err)


class _TwoHeads(nn.Module):
    """A trunk and two heads; the second head only takes part in some micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 3)

    def forward(self, x, use_aux):
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        return out + self.aux(h) if use_aux else out


@pytest.mark.parametrize(
    ("name", "reduction"),
    [
        ("adam", "mean"),
        ("rmsprop", "mean"),
        ("sgd_momentum", "mean"),
        ("adam", "running_mean"),
        ("rmsprop", "running_mean"),
    ],
)
def test_parameters_missing_from_some_micro_batches(name, reduction, make_data, rel_err):
    """Missing gradients count as zero within a cycle; a cycle without any skips the parameter."""
    cls, kw, _ = CONFIGS[name]
    torch.manual_seed(0)
    model = _TwoHeads()
    ref_model = _TwoHeads().double()
    ref_model.load_state_dict(model.state_dict())
    sizes = [5, 11, 3, 13]
    use = [
        [False, True, True, False],
        [False, False, False, False],
        [True, False, False, True],
        [False, False, True, True],
    ]
    data = make_data(32 * len(use))
    x, y = data

    def loss(m, sl, u):
        dt = next(m.parameters()).dtype
        return (m(x[sl].to(dt), u) - y[sl].to(dt)).square().mean()

    inner = cls(model.parameters(), **kw)
    opt = GradientAccumulateOptimizer(inner, 4, reduction=reduction)
    ref_opt = cls(ref_model.parameters(), **kw)
    for cycle, flags in zip(_slices([sizes] * len(use)), use):
        ref_opt.zero_grad()
        total = sum(sl.stop - sl.start for sl in cycle)
        big = sum(
            (sl.stop - sl.start) / total * loss(ref_model, sl, u) for sl, u in zip(cycle, flags)
        )
        big.backward()
        ref_opt.step()
        for sl, u in zip(cycle, flags):
            loss(model, sl, u).backward()
            opt.step(weight=sl.stop - sl.start)
        assert opt.update_applied
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= TOL
    _assert_same_state(inner, ref_opt, model, ref_model, rel_err)
    if "step" in ref_opt.state[ref_model.aux.weight]:  # the 2nd cycle left aux untouched
        assert float(inner.state[model.aux.weight]["step"]) == 3
        assert float(inner.state[model.fc1.weight]["step"]) == 4


def test_accum_steps_one_is_the_plain_optimizer(make_pair, make_data, mse):
    model, _ = make_pair()
    plain, _ = make_pair()
    opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), 1)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = make_data(40)
    for i in range(5):
        sl = slice(8 * i, 8 * i + 8)
        mse(model, x[sl], y[sl]).backward()
        opt.step()
        assert opt.update_applied
        ref.zero_grad()
        mse(plain, x[sl], y[sl]).backward()
        ref.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
