"""CPU benchmark of the PyTorch adapter against the same training loop written in plain torch.

``GradientAccumulateOptimizer`` is used as its docstring says: ``loss.backward(); opt.step();
opt.zero_grad()`` on every micro-batch; ``step()`` folds the fresh ``.grad`` into fp32
accumulators (C++ core) and frees it, and the ``K``-th call applies the update (core's fused
average + clip + AdamW). The plain-torch loop is the idiomatic one: ``(loss / K).backward()``
accumulates into ``.grad`` inside autograd, then clip + ``AdamW.step()`` + ``zero_grad()``.

What each row times (median of the repeats; all rows of a section run round-robin in one
process, one call of each per repeat after warm-up calls, so machine noise hits them alike):

1. Micro-step, for fp32 and for bf16 parameters, on a small pre-LN transformer (Linear,
   LayerNorm, causal attention; a fixed batch, same input every call):

   * ``plain: fwd + (loss/K).backward()``: autograd adds into the existing ``.grad``
     (fp32 grads for fp32 parameters, bf16 grads for bf16 ones).
   * ``plain: fwd + bwd + zero_grad()``: fresh ``.grad`` every call, no accumulation: the
     backward that the adapter's loop runs (reference point, not a real training loop).
   * ``ours: fwd + bwd + step() + zero_grad()``: one non-boundary micro-step (the wrapper
     has an ``accum_steps`` that is never reached, so every timed ``step()`` adds into the
     accumulators, as micro-steps 2 .. K-1 of a cycle do; bf16 grads go into fp32 buffers).
   * ``ours: step() + zero_grad() alone``: the same call, with its forward + backward run
     untimed just before: the adapter's own per-micro-step cost, measured directly.

   The overhead printed below the table is (ours − plain accumulating), in ms and in % of the
   plain step, and the direct ``step() + zero_grad()`` time in % of the plain step.

2. ``K``-cycle (K = 8 different batches), same model and dtypes:

   * ``plain``: K × (fwd + ``(loss/K).backward()``) + ``clip_grad_norm_(1.0, foreach=True)``
     + ``AdamW(fused=True).step()`` + ``zero_grad()``;
   * ``ours``: K × (fwd + bwd + ``step()`` + ``zero_grad()``), ``AdamW`` inside a wrapper with
     ``accum_steps=K, max_grad_norm=1.0`` (its last ``step()`` applies the update).

3. Apply step (the boundary) on a mid-size parameter set (GPT-2 layout, 8 layers, d = 640:
   ~45 M fp32 parameters in 100 tensors; no model, gradients are random tensors put in
   ``.grad``), ``K = 8``, AdamW, global-norm clip to 1.0:

   * ``ours: boundary step() + zero_grad()``: the K-th ``step()``. Each repeat first runs the
     K − 1 earlier micro-steps untimed (so the accumulators hold a real cycle), then times the
     call that folds the last micro-batch's ``.grad`` into the accumulators (with the sum of
     squares for the clip norm in the same pass) and applies the fused update. (``accum_steps=1``
     would not do: its only step overwrites the accumulator instead of adding to it.)
   * ``torch ... (fused)`` / ``(foreach)``: ``_foreach_mul_(grads, 1/K)`` +
     ``clip_grad_norm_(foreach=True)`` + ``AdamW.step()`` + ``zero_grad()``, the ``.grad``
     holding the accumulated gradient (refilled untimed). This is what runs after the last
     backward; that backward already added the last micro-batch into ``.grad``.
   * ``torch += last grad, ... (fused)``: the same plus that ``_foreach_add_`` of the last
     micro-batch's gradient, which ours does inside ``step()``: the like-for-like row.

4. bf16 gradient memory (counted, not timed), one mid-cycle micro-step of the bf16 model:
   plain torch accumulating in bf16 ``.grad``, ours (default mode) and ours with
   ``gradient_as_view``. What is counted: the bytes of the ``.grad`` tensors the parameters
   hold, sampled after each parameter's gradient is accumulated during the backward (before
   the wrapper's own hook runs) and after the backward, at their largest, plus the fp32
   accumulators (ours: fixed, 4 bytes per parameter). Not counted: activations, and autograd's
   transient gradient buffers before they land in ``.grad`` (the same in all three loops).

5. ``--resnet`` (this section alone): a ResNet-18 micro-step (ImageNet layout, 20 batch norms,
   input 8 x 3 x 32 x 32, forward + cross-entropy backward + ``zero_grad``) with plain
   ``nn.BatchNorm2d`` and with ``AccumBatchNorm2d`` (``convert_batchnorm``; its cycle never
   ends, so every timed forward folds its moments into the cycle), eager and under
   ``torch.compile`` (default mode, no graph cache: the first call's time is the compile
   time, after a small model's compile has paid the process's one-time costs); graph breaks
   counted with ``torch._dynamo.utils.counters``, and ours is compiled once more with
   ``fullgraph=True``.

Before timing, the fp32 cycle is cross-checked on the very objects that are then timed: after
one cycle the weights of ours and of plain torch agree to < 1e-5 relative (per tensor, max |diff|
/ max |w|), after a second to < 1e-4 (Adam amplifies rounding there), with the same clipped
gradient norm and step counts; for bf16, the accumulators after K − 1 micro-steps equal the
fp32 sum of the bf16 gradients of the same micro-batches, and the K-th step steps AdamW.

Threads: torch and the core's OpenMP both read ``OMP_NUM_THREADS`` (both counts are printed).
On a machine that something else keeps busy, OpenMP threads that wait on a descheduled peer
make every row slow and erratic; ``OMP_NUM_THREADS=1`` keeps the numbers sane there.

Usage:
    python benchmarks/torch_step.py                  # full run (~1-3 min on 2 cores)
    python benchmarks/torch_step.py --small          # small model and parameter set (seconds)
    OMP_NUM_THREADS=1 python benchmarks/torch_step.py --repeats 20 --json torch_step.json
    OMP_NUM_THREADS=1 python benchmarks/torch_step.py --resnet   # section 5 (~10 min: compiles)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from cpu_core import SMALL, gpt2_shapes, machine_info, numel, timed_round_robin
except ImportError:  # not run as a script from benchmarks/: cpu_core sits next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_core import SMALL, gpt2_shapes, machine_info, numel, timed_round_robin

try:
    from gradient_accumulator._loader import load_core
    from gradient_accumulator.torch import GradientAccumulateOptimizer, convert_batchnorm
except ImportError:  # run from a checkout: benchmarks/ sits next to the package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from gradient_accumulator._loader import load_core
    from gradient_accumulator.torch import GradientAccumulateOptimizer, convert_batchnorm

K = 8  # micro-batches per update
LR, WD, MAX_NORM = 1e-3, 0.01, 1.0
NEVER = 2**31 - 1  # accum_steps that no benchmark reaches: every step() is a non-boundary one

# Model and parameter-set sizes: full run and --small.
CONFIGS = {
    "full": dict(
        d=256,
        n_layer=2,
        n_head=4,
        d_io=64,
        batch=8,
        seq=32,
        apply_shapes=gpt2_shapes(n_layer=8, d=640, vocab=8192, ctx=512),
    ),
    "small": dict(d=128, n_layer=2, n_head=4, d_io=64, batch=4, seq=32, apply_shapes=SMALL),
}


# ---- the model ----


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has zero gradient
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def make_model(cfg: dict, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(cfg["d"], cfg["n_head"]) for _ in range(cfg["n_layer"])]
    model = nn.Sequential(
        nn.Linear(cfg["d_io"], cfg["d"]),
        *blocks,
        nn.LayerNorm(cfg["d"]),
        nn.Linear(cfg["d"], cfg["d_io"]),
    )
    return model.to(dtype)


# ResNet-18 (He et al. 2016, ImageNet layout: 7x7 stem, max-pool, four stages of two basic
# blocks, 20 batch norms), built here because torchvision is not a dependency. Input 32 x 32.
BN_BATCH = (8, 3, 32, 32)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


def resnet18(num_classes: int = 100) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    c = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(c, c_out, stride), BasicBlock(c_out, c_out, 1)]
        c = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes)]
    return nn.Sequential(*layers)


def make_batches(cfg: dict, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (cfg["batch"], cfg["seq"], cfg["d_io"])
    return [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(K)
    ]


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
    out = model(x)
    loss = F.mse_loss(out, y, reduction="sum") / (out.numel() // out.shape[-1])  # per token
    (loss * scale if scale != 1.0 else loss).backward()


def plain_cycle(model: nn.Module, batches) -> Callable[[], torch.Tensor]:
    """Idiomatic torch accumulation: (loss/K).backward() K times, clip, fused AdamW, zero."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)

    def run() -> torch.Tensor:
        for x, y in batches:
            forward_backward(model, x, y, 1.0 / K)
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()
        opt.zero_grad()
        return norm

    run.optimizer = opt  # type: ignore[attr-defined]
    return run


