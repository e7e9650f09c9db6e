"""``gradient_as_view=True``: fp32 ``.grad`` are views of the accumulators (no copy per step).

Autograd adds each micro-batch's gradient into the accumulator in place; the results must be
those of the default mode (which folds ``.grad`` in ``step()``) and of the big batch in fp64,
whatever the weights, a parameter without a gradient, a cleared ``.grad``, a checkpoint, a
bf16 parameter beside fp32 ones or an optimizer without a fused update.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate  # noqa: E402

K = 4
SIZES = [3, 5, 2, 7, 4, 6, 1, 8, 5, 2, 6, 3]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 3)
        self.extra = nn.Linear(5, 3)  # used in the first cycle only

    def forward(self, x, use_extra):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out + self.extra(x) if use_extra else out


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)) for n in SIZES]


def _train(view, inner, *, named=True, clear=None, **kwargs):
    """Three cycles of K weighted micro-batches (weight = size); ``extra`` has a gradient in the
    first cycle only. ``named``: weights given before the backward (``accumulate``), else to
    ``step``. ``clear``: how ``.grad`` is dropped after each step."""
    torch.manual_seed(0)
    model = _Net()
    opt = GradientAccumulateOptimizer(
        inner[0](model.parameters(), **inner[1]), K, gradient_as_view=view, **kwargs
    )
    for j, (x, y) in enumerate(_data()):
        use_extra = j < K
        if named:
            with accumulate(model, opt, weight=len(x)):
                nn.functional.mse_loss(model(x, use_extra), y).backward()
            opt.step()
        else:
            nn.functional.mse_loss(model(x, use_extra), y).backward()
            opt.step(weight=len(x))
        if clear == "model":
            model.zero_grad()
        else:
            opt.zero_grad()
    return model, opt


def _reference_sgd():
    """fp64 big batch: per cycle, the size-weighted mean of the micro-batches' mean losses."""
    torch.manual_seed(0)
    model = _Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    data = _data()
    for c in range(len(SIZES) // K):
        mbs = data[c * K : (c + 1) * K]
        total = sum(len(x) for x, _ in mbs)
        loss = sum(
            nn.functional.mse_loss(model(x.double(), c == 0), y.double()) * (len(x) / total)
            for x, y in mbs
        )
        loss.backward()
        if c > 0:
            model.extra.weight.grad = model.extra.bias.grad = None  # unused: left alone
        opt.step()
        opt.zero_grad()
    return model


SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


def _max_rel(a, b):
    return max(
        ((p.double() - q.double()).abs().max() / q.double().abs().max()).item()
        for p, q in zip(a.parameters(), b.parameters())
    )


def test_views_equal_the_big_batch_in_fp64():
    """Weighted micro-batches, momentum and weight decay, a head unused after the first cycle
    (left alone, as torch leaves a parameter whose .grad is None): within 1e-6 of fp64."""
    model, opt = _train(True, SGD)
    assert _max_rel(model, _reference_sgd()) < 1e-6
    assert opt.accumulation_state.updates == 3


def test_grad_is_the_accumulator_and_step_makes_no_copy():
    """After wrapping, each fp32 parameter's .grad is its accumulator (a view of the flat
    buffer): the backward writes there, and step() leaves it there."""
    torch.manual_seed(0)
    model = _Net()
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), K, gradient_as_view=True
    )
    accs = opt.accumulators()
    x, y = _data()[0]
    nn.functional.mse_loss(model(x, True), y).backward()
    for p, acc in zip(model.parameters(), accs):
        assert p.grad is acc
    expected = [acc.clone() for acc in accs]
    opt.step()
    opt.zero_grad()
    for p, acc, e in zip(model.parameters(), accs, expected):
        assert p.grad is acc
        torch.testing.assert_close(acc, e, rtol=0, atol=0)  # weight 1: not even rescaled


