"""AccumBatchNorm1d/2d/3d: running statistics of the big batch, micro-batch normalisation."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator.torch import (  # noqa: E402
    AccumBatchNorm1d,
    AccumBatchNorm2d,
    AccumBatchNorm3d,
    convert_batchnorm,
    flush_batchnorm,
)

C = 3
CASES = {
    "1d_nc": (AccumBatchNorm1d, nn.BatchNorm1d, ()),
    "1d_ncl": (AccumBatchNorm1d, nn.BatchNorm1d, (5,)),
    "2d": (AccumBatchNorm2d, nn.BatchNorm2d, (4, 3)),
    "3d": (AccumBatchNorm3d, nn.BatchNorm3d, (2, 3, 2)),
}


def _inputs(n, tail, seed):
    g = torch.Generator().manual_seed(seed)
    # Channel-dependent means far from 0 make the variance computation non-trivial.
    shift = torch.tensor([3.0, -2.0, 10.0]).view(1, C, *([1] * len(tail)))
    return shift + 2 * torch.randn(n, C, *tail, generator=g)


def _randomise_affine(bn, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.weight.copy_(1 + 0.5 * torch.randn(C, generator=g))
        bn.bias.copy_(torch.randn(C, generator=g))


def _plain_state(bn):
    """An AccumBatchNorm's state dict without the cycle buffers (a plain BatchNorm's keys)."""
    return {k: v for k, v in bn.state_dict().items() if not k.startswith("accum_")}


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("case", list(CASES))
def test_running_stats_equal_the_big_batch(case, momentum, rel_err):
    acc_cls, plain_cls, tail = CASES[case]
    sizes = [3, 5, 2, 6]
    k = len(sizes)
    bn = acc_cls(C, momentum=momentum, accum_steps=k)
    _randomise_affine(bn)
    ref = plain_cls(C, momentum=momentum).double()  # big batch, fp64
    micro_ref = plain_cls(C, momentum=momentum)  # the same layer as a plain BatchNorm
    micro_ref.load_state_dict(_plain_state(bn))
    per_micro = plain_cls(C, momentum=momentum)  # naive: statistics per micro-batch
    for cycle in range(3):
        xs = [_inputs(s, tail, seed=10 * cycle + j) for j, s in enumerate(sizes)]
        before = (bn.running_mean.clone(), bn.running_var.clone())
        for j, x in enumerate(xs):
            out = bn(x)
            # Training output: normalised with the micro-batch's own statistics.
            assert torch.allclose(out, micro_ref(x), rtol=0, atol=1e-6)
            per_micro(x)
            if j < k - 1:  # running statistics move only at the cycle's end
                assert torch.equal(bn.running_mean, before[0])
                assert torch.equal(bn.running_var, before[1])
                assert int(bn.num_batches_tracked) == cycle
        ref(torch.cat(xs).double())
        assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == cycle + 1
        assert rel_err(bn.running_mean, ref.running_mean) <= 1e-6
        assert rel_err(bn.running_var, ref.running_var) <= 1e-6
    # Updating per micro-batch would have given other statistics.
    assert rel_err(per_micro.running_var, ref.running_var) > 1e-3
    # Eval mode normalises with the running statistics, like the big-batch layer.
    bn.eval()
    ref.eval()
    with torch.no_grad():
        ref.weight.copy_(bn.weight)
        ref.bias.copy_(bn.bias)
    x = _inputs(4, tail, seed=99)
    steps = int(bn.accum_step)
    assert rel_err(bn(x), ref(x.double())) <= 1e-6
    assert int(bn.accum_step) == steps  # eval forwards are not accumulated


def test_training_gradients_equal_plain_batchnorm():
    bn = AccumBatchNorm2d(C, accum_steps=2)
    _randomise_affine(bn)
    plain = nn.BatchNorm2d(C)
    plain.load_state_dict(_plain_state(bn))
    x = _inputs(4, (3, 3), seed=1).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    w = torch.randn(4, C, 3, 3)
    (bn(x) * w).sum().backward()
    (plain(x2) * w).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)
    assert torch.allclose(bn.weight.grad, plain.weight.grad, atol=1e-5)
    assert torch.allclose(bn.bias.grad, plain.bias.grad, atol=1e-5)


def test_untracked_batchnorm_accumulates_nothing():
    bn = AccumBatchNorm1d(C, accum_steps=2, track_running_stats=False)
    plain = nn.BatchNorm1d(C, track_running_stats=False)
    x = _inputs(6, (), seed=2)
    assert torch.allclose(bn(x), plain(x), atol=1e-6)
    bn.eval()
    plain.eval()
    assert torch.allclose(bn(x), plain(x), atol=1e-6)
    assert bn.running_mean is None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, C, 3)
        self.bn2 = nn.BatchNorm2d(C, eps=1e-3, momentum=None)
        self.inner = nn.Sequential(nn.Flatten(), nn.Linear(C * 4, C), nn.BatchNorm1d(C))
        self.heads = nn.ModuleDict({"v": nn.BatchNorm3d(C, momentum=0.3)})


def test_convert_batchnorm_copies_without_aliasing():
    net = _Net()
    old = {"bn2": net.bn2, "bn1": net.inner[2], "bn3": net.heads["v"]}
    g = torch.Generator().manual_seed(0)
    for i, m in enumerate(old.values()):
        with torch.no_grad():
            m.weight.copy_(torch.randn(C, generator=g))
            m.bias.copy_(torch.randn(C, generator=g))
            m.running_mean.copy_(torch.randn(C, generator=g))
            m.running_var.copy_(torch.rand(C, generator=g) + 0.5)
            m.num_batches_tracked.fill_(7 + i)
    old["bn2"].bias.requires_grad_(False)
    old["bn3"].eval()
    snapshot = {n: copy.deepcopy(m.state_dict()) for n, m in old.items()}

    out = convert_batchnorm(net, 4)
    assert out is net
    new = {"bn2": net.bn2, "bn1": net.inner[2], "bn3": net.heads["v"]}
    assert type(new["bn2"]) is AccumBatchNorm2d
    assert type(new["bn1"]) is AccumBatchNorm1d
    assert type(new["bn3"]) is AccumBatchNorm3d
    assert isinstance(net.conv, nn.Conv2d) and isinstance(net.inner[1], nn.Linear)
    for name, m in new.items():
        o = old[name]
        assert m is not o
        assert m.accum_steps == 4
        assert (m.eps, m.momentum, m.affine) == (o.eps, o.momentum, o.affine)
        assert m.training == o.training
        for key, value in snapshot[name].items():
            assert torch.equal(m.state_dict()[key], value), (name, key)
        assert m.weight.requires_grad == o.weight.requires_grad
        assert m.bias.requires_grad == o.bias.requires_grad
        assert isinstance(m.weight, nn.Parameter)
    assert new["bn2"].bias.requires_grad is False
    assert new["bn3"].training is False

    # Modifying the old layers leaves the new ones unchanged (no shared storage).
    for o in old.values():
        with torch.no_grad():
            o.weight.add_(1.0)
            o.bias.add_(1.0)
        o.running_mean.add_(1.0)
        o.running_var.mul_(2.0)
        o.num_batches_tracked.add_(1)
    for name, m in new.items():
        for key, value in snapshot[name].items():
            assert torch.equal(m.state_dict()[key], value), (name, key)

    # A BatchNorm passed on its own is returned converted.
    single = nn.BatchNorm1d(C)
    conv = convert_batchnorm(single, 2)
    assert type(conv) is AccumBatchNorm1d and conv.accum_steps == 2


def test_plain_state_dict_loads_into_accum_batchnorm():
    plain = nn.BatchNorm2d(C)
    _randomise_affine(plain)
    plain(_inputs(8, (2, 2), seed=3))
    plain(_inputs(8, (2, 2), seed=4))
    sd = plain.state_dict()
    keys = set(sd)
    bn = AccumBatchNorm2d(C, accum_steps=3)
    bn(_inputs(4, (2, 2), seed=6))  # a cycle in progress is discarded by the load
    bn.load_state_dict(sd)  # strict
    assert set(sd) == keys  # the caller's dict is not modified
    for key, value in sd.items():
        assert torch.equal(bn.state_dict()[key], value)
    assert int(bn.accum_step) == 0 and float(bn.accum_count) == 0.0
    # And back: an AccumBatchNorm's own state dict round-trips.
    other = AccumBatchNorm2d(C, accum_steps=3)
    other.load_state_dict(bn.state_dict())
    assert torch.equal(other.running_var, plain.running_var)


class _Parallel(nn.ModuleList):
    """Layers applied side by side to the same input (so each sees the raw micro-batch)."""

    def forward(self, x):
        return [m(x) for m in self]


def test_flush_batchnorm_applies_a_partial_cycle(rel_err):
    model = nn.Sequential(
        _Parallel(
            [AccumBatchNorm1d(C, accum_steps=4), AccumBatchNorm1d(C, accum_steps=4, momentum=None)]
        )
    )
    ref = _Parallel([nn.BatchNorm1d(C), nn.BatchNorm1d(C, momentum=None)]).double()
    layers = list(model[0])
    xs = [_inputs(n, (), seed=20 + n) for n in (5, 7)]
    for x in xs:
        model(x)
    assert int(layers[0].num_batches_tracked) == 0
    flush_batchnorm(model)
    ref(torch.cat(xs).double())
    for m, r in zip(layers, ref):
        assert int(m.num_batches_tracked) == 1
        assert rel_err(m.running_mean, r.running_mean) <= 1e-6
        assert rel_err(m.running_var, r.running_var) <= 1e-6
    flush_batchnorm(model)  # nothing pending: no change
    assert [int(m.num_batches_tracked) for m in layers] == [1, 1]
    # The next full cycle starts from scratch.
    ys = [_inputs(4, (), seed=40 + j) for j in range(4)]
    for y in ys:
        model(y)
    ref(torch.cat(ys).double())
    for m, r in zip(layers, ref):
        assert int(m.num_batches_tracked) == 2
        assert rel_err(m.running_mean, r.running_mean) <= 1e-6
        assert rel_err(m.running_var, r.running_var) <= 1e-6


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_accum_batchnorm_rejects_bad_accum_steps(bad):
    with pytest.raises((ValueError, TypeError), match="accum_steps"):
        AccumBatchNorm2d(C, accum_steps=bad)
    with pytest.raises((ValueError, TypeError), match="accum_steps"):
        convert_batchnorm(nn.BatchNorm1d(C), bad)


def test_deep_copied_layer_is_flushed_by_the_optimizer_holding_its_weights(rel_err):
    from gradient_accumulator.torch import GradientAccumulateOptimizer

    model = nn.Sequential(nn.Linear(4, C), AccumBatchNorm1d(C, accum_steps=4))
    twin = copy.deepcopy(model)  # a layer of its own (not built by __init__)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1), 4)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    twin(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    opt.flush()  # the optimizer was not given the model: it finds the layer by its weight
    assert int(twin[1].num_batches_tracked) == 1 and int(twin[1].accum_step) == 0
    assert int(model[1].num_batches_tracked) == 0
    ref = nn.BatchNorm1d(C).double()
    ref(model[0](x).detach().double())
    assert rel_err(twin[1].running_var, ref.running_var) <= 1e-6


def test_convert_batchnorm_converts_sync_batchnorm(rel_err):
    from gradient_accumulator.torch import AccumSyncBatchNorm

    group = object()  # stands for a process group (not used without torch.distributed)
    sync = nn.SyncBatchNorm(C, momentum=0.2, eps=1e-3, process_group=group)
    _randomise_affine(sync)
    sync.running_mean.fill_(0.5)
    model = convert_batchnorm(nn.Sequential(nn.Identity(), sync), 2)
    bn = model[1]
    assert type(bn) is AccumSyncBatchNorm
    assert bn.process_group is group and bn.accum_steps == 2
    assert (bn.eps, bn.momentum) == (1e-3, 0.2)
    assert torch.equal(bn.weight, sync.weight) and torch.equal(bn.running_mean, sync.running_mean)
    bn.process_group = None  # single process from here on
    ref = nn.BatchNorm1d(C, momentum=0.2, eps=1e-3).double()
    ref.load_state_dict(_plain_state(bn))
    xs = [_inputs(3, (4,), seed=1), _inputs(5, (4,), seed=2)]
    model(xs[0])
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, sync.running_mean)
    model(xs[1])
    ref(torch.cat(xs).double())
    assert int(bn.num_batches_tracked) == 1
    assert rel_err(bn.running_mean, ref.running_mean) <= 1e-6
    assert rel_err(bn.running_var, ref.running_var) <= 1e-6


def test_convert_batchnorm_refuses_an_uninitialised_lazy_batchnorm():
    model = nn.Sequential(nn.BatchNorm1d(C), nn.Sequential(nn.LazyBatchNorm1d()))
    with pytest.raises(ValueError, match=r"1\.0 is an uninitialised LazyBatchNorm1d"):
        convert_batchnorm(model, 2)
    assert type(model[0]) is nn.BatchNorm1d  # nothing was converted
    model.eval()(_inputs(2, (), seed=0))  # materialised: now a BatchNorm1d
    convert_batchnorm(model, 2)
    assert type(model[0]) is type(model[1][0]) is AccumBatchNorm1d


class _MyBatchNorm(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 2


class _ThirdPartyBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(C))
        self.register_buffer("running_var", torch.ones(C))


def test_convert_batchnorm_warns_for_batchnorm_layers_it_leaves_alone():
    model = nn.Sequential(nn.BatchNorm2d(C), nn.Sequential(_MyBatchNorm(C)), _ThirdPartyBatchNorm())
    with pytest.warns(UserWarning) as record:
        convert_batchnorm(model, 2)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "1.0 (_MyBatchNorm)" in messages[0] and "every micro-batch" in messages[0]
    assert "2 (_ThirdPartyBatchNorm)" in messages[1]
    assert type(model[0]) is AccumBatchNorm2d and type(model[1][0]) is _MyBatchNorm


def test_convert_sync_batchnorm_keeps_accum_batchnorm(rel_err):
    group = object()
    model = convert_batchnorm(nn.Sequential(nn.BatchNorm1d(C), nn.LayerNorm(C)), 2)
    model.add_module("plain", nn.BatchNorm1d(C))
    ours = model[0]
    out = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    assert out is model and model[0] is ours and ours.process_group is group
    assert type(model.plain) is nn.SyncBatchNorm  # everything else as torch converts it
    assert type(nn.SyncBatchNorm.convert_sync_batchnorm(ours)) is AccumBatchNorm1d
    ours.process_group = None
    xs = [_inputs(4, (), seed=7), _inputs(6, (), seed=8)]
    for x in xs:
        ours(x)
    ref = nn.BatchNorm1d(C).double()
    ref(torch.cat(xs).double())
    assert int(ours.num_batches_tracked) == 1
    assert rel_err(ours.running_var, ref.running_var) <= 1e-6
