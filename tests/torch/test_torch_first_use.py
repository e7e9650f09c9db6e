"""Details a first user meets: a weight given as a 0-d tensor, a parameter resized between
micro-steps (named, nothing changed), an optimizer whose step needs a closure.

Runs are compared with a float64 copy of the model trained by the plain optimizer on each cycle's
concatenated big batch (loss = mean over it), within fp32 tolerance, as test_torch_optimizer.py.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from gradient_accumulator.torch import GradientAccumulateOptimizer, accumulate  # noqa: E402

TOL = 1e-5  # max|Δw| / max|w| in fp32, against the fp64 big batch
SAME = 1e-6  # tensor weights against the same float weights (the same arithmetic: 0 expected)
SIZES = [[5, 11, 3, 13], [11, 3, 13, 5], [3, 13, 5, 11]]  # uneven micro-batches, 3 cycles


def _run(model, opt, data, mse, weight_of, *, named=False):
    x, y = data
    pos = 0
    for cycle in SIZES:
        for n in cycle:
            sl = slice(pos, pos + n)
            pos += n
            if named:  # named before the backward, through accumulate()
                with accumulate(model, opt, weight=weight_of(n, y[sl])):
                    mse(model, x[sl], y[sl]).backward()
                opt.step()
            else:
                mse(model, x[sl], y[sl]).backward()
                opt.step(weight=weight_of(n, y[sl]))
            opt.zero_grad()
        assert opt.update_applied


def _reference(model, data, mse, cls, kw):
    x, y = data
    opt = cls(model.parameters(), **kw)
    pos = 0
    for cycle in SIZES:
        sl = slice(pos, pos + sum(cycle))
        pos += sum(cycle)
        opt.zero_grad()
        mse(model, x[sl], y[sl]).backward()
        opt.step()


TENSOR_WEIGHTS = {
    # a token count as a user computes it: an int64 tensor, never .item()-ed
    "int64_count": lambda n, y: (y[:, 0] != -100).sum(),
    "int32": lambda n, y: torch.tensor(n, dtype=torch.int32),
    "float32": lambda n, y: torch.tensor(float(n), dtype=torch.float32),
    "float64": lambda n, y: torch.tensor(float(n), dtype=torch.float64),
}


@pytest.mark.parametrize("named", [False, True], ids=["step", "accumulate"])
@pytest.mark.parametrize("kind", list(TENSOR_WEIGHTS))
@pytest.mark.parametrize(
    ("cls", "kw"),
    [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}), (torch.optim.SGD, {"lr": 0.1})],
    ids=["adamw", "sgd"],
)
def test_tensor_weights_match_float_weights_and_the_big_batch(
    cls, kw, kind, named, make_pair, make_data, mse, rel_err
):
    data = make_data(sum(map(sum, SIZES)))
    with_tensor, ref_model = make_pair()
    with_float, _ = make_pair()
    opt_t = GradientAccumulateOptimizer(cls(with_tensor.parameters(), **kw), 4)
    _run(with_tensor, opt_t, data, mse, TENSOR_WEIGHTS[kind], named=named)
    opt_f = GradientAccumulateOptimizer(cls(with_float.parameters(), **kw), 4)
    _run(with_float, opt_f, data, mse, lambda n, y: float(n), named=named)
    _reference(ref_model, data, mse, cls, kw)
    tensor_params, float_params = list(with_tensor.parameters()), list(with_float.parameters())
    assert rel_err(tensor_params, float_params) <= SAME
    assert rel_err(tensor_params, list(ref_model.parameters())) <= TOL
    assert rel_err(float_params, list(ref_model.parameters())) <= TOL


def _half_cycle(make_pair, make_data, mse):
    """An optimizer two micro-batches into a cycle of 4, with a third backward done."""
    model, _ = make_pair()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4, model=model)
    x, y = make_data(12)
    for i in range(2):
        mse(model, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]).backward()
        opt.step(weight=4)
        opt.zero_grad()
    mse(model, x[8:], y[8:]).backward()
    return model, opt


def _snapshot(model, opt):
    return (
        [a.clone() for a in opt.accumulators()],
        [p.detach().clone() for p in model.parameters()],
        [p.grad.clone() for p in model.parameters()],
        opt.accumulation_state,
    )


def _assert_unchanged(before, model, opt):
    accs, params, grads, state = before
    assert all(torch.equal(a, b) for a, b in zip(accs, opt.accumulators()))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, model.parameters()))
    assert opt.accumulation_state == state


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (torch.tensor(-2.0), ValueError, r"weight must be finite and >= 0, got -2\.0"),
        (torch.tensor(-3), ValueError, r"weight must be finite and >= 0, got -3"),
        (torch.tensor(math.nan), ValueError, r"weight must be finite and >= 0, got nan"),
        (torch.tensor(math.inf), ValueError, r"weight must be finite and >= 0, got inf"),
        (torch.tensor([4.0]), ValueError, r"weight must be a number or a 0-d tensor.*\(1,\)"),
        (torch.ones(2, 2), ValueError, r"weight must be a number or a 0-d tensor.*\(2, 2\)"),
        (torch.tensor(True), TypeError, r"weight must be a real number.*torch\.bool"),
        (torch.tensor(1 + 0j), TypeError, r"weight must be a real number.*complex"),
    ],
)
@pytest.mark.parametrize("where", ["step", "expect_weight", "accumulate"])
def test_a_bad_tensor_weight_is_refused_like_a_float_and_changes_nothing(
    bad, error, match, where, make_pair, make_data, mse
):
    model, opt = _half_cycle(make_pair, make_data, mse)
    before = _snapshot(model, opt)
    with pytest.raises(error, match=match):
        if where == "step":
            opt.step(weight=bad)
        elif where == "expect_weight":
            opt.expect_weight(bad)
        else:
            with accumulate(model, opt, weight=bad):
                pass
    _assert_unchanged(before, model, opt)
    # Fixed, the same micro-batch counts once.
    opt.step(weight=torch.tensor(4))
    assert opt.accumulation_state.micro_step == 3
    assert opt.accumulation_state.total_weight == 12.0


@pytest.mark.parametrize("model_given", [True, False])
@pytest.mark.parametrize("new_shape", [(4, 3), (6, 3)], ids=["reshaped", "resized"])
def test_a_parameter_reshaped_between_micro_steps_is_named_and_changes_nothing(
    new_shape, model_given
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 3, bias=False))
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 3, model=model if model_given else None
    )
    x = torch.randn(5, 2)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    # The second layer's weight (3, 4) is replaced by one of another shape.
    w = model[1].weight
    w.data = torch.randn(new_shape)
    p_old = [p.detach().clone() for p in model.parameters()]
    w.grad = torch.randn(new_shape)
    model[0].weight.grad = torch.randn(4, 2)
    model[0].bias.grad = torch.randn(4)
    accs = [a.clone() for a in opt.accumulators()]
    grads = [p.grad.clone() for p in model.parameters()]
    state = opt.accumulation_state
    name = r"'1\.weight'" if model_given else r"param_groups\[0\]\['params'\]\[2\]"
    with pytest.raises(
        ValueError,
        match=rf"parameter {name} \(shape \(3, 4\)\) changed shape since the optimizer was "
        rf"wrapped: its \.grad has shape \({new_shape[0]}, {new_shape[1]}\)",
    ):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(accs, opt.accumulators()))
    assert all(torch.equal(a, b) for a, b in zip(p_old, model.parameters()))
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, model.parameters()))
    assert opt.accumulation_state == state


def test_a_parameter_reshaped_without_a_gradient_is_refused_at_the_boundary():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 3, bias=False))
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    model(torch.randn(5, 2)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model[1].weight.data = torch.randn(4, 3)
    model[0].weight.grad = torch.randn(4, 2)  # the reshaped weight has no gradient this time
    before = [p.detach().clone() for p in model.parameters()]
    accs = [a.clone() for a in opt.accumulators()]
    for call in (opt.step, opt.flush):
        with pytest.raises(ValueError, match=r"parameter '1\.weight' \(shape \(3, 4\)\) changed"):
            call()
        assert all(torch.equal(a, b) for a, b in zip(accs, opt.accumulators()))
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert opt.micro_step == 1