@pytest.mark.parametrize("inner", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"clear": "model"},
        {"max_grad_norm": 0.05},
        {"use_agc": True, "clip_factor": 0.02},
    ],
    ids=["plain", "model_zero_grad", "clip", "agc"],
)
def test_views_equal_the_default_mode(inner, variant):
    """Same weights as the default mode within 2e-6 (fp32, different summation orders), with
    clipping or AGC, and when model.zero_grad() drops the views after every step (each
    backward then writes fresh tensors, which step() folds in and replaces by the views)."""
    a, _ = _train(False, inner, **variant)
    b, opt = _train(True, inner, **variant)
    assert _max_rel(b, a) < 2e-6
    # model.zero_grad() drops the views after the last step; the wrapper's keeps them.
    views = [p.grad is acc for p, acc in zip(b.parameters(), opt.accumulators())]
    assert views == [variant.get("clear") != "model"] * len(views)


def test_a_weight_given_to_step_after_the_backward_is_refused_then_recovered():
    """The backward already added the gradient with weight 1: step(weight=5) is refused before
    anything is counted, naming the way out, and step() then counts the micro-batch once."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    opts = [
        GradientAccumulateOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), 2, **kw)
        for m, kw in ((model, {"gradient_as_view": True}), (ref, {}))
    ]
    data = _data()[:2]
    for m, opt in zip((model, ref), opts):
        for x, y in data:
            nn.functional.mse_loss(m(x, True), y).backward()
            if opt is opts[0]:
                with pytest.raises(ValueError, match="gradient_as_view"):
                    opt.step(weight=5.0)
                assert opt.micro_step in (0, 1)
            opt.step()
            opt.zero_grad()
    assert _max_rel(model, ref) < 1e-6


def test_zero_weight_micro_batch_counts_nothing():
    """accumulate(weight=0) with views: the micro-batch's gradient does not reach the update."""
    results = []
    for zero_batch in (True, False):
        torch.manual_seed(0)
        model = _Net()
        opt = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            3 if zero_batch else 2,
            gradient_as_view=True,
        )
        data = _data()[:2]
        if zero_batch:
            data = [(torch.randn(9, 5) * 50, torch.randn(9, 3))] + data
        for j, (x, y) in enumerate(data):
            weight = 0.0 if zero_batch and j == 0 else float(len(x))
            with accumulate(model, opt, weight=weight):
                nn.functional.mse_loss(model(x, True), y).backward()
            opt.step()
            opt.zero_grad()
        results.append(model)
    assert _max_rel(results[0], results[1]) < 1e-6


def test_checkpoint_mid_cycle_resumes_exactly():
    """state_dict after 2 micro-steps (and after a weight was named for the third, before its
    backward), loaded into a new wrapper: the run ends as the uninterrupted one, bit for bit."""
    full, _ = _train(True, ADAMW)
    torch.manual_seed(0)
    model = _Net()
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), **ADAMW[1]), K, gradient_as_view=True
    )
    data = _data()
    for j, (x, y) in enumerate(data[: K + 2]):
        with accumulate(model, opt, weight=len(x)):
            nn.functional.mse_loss(model(x, j < K), y).backward()
        opt.step()
        opt.zero_grad()
    opt.expect_weight(float(len(data[K + 2][0])))  # rescales the views: saved as sums anyway
    state = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = GradientAccumulateOptimizer(
        torch.optim.AdamW(model2.parameters(), **ADAMW[1]), K, gradient_as_view=True
    )
    opt2.load_state_dict(state)
    for x, y in data[K + 2 :]:
        with accumulate(model2, opt2, weight=len(x)):
            nn.functional.mse_loss(model2(x, False), y).backward()
        opt2.step()
        opt2.zero_grad()
    for p, q in zip(model2.parameters(), full.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bf16_parameters_keep_the_fold_beside_fp32_views():
    """A bf16 layer beside fp32 ones: only the fp32 parameters get views; the bf16 gradients are
    folded into fp32 during the backward (test_torch_grad_views_lowp.py). Same result as the
    default mode (within 1e-6)."""
    out = []
    for view in (False, True):
        torch.manual_seed(0)
        model = _Net()
        model.fc2.to(torch.bfloat16)
        opt = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), K, gradient_as_view=view
        )
        for x, y in _data()[:K]:
            h = torch.tanh(model.fc1(x)).to(torch.bfloat16)
            loss = nn.functional.mse_loss(model.fc2(h).float() + model.extra(x), y)
            loss.backward()
            opt.step(weight=1.0)
            opt.zero_grad()
        if view:
            assert model.fc2.weight.grad is None and model.fc1.weight.grad is not None
        out.append(model)
    assert _max_rel(out[1], out[0]) < 1e-6


