"""Accumulation-aware batch norm: running statistics updated once per cycle, from all micro-batches.

Forward normalises with the micro-batch's own statistics (the layer cannot see the big batch).
Each training forward takes the micro-batch's per-channel mean and variance from torch's own
fused batch-norm kernel (the one ``nn.BatchNorm*d`` runs: no second pass over the input) and
merges them into the cycle's (count, mean, M2) in fp64 (Chan's parallel formula, in the C++
core: on the device where the core has kernels, on the CPU and CUDA; through small host copies
elsewhere); the ``accum_steps``-th forward updates ``running_mean``, ``running_var`` and
``num_batches_tracked`` once, exactly as one ``nn.BatchNorm*d`` forward over the concatenated
big batch would (unbiased running variance, PyTorch's momentum convention, ``momentum=None`` as
a cumulative average). A layer registered with a ``GradientAccumulateOptimizer`` (through the
optimizer's ``model=`` or ``convert_batchnorm(model, optimizer)``) takes the cycle's length and
phase from that optimizer instead: its running statistics update in the forward of the
micro-batch whose ``step()`` ends the optimizer's cycle, so a changed ``accum_steps`` moves both
together. Under torch.distributed the cycle's moments of all ranks are merged at
the boundary with one small all_gather (``process_group``, default: the default group), so the
statistics are those of the global big batch.

Precision: a micro-batch's moments are what torch's kernel computes for that input (for fp32
input: accumulated in higher precision, rounded to fp32, as ``nn.BatchNorm*d`` itself does on the
big batch); everything from there on is fp64. fp16/bf16 running statistics take their moments
from an fp64 pass over the input instead.

Under ``torch.compile`` (``fullgraph=True`` included) the normalisation is traced like
``nn.BatchNorm*d``'s and the cycle's bookkeeping (merge, micro-step counter, the boundary's
running update) runs as one registered custom op, ``gradient_accumulator::bn_fold``: no graph
break.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradient_accumulator import _validation, core
from gradient_accumulator.deprecation import warn_once
from gradient_accumulator.torch._glue import keep_on_sync_conversion

__all__ = [
    "AccumBatchNorm1d",
    "AccumBatchNorm2d",
    "AccumBatchNorm3d",
    "AccumSyncBatchNorm",
    "convert_batchnorm",
    "flush_batchnorm",
]

_ACCUM_BUFFERS = ("accum_count", "accum_mean", "accum_m2", "accum_step")
_MOMENTS = ("accum_count", "accum_mean", "accum_m2")  # always float64

# Every live AccumBatchNorm layer. Only for a deprecated fallback: an optimizer built without
# ``model=`` still flushes the unregistered layers whose affine weight it holds.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_layers() -> list[nn.Module]:
    """The AccumBatchNorm layers that currently exist (in no particular order)."""
    return list(_LIVE)


class Registered:
    """The AccumBatchNorm layers registered with one optimizer, in registration order.

    Weak references: a layer dropped from its model is not kept alive by the optimizer. A copy
    of the optimizer (pickle, deepcopy) starts with none: its layers are copies too, and are
    registered again through ``convert_batchnorm(model, optimizer)``.
    """

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def add(self, layer: nn.Module) -> None:
        if all(r() is not layer for r in self._refs):
            self._refs.append(weakref.ref(layer))

    def discard(self, layer: nn.Module) -> None:
        self._refs = [r for r in self._refs if r() is not layer]

    def layers(self) -> list[nn.Module]:
        """The registered layers still alive."""
        alive = [r() for r in self._refs]
        self._refs = [r for r, m in zip(self._refs, alive) if m is not None]
        return [m for m in alive if m is not None]

    def __reduce__(self) -> tuple:
        return (Registered, ())


def register(module: nn.Module, optimizer: Any) -> int:
    """Register every AccumBatchNorm layer of ``module`` with ``optimizer`` (a
    ``GradientAccumulateOptimizer``): from then on the layers take the cycle's length and phase
    from it, and its ``flush()`` flushes them. A layer registered with another optimizer
    before moves to this one.

    Returns:
        The number of layers registered.
    """
    registered = optimizer._loop.batchnorms
    ref = weakref.ref(optimizer)
    n = 0
    for m in module.modules():
        if isinstance(m, _AccumBatchNormMixin):
            previous = _owner(m)
            if previous is not None and previous is not optimizer:
                previous._loop.batchnorms.discard(m)
            m._ga_owner = ref
            registered.add(m)
            n += 1
    return n


def _owner(m: Any) -> Any:
    """The optimizer ``m`` (a layer, or the custom op's view of one) is registered with, or
    None (standalone, or the optimizer is gone)."""
    ref = m._ga_owner
    return None if ref is None else ref()


def core_runs_on(device: torch.device, *, moments: bool = False) -> bool:
    """Whether the C++ core's batch-norm kernels take tensors on ``device``.

    The merge and the running-statistics update run on the CPU always, and on CUDA when the
    build has CUDA kernels; the moments of an input (``moments=True``) on the CPU only. Elsewhere
    (mps, xpu, CUDA with a CPU-only build) the layer goes through host copies.
    """
    if device.type == "cpu":
        return True
    return not moments and device.type == "cuda" and core.has_cuda()


def _host(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy of ``t`` on the CPU (a copy even of a CPU tensor)."""
    return t.to(device="cpu", dtype=torch.float64, copy=True)


def _torch_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (axis 1) mean and M2 of ``x`` with torch ops, float64, on ``x``'s device."""
    dims = [d for d in range(x.dim()) if d != 1]
    xd = x.double()
    mean = xd.mean(dim=dims)
    m2 = ((xd - mean.view(1, -1, *([1] * (x.dim() - 2)))) ** 2).sum(dim=dims)
    return mean, m2


def layers_to_flush(
    model: nn.Module | None, index: dict[int, int], registered: Registered | None = None
) -> list[nn.Module]:
    """The AccumBatchNorm layers an optimizer flushes with its own partial cycle, in an order
    every rank shares: those of ``model``, then those registered with it (``registered``),
    then — deprecated, with a warning — the unregistered live layers whose affine weight the
    optimizer holds (``index``: parameter id → position), by that position."""
    layers: list[nn.Module] = []
    if model is not None:
        layers = [m for m in model.modules() if isinstance(m, _AccumBatchNormMixin)]
    known = {id(m) for m in layers}
    if registered is not None:
        for m in registered.layers():
            if id(m) not in known:
                layers.append(m)
                known.add(id(m))
    held = sorted(
        (index[id(m.weight)], m)
        for m in live_layers()
        if id(m) not in known
        and _owner(m) is None  # a registered layer is its optimizer's to flush
        and isinstance(m.weight, torch.Tensor)
        and id(m.weight) in index
    )
    if any(int(m.accum_step) > 0 for _, m in held):  # the fallback made a difference
        warn_once(
            "flush-by-weights",
            "GradientAccumulateOptimizer.flush() found AccumBatchNorm layers by their weights, "
            "a deprecated fallback: register them with the optimizer (model= or "
            "convert_batchnorm(model, optimizer)) so that they also follow its cycle "
            "(said once per process)",
            stacklevel=4,
        )
    return layers + [m for _, m in held]


def _input_moments(x: torch.Tensor) -> torch.Tensor:
    """(mean, M2) of ``x`` per channel (axis 1), float64, stacked: the core's fp64 pass on the
    CPU in eager mode, torch ops elsewhere."""
    if core_runs_on(x.device, moments=True) and not torch.compiler.is_compiling():
        c = x.shape[1]
        out = torch.empty(2, c, dtype=torch.float64)
        core.bn_moments(x.contiguous(), channels_axis=1, mean=out[0], m2=out[1])
        return out
    return torch.stack(_torch_moments(x))


def _fold(m: Any, mean: torch.Tensor, m2: torch.Tensor, count: int) -> None:
    """Merge one micro-batch's moments (``mean`` and ``m2`` = Σ(x − mean)² per channel, float32
    or float64, ``count`` values per channel)
    into the cycle of ``m`` (a layer, or the custom op's view of one), count the micro-step and
    end the cycle at the ``accum_steps``-th.

    Runs on every training forward, so it reads the buffers once (a module's attribute lookup
    is not free) and needs no autograd context (nothing here requires grad)."""
    if m.accum_mean.dtype != torch.float64:  # e.g. after model.half()
        for name in _MOMENTS:
            setattr(m, name, getattr(m, name).double())
    b = m._buffers if isinstance(m, nn.Module) else m.__dict__
    acc_count, acc_mean, acc_m2, acc_step = (
        b["accum_count"],
        b["accum_mean"],
        b["accum_m2"],
        b["accum_step"],
    )
    if core_runs_on(acc_mean.device):
        if mean.device != acc_mean.device:
            mean, m2 = mean.to(acc_mean.device), m2.to(acc_mean.device)
        total = core.bn_merge(float(acc_count), acc_mean, acc_m2, float(count), mean, m2)
    else:  # no core kernels on this device: merge small host copies, copy the result back
        h_mean, h_m2 = _host(acc_mean), _host(acc_m2)
        total = core.bn_merge(float(acc_count), h_mean, h_m2, float(count), _host(mean), _host(m2))
        acc_mean.copy_(h_mean)
        acc_m2.copy_(h_m2)
    acc_count.fill_(total)
    acc_step.add_(1)
    owner = _owner(m)
    if owner is not None:
        # Registered: the cycle is the optimizer's; this forward's micro-batch ends it when
        # the coming step() does.
        if owner.is_boundary_next():
            _update_running(m)
    elif int(acc_step) >= m._accum_steps:
        _update_running(m)


def _update_running(m: Any, collective: bool = False) -> None:
    """Fold the cycle's merged moments of ``m`` into its running statistics and start a new
    cycle.

    Args:
        collective: take part in the merge across ranks even with an empty local cycle
            (a flush, which every rank makes, whatever it has seen).
    """
    with torch.no_grad():
        if int(m.accum_step) == 0 and not (collective and m._multi_rank()):
            return
        _merge_across_ranks(m)
        if float(m.accum_count) == 0:  # no rank saw a sample this cycle
            m.accum_step.zero_()
            return
        m.num_batches_tracked += 1
        if m.momentum is None:
            factor = 1.0 / float(m.num_batches_tracked)
        else:
            factor = float(m.momentum)
        count = float(m.accum_count)
        if count > 1:
            rm, rv = m.running_mean, m.running_var
            if core_runs_on(rm.device):
                mean, m2 = m.accum_mean, m.accum_m2
                direct = rm.dtype in (torch.float32, torch.float64)
                # fp16/bf16 statistics: an fp64 copy on the same device, rounded once back
                rm_w = rm if direct else rm.double()
                rv_w = rv if direct else rv.double()
            else:  # no core kernels on this device: update host copies, copy the result back
                mean, m2 = _host(m.accum_mean), _host(m.accum_m2)
                direct = False
                rm_w, rv_w = _host(rm), _host(rv)
            core.bn_update_running(rm_w, rv_w, mean, m2, count, momentum=factor, unbiased=True)
            if not direct:
                rm.copy_(rm_w)
                rv.copy_(rv_w)
        m.accum_count.zero_()
        m.accum_mean.zero_()
        m.accum_m2.zero_()
        m.accum_step.zero_()


def _multi_rank(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _merge_across_ranks(m: Any) -> None:
    """Under torch.distributed, merge every rank's cycle moments (one all_gather)."""
    import torch.distributed as dist

    if not m._multi_rank():
        return
    group = m.process_group
    world = dist.get_world_size(group)
    c = m.accum_mean.numel()
    mine = torch.cat([m.accum_count.view(1), m.accum_mean, m.accum_m2])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if not core_runs_on(mine.device):  # no core kernels there: merge on the host
        gathered = [_host(g) for g in gathered]
    counts = torch.stack([g[0] for g in gathered]).tolist()  # one read of the device
    # Merged into rank 0's gathered copy (a buffer of its own), in rank order: every rank
    # computes the same result.
    count, mean, m2 = counts[0], gathered[0][1 : 1 + c], gathered[0][1 + c :]
    for n, other in zip(counts[1:], gathered[1:]):
        count = core.bn_merge(count, mean, m2, n, other[1 : 1 + c], other[1 + c :])
    m.accum_count.fill_(count)
    m.accum_mean.copy_(mean)
    m.accum_m2.copy_(m2)


# Layers by key, for the custom op (which takes tensors and numbers, not modules): the op reads
# a layer's process group from here; everything it changes comes in as its own arguments.
_BY_KEY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT_KEY = [0]


class _Held:
    """The custom op's view of a layer: its cycle buffers as the op was given them."""

    def __init__(self, key: int, **tensors: Any) -> None:
        self.__dict__.update(tensors)
        layer = _BY_KEY.get(key)
        self.process_group = None if layer is None else layer.process_group
        self._ga_owner = None if layer is None else layer._ga_owner
        self._layer = layer

    def _multi_rank(self) -> bool:
        if self._layer is not None:
            return self._layer._multi_rank()
        return _multi_rank(self.process_group)


# Defined with torch.library's low-level API (a schema and a kernel) rather than
# torch.library.custom_op, whose Python wrappers cost ~100 µs a call: the compiled graph calls
# this op on every training forward of every layer.
_LIB = torch.library.Library("gradient_accumulator", "DEF")
_LIB.define(
    "bn_fold(Tensor mean, Tensor m2, SymInt count, Tensor(a!) accum_count, "
    "Tensor(b!) accum_mean, Tensor(c!) accum_m2, Tensor(d!) accum_step, "
    "Tensor(e!) running_mean, Tensor(f!) running_var, Tensor(g!) num_batches_tracked, "
    "SymInt accum_steps, float? momentum, SymInt key) -> ()"
)


def _bn_fold_kernel(
    mean: torch.Tensor,
    m2: torch.Tensor,
    count: int,
    accum_count: torch.Tensor,
    accum_mean: torch.Tensor,
    accum_m2: torch.Tensor,
    accum_step: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    num_batches_tracked: torch.Tensor,
    accum_steps: int,
    momentum: float | None,
    key: int,
) -> None:
    """AccumBatchNorm's per-micro-step bookkeeping as one op (what the eager forward runs)."""
    held = _Held(
        key,
        accum_count=accum_count,
        accum_mean=accum_mean,
        accum_m2=accum_m2,
        accum_step=accum_step,
        running_mean=running_mean,
        running_var=running_var,
        num_batches_tracked=num_batches_tracked,
        _accum_steps=accum_steps,
        momentum=momentum,
    )
    _fold(held, mean, m2, count)


_LIB.impl("bn_fold", _bn_fold_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("gradient_accumulator::bn_fold", lib=_LIB)
def _bn_fold_fake(*args: Any) -> None:
    return None


class _AccumBatchNormMixin:
    """Shared implementation of AccumBatchNorm1d/2d/3d (mixed into nn.BatchNorm*d)."""

    def _init_accum(self, accum_steps: Any, process_group: Any = None) -> None:
        self._accum_steps = _validation.check_accum_steps(accum_steps)
        self._ga_owner: weakref.ref | None = None
        self.process_group = process_group
        c = self.num_features
        device = self.running_mean.device if self.running_mean is not None else None
        self.register_buffer("accum_count", torch.zeros((), dtype=torch.float64, device=device))
        self.register_buffer("accum_mean", torch.zeros(c, dtype=torch.float64, device=device))
        self.register_buffer("accum_m2", torch.zeros(c, dtype=torch.float64, device=device))
        self.register_buffer("accum_step", torch.zeros((), dtype=torch.long, device=device))
        self._register()

    def _register(self) -> None:
        _LIVE.add(self)
        self._ga_key = _NEXT_KEY[0]
        _NEXT_KEY[0] += 1
        _BY_KEY[self._ga_key] = self

    @property
    def accum_steps(self) -> int:
        """Micro-batches per running-statistics update: the registered optimizer's
        ``accum_steps`` (read at every forward), else the layer's own."""
        owner = _owner(self)
        return self._accum_steps if owner is None else owner.accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        value = _validation.check_accum_steps(value)
        if _owner(self) is not None:
            warnings.warn(
                "accum_steps set on an AccumBatchNorm layer registered with an optimizer is "
                "ignored while it is registered: the layer follows the optimizer's accum_steps "
                "(set that one)",
                UserWarning,
                stacklevel=2,
            )
        self._accum_steps = value

    def registered_optimizer(self) -> Any:
        """The ``GradientAccumulateOptimizer`` whose cycle this layer follows, or None."""
        return _owner(self)

    def __getstate__(self) -> dict:
        # A copy is a layer of its own, registered with no optimizer (the optimizer does not
        # hold its parameters): it keeps the cycle length it had.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state["_accum_steps"] = self.accum_steps
        state["_ga_owner"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        # A deep copy or an unpickled layer is a layer of its own: its own key, and live.
        state.setdefault("_ga_owner", None)
        if "_accum_steps" not in state and "accum_steps" in state:  # pickled by an older version
            state["_accum_steps"] = state.pop("accum_steps")
        super().__setstate__(state)
        self._register()

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202
        # model.to(dtype) / .half() would round the cycle's float64 moments; they follow the
        # module's device but keep float64, so a mid-cycle resume stays bit-identical.
        saved = {n: getattr(self, n) for n in _MOMENTS}
        out = super()._apply(fn, *args, **kwargs)
        for n, old in saved.items():
            new = getattr(self, n)
            if new.dtype != torch.float64:
                self._buffers[n] = old.to(device=new.device, dtype=torch.float64)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", accum_steps={self.accum_steps}"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        # A plain BatchNorm's state dict has no cycle state: start a fresh cycle.
        for name in _ACCUM_BUFFERS:
            if prefix + name not in state_dict:
                state_dict[prefix + name] = torch.zeros_like(getattr(self, name))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        if not (self.training and self.track_running_stats):
            return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        c = self.num_features
        count = input.numel() // c
        rm = self._buffers["running_mean"]
        compiling = torch.compiler.is_compiling()
        if rm.dtype not in (torch.float32, torch.float64):
            # fp16/bf16 statistics: fp64 moments from a pass of their own
            out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
            moments = _input_moments(input.detach())
            mean, m2 = moments[0], moments[1]
        elif input.device.type == "cpu" and not compiling:
            # torch's kernel computes the micro-batch's moments in the pass that normalises and
            # returns the mean; with momentum n − 1 its "running variance" update turns a zero
            # buffer into (n − 1)·(unbiased variance) = M2 (its running mean, (n − 1)·mean, is
            # not used). No extra read of the input and no op beyond the buffers' allocation.
            if count <= 1:
                raise ValueError(
                    "Expected more than 1 value per channel when training, got input size "
                    f"{input.size()}"
                )
            scaled_mean, m2 = torch.zeros(2, c, dtype=rm.dtype).unbind()
            out, mean, _ = torch.native_batch_norm(
                input, self.weight, self.bias, scaled_mean, m2, True, float(count - 1), self.eps
            )
        else:
            # Elsewhere (and when traced) through F.batch_norm, as nn.BatchNorm*d: fresh zero
            # "running" buffers with momentum 1 receive the mean and the unbiased variance.
            stats = torch.zeros(2, c, dtype=rm.dtype, device=rm.device)
            out = F.batch_norm(
                input, stats[0], stats[1], self.weight, self.bias, True, 1.0, self.eps
            )
            moments = stats.to(torch.float64)
            moments[1].mul_(count - 1)
            mean, m2 = moments[0], moments[1]
        if compiling:
            torch.ops.gradient_accumulator.bn_fold(
                mean,
                m2,
                count,
                self.accum_count,
                self.accum_mean,
                self.accum_m2,
                self.accum_step,
                self.running_mean,
                self.running_var,
                self.num_batches_tracked,
                self._accum_steps,  # the kernel reads a registered optimizer's at run time
                self.momentum,
                self._ga_key,
            )
        else:
            _fold(self, mean, m2, count)
        return out

    def _update_running(self, collective: bool = False) -> None:
        _update_running(self, collective)

    def _multi_rank(self) -> bool:
        return _multi_rank(self.process_group)

    def flush(self) -> None:
        """Apply a partial cycle's statistics now (end of data).

        Under torch.distributed every rank must flush: a rank with an empty partial cycle
        still takes part in the merge.
        """
        self._update_running(collective=True)


class AccumBatchNorm1d(_AccumBatchNormMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` whose running statistics are those of the accumulated big batch.

    Takes ``nn.BatchNorm1d``'s arguments plus ``accum_steps``.

    Example:
        >>> import torch
        >>> bn = AccumBatchNorm1d(3, accum_steps=2)
        >>> _ = bn(torch.randn(4, 3)); _ = bn(torch.randn(4, 3))
        >>> int(bn.num_batches_tracked)
        1
    """

    def __init__(
        self,
        num_features: int,
        *args: Any,
        accum_steps: int = 1,
        process_group: Any = None,
        **kwargs: Any,
    ):
        super().__init__(num_features, *args, **kwargs)
        self._init_accum(accum_steps, process_group)


class AccumBatchNorm2d(_AccumBatchNormMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose running statistics are those of the accumulated big batch.

    Example:
        >>> import torch
        >>> bn = AccumBatchNorm2d(3, accum_steps=4)
        >>> bn(torch.randn(2, 3, 5, 5)).shape
        torch.Size([2, 3, 5, 5])
    """

    def __init__(
        self,
        num_features: int,
        *args: Any,
        accum_steps: int = 1,
        process_group: Any = None,
        **kwargs: Any,
    ):
        super().__init__(num_features, *args, **kwargs)
        self._init_accum(accum_steps, process_group)


class AccumBatchNorm3d(_AccumBatchNormMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` whose running statistics are those of the accumulated big batch.

    Example:
        >>> import torch
        >>> bn = AccumBatchNorm3d(2, accum_steps=2)
        >>> bn(torch.randn(2, 2, 3, 3, 3)).shape
        torch.Size([2, 2, 3, 3, 3])
    """

    def __init__(
        self,
        num_features: int,
        *args: Any,
        accum_steps: int = 1,
        process_group: Any = None,
        **kwargs: Any,
    ):
        super().__init__(num_features, *args, **kwargs)
        self._init_accum(accum_steps, process_group)


class AccumSyncBatchNorm(_AccumBatchNormMixin, nn.modules.batchnorm._BatchNorm):
    """The accumulating counterpart of ``nn.SyncBatchNorm``: running statistics of the global
    big batch.

    What ``convert_batchnorm`` makes of an ``nn.SyncBatchNorm``. The running statistics are
    merged across the ranks of ``process_group`` (default: the default group) once per cycle,
    with one small all_gather, and equal those of torch's ``SyncBatchNorm`` on the global big
    batch (all ranks' micro-batches of the cycle together). The training forward normalises
    with the rank's own micro-batch statistics, like ``AccumBatchNorm*d`` and like a plain
    ``BatchNorm`` under DDP: no collective per micro-batch (``SyncBatchNorm`` normalises with
    the statistics of the micro-batch across ranks, two collectives per layer and micro-batch,
    on GPUs only). Accepts inputs of rank 2 and more, like ``SyncBatchNorm``. It is not a
    subclass of ``nn.SyncBatchNorm`` (DDP refuses those on the CPU).

    Example:
        >>> import torch
        >>> bn = AccumSyncBatchNorm(3, accum_steps=2)
        >>> _ = bn(torch.randn(4, 3, 5)); _ = bn(torch.randn(2, 3, 5))
        >>> int(bn.num_batches_tracked)
        1
    """

    def __init__(
        self,
        num_features: int,
        *args: Any,
        accum_steps: int = 1,
        process_group: Any = None,
        **kwargs: Any,
    ):
        super().__init__(num_features, *args, **kwargs)
        self._init_accum(accum_steps, process_group)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


_TARGETS = {
    nn.BatchNorm1d: AccumBatchNorm1d,
    nn.BatchNorm2d: AccumBatchNorm2d,
    nn.BatchNorm3d: AccumBatchNorm3d,
    nn.SyncBatchNorm: AccumSyncBatchNorm,
}


def _uninitialized_lazy(m: nn.Module) -> bool:
    from torch.nn.modules.lazy import LazyModuleMixin

    return isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()


def _batchnorm_like(m: nn.Module) -> bool:
    """A batch norm that updates running statistics in its forward, other than ours."""
    if isinstance(m, _AccumBatchNormMixin):
        return False
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return True
    name = type(m).__name__.lower()
    return (
        "batchnorm" in name
        and "frozen" not in name
        and isinstance(getattr(m, "running_mean", None), torch.Tensor)
    )


def _is_accumulating(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a GradientAccumulateOptimizer (by its class, without importing
    torch/optimizer.py, which imports this module)."""
    return any(
        c.__name__ == "GradientAccumulateOptimizer"
        and c.__module__ == "gradient_accumulator.torch.optimizer"
        for c in type(optimizer).__mro__
    )


def convert_batchnorm(
    module: nn.Module, optimizer: Any = None, *, accum_steps: int | None = None
) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` in ``module`` by its
    accumulating counterpart (``AccumBatchNorm1d/2d/3d``, ``AccumSyncBatchNorm``).

    Given the ``GradientAccumulateOptimizer`` that trains ``module``, the new layers (and any
    AccumBatchNorm already in ``module``) are registered with it: they take the cycle's length
    and phase from it — a changed ``opt.accum_steps`` moves them too — and its ``flush()``
    flushes them. The new layers then keep the old layers' affine parameters (the same
    ``nn.Parameter`` objects, which the optimizer holds), so the optimizer may be built before
    the conversion. Given ``accum_steps`` instead (the form of earlier versions; anything but
    an optimizer in its place is taken as ``accum_steps``), the layers count their own cycle of
    that length until an optimizer built with ``model=`` registers them, and the affine
    parameters are copies.

    Running statistics and ``num_batches_tracked`` are copied (no buffer is shared with the
    old layer); ``requires_grad``, the training mode and a ``SyncBatchNorm``'s
    ``process_group`` are kept. A ``LazyBatchNorm*d`` is converted once a
    forward has materialised it (it is then a ``BatchNorm*d``); before that it is refused. Any
    other batch-norm-like layer (a subclass of ``BatchNorm*d`` with a forward of its own, a
    third-party batch norm) is left alone with a warning: its running statistics keep updating
    on every micro-batch. A later ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` keeps the
    converted layers (see ``AccumSyncBatchNorm``).

    Args:
        module: the model (or a single batch norm).
        optimizer: the ``GradientAccumulateOptimizer`` to register the layers with.
        accum_steps: the layers' own cycle length, for layers used without a registered
            optimizer (not together with ``optimizer``).

    Returns:
        The converted module (``module`` itself, changed in place, unless it is a BatchNorm).

    Raises:
        ValueError: ``module`` holds an uninitialised lazy batch norm, or both ``optimizer``
            and ``accum_steps`` are given (nothing is converted).
        TypeError: ``module`` is not a module, ``optimizer`` is a torch optimizer that is not
            a GradientAccumulateOptimizer, ``accum_steps`` is not an int, or neither is given.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gradient_accumulator.torch import GradientAccumulateOptimizer
        >>> model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
        >>> opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4)
        >>> model = convert_batchnorm(model, opt)
        >>> type(model[1]).__name__, model[1].accum_steps
        ('AccumBatchNorm2d', 4)
        >>> opt.accum_steps = 8  # between cycles: the layer follows
        >>> model[1].accum_steps
        8
        >>> type(convert_batchnorm(nn.BatchNorm1d(3), accum_steps=2)).__name__
        'AccumBatchNorm1d'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if (
        optimizer is not None
        and not _is_accumulating(optimizer)
        and not isinstance(optimizer, torch.optim.Optimizer)
    ):
        # convert_batchnorm(model, k), the form of earlier versions: k is accum_steps.
        if accum_steps is not None:
            raise ValueError("convert_batchnorm takes optimizer or accum_steps, not both")
        optimizer, accum_steps = None, optimizer
    if optimizer is not None:
        if accum_steps is not None:
            raise ValueError(
                "convert_batchnorm takes optimizer or accum_steps, not both (registered "
                "layers take accum_steps from the optimizer)"
            )
        if not _is_accumulating(optimizer):
            raise TypeError(
                "optimizer must be a GradientAccumulateOptimizer (the one that trains the "
                f"module), got {type(optimizer).__name__}; wrap it first"
            )
        steps = optimizer.accum_steps
    elif accum_steps is None:
        raise TypeError(
            "convert_batchnorm needs the optimizer to register the layers with "
            "(convert_batchnorm(model, optimizer)) or accum_steps"
        )
    else:
        steps = _validation.check_accum_steps(accum_steps)
    for name, m in module.named_modules():
        if _uninitialized_lazy(m) and _batchnorm_like(m):
            raise ValueError(
                f"module: {name or 'the module'} is an uninitialised {type(m).__name__}; run "
                "one forward (e.g. on a sample batch, in eval mode) to materialise it, then "
                "call convert_batchnorm"
            )
    module = _convert(module, steps, "", keep_params=optimizer is not None)
    if optimizer is not None:
        register(module, optimizer)
    return module


def _convert(module: nn.Module, accum_steps: int, path: str, keep_params: bool) -> nn.Module:
    target = _TARGETS.get(type(module))
    if target is not None:
        extra = {"process_group": module.process_group} if target is AccumSyncBatchNorm else {}
        new = target(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
            accum_steps=accum_steps,
            **extra,
        ).to(device=next(iter(module.state_dict().values()), torch.empty(0)).device)
        if module.affine:
            new = new.to(dtype=module.weight.dtype)
        with torch.no_grad():
            if module.affine and keep_params:
                # The optimizer holds these very objects.
                new.weight, new.bias = module.weight, module.bias
            elif module.affine:
                new.weight.copy_(module.weight)
                new.bias.copy_(module.bias)
                new.weight.requires_grad_(module.weight.requires_grad)
                new.bias.requires_grad_(module.bias.requires_grad)
            if module.track_running_stats:
                new.running_mean.copy_(module.running_mean)
                new.running_var.copy_(module.running_var)
                new.num_batches_tracked.copy_(module.num_batches_tracked)
        new.train(module.training)
        return new
    if _batchnorm_like(module):
        warnings.warn(
            f"convert_batchnorm leaves {path or 'the module'} ({type(module).__name__}) as it "
            "is: its running statistics update on every micro-batch, not once per cycle. "
            "Replace it by an AccumBatchNorm layer yourself if it is a plain batch norm",
            UserWarning,
            stacklevel=3,
        )
        return module
    for name, child in module.named_children():
        child_path = f"{path}.{name}" if path else name
        setattr(module, name, _convert(child, accum_steps, child_path, keep_params))
    return module


# torch's SyncBatchNorm.convert_sync_batchnorm replaces every _BatchNorm, ours included, by a
# SyncBatchNorm that shares our running statistics and updates them on every micro-batch. Ours
# already merge across ranks once per cycle: the converter keeps them (in the process group it
# is given) and converts everything else as torch does (the patch lives in torch/_glue.py).
keep_on_sync_conversion(_AccumBatchNormMixin)


def flush_batchnorm(module: nn.Module) -> None:
    """Apply the partial cycle of every AccumBatchNorm in ``module`` (end of data)."""
    for m in module.modules():
        if isinstance(m, _AccumBatchNormMixin):
            m.flush()