def ours_cycle(model: nn.Module, batches, view: bool = False) -> Callable[[], None]:
    """The adapter's loop: backward, step, zero_grad on every micro-batch."""
    opt = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        K,
        max_grad_norm=MAX_NORM,
        gradient_as_view=view,
    )

    def run() -> None:
        for x, y in batches:
            forward_backward(model, x, y, 1.0)
            opt.step()
            opt.zero_grad()

    run.optimizer = opt  # type: ignore[attr-defined]
    return run


# ---- timing ----

Case = tuple[Optional[Callable[[], None]], Callable[[], object]]  # (untimed setup, timed call)


def round_robin(cases: dict[str, Case], repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per timed call; each case's own setup runs untimed just before it."""
    gc.collect()
    return timed_round_robin(
        {name: fn for name, (_, fn) in cases.items()},
        {name: setup for name, (setup, _) in cases.items()},
        repeats,
        warmup,
    )


# ---- correctness cross-checks (untimed) ----


def check_fp32_cycle(
    plain: Callable, ours: Callable, plain_model: nn.Module, ours_model: nn.Module
) -> dict:
    """Two cycles of each; weights, clipped norms and step counts must agree.

    After the first update the weights agree to ~1e-7 relative (per tensor, max |diff| / max
    |w|). From the second one on, Adam's m / sqrt(v) amplifies the fp32 rounding of elements
    whose two gradients nearly cancel, and a few reach ~5e-6; a wrong bias correction or step
    count would be off by ~1e-2.
    """

    def max_rel() -> float:
        return max(
            float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
            for a, b in zip(ours_model.parameters(), plain_model.parameters())
        )

    w0 = [p.detach().clone() for p in plain_model.parameters()]
    rel = []
    for _ in range(2):
        norm_plain = float(plain())
        ours()
        rel.append(max_rel())
    opt = ours.optimizer  # type: ignore[attr-defined]
    norm_ours = opt.last_grad_norm
    a = [p.detach() for p in ours_model.parameters()]
    b = [p.detach() for p in plain_model.parameters()]
    du = math.sqrt(sum(float((x - y).double().square().sum()) for x, y in zip(a, b)))
    u = math.sqrt(sum(float((y - z).double().square().sum()) for y, z in zip(b, w0)))
    steps = {float(opt.optimizer.state[p]["step"]) for p in ours_model.parameters()}
    steps |= {
        float(plain.optimizer.state[p]["step"])  # type: ignore[attr-defined]
        for p in plain_model.parameters()
    }
    res = dict(
        weights_max_rel_diff_cycle1=rel[0],
        weights_max_rel_diff_cycle2=rel[1],
        update_rel_diff=du / u,
        grad_norm_ours=norm_ours,
        grad_norm_torch=norm_plain,
        steps=sorted(steps),
    )
    assert steps == {2.0}, f"optimizer step counts differ: {res}"
    assert norm_plain > MAX_NORM, f"clipping not exercised: {res}"
    assert math.isclose(norm_ours, norm_plain, rel_tol=1e-5), f"grad norms differ: {res}"
    assert rel[0] < 1e-5 and rel[1] < 1e-4 and du / u < 1e-4, f"ours and torch disagree: {res}"
    return res


def check_bf16_cycle(ours: Callable, ours_model: nn.Module, batches) -> dict:
    """K − 1 micro-steps: accumulators = fp32 sum of the bf16 grads; the K-th step updates."""
    opt = ours.optimizer  # type: ignore[attr-defined]
    ref_model = copy.deepcopy(ours_model)
    ref = [torch.zeros(p.shape) for p in ref_model.parameters()]
    w0 = [p.detach().clone() for p in ours_model.parameters()]
    for x, y in batches[:-1]:
        forward_backward(ours_model, x, y, 1.0)
        opt.step()
        opt.zero_grad()
        forward_backward(ref_model, x, y, 1.0)
        for r, p in zip(ref, ref_model.parameters()):
            assert p.grad.dtype == torch.bfloat16
            r.add_(p.grad.float())
        ref_model.zero_grad()
    acc_err = max(
        float((a - r).abs().max() / r.abs().max()) for a, r in zip(opt.accumulators(), ref)
    )
    x, y = batches[-1]
    forward_backward(ours_model, x, y, 1.0)
    opt.step()
    opt.zero_grad()
    # (An update smaller than half a bf16 ulp leaves a weight as it was: LayerNorm gains near
    # 1 do not move with lr 1e-3, in plain torch either; the moments always do.)
    moved = sum(not torch.equal(p, q) for p, q in zip(ours_model.parameters(), w0))
    states = [opt.optimizer.state[p] for p in ours_model.parameters()]
    stepped = all(float(s["step"]) == 1.0 and bool(s["exp_avg"].any()) for s in states)
    finite = all(bool(torch.isfinite(p).all()) for p in ours_model.parameters())
    res = dict(
        accumulators_max_rel_diff=acc_err,
        update_applied=opt.update_applied,
        optimizer_stepped=stepped,
        tensors_moved=moved,
        tensors=len(w0),
        finite=finite,
    )
    assert acc_err < 1e-6 and opt.update_applied and stepped and moved > 0 and finite, res
    return res


# ---- 1 and 2: micro-step overhead and K-cycle ----


def bench_model(cfg: dict, dtype: torch.dtype, repeats: int, warmup: int) -> tuple[list, dict]:
    label = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    base = make_model(cfg, dtype)
    batches = make_batches(cfg, dtype)
    x0, y0 = batches[0]

    # K-cycle objects, cross-checked first (the same objects are timed below).
    m_cp, m_co, m_cv = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    cyc_plain, cyc_ours = plain_cycle(m_cp, batches), ours_cycle(m_co, batches)
    cyc_view = ours_cycle(m_cv, batches, view=True)
    if dtype == torch.float32:
        check = check_fp32_cycle(cyc_plain, cyc_ours, m_cp, m_co)
        cyc_view()
        cyc_view()
        check["view_max_rel_diff_cycle2"] = max(
            float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
            for a, b in zip(m_cv.parameters(), m_co.parameters())
        )
        print(
            f"cross-check {label}: ours vs torch (clip + fused AdamW), cycles of K={K}: "
            f"weights max rel diff {check['weights_max_rel_diff_cycle1']:.1e} after "
            f"one, {check['weights_max_rel_diff_cycle2']:.1e} after two; update rel diff "
            f"{check['update_rel_diff']:.1e}; clipped grad norm "
            f"{check['grad_norm_ours']:.6g} vs {check['grad_norm_torch']:.6g}; "
            f"gradient_as_view vs default after two: {check['view_max_rel_diff_cycle2']:.1e}",
            flush=True,
        )
    else:
        check = check_bf16_cycle(cyc_ours, m_co, batches)
        print(
            f"cross-check {label}: fp32 accumulators after {K - 1} micro-steps vs fp32 sum of "
            f"the bf16 grads: max rel diff {check['accumulators_max_rel_diff']:.1e}; the "
            f"{K}th step stepped AdamW on all {check['tensors']} tensors "
            f"({check['tensors_moved']} changed in bf16)",
            flush=True,
        )

    # Micro-step objects: one model per loop, so that .grad states do not mix.
    m_acc, m_fresh, m_ours, m_view = (copy.deepcopy(base) for _ in range(4))
    opt_micro = GradientAccumulateOptimizer(
        torch.optim.AdamW(m_ours.parameters(), lr=LR, weight_decay=WD), NEVER
    )
    opt_view = GradientAccumulateOptimizer(
        torch.optim.AdamW(m_view.parameters(), lr=LR, weight_decay=WD),
        NEVER,
        gradient_as_view=True,
    )

    def plain_acc() -> None:
        forward_backward(m_acc, x0, y0, 1.0 / K)

    def plain_fresh() -> None:
        forward_backward(m_fresh, x0, y0, 1.0)
        m_fresh.zero_grad()

    def ours_step() -> None:
        opt_micro.step()
        opt_micro.zero_grad()

    def ours_micro() -> None:
        forward_backward(m_ours, x0, y0, 1.0)
        ours_step()

    def view_micro() -> None:
        forward_backward(m_view, x0, y0, 1.0)
        opt_view.step()
        opt_view.zero_grad()

    names = dict(
        acc="plain: fwd + (loss/K).backward()",
        fresh="plain: fwd + bwd + zero_grad() (fresh .grad)",
        ours="ours: fwd + bwd + step() + zero_grad()",
        step="ours: step() + zero_grad() alone",
        view="ours, gradient_as_view: fwd + bwd + step() + zero_grad()",
    )
    res = round_robin(
        {
            names["acc"]: (None, plain_acc),
            names["fresh"]: (None, plain_fresh),
            names["ours"]: (None, ours_micro),
            names["step"]: (lambda: forward_backward(m_ours, x0, y0, 1.0), ours_step),
            names["view"]: (None, view_micro),
        },
        repeats * 4,
        warmup * 2,
    )
    assert opt_micro.micro_step > 0 and not opt_micro.update_applied
    assert opt_view.micro_step > 0 and not opt_view.update_applied
    rows = record(f"{label} micro-step", res, names["ours"])

    cyc = dict(
        plain=f"plain: {K} x (fwd + bwd) + clip + AdamW(fused) + zero",
        ours=f"ours: {K} x (fwd + bwd + step + zero), AdamW + clip",
        view="ours, gradient_as_view: the same",
    )
    res_c = round_robin(
        {
            cyc["plain"]: (None, cyc_plain),
            cyc["ours"]: (None, cyc_ours),
            cyc["view"]: (None, cyc_view),
        },
        repeats,
        warmup,
    )
    assert cyc_ours.optimizer.micro_step == 0  # type: ignore[attr-defined]
    rows += record(f"{label} {K}-cycle", res_c, cyc["ours"])

    plain_ms = res[names["acc"]] * 1e3
    summary = dict(
        dtype=label,
        plain_micro_ms=plain_ms,
        ours_micro_ms=res[names["ours"]] * 1e3,
        overhead_ms=res[names["ours"]] * 1e3 - plain_ms,
        overhead_pct=100 * (res[names["ours"]] * 1e3 / plain_ms - 1),
        view_micro_ms=res[names["view"]] * 1e3,
        view_overhead_pct=100 * (res[names["view"]] * 1e3 / plain_ms - 1),
        step_alone_ms=res[names["step"]] * 1e3,
        step_alone_pct=100 * res[names["step"]] * 1e3 / plain_ms,
        fresh_grad_pct=100 * (res[names["fresh"]] * 1e3 / plain_ms - 1),
        plain_cycle_ms=res_c[cyc["plain"]] * 1e3,
        ours_cycle_ms=res_c[cyc["ours"]] * 1e3,
        cycle_overhead_pct=100 * (res_c[cyc["ours"]] / res_c[cyc["plain"]] - 1),
        view_cycle_ms=res_c[cyc["view"]] * 1e3,
        view_cycle_overhead_pct=100 * (res_c[cyc["view"]] / res_c[cyc["plain"]] - 1),
        cross_check=check,
    )
    return rows, summary


# ---- 4: bf16 gradient memory ----


def bf16_grad_memory(cfg: dict) -> dict[str, dict[str, int]]:
    """Peak bytes of live ``.grad`` tensors during a mid-cycle micro-step's backward, plus the
    fp32 accumulators, for plain torch, ours and ours with ``gradient_as_view`` (bf16 model)."""
    x0, y0 = make_batches(cfg, torch.bfloat16)[0]
    out = {}
    for name in ("plain", "ours", "view"):
        model = make_model(cfg, torch.bfloat16)
        params = list(model.parameters())
        peak = [0]

        def sample(_: torch.Tensor | None = None, params=params, peak=peak) -> None:
            grads = {id(p.grad): p.grad for p in params if p.grad is not None}
            peak[0] = max(peak[0], sum(g.numel() * g.element_size() for g in grads.values()))

        for p in params:  # registered first: each runs before the wrapper's own hook
            p.register_post_accumulate_grad_hook(sample)
        opt = None
        if name != "plain":
            opt = GradientAccumulateOptimizer(
                torch.optim.AdamW(params, lr=LR, weight_decay=WD),
                NEVER,
                gradient_as_view=name == "view",
            )
        for _ in range(2):  # the second micro-step is measured (plain: .grad already there)
            peak[0] = 0
            forward_backward(model, x0, y0, 1.0 / K if opt is None else 1.0)
            sample()
            if opt is not None:
                opt.step()
                opt.zero_grad()
        accs = sum(a.numel() * 4 for a in opt.accumulators()) if opt is not None else 0
        out[name] = dict(grad_bytes=peak[0], accumulator_bytes=accs, total=peak[0] + accs)
    return out


# ---- 3: the apply step ----


def bench_apply(shapes: list[tuple[int, ...]], repeats: int, warmup: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    # Micro-batch gradients: two sets, used alternately (values do not change the timings).
    micro = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    last = micro[(K - 1) % 2]
    total = torch._foreach_add(micro[0], micro[1])  # the cycle's sum: K/2 of each set
    torch._foreach_mul_(total, K / 2)
    bufs = [torch.empty(s) for s in shapes]  # torch's .grad, refilled before each call

    ours = GradientAccumulateOptimizer(
        torch.optim.AdamW(params, lr=LR, weight_decay=WD), K, max_grad_norm=MAX_NORM
    )

    def set_grads(grads: list[torch.Tensor]) -> None:
        for p, g in zip(params, grads):
            p.grad = g

    def ours_setup() -> None:
        for i in range(K - 1):
            set_grads(micro[i % 2])
            ours.step()
        set_grads(last)
        assert ours.is_boundary_next()

    def ours_boundary() -> None:
        ours.step()
        ours.zero_grad()

    def torch_setup(fold: bool) -> Callable[[], None]:
        def setup() -> None:
            torch._foreach_copy_(bufs, total)
            if fold:
                torch._foreach_sub_(bufs, last)
            set_grads(bufs)

        return setup

    def torch_pipeline(opt: torch.optim.Optimizer, fold: bool) -> Callable[[], None]:
        def run() -> None:
            if fold:
                torch._foreach_add_(bufs, last)
            torch._foreach_mul_(bufs, 1.0 / K)
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
            opt.step()
            opt.zero_grad()

        return run

    opt_fu = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    opt_fe = torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True)
    name_ours = "ours: boundary step() + zero_grad()"
    res = round_robin(
        {
            "torch avg+clip+AdamW(fused)+zero": (torch_setup(False), torch_pipeline(opt_fu, False)),
            "torch avg+clip+AdamW(foreach)+zero": (
                torch_setup(False),
                torch_pipeline(opt_fe, False),
            ),
            "torch += last grad, avg+clip+AdamW(fused)+zero": (
                torch_setup(True),
                torch_pipeline(opt_fu, True),
            ),
            name_ours: (ours_setup, ours_boundary),
        },
        repeats,
        warmup,
    )
    assert ours.update_applied and ours.micro_step == 0
    assert ours.last_grad_norm is not None and ours.last_grad_norm > MAX_NORM
    n = numel(shapes)
    rows = record(f"apply: {n / 1e6:.1f}M params, {len(shapes)} tensors", res, name_ours)
    return rows


# ---- 5: batch norm on ResNet-18 ----


def bench_resnet(repeats: int, warmup: int, compiled: bool) -> tuple[list, dict]:
    """ResNet-18 micro-step (forward + backward + ``zero_grad``): plain ``nn.BatchNorm2d``
    against ``AccumBatchNorm2d`` (``convert_batchnorm``, ``accum_steps`` never reached: every
    timed forward folds its moments into the cycle), eager and under ``torch.compile``."""
    torch.manual_seed(0)
    plain = resnet18()
    ours = convert_batchnorm(copy.deepcopy(plain), NEVER)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BN_BATCH, generator=g)
    y = torch.randint(0, 100, (BN_BATCH[0],), generator=g)

    def micro(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            F.cross_entropy(model(x), y).backward()
            model.zero_grad()

        return run

    # Same forward (each micro-batch normalised by its own statistics) and backward.
    with torch.no_grad():
        diff = float((plain(x) - ours(x)).abs().max())
    assert diff < 1e-4, f"plain and ours disagree: {diff}"
    names = dict(plain="plain nn.BatchNorm2d: fwd + bwd", ours="ours AccumBatchNorm2d: fwd + bwd")
    res = round_robin(
        {names["plain"]: (None, micro(plain)), names["ours"]: (None, micro(ours))},
        repeats * 4,
        warmup * 2,
    )
    rows = record("ResNet-18 micro-step, eager", res, names["ours"])
    summary = dict(
        batch=list(BN_BATCH),
        eager_plain_ms=res[names["plain"]] * 1e3,
        eager_ours_ms=res[names["ours"]] * 1e3,
        eager_ratio=res[names["ours"]] / res[names["plain"]],
    )
    if not compiled:
        return rows, summary
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    # Compile time from scratch each run: no graph cache from an earlier run.
    inductor_config.force_disable_caches = True
    # The process's first compile also pays one-time costs (imports, the C++ toolchain's first
    # run): a small warm-up model pays them, so that neither timed compile does.
    warm_up = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten())
    torch.compile(warm_up)(x[:2]).sum().backward()
    torch._dynamo.reset()
    warm_s, breaks, runs = {}, {}, {}
    for key, model in (("plain", plain), ("ours", ours)):
        counters.clear()
        fn = micro(torch.compile(model))
        t0 = time.perf_counter()
        fn()  # compiles forward and backward
        warm_s[key] = time.perf_counter() - t0
        breaks[key] = sum(counters["graph_break"].values())
        runs[key] = fn
    # fullgraph=True compiles (its graph is the one above): asserted, not timed.
    torch.compile(ours, fullgraph=True)(x)
    res_c = round_robin(
        {names["plain"]: (None, runs["plain"]), names["ours"]: (None, runs["ours"])},
        repeats * 4,
        warmup * 2,
    )
    rows += record("ResNet-18 micro-step, torch.compile", res_c, names["ours"])
    summary.update(
        compiled_plain_ms=res_c[names["plain"]] * 1e3,
        compiled_ours_ms=res_c[names["ours"]] * 1e3,
        compiled_ratio=res_c[names["ours"]] / res_c[names["plain"]],
        compile_plain_s=warm_s["plain"],
        compile_ours_s=warm_s["ours"],
        compile_ratio=warm_s["ours"] / warm_s["plain"],
        graph_breaks_plain=breaks["plain"],
        graph_breaks_ours=breaks["ours"],
    )
    return rows, summary


