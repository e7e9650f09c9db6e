"""Zero-pass accumulation: each ``nn.Linear``'s weight gradient written by one GEMM straight
into the wrapper's fp32 accumulator (:func:`fuse_accumulation`).

The unfused micro-step computes a weight's gradient dyᵀx into a temporary (``.grad``) and then
folds it into the accumulator, a second pass over memory. A fused layer's backward instead
calls the core's fused fold (``core.wgrad_accumulate``: oneDNN's matmul on the CPU, cuBLASLt
on CUDA) with the accumulator as the GEMM's output, beta = 1 and the micro-batch's weight as
the product's scale, and makes no ``.grad`` for the weight; the bias's Σdy is folded the same
way. The bookkeeping (first write of a cycle, seen flags, the weight counted once) is the
engine's, shared with every gradient folded during a backward (``Cycle.early_write`` and
``Cycle.early_written``).

bf16/fp16 inputs on a CPU whose oneDNN has no kernel for them are widened to fp32 by the core,
which then takes oneDNN's fp32 GEMM. Where the core has no fused kernel at all (no oneDNN
installed; cuBLASLt missing or without an algorithm for the case) the layer still folds during
the backward, from a gradient it forms and frees at once: the unfused arithmetic, without a
``.grad`` kept until ``step()``. :func:`fused_path` says which a shape takes.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from gradient_accumulator import core

__all__ = ["FusedLinear", "FusionReport", "fuse_accumulation", "fused_path"]

# The op a fused layer's backward calls: declared as writing the two accumulators, so that
# torch.compile keeps it in the graph, in order, and copies neither.
_LIB = torch.library.Library("gradient_accumulator", "FRAGMENT")
_LIB.define(
    "fold_linear(Tensor(a!) acc, Tensor(b!)? bias_acc, Tensor dy, Tensor x, SymInt key) -> ()"
)

_KEYS = itertools.count(1)
# key -> the layer's slot: which wrapper's cycle and which accumulators (held weakly).
_SLOTS: dict[int, _Slot] = {}


class _Slot(NamedTuple):
    loop: weakref.ref  # the wrapper's Loop
    weight_index: int
    bias_index: int | None
    ddp: weakref.ref | None  # the DistributedDataParallel around the model, if given


def _dense(t: torch.Tensor) -> torch.Tensor:
    # The core takes any dense layout; an expanded gradient (a sum's) or a strided slice is
    # copied first.
    return t if t.is_contiguous() else t.contiguous()


def _loop_of(key: int) -> Any:
    slot = _SLOTS.get(int(key))
    loop = slot.loop() if slot is not None else None
    if loop is None:
        raise RuntimeError(
            "a fused Linear ran its backward after its GradientAccumulateOptimizer was dropped "
            "or the fusion undone; call fuse_accumulation(model, opt) with the live optimizer"
        )
    return slot, loop


def _rows(t: torch.Tensor) -> torch.Tensor:
    return _dense(t.reshape(-1, t.shape[-1]))


def _fold_linear_kernel(
    acc: torch.Tensor, bias_acc: torch.Tensor | None, dy: torch.Tensor, x: torch.Tensor, key: int
) -> None:
    """dW = dyᵀx into ``acc`` and db = Σdy into ``bias_acc`` (the tensors the op was given,
    which it declares written) with the micro-batch's weight, in one core call."""
    slot, loop = _loop_of(key)
    cycle = loop.cycle
    weight = cycle.hook_weight()
    dy2 = _rows(dy)
    x2 = _rows(x.to(dy2.dtype))
    wi, bi = slot.weight_index, slot.bias_index
    before, fresh = cycle.early_write(wi, weight)
    bias_fresh = cycle.early_write(bi, weight)[1] if bias_acc is not None else False
    mode = cycle.mode
    cpu_bias = bias_acc if bias_acc is not None and not cycle.cuda else None
    done, _why = core.wgrad_accumulate(
        acc,
        dy2,
        x2,
        weight=weight,
        mode=mode,
        weight_before=before,
        overwrite=fresh,
        bias_acc=cpu_bias,
        bias_overwrite=bias_fresh,
    )
    nonfinite = False  # a non-finite product is caught by the boundary's result check
    if not done:  # no fused kernel here: the unfused arithmetic, formed and freed at once
        nonfinite = cycle.write_gradient(acc, torch.mm(dy2.t(), x2), weight, before, fresh)
    if bias_acc is not None and (cpu_bias is None or not done):
        g = dy2.sum(0, dtype=torch.float32)
        nonfinite |= cycle.write_gradient(bias_acc, g, weight, before, bias_fresh)
    cycle.early_written((wi,) if bi is None else (wi, bi), weight, nonfinite)


