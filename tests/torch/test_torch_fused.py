"""fuse_accumulation: nn.Linear weight gradients written by one GEMM into the accumulators.

Every scenario trains the same model twice from the same state, fused and unfused (and, where
stated, against the fp64 big batch): fp32 parameters agree within 1e-6 relative per cycle (the
GEMM sums in another order), and within 1e-5 of the fp64 big batch over several cycles.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gradient_accumulator import core  # noqa: E402
from gradient_accumulator.torch import (  # noqa: E402
    FusedLinear,
    GradientAccumulateOptimizer,
    fuse_accumulation,
    fused_path,
)

FUSED_TOL = 1e-6  # fused against unfused, fp32, relative to max|w|
BIG_TOL = 1e-5  # against the fp64 big batch
HAS_ONEDNN = (
    importlib.util.find_spec("gradient_accumulator") is not None
    and (core.wgrad_path("float32", 4, 4, 4)[0])
)


def _mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    ).to(dtype)


def _data(cycles: int, k: int):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(3 + (i * 5) % 7, 8, generator=g), torch.randn(3 + (i * 5) % 7, 3, generator=g))
        for i in range(cycles * k)
    ]


def _train(model, opt, data, *, fn=None):
    f = fn or model
    for x, y in data:
        w = float(len(x))
        opt.expect_weight(w)
        loss = ((f(x.to(next(model.parameters()).dtype)) - y) ** 2).mean()
        loss.backward()
        opt.step(weight=w)
        opt.zero_grad()
    return model


def _rel(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max(
        ((sa[k].double() - sb[k].double()).abs().max() / sa[k].double().abs().max()).item()
        for k in sa
    )


def _pair(reduction="mean", k=4, opt_cls=torch.optim.AdamW, **kw):
    out = []
    for fuse in (False, True):
        m = _mlp()
        opt = GradientAccumulateOptimizer(
            opt_cls(m.parameters(), lr=1e-2), k, reduction=reduction, **kw
        )
        if fuse:
            report = fuse_accumulation(m, opt, min_size=0)
            assert report.fused == ["0", "2", "4"] and not report.left
        out.append((m, opt))
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "running_mean"])
def test_fused_matches_unfused_every_reduction(reduction):
    (a, oa), (b, ob) = _pair(reduction)
    data = _data(3, 4)
    for c in range(3):  # per cycle, from the same state
        _train(a, oa, data[4 * c : 4 * c + 4])
        _train(b, ob, data[4 * c : 4 * c + 4])
        assert _rel(a, b) <= FUSED_TOL
    for m in (a, b):
        assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize(
    "options",
    [{"max_grad_norm": 0.05}, {"use_agc": True, "clip_factor": 0.01}],
    ids=["clip", "agc"],
)
def test_clipping_and_agc_act_on_the_fused_accumulators(options):
    (a, oa), (b, ob) = _pair(opt_cls=torch.optim.SGD, **options)
    data = _data(3, 4)
    _train(a, oa, data)
    _train(b, ob, data)
    assert oa.last_grad_norm is None or abs(oa.last_grad_norm - ob.last_grad_norm) <= 1e-6 * abs(
        oa.last_grad_norm
    )
    assert _rel(a, b) <= FUSED_TOL


def test_activation_checkpointing_folds_once():
    from torch.utils.checkpoint import checkpoint

    (a, oa), (b, ob) = _pair()
    data = _data(2, 4)
    _train(a, oa, data)
    _train(b, ob, data, fn=lambda x: checkpoint(b, x, use_reentrant=False))
    assert _rel(a, b) <= FUSED_TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_fused_matches_unfused():
    data = [(x.cuda(), y.cuda()) for x, y in _data(3, 4)]
    models = []
    for fuse in (False, True):
        m = _mlp().cuda()
        opt = GradientAccumulateOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), 4)
        if fuse:
            assert fuse_accumulation(m, opt, min_size=0).fused == ["0", "2", "4"]
            assert fused_path(m[0], 5) == "cublaslt"
        models.append(_train(m, opt, data))
    assert _rel(*models) <= FUSED_TOL


def test_fused_matches_the_fp64_big_batch():
    k, cycles = 4, 3
    data = _data(cycles, k)
    m = _mlp()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), k)
    fuse_accumulation(m, opt, min_size=0)
    _train(m, opt, data)
    ref = _mlp().double()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for c in range(cycles):
        mbs = data[k * c : k * c + k]
        total = sum(len(x) for x, _ in mbs)
        loss = sum(((ref(x.double()) - y.double()) ** 2).mean() * len(x) / total for x, y in mbs)
        loss.backward()
        ropt.step()
        ropt.zero_grad()
    assert _rel(ref, m) <= BIG_TOL


@pytest.mark.skipif(not HAS_ONEDNN, reason="oneDNN (onednn-cpu-gomp) is not installed")
def test_fp32_takes_onednn_and_core_matches_fp64():
    layer = nn.Linear(19, 23)
    assert fused_path(layer, 37).startswith("onednn:")
    g = torch.Generator().manual_seed(3)
    dy, x = torch.randn(37, 23, generator=g), torch.randn(37, 19, generator=g)
    acc = torch.randn(23, 19, generator=g)
    ref = acc.double() + 0.5 * dy.double().t() @ x.double()
    done, why = core.wgrad_accumulate(acc, dy, x, weight=0.5)
    assert done, why
    assert ((acc.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-6
    # overwrite never reads the accumulator (NaN there is not kept); a transposed dy view.
    acc.fill_(float("nan"))
    done, _ = core.wgrad_accumulate(acc, dy.t().contiguous().t(), x, weight=2.0, overwrite=True)
    ref = 2.0 * dy.double().t() @ x.double()
    assert done and ((acc.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-6
    # running mean: acc·W/(W+w) + dyᵀx·w/(W+w)
    before = acc.double().clone()
    done, _ = core.wgrad_accumulate(acc, dy, x, weight=1.0, mode="running_mean", weight_before=3.0)
    ref = before * 0.75 + 0.25 * dy.double().t() @ x.double()
    assert done and ((acc.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-6


@pytest.mark.skipif(not HAS_ONEDNN, reason="oneDNN (onednn-cpu-gomp) is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_sum_in_fp32(dtype):
    """bf16/fp16 inputs: the product of the exact input values summed in fp32 (a bf16 kernel,
    or the fp32 one on widened inputs), never rounded to the input dtype."""
    g = torch.Generator().manual_seed(4)
    dy = torch.randn(64, 48, generator=g).to(dtype)
    x = torch.randn(64, 40, generator=g).to(dtype)
    acc = torch.zeros(48, 40)
    assert core.wgrad_path(str(dtype).replace("torch.", ""), 64, 48, 40)[0]
    done, why = core.wgrad_accumulate(acc, dy.t().contiguous().t(), x, weight=3.0)
    assert done, why
    ref = 3.0 * dy.double().t() @ x.double()
    rounded = 3.0 * torch.mm(dy.t(), x).double()  # the unfused gradient, rounded to dtype
    err = ((acc.double() - ref).abs().max() / ref.abs().max()).item()
    err_unfused = ((rounded - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-6 and err_unfused > 100 * err, (err, err_unfused)


def test_core_refuses_bad_arguments_and_writes_nothing():
    acc = torch.zeros(3, 4)
    dy, x = torch.randn(5, 3), torch.randn(5, 4)
    with pytest.raises(ValueError, match="shapes do not chain"):
        core.wgrad_accumulate(acc, dy, torch.randn(6, 4))
    with pytest.raises(TypeError, match="x"):
        core.wgrad_accumulate(acc, dy, x.double())
    with pytest.raises(ValueError, match="weight"):
        core.wgrad_accumulate(acc, dy, x, weight=-1.0)
    with pytest.raises(ValueError, match="2-D"):
        core.wgrad_accumulate(acc, dy.reshape(5, 3, 1), x)
    assert torch.count_nonzero(acc) == 0


class _Reused(nn.Module):
    """One Linear applied twice in a forward (a weight-shared recurrence)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        return self.out(torch.tanh(self.shared(h)))