def test_optimizer_without_fused_update():
    """RMSprop gets the final gradient in .grad for its own step(); the views come back after."""
    inner = (torch.optim.RMSprop, {"lr": 1e-3})
    a, _ = _train(False, inner)
    b, opt = _train(True, inner)
    assert _max_rel(b, a) < 2e-6
    assert all(p.grad is acc for p, acc in zip(b.parameters(), opt.accumulators()))


def test_arguments():
    model = _Net()
    with pytest.raises(ValueError, match="gradient_as_view"):
        GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            K,
            reduction="running_mean",
            gradient_as_view=True,
        )
    with pytest.raises(TypeError, match="gradient_as_view"):
        GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), K, gradient_as_view="yes"
        )


def _one_param(view):
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.5, -0.25]]))
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(lin.parameters(), lr=1.0), 2, gradient_as_view=view
    )
    return lin, opt


X = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]]), torch.tensor([[100.0, 100.0]])]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_double_backward_is_refused_and_the_accumulators_kept():
    """backward(create_graph=True) replaces .grad by view + gradient out of place: folding it
    would count the cycle's sum so far twice (before the check: -(2g1+g2)/2). It is refused
    before anything is counted, the accumulator still holds the first micro-batch's gradient,
    and the default mode takes double backward."""
    lin, opt = _one_param(True)
    lin(X[0]).sum().backward()
    opt.step()
    opt.zero_grad()
    lin(X[1]).sum().backward(create_graph=True)
    with pytest.raises(ValueError, match="create_graph"):
        opt.step()
    torch.testing.assert_close(opt.accumulators()[0], X[0], rtol=0, atol=0)
    assert opt.micro_step == 1
    lin, opt = _one_param(False)
    w0 = lin.weight.detach().clone()
    for x in X[:2]:
        lin(x).sum().backward(create_graph=True)
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(lin.weight.detach(), w0 - (X[0] + X[1]) / 2)


def test_a_micro_batch_cannot_be_dropped_after_its_backward():
    """Dropping a micro-batch after its backward (zero_grad without step) would silently keep
    its gradient, already in the accumulators (before the check: an update of -(g1+g3+g2)/2
    instead of -(g1+g2)/2). The wrapper's zero_grad() refuses and changes nothing, so step()
    still counts the micro-batch once; clearing .grad through the model is refused at step()."""
    lin, opt = _one_param(True)
    w0 = lin.weight.detach().clone()
    lin(X[0]).sum().backward()
    opt.step()
    opt.zero_grad()
    lin(X[2]).sum().backward()
    with pytest.raises(RuntimeError, match="cannot be dropped"):
        opt.zero_grad()
    opt.step()  # counts it: the cycle is X[0], X[2]
    opt.zero_grad()
    torch.testing.assert_close(lin.weight.detach(), w0 - (X[0] + X[2]) / 2)
    lin(X[1]).sum().backward()
    lin.zero_grad()
    with pytest.raises(ValueError, match="cannot be dropped"):
        opt.step()
    assert opt.micro_step == 0


