"""``gradient_as_view=True`` with bf16/fp16 parameters: each gradient folded during the backward.

A hook after autograd accumulated a low-precision parameter's gradient folds it into the fp32
accumulator with the micro-batch's weight and drops ``.grad``. The results must equal the default
mode (which folds ``.grad`` in ``step()``) bit for bit: the same gradients summed in the same
order, whatever the reduction, the weights, a short cycle, a parameter without a gradient, a
non-finite gradient, a checkpoint, a loss scale or two backwards in one micro-batch.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate  # noqa: E402

K = 4
SIZES = [3, 5, 2, 7, 4, 6, 1, 8, 5, 2]


class _Net(nn.Module):
    """fc1 → tanh → fc2, plus ``extra`` used in some micro-steps only; low-precision layers
    take their input cast to their dtype, the loss is taken in fp32."""

    def __init__(self, dtype: torch.dtype, mixed: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 3)
        self.extra = nn.Linear(5, 3)
        for layer in (self.fc2, self.extra) if mixed else (self.fc1, self.fc2, self.extra):
            layer.to(dtype)

    def forward(self, x, use_extra):
        h = torch.tanh(self.fc1(x.to(self.fc1.weight.dtype)))
        out = self.fc2(h.to(self.fc2.weight.dtype)).float()
        if use_extra:
            out = out + self.extra(x.to(self.extra.weight.dtype)).float()
        return out


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)) for n in SIZES]


def _make(view, dtype, mixed, **kwargs):
    torch.manual_seed(0)
    model = _Net(dtype, mixed)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, GradientAccumulateOptimizer(inner, K, gradient_as_view=view, **kwargs)


def _train(
    view,
    *,
    dtype=torch.bfloat16,
    mixed=False,
    weights=None,
    flush_at=None,
    nan_at=None,
    save_at=None,
    scaler=None,
    two_losses=False,
    **kwargs,
):
    """Ten micro-batches; ``extra`` has no gradient in every third one. ``weights``: named
    before each backward (``accumulate``). ``flush_at``: flush after that micro-batch (a short
    cycle). ``nan_at``: a NaN input there. ``save_at``: after that micro-batch, save, then go on
    with a new model and wrapper loaded from the save. ``two_losses``: two backwards per
    micro-batch (each half of it)."""
    model, opt = _make(view, dtype, mixed, grad_scaler=scaler, **kwargs)
    for j, (x, y) in enumerate(_data()):
        if nan_at == j:
            x = x.clone()
            x[0, 0] = float("nan")
        w = 1.0 if weights is None else weights[j]
        with accumulate(model, opt, weight=w):
            parts = [(x[:1], y[:1]), (x[1:], y[1:])] if two_losses else [(x, y)]
            for xs, ys in parts:
                loss = nn.functional.mse_loss(model(xs, j % 3 != 2), ys)
                (scaler.scale(loss) if scaler is not None else loss).backward()
        opt.step()
        opt.zero_grad()
        if flush_at == j:
            opt.flush()
        if save_at == j:
            saved, weights_saved = copy.deepcopy(opt.state_dict()), model.state_dict()
            model, opt = _make(view, dtype, mixed, grad_scaler=scaler, **kwargs)
            model.load_state_dict(weights_saved)
            opt.load_state_dict(saved)
    return model, opt


def _assert_same(a, b, exact=True, tol=None):
    """Bit for bit; else (fp32 views holding Σwg/w, which rounds differently) within 1e-5."""
    (ma, oa), (mb, ob) = a, b
    if tol is None:
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert p.dtype == q.dtype
        torch.testing.assert_close(p, q, **tol)
    if oa.micro_step > 0:  # after a boundary fp32 views are zeroed, the others left as they are
        for p, q in zip(oa.accumulators(), ob.accumulators()):
            torch.testing.assert_close(p, q, **tol)
    sa, sb = oa.accumulation_state, ob.accumulation_state
    assert sa._replace(total_weight=0) == sb._replace(total_weight=0)
    assert sa.total_weight == pytest.approx(sb.total_weight, rel=1e-12)


CASES = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "fp16": {"dtype": torch.float16},
    "mixed": {"mixed": True},
    "weighted": {"weights": [float(n) for n in SIZES]},
    "weighted-mixed-sum": {"weights": [float(n) for n in SIZES], "mixed": True, "reduction": "sum"},
    "zero-weight": {"weights": [1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0]},
    "flush": {"flush_at": 5},
    "clip": {"max_grad_norm": 0.05},
}


@pytest.mark.parametrize("case", list(CASES))
def test_low_precision_folds_equal_the_default_mode(case):
    """Bit for bit, but where fp32 views (mixed) take weights other than 1 (they hold Σwg/w)."""
    kw = CASES[case]
    exact = not (kw.get("mixed") and kw.get("weights"))
    _assert_same(_train(True, **kw), _train(False, **kw), exact=exact)


@pytest.mark.filterwarnings("ignore::gradient_accumulator.nonfinite.NonFiniteGradientWarning")
@pytest.mark.parametrize("mixed", [False, True])
def test_a_non_finite_gradient_skips_the_cycle_as_in_the_default_mode(mixed):
    a, b = _train(True, mixed=mixed, nan_at=5), _train(False, mixed=mixed, nan_at=5)
    _assert_same(a, b)
    assert a[1].accumulation_state.updates == 1  # cycle 2 skipped


@pytest.mark.parametrize("mixed", [False, True])
def test_checkpoint_mid_cycle_resumes_exactly(mixed):
    kw = {"mixed": mixed, "weights": [float(n) for n in SIZES], "save_at": 5}
    _assert_same(_train(True, **kw), _train(False, **kw), exact=not mixed)


def test_grad_scaler_as_in_the_default_mode():
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)

    a = _train(True, dtype=torch.float16, scaler=scaler())
    b = _train(False, dtype=torch.float16, scaler=scaler())
    _assert_same(a, b)


def test_one_low_precision_gradient_alive_at_a_time_and_step_folds_nothing():
    """During the backward each bf16 .grad is dropped once folded: when a parameter's gradient
    has been accumulated no other one is alive; after the backward none is, and step() passes
    no low-precision gradient to the engine."""
    torch.manual_seed(0)
    model = _Net(torch.bfloat16, False)
    params = list(model.parameters())
    alive = []

    def count(_):
        alive.append(sum(p.grad is not None for p in params))

    for p in params:  # before the wrapper's hooks: sees .grad before it is folded
        p.register_post_accumulate_grad_hook(count)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(params, lr=0.1), K, gradient_as_view=True)
    x, y = _data()[0]
    nn.functional.mse_loss(model(x, True), y).backward()
    assert alive == [1] * len(params)
    assert all(p.grad is None for p in params)
    folds = []
    fold = opt._loop.cycle.fold
    opt._loop.cycle.fold = lambda grads, *a, **k: folds.append(grads) or fold(grads, *a, **k)
    opt.step()
    assert folds == [[None] * len(params)]


def test_two_backwards_sum_in_fp32_and_count_the_weight_once():
    """Two losses in one micro-batch: both bf16 gradients folded into fp32 with the named weight
    (w·g1 + w·g2 in fp32; the default mode adds g1 + g2 in bf16 first), the weight counted once."""
    model, opt = _make(True, torch.bfloat16, False)
    ref = copy.deepcopy(model)
    x, y = _data()[0]
    halves = ((x[:1], y[:1]), (x[1:], y[1:]))
    grads = [
        torch.autograd.grad(nn.functional.mse_loss(ref(xs, True), ys), list(ref.parameters()))
        for xs, ys in halves
    ]
    with accumulate(model, opt, weight=3.0):
        for xs, ys in halves:
            nn.functional.mse_loss(model(xs, True), ys).backward()
    opt.step()
    assert opt.accumulation_state.micro_step == 1
    assert opt.accumulation_state.total_weight == 3.0
    for acc, g1, g2 in zip(opt.accumulators(), *grads):
        torch.testing.assert_close(acc, 3.0 * g1.float() + 3.0 * g2.float(), rtol=0, atol=0)
    # Ten micro-batches of two losses each, beside fp32 views: the default mode within bf16's
    # rounding of g1 + g2.
    a = _train(True, two_losses=True, mixed=True)
    b = _train(False, two_losses=True, mixed=True)
    _assert_same(a, b, tol={"rtol": 2e-2, "atol": 1e-2})


def test_a_folded_micro_batch_cannot_be_dropped():
    """zero_grad() after the backward would drop a micro-batch already in the accumulators: it is
    refused and changes nothing, so step() counts the micro-batch once (as the default mode)."""
    out = []
    for view in (True, False):
        model, opt = _make(view, torch.bfloat16, True)
        for j, (x, y) in enumerate(_data()[:K]):
            nn.functional.mse_loss(model(x, True), y).backward()
            if view and j == 1:
                with pytest.raises(RuntimeError, match="cannot be dropped"):
                    opt.zero_grad()
            opt.step()
            opt.zero_grad()
        out.append((model, opt))
    _assert_same(*out)


def test_a_weight_given_to_step_after_the_backward_is_refused_then_recovered():
    """The bf16 gradients were folded with weight 1 during the backward: step(weight=2) is
    refused before anything counts; step() then counts the micro-batch once. Naming another
    weight after the backward is refused too."""
    out = []
    for view in (True, False):
        model, opt = _make(view, torch.bfloat16, False)
        for j, (x, y) in enumerate(_data()[:K]):
            nn.functional.mse_loss(model(x, True), y).backward()
            if view and j == 2:
                with pytest.raises(ValueError, match="gradient_as_view"):
                    opt.step(weight=2.0)
                with pytest.raises(ValueError, match="already folded"):
                    opt.expect_weight(2.0)
                assert opt.micro_step == 2
            opt.step()
            opt.zero_grad()
        out.append((model, opt))
    _assert_same(*out)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_double_backward_leaves_the_low_precision_fold_to_step():
    """Under backward(create_graph=True) .grad may be part of a graph: the hook leaves it, the
    caller can differentiate it, and step() folds it as the default mode does."""
    out = []
    for view in (True, False):
        model, opt = _make(view, torch.bfloat16, False)
        for x, y in _data()[:K]:
            nn.functional.mse_loss(model(x, True), y).backward(create_graph=True)
            assert model.fc2.weight.grad is not None and model.fc2.weight.grad.requires_grad
            opt.step()
            opt.zero_grad()
        out.append((model, opt))
    _assert_same(*out)


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "fp32+bf16"])
@pytest.mark.parametrize("call", ["flush", "state_dict"])
def test_flush_or_save_between_a_backward_and_its_step_is_refused(mixed, call):
    """The backward already put the micro-batch into the accumulators (views, folds) but the
    counters do not know it yet: a flush would apply it half-counted (its weight missing for
    fp32 views), a checkpoint would save it uncounted. Refused, nothing changed; after step()
    the same call gives the default mode's result bit for bit."""
    data = _data()
    results = {}
    for view in (False, True):
        model, opt = _make(view, torch.bfloat16, mixed)
        for x, y in data[:2]:
            (model(x, True) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        x, y = data[2]
        (model(x, True) - y).square().mean().backward()
        if view:
            before = [p.detach().clone() for p in model.parameters()]
            accs = [a.clone() for a in opt.accumulators()]
            position = opt.accumulation_state
            with pytest.raises(RuntimeError, match=rf"{call}\(\) between a backward and its step"):
                getattr(opt, call)()
            assert opt.accumulation_state == position
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            if call == "flush":  # a flush would have touched these; a save touches nothing
                assert all(torch.equal(a, b) for a, b in zip(accs, opt.accumulators()))
        opt.step()
        opt.zero_grad()
        out = getattr(opt, call)()
        saved = out["accumulation"]["accumulators"] if call == "state_dict" else None
        results[view] = ([p.detach().clone() for p in model.parameters()], saved)
    for a, b in zip(results[False][0], results[True][0]):
        assert torch.equal(a, b)
    if call == "state_dict":
        assert torch.equal(results[False][1], results[True][1])


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "fp32+bf16"])
def test_load_state_dict_between_a_backward_and_its_step_is_refused(mixed):
    """Loading a checkpoint in flight overwrote the accumulators holding the backward's folds
    and views, then step() counted the micro-batch's weight with its gradient gone (and with
    fp32 views the load stopped half-way: inner state and cycle loaded, counters not, step()
    refused). Refused before anything is loaded; after step() the load restores the checkpoint."""
    data = _data()
    model, opt = _make(True, torch.bfloat16, mixed)
    x, y = data[0]
    (model(x, True) - y).square().mean().backward()
    opt.step()
    opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    with accumulate(model, opt, weight=2.0):
        (model(*data[1][:1], True) - data[1][1]).square().mean().backward()
    position = opt.accumulation_state
    accs = [a.clone() for a in opt.accumulators()]
    inner = copy.deepcopy(opt.optimizer.state_dict())
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) between a backward and its step"):
        opt.load_state_dict(saved)
    assert opt.accumulation_state == position
    assert all(torch.equal(a, b) for a, b in zip(accs, opt.accumulators()))
    assert str(opt.optimizer.state_dict()) == str(inner)
    opt.step()
    assert opt.accumulation_state.micro_step == 2
    opt.load_state_dict(saved)
    assert opt.accumulation_state == (1, 1.0, False, 0)
    assert torch.equal(
        opt.state_dict()["accumulation"]["accumulators"], saved["accumulation"]["accumulators"]
    )