def print_resnet_summary(s: dict) -> None:
    line = (
        f"ResNet-18 micro-step {tuple(s['batch'])}: eager ours {s['eager_ours_ms']:.1f} ms vs "
        f"plain {s['eager_plain_ms']:.1f} ms ({s['eager_ratio']:.3f}x)"
    )
    if "compiled_ratio" in s:
        line += (
            f"; compiled ours {s['compiled_ours_ms']:.1f} ms vs plain "
            f"{s['compiled_plain_ms']:.1f} ms ({s['compiled_ratio']:.3f}x), graph breaks "
            f"{s['graph_breaks_ours']} (plain {s['graph_breaks_plain']}), first call (compile) "
            f"{s['compile_ours_s']:.1f} s vs {s['compile_plain_s']:.1f} s "
            f"({s['compile_ratio']:.2f}x)"
        )
    print(line)


# ---- report ----


def record(section: str, res: dict[str, float], ours: str) -> list[dict]:
    return [
        dict(section=section, impl=name, ms=t * 1e3, ours=name == ours, vs_ours=t / res[ours])
        for name, t in res.items()
    ]


def print_table(rows: list[dict]) -> None:
    head = f"{'implementation':<52} {'ms':>10} {'vs ours':>8}"
    section = None
    for r in rows:
        if r["section"] != section:
            section = r["section"]
            print(f"\n== {section} ==")
            print(head)
            print("-" * len(head))
        mark = "*" if r["ours"] else " "
        print(f"{mark}{r['impl']:<51} {r['ms']:>10.2f} {r['vs_ours']:>7.2f}x")