def test_a_layer_applied_twice_folds_both_uses():
    """Both backward calls of a reused fused layer add into its accumulators in one micro-step
    (the second is not a first write), as the unfused gradient sums them."""
    data = _data(2, 4)
    models = []
    for fuse in (False, True):
        m = _Reused()
        opt = GradientAccumulateOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), 4)
        if fuse:
            assert fuse_accumulation(m, opt, min_size=0).fused == ["inp", "shared", "out"]
        models.append(_train(m, opt, data))
    assert _rel(*models) <= FUSED_TOL


def test_tied_gpt2_head_gets_both_contributions():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=97,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 97, (2, 5 + i % 3), generator=g) for i in range(6)]
    models = []
    for fuse in (False, True):
        torch.manual_seed(0)
        m = transformers.GPT2LMHeadModel(cfg)
        assert m.lm_head.weight is m.transformer.wte.weight
        opt = GradientAccumulateOptimizer(torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9), 3)
        if fuse:
            report = fuse_accumulation(m, opt, min_size=0)
            assert report.fused == ["lm_head"]  # GPT-2's other layers are Conv1D
            assert (
                isinstance(m.lm_head, FusedLinear) and m.lm_head.weight is m.transformer.wte.weight
            )
        for ids in batches:
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        models.append(m)
    assert _rel(*models) <= FUSED_TOL * 10  # two cycles of SGD with momentum


