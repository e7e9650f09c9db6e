"""AccumBatchNorm registered with a GradientAccumulateOptimizer follows the optimizer's cycle.

Registered through the optimizer's ``model=`` or ``convert_batchnorm(model, optimizer)``, a layer
takes the cycle's length and phase from the optimizer: ``accum_steps`` changed between cycles
changes both, so every update comes with exactly one running-statistics merge of the same
micro-batches. Each scenario counts updates and merges and checks the running statistics against
an fp64 ``nn.BatchNorm1d`` fed the cycles' concatenated micro-batches.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator import GradientAccumulatorDeprecationWarning, deprecation  # noqa: E402
from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    GradientAccumulateOptimizer,
    convert_batchnorm,
)

C = 3
TOL = 1e-6  # fp32 running statistics against the fp64 reference, relative to max|ref|


def _model():
    torch.manual_seed(0)
    # Batch norm first: its inputs are the data, so the reference needs no forward of its own.
    return nn.Sequential(nn.BatchNorm1d(C, momentum=0.3), nn.Linear(C, 1))


def _micro_batch(j):
    g = torch.Generator().manual_seed(100 + j)
    n = 3 + j % 4  # uneven micro-batches
    return torch.tensor([3.0, -2.0, 10.0]) + 2 * torch.randn(n, C, generator=g)


def _train(model, opt, schedule, start=0):
    """``schedule``: (accum_steps, cycles) pairs, set between cycles. Returns the micro-batches
    of each cycle, in order."""
    cycles, j = [], start
    for steps, n in schedule:
        opt.accum_steps = steps
        for _ in range(n):
            xs = []
            for _ in range(steps):
                x = _micro_batch(j)
                j += 1
                xs.append(x)
                model(x).square().mean().backward()
                opt.step(weight=len(x))
                opt.zero_grad()
            cycles.append(xs)
    return cycles


def _check_stats(bn, cycles, rel_err):
    ref = nn.BatchNorm1d(C, momentum=0.3).double()
    for xs in cycles:
        ref(torch.cat(xs).double())
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == len(cycles)
    assert int(bn.accum_step) == 0
    assert rel_err(bn.running_mean, ref.running_mean) <= TOL
    assert rel_err(bn.running_var, ref.running_var) <= TOL


@pytest.mark.parametrize("registration", ["model=", "convert_batchnorm(model, opt)"])
@pytest.mark.parametrize("schedule", [[(2, 2), (3, 2)], [(4, 1), (2, 3), (1, 2)]])
def test_accum_steps_changed_between_cycles_keeps_batchnorm_in_phase(
    registration, schedule, rel_err
):
    """Updates and batch-norm merges stay one to one when accum_steps changes (the layer was
    built with another accum_steps: the optimizer's governs)."""
    model = _model()
    if registration == "model=":
        model = convert_batchnorm(model, accum_steps=schedule[0][0])
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = GradientAccumulateOptimizer(inner, schedule[0][0], model=model)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = GradientAccumulateOptimizer(inner, schedule[0][0])
        model = convert_batchnorm(model, opt)
    bn = model[0]
    cycles = _train(model, opt, schedule)
    assert opt.accumulation_state.updates == len(cycles)
    _check_stats(bn, cycles, rel_err)
    assert bn.accum_steps == opt.accum_steps == schedule[-1][0]
    assert bn.registered_optimizer() is opt


def test_flush_applies_the_partial_cycle_of_registered_layers(rel_err):
    """convert_batchnorm(model, opt) without model=: the optimizer's flush still flushes the
    layer (no deprecated fallback, no warning), in phase with the short last update."""
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), 3)
    model = convert_batchnorm(model, opt)
    cycles = _train(model, opt, [(3, 1)])
    xs = [_micro_batch(50), _micro_batch(51)]
    for x in xs:
        model(x).square().mean().backward()
        opt.step(weight=len(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.flush()
    cycles.append(xs)
    assert opt.accumulation_state.updates == 2
    _check_stats(model[0], cycles, rel_err)


def test_convert_with_optimizer_keeps_the_parameters_the_optimizer_holds():
    """The optimizer built before the conversion trains the new layer's affine parameters."""
    model = _model()
    old = model[0]
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), 1)
    model = convert_batchnorm(model, opt)
    assert model[0].weight is old.weight and model[0].bias is old.bias
    before = model[0].weight.detach().clone()
    model(_micro_batch(0)).square().mean().backward()
    opt.step()
    assert not torch.equal(model[0].weight.detach(), before)
    # Without an optimizer the parameters are copies, as before.
    plain = _model()
    old = plain[0]
    conv = convert_batchnorm(plain, 2)
    assert conv[0].weight is not old.weight and conv[0].registered_optimizer() is None