def test_load_into_the_same_wrapper_after_a_weight_was_named():
    """accumulate(weight=2.5) names the weight, then the state is saved and loaded into the
    same wrapper before the backward: the named weight still holds, as in the default mode
    (before the fix the views were reset to weight 1 while step() expected 2.5, and every
    step() and zero_grad() then refused)."""
    out = []
    for view in (False, True):
        torch.manual_seed(0)
        model = _Net()
        opt = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), K, gradient_as_view=view
        )
        for j, (x, y) in enumerate(_data()[:6]):
            with accumulate(model, opt, weight=2.5 if j == 1 else len(x)):
                if j == 1:
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                nn.functional.mse_loss(model(x, True), y).backward()
            opt.step()
            opt.zero_grad()
        out.append(model)
    assert _max_rel(out[1], out[0]) < 1e-6


def test_a_new_wrapper_replaces_an_abandoned_wrappers_views():
    """A view wrapper dropped mid-cycle leaves its partial sum in the parameters' .grad; a new
    wrapper of the same model takes the .grad over (the old partial cycle is abandoned with its
    wrapper, as in the default mode) instead of folding the old sum in (3.1e-2 off before).
    The dropped wrapper's hooks go with it, and its buffer once no .grad points into it."""
    import gc
    import weakref

    out = []
    for view in (False, True):
        torch.manual_seed(0)
        model = _Net()
        old = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), K, gradient_as_view=view
        )
        for x, y in _data()[:6]:  # one cycle and half of the next
            nn.functional.mse_loss(model(x, True), y).backward()
            old.step()
            old.zero_grad()
        flat = weakref.ref(old._loop.flat)
        del old
        gc.collect()
        new = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), K, gradient_as_view=view
        )
        assert flat() is None  # the old views were replaced: nothing holds the old buffer
        for x, y in _data()[6:10]:
            nn.functional.mse_loss(model(x, True), y).backward()
            new.step()
            new.zero_grad()
        if view:
            w = model.fc1.weight
            assert len(w._backward_hooks or {}) == 1  # the new wrapper's pre-hook only
            assert len(w._post_accumulate_grad_hooks or {}) == 1
        out.append(model)
    assert _max_rel(out[1], out[0]) < 1e-6


def test_renaming_the_weight_after_the_backward_is_refused():
    """A weight named again after the backward: the gradient autograd already added into the
    views carries the first weight, while step() would count the second in the total (the mean
    was off: Σ wᵢgᵢ over a total with the wrong weight). Refused, nothing changed; step() then
    counts the micro-batch with its first weight, as the default mode does."""
    data = _data()
    results = {}
    for view in (False, True):
        torch.manual_seed(0)
        model = _Net()
        opt = GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), K, gradient_as_view=view
        )
        for j, (x, y) in enumerate(data[:K]):
            opt.expect_weight(float(len(x)))
            nn.functional.mse_loss(model(x, True), y).backward()
            if view and j == 1:
                accs = [a.clone() for a in opt.accumulators()]
                with pytest.raises(ValueError, match="already added its gradients"):
                    opt.expect_weight(float(len(x)) + 1.0)
                assert all(torch.equal(a, b) for a, b in zip(accs, opt.accumulators()))
                with pytest.raises(ValueError, match="already added its gradients"):
                    opt.expect_weight(0.0)
                assert all(p.grad is not None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        assert opt.accumulation_state.updates == 1
        results[view] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_engine_refuses_naming_another_weight_after_an_early_fold():
    """The engine's side of the same rule, for folds made during a backward (overlap_reduce's
    hooks, gradient_as_view's bf16/fp16 hooks): the named weight must be the folded one."""
    from gradient_accumulator._engine import Cycle

    accs = [torch.zeros(3), torch.zeros(2)]
    cycle = Cycle(accs, 2, "mean")
    cycle.name_weight(2.0)
    cycle.fold_one(0, torch.ones(3), cycle.hook_weight())
    cycle.check_named_weight(2.0)  # the same weight again is fine
    with pytest.raises(ValueError, match="already folded in with weight 2.0"):
        cycle.check_named_weight(3.0)
    assert cycle.total_weight == 2.0 and cycle.early_weight == 2.0
    torch.testing.assert_close(accs[0], torch.full((3,), 2.0))