def test_compiled_model_has_no_graph_break_and_no_copy_of_the_accumulators():
    from torch._inductor.utils import run_and_get_code

    (a, oa), (b, ob) = _pair()
    data = _data(2, 4)
    _train(a, oa, data)
    compiled = torch.compile(b, fullgraph=True)  # fullgraph: a graph break raises
    x0, y0 = data[0]
    ob.expect_weight(float(len(x0)))

    def micro_step():
        ((compiled(x0) - y0) ** 2).mean().backward()

    _, codes = run_and_get_code(micro_step)
    backward = "\n".join(codes)
    assert "gradient_accumulator.fold_linear" in backward
    accs = {tuple(t.shape) for t in ob.accumulators()}
    # No clone or copy of anything shaped like an accumulator in the generated code.
    for line in backward.splitlines():
        if "clone" in line or "copy_" in line:
            assert not any(
                str(list(s)).replace(" ", "") in line.replace(" ", "") for s in accs
            ), line
    ob.step(weight=float(len(x0)))
    ob.zero_grad()
    _train(b, ob, data[1:], fn=compiled)
    assert _rel(a, b) <= FUSED_TOL


def test_nonfinite_micro_step_skips_the_cycle():
    (a, oa), (b, ob) = _pair(k=2, opt_cls=torch.optim.SGD)
    before = copy.deepcopy(b.state_dict())
    x, y = _data(1, 2)[0]
    bad = x.clone()
    bad[0, 0] = float("nan")
    from gradient_accumulator.nonfinite import NonFiniteGradientWarning

    with pytest.warns(NonFiniteGradientWarning):
        for inp in (bad, x):
            ob.expect_weight(1.0)
            ((b(inp) - y) ** 2).mean().backward()
            ob.step()
            ob.zero_grad()
    assert not ob.update_applied
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_mid_cycle_checkpoint_resumes_exactly(tmp_path):
    data = _data(2, 4)
    (a, oa), _ = _pair()
    _train(a, oa, data)
    m = _mlp()
    opt = GradientAccumulateOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), 4)
    fuse_accumulation(m, opt, min_size=0)
    _train(m, opt, data[:6])  # mid-cycle
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, path)
    ck = torch.load(path, weights_only=False)
    m2 = _mlp()
    m2.load_state_dict(ck["model"])  # the keys of a plain model load into the fused one's
    opt2 = GradientAccumulateOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2), 4)
    opt2.load_state_dict(ck["opt"])
    fuse_accumulation(m2, opt2, min_size=0)
    _train(m2, opt2, data[6:])
    assert _rel(a, m2) <= FUSED_TOL


def test_weight_is_taken_before_the_backward_and_a_late_one_is_refused():
    (a, oa), (b, ob) = _pair(k=2)
    x, y = _data(1, 2)[0]
    ((b(x) - y) ** 2).mean().backward()  # no weight named: the fused GEMMs took 1
    acc_before = [t.clone() for t in ob.accumulators()]
    with pytest.raises(ValueError, match="weight=3.0 differs"):
        ob.step(weight=3.0)
    assert all(torch.equal(u, v) for u, v in zip(acc_before, ob.accumulators()))
    ob.step(weight=1.0)  # the micro-batch still counts, once