def test_standalone_layer_keeps_its_own_cycle():
    """Unregistered, a layer counts its own accum_steps, whatever optimizer trains it."""
    model = convert_batchnorm(_model(), accum_steps=2)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), 3)
    _train(model, opt, [(3, 2)])  # 6 micro-batches
    assert model[0].registered_optimizer() is None
    assert int(model[0].num_batches_tracked) == 3
    assert opt.accumulation_state.updates == 2


def test_copies_are_standalone_and_keep_the_cycle_length(rel_err):
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), 2)
    model = convert_batchnorm(model, opt)
    opt.accum_steps = 3
    twin = copy.deepcopy(model)
    assert twin[0].registered_optimizer() is None and twin[0].accum_steps == 3
    for j in range(3):
        twin(_micro_batch(j))
    assert int(twin[0].num_batches_tracked) == 1
    assert model[0].registered_optimizer() is opt


def test_accum_steps_set_on_a_registered_layer_warns_and_is_ignored():
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), 2)
    model = convert_batchnorm(model, opt)
    with pytest.warns(UserWarning, match="follows the optimizer's accum_steps"):
        model[0].accum_steps = 5
    assert model[0].accum_steps == 2
    with pytest.raises(ValueError, match="accum_steps"):
        model[0].accum_steps = 0


def test_a_layer_whose_optimizer_is_gone_counts_its_own_cycle():
    model = _model()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), 2)
    model = convert_batchnorm(model, opt)
    del opt
    import gc

    gc.collect()
    assert model[0].registered_optimizer() is None and model[0].accum_steps == 2
    for j in range(4):
        model(_micro_batch(j))
    assert int(model[0].num_batches_tracked) == 2


def test_convert_batchnorm_refuses_bad_registration_arguments():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = GradientAccumulateOptimizer(inner, 2)
    with pytest.raises(ValueError, match="optimizer or accum_steps"):
        convert_batchnorm(model, opt, accum_steps=2)
    with pytest.raises(ValueError, match="optimizer or accum_steps"):
        convert_batchnorm(model, 2, accum_steps=2)
    with pytest.raises(TypeError, match="optimizer.*or accum_steps"):
        convert_batchnorm(model)
    with pytest.raises(TypeError, match="optimizer must be a GradientAccumulateOptimizer"):
        convert_batchnorm(model, inner)
    with pytest.raises(TypeError, match="accum_steps must be an int"):
        convert_batchnorm(model, "2")
    assert type(model[0]) is nn.BatchNorm1d  # nothing converted


def test_flush_by_weight_alone_is_deprecated_and_said_once(monkeypatch):
    """An unregistered layer found only by the weight the optimizer holds is still flushed,
    with the package's DeprecationWarning that names the registration, once per process: the
    second flush (another optimizer, another layer) flushes too and says nothing."""
    monkeypatch.setattr(deprecation, "_warned", set())  # as in a new process
    for expect_warning in (True, False):
        model = nn.Sequential(nn.Linear(4, C), AccumBatchNorm1d(C, accum_steps=4))
        opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4)
        model(torch.randn(6, 4)).square().sum().backward()
        opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.flush()
        ours = [w for w in caught if w.category is GradientAccumulatorDeprecationWarning]
        assert len(ours) == int(expect_warning), [str(w.message) for w in caught]
        if expect_warning:
            assert "convert_batchnorm(model, optimizer)" in str(ours[0].message)
            assert issubclass(ours[0].category, DeprecationWarning)
        assert int(model[1].num_batches_tracked) == 1 and int(model[1].accum_step) == 0


def test_flush_by_weight_alone_warns_only_when_it_flushes_something():
    model = nn.Sequential(nn.Linear(4, C), AccumBatchNorm1d(C, accum_steps=2))
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    for _ in range(2):  # a full cycle: nothing pending for the fallback to flush
        model(torch.randn(6, 4)).square().sum().backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.flush()
    assert int(model[1].num_batches_tracked) == 1


def test_a_layer_registered_again_moves_to_the_new_optimizer():
    """Registered with one optimizer at a time: the last one's cycle counts, and only it
    flushes the layer."""
    model = _model()
    first = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), 2)
    model = convert_batchnorm(model, first)
    second = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), 3, model=model
    )
    bn = model[0]
    assert bn.registered_optimizer() is second and bn.accum_steps == 3
    model(_micro_batch(0)).square().mean().backward()
    second.step()
    first.flush()  # nothing of the layer's: it is second's now
    assert int(bn.accum_step) == 1 and int(bn.num_batches_tracked) == 0
    second.flush()
    assert int(bn.accum_step) == 0 and int(bn.num_batches_tracked) == 1