def print_summary(s: dict) -> None:
    print(
        f"{s['dtype']} micro-step: ours {s['ours_micro_ms']:.2f} ms vs plain "
        f"{s['plain_micro_ms']:.2f} ms: overhead {s['overhead_ms']:+.2f} ms "
        f"({s['overhead_pct']:+.1f}% of the plain step); step() + zero_grad() alone "
        f"{s['step_alone_ms']:.2f} ms ({s['step_alone_pct']:.1f}%); fresh .grad instead of "
        f"accumulating in backward: {s['fresh_grad_pct']:+.1f}%; gradient_as_view "
        f"{s['view_micro_ms']:.2f} ms ({s['view_overhead_pct']:+.1f}%)"
    )
    print(
        f"{s['dtype']} {K}-cycle: ours {s['ours_cycle_ms']:.1f} ms vs plain "
        f"{s['plain_cycle_ms']:.1f} ms ({s['cycle_overhead_pct']:+.1f}%); gradient_as_view "
        f"{s['view_cycle_ms']:.1f} ms ({s['view_cycle_overhead_pct']:+.1f}%)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="small model and parameter set")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per implementation for the cycle and apply sections "
        "(micro-steps: 4x); default 10, --small 5",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    ap.add_argument("--json", metavar="PATH", help="write machine info and results here")
    ap.add_argument(
        "--resnet",
        action="store_true",
        help="only section 5: ResNet-18 with AccumBatchNorm2d vs BatchNorm2d, eager and compiled",
    )
    ap.add_argument(
        "--no-compile", action="store_true", help="with --resnet: eager rows only (no compile)"
    )
    args = ap.parse_args()
    repeats = args.repeats if args.repeats is not None else (5 if args.small else 10)
    cfg = CONFIGS["small" if args.small else "full"]

    info = machine_info()
    info["core_threads"] = load_core().num_threads()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    load = info.get("load_avg")
    if load and load[0] > 0.5 and max(info["torch_threads"], info["core_threads"]) > 1:
        print(
            f"warning: load average {load[0]:.1f} before the run: with several threads per "
            "process, timings on a busy machine are erratic (try OMP_NUM_THREADS=1)"
        )
    if args.resnet:
        t0 = time.perf_counter()
        rows, summary = bench_resnet(repeats, args.warmup, not args.no_compile)
        print_table(rows)
        print("\n* = ours; 'vs ours' = time / our time (> 1: ours is faster)")
        print_resnet_summary(summary)
        print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=info, repeats=repeats, results=rows, summary=summary), f)
        return
    n_model = sum(p.numel() for p in make_model(cfg, torch.float32).parameters())
    n_tensors = len(list(make_model(cfg, torch.float32).parameters()))
    print(
        f"model: {cfg['n_layer']}-layer transformer, d={cfg['d']}, {n_model:,} parameters in "
        f"{n_tensors} tensors; micro-batch {cfg['batch']} x {cfg['seq']} tokens; K={K}, "
        f"AdamW lr {LR}, clip {MAX_NORM}; {repeats} repeats ({4 * repeats} for micro-steps)"
    )

    t0 = time.perf_counter()
    rows: list[dict] = []
    summaries = []
    for dtype in (torch.float32, torch.bfloat16):
        r, s = bench_model(cfg, dtype, repeats, args.warmup)
        rows += r
        summaries.append(s)
    memory = bf16_grad_memory(cfg)
    shapes = cfg["apply_shapes"]
    print(f"apply: {len(shapes)} tensors, {numel(shapes):,} parameters ...", flush=True)
    rows += bench_apply(shapes, repeats, args.warmup)

    print_table(rows)
    print("\n* = ours; 'vs ours' = time / our time (> 1: ours is faster)")
    for s in summaries:
        print_summary(s)
    mib = 1 / 2**20
    print(
        "bf16 micro-step, peak live .grad + fp32 accumulators (MiB): "
        + "; ".join(
            f"{name} {m['grad_bytes'] * mib:.2f} + {m['accumulator_bytes'] * mib:.2f} = "
            f"{m['total'] * mib:.2f}"
            for name, m in zip(
                ("plain bf16 .grad", "ours", "ours gradient_as_view"), memory.values()
            )
        )
    )
    print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    machine=info,
                    k=K,
                    lr=LR,
                    weight_decay=WD,
                    max_grad_norm=MAX_NORM,
                    model={k: v for k, v in cfg.items() if k != "apply_shapes"},
                    model_params=n_model,
                    apply_params=numel(shapes),
                    apply_tensors=len(shapes),
                    repeats=repeats,
                    warmup=args.warmup,
                    results=rows,
                    summary=summaries,
                    bf16_grad_memory=memory,
                ),
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