def test_refusals_change_nothing():
    m = _mlp()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="GradientAccumulateOptimizer"):
        fuse_accumulation(m, inner, min_size=0)
    with pytest.raises(ValueError, match="min_size"):
        fuse_accumulation(m, GradientAccumulateOptimizer(inner, 2), min_size=-1)
    with pytest.raises(TypeError, match="model"):
        fuse_accumulation("model", GradientAccumulateOptimizer(inner, 2))
    view = GradientAccumulateOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), 2, gradient_as_view=True
    )
    with pytest.raises(ValueError, match="gradient_as_view"):
        fuse_accumulation(m, view, min_size=0)
    assert all(type(layer) is nn.Linear for layer in (m[0], m[2], m[4]))


def test_a_deep_copy_runs_plain_and_leaves_the_accumulators_alone():
    (a, oa), (b, ob) = _pair(k=4)
    x, y = _data(1, 1)[0]
    ema = copy.deepcopy(b)
    assert isinstance(ema[0], FusedLinear)
    ((ema(x) - y) ** 2).mean().backward()
    assert all(p.grad is not None for p in ema.parameters())  # plain gradients, its own
    assert all(torch.count_nonzero(t) == 0 for t in ob.accumulators())


def test_double_backward_is_refused():
    m = _mlp()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), 2)
    fuse_accumulation(m, opt, min_size=0)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph"):
        m(x).sum().backward(create_graph=True)


def test_small_layers_are_left_alone_by_default():
    m = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = GradientAccumulateOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), 2)
    report = fuse_accumulation(m, opt)
    assert report.fused == ["0"] and "min_size" in report.left["2"]


def test_frozen_and_foreign_layers_are_left_alone_with_the_reason_and_undo_restores():
    m = _mlp()
    m[2].weight.requires_grad_(False)
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1), 2
    )
    originals = [m[0], m[2], m[4]]
    keys = list(m.state_dict())
    report = fuse_accumulation(m, opt, min_size=0)
    assert report.fused == ["0", "4"]
    assert "frozen" in report.left["2"]
    assert "fused 0" in repr(report)
    report.undo()
    assert [m[0], m[2], m[4]] == originals and list(m.state_dict()) == keys


def _fp64_reference(data, k, cycles, lr):
    ref = _mlp().double()
    ropt = torch.optim.SGD(ref.parameters(), lr=lr)
    for c in range(cycles):
        mbs = data[k * c : k * c + k]
        total = sum(len(x) for x, _ in mbs)
        sum(
            ((ref(x.double()) - y.double()) ** 2).mean() * len(x) / total for x, y in mbs
        ).backward()
        ropt.step()
        ropt.zero_grad()
    return ref


def test_autocast_bf16_is_no_further_from_fp64_than_unfused():
    # The fused layers fold the bias's Σdy in fp32 where autocast's unfused gradient is bf16.
    (a, oa), (b, ob) = _pair(opt_cls=torch.optim.SGD)
    data = _data(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _train(a, oa, data)
        _train(b, ob, data)
    ref = _fp64_reference(data, 4, 2, 1e-2)
    unfused, fused = _rel(ref, a), _rel(ref, b)
    print(f"autocast bf16, max rel error against fp64: unfused {unfused:.3e}, fused {fused:.3e}")
    assert fused <= unfused * 1.001 + 1e-7, (fused, unfused)
    assert fused <= 1e-2


def test_bf16_parameters_are_no_further_from_fp64_than_unfused():
    data = _data(2, 4)
    results = []
    for fuse in (False, True):
        m = _mlp(torch.bfloat16)
        opt = GradientAccumulateOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), 4)
        if fuse:
            assert fuse_accumulation(m, opt, min_size=0).fused == ["0", "2", "4"]
        _train(m, opt, data)
        results.append(m)
    ref = _fp64_reference(data, 4, 2, 0.05)
    unfused, fused = (_rel(ref, r) for r in results)
    print(f"bf16 parameters, max rel error against fp64: unfused {unfused:.3e}, fused {fused:.3e}")
    assert fused <= unfused * 1.001 + 1e-7, (fused, unfused)