_LIB.impl("fold_linear", _fold_linear_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("gradient_accumulator::fold_linear", lib=_LIB)
def _fold_linear_fake(*args: Any) -> None:
    return None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _FusedLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward folds dW and db into the accumulators (no gradients)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        key: int,
        cast: Any,
    ) -> torch.Tensor:
        if cast is not None:  # autocast's casts, made here so that the backward sees them
            x, weight = x.to(cast), weight.to(cast)
            bias = bias.to(cast) if bias is not None else None
        ctx.save_for_backward(x, weight)
        ctx.key = key
        ctx.acc = _accumulators(key)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "backward(create_graph=True) through a fused Linear: its weight gradient goes "
                "into the accumulator and has no graph; undo the fusion (report.undo()) for "
                "double backward"
            )
        x, weight = ctx.saved_tensors
        grad_x = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        acc, bias_acc = ctx.acc
        torch.ops.gradient_accumulator.fold_linear(acc, bias_acc, dy, x, ctx.key)
        return grad_x, None, None, None, None


def _accumulators(key: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    slot = _SLOTS[key]
    loop = slot.loop()
    accs = loop.cycle.accs
    bias = accs[slot.bias_index] if slot.bias_index is not None else None
    return accs[slot.weight_index], bias


class FusedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight (and bias) gradients go straight into a
    ``GradientAccumulateOptimizer``'s accumulators (made by :func:`fuse_accumulation`).

    It holds the original layer's very parameters, so ``state_dict`` keys and values are the
    same both ways; ``isinstance(layer, nn.Linear)`` holds.
    """

    _ga_key: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slot = _SLOTS.get(self._ga_key)
        loop = slot.loop() if slot is not None else None
        # A copy of the model (deepcopy for an EMA, pickling) holds other parameters: it runs as
        # a plain Linear and never writes the original's accumulators.
        if (
            loop is None
            or not torch.is_grad_enabled()
            or loop.params[slot.weight_index] is not self.weight
        ):
            return F.linear(x, self.weight, self.bias)
        if slot.ddp is not None:
            ddp = slot.ddp()
            if ddp is not None and ddp.require_backward_grad_sync:
                raise ValueError(
                    "a fused Linear under DistributedDataParallel outside accumulate(model, "
                    "opt): DDP would wait for gradients the fused layer never makes; run each "
                    "micro-batch's forward and backward inside accumulate(model, opt)"
                )
        cast = _autocast_dtype(x.device.type)
        return _FusedLinearFunction.apply(x, self.weight, self.bias, self._ga_key, cast)


class FusionReport:
    """What :func:`fuse_accumulation` did: ``fused`` (the layers' names), ``left`` (name →
    why not), and :meth:`undo`."""

    def __init__(self, root: nn.Module) -> None:
        self.fused: list[str] = []
        self.left: dict[str, str] = {}
        self._root = root
        self._originals: dict[str, tuple[nn.Module, int]] = {}

    def undo(self) -> None:
        """Put the original ``nn.Linear`` objects back (the parameters never moved); the
        fused layers' keys stop folding."""
        for name, (original, key) in self._originals.items():
            _SLOTS.pop(key, None)
            parent, _, leaf = name.rpartition(".")
            owner = self._root.get_submodule(parent) if parent else self._root
            setattr(owner, leaf, original)
        self._originals.clear()
        self.fused = []

    def __repr__(self) -> str:
        lines = [f"FusionReport: {len(self.fused)} fused, {len(self.left)} left alone"]
        lines += [f"  fused {n}" for n in self.fused]
        lines += [f"  left  {n}: {why}" for n, why in self.left.items()]
        return "\n".join(lines)


# Below this many weights a layer is left unfused by default: the host cost of the fused call
# (about 60-90 µs a layer on the development CPU, mostly Python and the op dispatch) exceeds
# the pass over the gradient it saves. benchmarks/fused_wgrad.py --sweep measures the crossover.
MIN_SIZE = 2**19


def _why_not(m: nn.Linear, loop: Any, min_size: int) -> str | None:
    w = m.weight
    if type(m) is not nn.Linear:
        return f"a subclass of nn.Linear ({type(m).__name__}) with a forward of its own"
    if not w.requires_grad:
        return "its weight does not require grad (frozen)"
    if id(w) not in loop.index:
        return "its weight is not one of the optimizer's parameters"
    if type(w) is not nn.Parameter and type(w) is not torch.Tensor:
        return f"its weight is a {type(w).__name__}, not a plain dense tensor"
    if w.layout != torch.strided or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"its weight's dtype/layout ({w.dtype}, {w.layout}) is not accumulated fused"
    if m.bias is not None and m.bias.requires_grad and id(m.bias) not in loop.index:
        return "its bias is not one of the optimizer's parameters"
    if w.numel() < min_size:
        return (
            f"{w.numel()} weights, fewer than min_size={min_size}: the fused call's host cost "
            "exceeds the pass it saves"
        )
    return None


def fuse_accumulation(
    model: nn.Module, optimizer: Any, *, min_size: int = MIN_SIZE
) -> FusionReport:
    """Make every eligible ``nn.Linear`` of ``model`` accumulate its weight gradient with one
    GEMM straight into ``optimizer``'s fp32 accumulator (no ``.grad``, no second pass).

    Eligible: a plain ``nn.Linear`` whose weight the optimizer holds, requires grad, and is a
    dense fp32, bf16 or fp16 tensor. Each is replaced in its parent by a :class:`FusedLinear`
    holding the same parameters (``state_dict`` unchanged both ways). A weight that is also
    used elsewhere (tied embeddings, a layer called twice) gets every contribution: the fused
    ones land during the backward, the others through ``.grad`` at ``step()``.

    The micro-batch's weight must be known before its backward (the GEMM scales by it):
    ``accumulate(model, opt, weight=w)`` or ``opt.expect_weight(w)``; without one it is 1, and
    ``step(weight=other)`` is refused with nothing changed.

    Args:
        model: the model (or a DistributedDataParallel around it: its micro-batches must then
            run inside ``accumulate(model, opt)``).
        optimizer: the ``GradientAccumulateOptimizer`` that trains it.
        min_size: layers with fewer weights are left alone (default 2¹⁹ = 524,288, a 512×1024
            layer): below it the fused call's fixed host cost (tens of µs) outweighs the
            pass it saves. 0 fuses every eligible layer.

    Returns:
        A :class:`FusionReport`: what was fused, what was left alone and why, and ``undo()``.

    Raises:
        TypeError: ``model`` is not a module or ``optimizer`` not a GradientAccumulateOptimizer.
        ValueError: the optimizer accumulates in a way the fused layers cannot join
            (``gradient_as_view=True``, ``overlap_reduce=True`` over ranks, FSDP2-sharded
            parameters), or ``min_size`` is negative; nothing is changed.

    Example:
        >>> import torch
        >>> from gradient_accumulator.torch import GradientAccumulateOptimizer
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        >>> report = fuse_accumulation(model, opt, min_size=0)  # a toy layer: fuse it anyway
        >>> report.fused, type(model[0]).__name__
        (['0'], 'FusedLinear')
    """
    from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer, unwrap_optimizer

    optimizer = unwrap_optimizer(optimizer)
    if not isinstance(optimizer, GradientAccumulateOptimizer):
        raise TypeError(
            f"optimizer must be a GradientAccumulateOptimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be an int >= 0, got {min_size!r}")
    loop = optimizer._loop
    if loop.views is not None:
        raise ValueError(
            "fuse_accumulation with gradient_as_view=True: the views already take the fp32 "
            "gradients in place during the backward; use one or the other (nothing changed)"
        )
    if loop.sharded:
        raise ValueError(
            "fuse_accumulation with FSDP2-sharded parameters: each rank holds a shard of the "
            "accumulator and the full gradient is reduce-scattered by FSDP2; not supported "
            "(nothing changed)"
        )
    if loop.hooks:
        raise ValueError(
            "fuse_accumulation with overlap_reduce=True: its reduction starts per parameter "
            "from hooks that fused weights (which get no .grad) never fire; create the "
            "optimizer with overlap_reduce=False (nothing changed)"
        )
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
    root = model.module if ddp is not None else model
    report = FusionReport(root)
    for name, m in list(root.named_modules()):
        if not isinstance(m, nn.Linear) or isinstance(m, FusedLinear):
            continue
        why = _why_not(m, loop, min_size)
        if why is not None:
            report.left[name or "<model>"] = why
            continue
        if not name:
            report.left["<model>"] = "the model itself is the Linear: fuse its parent"
            continue
        key = next(_KEYS)
        bias = m.bias if m.bias is not None and m.bias.requires_grad else None
        _SLOTS[key] = _Slot(
            weakref.ref(loop),
            loop.index[id(m.weight)],
            loop.index[id(bias)] if bias is not None else None,
            weakref.ref(ddp) if ddp is not None else None,
        )
        fused = FusedLinear.__new__(FusedLinear)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = m.in_features, m.out_features
        fused.weight, fused.bias = m.weight, m.bias
        fused.train(m.training)
        fused._ga_key = key
        parent, _, leaf = name.rpartition(".")
        owner = root.get_submodule(parent) if parent else root
        setattr(owner, leaf, fused)
        report._originals[name] = (m, key)
        report.fused.append(name)
    return report


def fused_path(layer: nn.Linear, n: int = 1) -> str:
    """Which path ``layer``'s fold takes for ``n`` rows of input: ``"onednn:<kernel>"``,
    ``"cublaslt"``, or ``"unfused: <reason>"`` (formed and folded during the backward)."""
    w = layer.weight
    if w.device.type == "cuda":
        return "cublaslt" if core.cuda_status().available else "unfused: no CUDA kernels"
    dtype = str(w.dtype).replace("torch.", "")
    fused, what = core.wgrad_path(dtype, n, layer.out_features, layer.in_features)
    return what if fused else f"unfused: {what}"
