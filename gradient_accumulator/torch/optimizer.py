"""GradientAccumulateOptimizer: any torch optimizer stepping once per k micro-batches, exactly."""

from __future__ import annotations

import hashlib
import math
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Callable, NamedTuple

import torch

from gradient_accumulator import _validation, core
from gradient_accumulator.nonfinite import NonFiniteCounter, check_on_nonfinite
from gradient_accumulator.torch.distributed import (
    AGREE_SLOT,
    SCALAR_SLOTS,
    BucketReducer,
    agreement_slots,
    check_ranks_agree,
    disagreement,
    resolve_group,
)

__all__ = ["AccumulationState", "GradientAccumulateOptimizer"]

_REDUCTIONS = ("mean", "sum", "running_mean")
_LEFTOVERS = ("apply", "carry")


class AccumulationState(NamedTuple):
    """Where the wrapper stands inside a cycle (also saved in ``state_dict()``).

    Attributes:
        micro_step: micro-batches accumulated in the current cycle (0 ≤ micro_step < accum_steps).
        total_weight: sum of the weights of those micro-batches.
        nonfinite: True if any of them had a NaN/Inf gradient.
        updates: optimizer updates made so far (skipped non-finite cycles not counted).
    """

    micro_step: int
    total_weight: float
    nonfinite: bool
    updates: int


def _float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


_FLT_MAX = 3.4028234663852886e38


def _global_clip_coef(norm: Any, max_norm: float) -> Any:
    """min(1, max_norm / (‖g‖ + 1e-6)): a float for a float norm, a tensor for a device norm.

    The core's formula (``csrc/core/formulas.h``), for the norm the adapter computes over every
    group before the per-group apply calls.
    """
    coef = max_norm / (norm + 1e-6)
    return coef.clamp(max=1.0) if isinstance(coef, torch.Tensor) else min(1.0, coef)


class _InterruptGate:
    """Holds Ctrl-C while a step writes, so it surfaces once buffers and counters agree.

    On the first step in the main thread, the process's Python-level SIGINT handler (if it has
    one) is wrapped once: outside a step the wrapper calls it at once; inside one it records the
    signal, and the step calls it on the way out. Entering and leaving a step then costs a
    counter update, not a ``signal.signal`` call. A handler installed later (by a trainer, say)
    is wrapped in turn at the next step.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending: tuple[int, Any] | None = None
        self.inner: Callable[..., Any] | None = None

    def install(self) -> None:
        current = signal.getsignal(signal.SIGINT)
        if callable(current) and not isinstance(current, _InterruptGate):
            self.inner = current
            signal.signal(signal.SIGINT, self)

    def __call__(self, signum: int, frame: Any) -> None:
        if self.depth > 0:
            self.pending = (signum, frame)
        elif self.inner is not None:
            self.inner(signum, frame)

    def __enter__(self) -> _InterruptGate:
        # Only the main thread receives KeyboardInterrupt: steps elsewhere hold nothing.
        if threading.get_ident() == _MAIN_THREAD:
            # Another library (a trainer's signal connector, say) may have replaced or restored
            # the handler since: wrap whatever is current again (one dict lookup per step).
            if signal.getsignal(signal.SIGINT) is not self:
                self.install()
            self.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        if threading.get_ident() != _MAIN_THREAD:
            return
        self.depth -= 1
        if self.depth == 0 and self.pending is not None:
            pending, self.pending = self.pending, None
            if self.inner is not None and signal.getsignal(signal.SIGINT) is self:
                self.inner(*pending)  # the default handler raises KeyboardInterrupt here


_MAIN_THREAD = threading.main_thread().ident
_held_interrupts = _InterruptGate()


def _refuse_outer_accumulation() -> None:
    """Refuse to run under an ``accelerate`` gradient accumulation of more than one step.

    ``Accelerator(gradient_accumulation_steps=n)`` sums ``n`` backwards in ``.grad`` and lets
    the optimizer step only every ``n``-th call: with this wrapper that accumulates twice
    (``n × accum_steps`` micro-batches per update, the first ``n`` summed unweighted).
    accelerate's gradient state is process-wide, so it is read without importing accelerate.
    """
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    try:
        kwargs = state.GradientState._shared_state.get("plugin_kwargs") or {}
        steps = int(kwargs.get("num_steps", 1))
    except (AttributeError, TypeError, ValueError):
        return
    if steps > 1:
        raise ValueError(
            f"accelerate is set to accumulate gradients over {steps} steps "
            "(Accelerator(gradient_accumulation_steps=...)), and GradientAccumulateOptimizer "
            "accumulates too: the micro-batches would be accumulated twice. Create the "
            "Accelerator with gradient_accumulation_steps=1 and let the optimizer's accum_steps "
            "count the micro-batches"
        )


def _is_lightning_proxy(cls: type) -> bool:
    return any(
        b.__name__ == "LightningOptimizer" and b.__module__.endswith("core.optimizer")
        for b in cls.__mro__
    )


# Attributes a proxy must read and write on the real wrapper, not on itself.
_PROXIED_ATTRIBUTES = (
    "update_applied",
    "last_grad_norm",
    "accum_steps",
    "reduction",
    "max_grad_norm",
    "use_agc",
    "clip_factor",
    "eps",
    "grad_scaler",
    "leftover",
)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The GradientAccumulateOptimizer behind a framework's optimizer proxy, else ``optimizer``.

    Follows Lightning's ``LightningOptimizer`` (``_optimizer``) and accelerate's
    ``AcceleratedOptimizer`` (``optimizer``), so that state set on the result reaches the real
    wrapper and not a copy on the proxy.
    """
    for _ in range(8):
        if isinstance(optimizer, GradientAccumulateOptimizer) and not _is_lightning_proxy(
            type(optimizer)
        ):
            return optimizer
        inner = vars(optimizer).get("_optimizer", vars(optimizer).get("optimizer"))
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


def _forward_attribute(name: str) -> property:
    def get(self: Any) -> Any:
        return getattr(self._optimizer, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self._optimizer, name, value)

    return property(get, set_, doc=f"The wrapped optimizer's ``{name}``.")


def _forward_method(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._optimizer, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _install_lightning_forwarding(cls: type) -> None:
    """Make Lightning's optimizer proxy act on the real wrapper.

    Lightning's ``LightningOptimizer`` becomes a subclass of the wrapped optimizer's class, so our
    methods would run with the proxy as ``self`` and write the cycle's counters on the proxy
    (a ``flush()`` through ``self.optimizers()`` would leave the real wrapper mid-cycle). Every
    public method, property and attribute is forwarded to the real wrapper instead, and
    ``step()`` only counts as a Lightning optimizer step (``global_step``, step hooks) when it
    ends a cycle; ``flush()`` counts when it applies an update.
    """
    # Names the proxy's own classes define (before ours in the MRO) stay theirs.
    mro = cls.__mro__
    proxy_bases = [
        b
        for b in mro[: mro.index(GradientAccumulateOptimizer)]
        if not issubclass(b, GradientAccumulateOptimizer)
    ]
    own = {n for b in proxy_bases for n in vars(b)}
    names = {n for n in vars(GradientAccumulateOptimizer) if not n.startswith("_")}
    for name in sorted(names - own - {"step", "flush"}):
        value = vars(GradientAccumulateOptimizer)[name]
        if isinstance(value, property):
            setattr(cls, name, _forward_attribute(name))
        elif callable(value):
            setattr(cls, name, _forward_method(name))
    for name in _PROXIED_ATTRIBUTES:
        if name not in own:
            setattr(cls, name, _forward_attribute(name))
    base_step = cls.step

    def step(self: Any, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        real = self._optimizer
        module = getattr(self._strategy, "lightning_module", None)
        if module is not None and module.automatic_optimization and real.accum_steps > 1:
            raise RuntimeError(
                "GradientAccumulateOptimizer with accum_steps > 1 needs Lightning's manual "
                "optimization: set self.automatic_optimization = False and call "
                "opt.step(weight=...) on every micro-batch in training_step (Lightning's "
                "automatic loop would count every micro-batch as an optimizer step and step "
                "interval='step' schedulers on each)"
            )
        if not real.is_boundary_next():
            # A micro-step, not an optimizer step: Lightning must not count it.
            return real.step(closure, **kwargs)
        return base_step(self, closure, **kwargs)

    def flush(self: Any) -> bool:
        applied = self._optimizer.flush()
        if applied:  # count the update as Lightning's optimizer step
            self._on_before_step()
            self._on_after_step()
        return applied

    step.__doc__ = GradientAccumulateOptimizer.step.__doc__
    flush.__doc__ = GradientAccumulateOptimizer.flush.__doc__
    cls.step = step
    cls.flush = flush


class GradientAccumulateOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` so that it steps once every ``accum_steps`` micro-batches.

    Keep the usual loop — ``loss.backward(); opt.step(); opt.zero_grad()`` on every micro-batch.
    Each ``step()`` folds the fresh ``.grad`` of every parameter into an fp32 accumulator (one
    pass of the C++ core, whatever the gradient's dtype) and frees it; the ``accum_steps``-th call
    applies the update. For ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (amsgrad off) the update
    is the core's fused pass — average, unscale, clip or AGC, optimizer step — writing the inner
    optimizer's own state tensors, so ``optimizer.state_dict()`` stays interchangeable with the
    plain optimizer. Any other optimizer gets the final gradient in ``.grad`` and its own
    ``step()``. The inner optimizer's step count, bias correction and learning rate therefore
    count real updates.

    Micro-batches may carry a weight (samples or tokens): with ``reduction="mean"`` the update
    uses the exact weighted mean ``Σ wᵢ gᵢ / Σ wᵢ``, so uneven micro-batches match the big batch
    when each loss is a mean over its own micro-batch and ``weight`` is its size.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        accum_steps: micro-batches per update, an int ≥ 1.
        reduction: ``"mean"`` (divide by the total weight), ``"sum"`` (no division) or
            ``"running_mean"`` (the accumulator always holds the mean so far).
        max_grad_norm: clip the global L2 norm of the averaged gradient to this value.
        use_agc: adaptive gradient clipping of the averaged gradient (NFNets).
        clip_factor: AGC's λ.
        eps: AGC's ε (floor of a unit's weight norm).
        agc_exclude: parameters (or modules, whose parameters are taken) left unclipped by AGC.
            ``"final"`` (default) excludes the last parameter of rank ≥ 2 and the rank ≤ 1
            parameters that follow it — the final classifier when parameters are in
            registration order, as in the NFNets paper. ``()`` clips everything.
        grad_scaler: a ``torch.amp.GradScaler`` whose scale the losses were multiplied by
            (``scaler.scale(loss).backward()``; then call ``opt.step()``, not
            ``scaler.step(opt)``). Gradients are accumulated scaled and unscaled once at the
            boundary; a cycle with a non-finite gradient skips the update, resets the
            accumulators and lowers the scale. The wrapper calls ``scaler.update()``.
        leftover: what :meth:`flush` does with a cycle cut short by the end of the data:
            ``"apply"`` it with its true weight (default) or ``"carry"`` it into the next cycle.
        process_group: reduce the accumulators over this ``torch.distributed`` group once per
            cycle. By default the default group is used when torch.distributed is initialised
            with more than one rank. Per-rank weights are summed in the same round, so the
            update is the exact weighted mean over all ranks' micro-batches. Use it with an
            unwrapped model (it replaces DDP's reduction), or with a DDP model whose forward
            and backward run inside :func:`accumulate` (DDP then stays silent on every
            micro-batch and this reduction replaces its own). ``False``: never reduce.
        bucket_cap_mb: size of a reduction bucket (one collective each), in MiB.
        overlap_reduce: start each bucket's reduction during the last micro-batch's backward, as
            soon as its gradients are final (needs the micro-batch's weight before the
            backward: the default 1, or ``accumulate(model, opt, weight=...)``). False: reduce
            after the backward, in ``step()``.
        reduce_timeout: seconds to wait for the other ranks at the boundary before raising
            ``RuntimeError`` (None: the process group's own timeout).
        on_nonfinite: what a cycle whose accumulated gradient holds NaN or Inf does (a NaN/Inf
            micro-batch gradient, or finite ones whose weighted sum overflowed fp32):
            ``"skip"`` (default) drops it and warns (``NonFiniteGradientWarning``, on the 1st,
            2nd, 4th, … skipped cycle), ``"raise"`` raises ``NonFiniteGradientError`` before
            anything is written, ``"apply"`` applies it. With ``grad_scaler`` such a cycle is
            skipped silently and the scale lowered, whatever this says.
        model: the module the parameters come from (optional). Errors then name parameters
            by their names in it, and :meth:`flush` also flushes its ``AccumBatchNorm*d``
            layers (without it, those whose affine weight this optimizer holds).

    Attributes:
        update_applied: whether the last :meth:`step` (or :meth:`flush`) updated the weights.
        last_grad_norm: with ``max_grad_norm``, the norm of the last cycle's averaged gradient
            before clipping — a float for CPU parameters, a 0-dim device tensor for CUDA ones
            (read it when you need it; the step itself never waits for the GPU). NaN after a
            skipped cycle.

    On CUDA the accumulate, norm, clip and update run in the core's CUDA kernels on the current
    stream; micro-steps do not synchronise with the device, and each update reads one flag
    (whether a gradient of the cycle was non-finite) back to the host, as ``GradScaler`` does.

    Example:
        >>> import torch
        >>> from gradient_accumulator.torch import GradientAccumulateOptimizer
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters()), 4)
        >>> for _ in range(8):
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> opt.optimizer.state[model.weight]["step"].item()
        2.0
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if _is_lightning_proxy(cls):
            _install_lightning_forwarding(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accum_steps: int,
        reduction: str = "mean",
        *,
        max_grad_norm: float | None = None,
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        agc_exclude: str | Iterable[Any] = "final",
        grad_scaler: Any = None,
        leftover: str = "apply",
        process_group: Any = None,
        bucket_cap_mb: float = 25.0,
        overlap_reduce: bool = True,
        reduce_timeout: float | None = None,
        on_nonfinite: str = "skip",
        model: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, GradientAccumulateOptimizer):
            raise TypeError("optimizer is already a GradientAccumulateOptimizer")
        self.accum_steps = _validation.check_accum_steps(accum_steps)
        reduction = _validation.check_choice(reduction, "reduction", _REDUCTIONS)
        leftover = _validation.check_choice(leftover, "leftover", _LEFTOVERS)
        if max_grad_norm is not None:
            max_grad_norm = _validation.check_positive(max_grad_norm, "max_grad_norm")
        use_agc = _validation.check_bool(use_agc, "use_agc")
        if use_agc and max_grad_norm is not None:
            raise ValueError("use_agc and max_grad_norm are exclusive: choose one clipping rule")
        clip_factor, eps = _validation.check_agc_args(clip_factor, eps)
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
            raise TypeError("grad_scaler must be a torch.amp.GradScaler")

        self.optimizer = optimizer
        self.reduction = reduction
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.use_agc = bool(use_agc)
        self.clip_factor = float(clip_factor)
        self.eps = float(eps)
        self.grad_scaler = grad_scaler
        self.leftover = leftover
        self.model = model
        self._nonfinite_counter = NonFiniteCounter("GradientAccumulateOptimizer")
        # The inner optimizer's groups and state are the wrapper's: LR schedulers and state_dict()
        # act on it. (torch.optim.Optimizer.__init__ is not called: it would rebuild the groups.)
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        # param_groups, state and defaults are properties reading the inner optimizer's current
        # objects: its load_state_dict() replaces them, and a scheduler must keep acting on them.

        self._params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if not self._params:
            raise ValueError("optimizer has no parameters")
        self._names = self._parameter_names(model)
        ids = {id(p) for p in self._params}
        if len(ids) != len(self._params):
            raise ValueError("a parameter appears twice in the optimizer's param_groups")
        for i, p in enumerate(self._params):
            if p.device.type != "cpu" and not core.has_cuda():
                raise TypeError(
                    f"parameter {self._names[i]} is on {p.device}, but this build of "
                    "gradient-accumulator has no CUDA kernels (rebuild with GA_CUDA=ON)"
                )
            if not p.is_floating_point() or p.dtype not in (
                torch.float32,
                torch.bfloat16,
                torch.float16,
            ):
                raise TypeError(
                    f"parameter {self._names[i]} has dtype {p.dtype}; expected float32/bf16/fp16"
                )
            if p.device != self._params[0].device:
                raise ValueError(
                    f"parameter {self._names[i]} is on {p.device}, parameter {self._names[0]} on "
                    f"{self._params[0].device}: one wrapper holds parameters of one device"
                )
        self._check_layout()
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._agc_skip = self._resolve_exclude(agc_exclude) if self.use_agc else set()
        self._fused_kind = self._fused_optimizer_kind()

        # One flat fp32 buffer per device for all accumulators, laid out in backward order and
        # cut into buckets; a tail of scalars travels with the last bucket: SCALAR_SLOTS for
        # the weight, the non-finite flag and the ranks' agreement, then one "seen" flag per
        # parameter (a multiple of 16 elements, for 64-byte alignment).
        if process_group is False:
            self._distributed, group = False, None
        else:
            self._distributed, group = resolve_group(process_group)
        bucket_cap_mb = _validation.check_positive(bucket_cap_mb, "bucket_cap_mb")
        if reduce_timeout is not None:
            reduce_timeout = _validation.check_positive(reduce_timeout, "reduce_timeout")
        plan = core.arena_plan(
            [p.numel() for p in self._params],
            bucket_numel=max(1, int(bucket_cap_mb * 2**20 // 4)),
        )
        self._tail = SCALAR_SLOTS + -(-len(self._params) // 16) * 16
        self._flat = torch.zeros(
            plan.total + self._tail, dtype=torch.float32, device=self._params[0].device
        )
        self._accs = [
            self._flat[o : o + p.numel()].view_as(p) for o, p in zip(plan.offsets, self._params)
        ]
        # On CUDA the core raises a device flag for non-finite gradients instead of returning a
        # Python bool, so micro-steps never wait for the GPU; the flag is read once per cycle.
        self._cuda = self._flat.is_cuda
        self._device_flag = (
            torch.zeros((), dtype=torch.float32, device=self._flat.device) if self._cuda else None
        )
        self._layout = self._layout_fingerprint()
        self._reducer: BucketReducer | None = None
        self._hooks: list[Any] = []
        self._next_weight: float | None = None
        self._overlap = bool(overlap_reduce) and self._distributed
        if self._distributed:
            # Ranks that disagree on the cycle or the layout would pair wrong collectives (or
            # abort inside the backend on different sizes): one clear error on every rank now.
            check_ranks_agree(
                group,
                {
                    "accum_steps": self.accum_steps,
                    "reduction": _REDUCTIONS.index(reduction),
                    "number of parameters": len(self._params),
                    "accumulator elements": self._flat.numel(),
                    "buckets": len(plan.bucket_start),
                    "layout fingerprint": int(self._layout[:12], 16),
                    "overlap_reduce": int(bool(overlap_reduce)),
                },
                self._flat.device,
            )
            self._reducer = BucketReducer(
                self._flat, plan.bucket_start, group, reduce_timeout, tail=self._tail
            )
            self._bucket_of = list(plan.bucket_of)
            self._bucket_size = [0] * self._reducer.num_buckets
            for b in self._bucket_of:
                self._bucket_size[b] += 1
            self._bucket_done = [0] * self._reducer.num_buckets
            if self._overlap:
                for p in self._params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._seen = [False] * len(self._params)  # parameter received a gradient this cycle
        self._micro_step = 0
        self._total_weight = 0.0
        self._nonfinite = False
        self._sumsq: float | None = None
        self._updates = 0
        self._overlapped = False  # this micro-batch's gradients went through the hooks
        self._flushing = False  # the reduction in progress is a flush's (checked across ranks)
        self._overlap_weight = 1.0
        self._hooked: set[int] = set()  # parameters the hooks folded in this micro-batch
        self.update_applied = False
        self.last_grad_norm: Any = None
        self._clip_coef: torch.Tensor | None = None

    # ---- configuration helpers ----

    def _parameter_names(self, model: torch.nn.Module | None) -> list[str]:
        """How errors name each parameter: its name in ``model``, else its group and index."""
        named = {}
        if model is not None:
            named = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        names = []
        for g, group in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                names.append(
                    repr(named[id(p)]) if id(p) in named else f"param_groups[{g}]['params'][{j}]"
                )
        return names

    def _check_layout(self) -> None:
        """Refuse now what the core would refuse at the first update (nothing written yet)."""
        spans = []
        for i, p in enumerate(self._params):
            if not p.is_contiguous():
                fmt = (
                    "channels-last"
                    if p.dim() in (4, 5)
                    and (
                        p.is_contiguous(memory_format=torch.channels_last)
                        or p.is_contiguous(memory_format=torch.channels_last_3d)
                    )
                    else "non-contiguous"
                )
                raise ValueError(
                    f"parameter {self._names[i]} is {fmt}; the update writes parameters as flat "
                    "contiguous buffers (convert the model with "
                    "memory_format=torch.contiguous_format, or keep channels-last activations only)"
                )
            if p.numel():
                start = p.data_ptr()
                spans.append((start, start + p.numel() * p.element_size(), i))
        spans.sort()
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
            if start_b < end_a:
                first, second = sorted((a, b))
                raise ValueError(
                    f"parameters {self._names[first]} and {self._names[second]} share memory; "
                    "each parameter must own its storage (tie weights by using one Parameter "
                    "object, which the optimizer then holds once)"
                )

    def _layout_fingerprint(self) -> str:
        """A digest of what the accumulator buffer's layout depends on (shapes, dtypes, groups)."""
        h = hashlib.sha256()
        for group in self.optimizer.param_groups:
            h.update(b"|group")
            for p in group["params"]:
                h.update(f"{tuple(p.shape)}:{p.dtype};".encode())
        h.update(f"|{self._flat.numel()}".encode())
        return h.hexdigest()[:16]

    def _resolve_exclude(self, exclude: str | Iterable[Any]) -> set[int]:
        if isinstance(exclude, str):
            if exclude != "final":
                raise ValueError(f"agc_exclude must be 'final' or an iterable, got {exclude!r}")
            last = max((i for i, p in enumerate(self._params) if p.dim() >= 2), default=None)
            if last is None:
                return set()
            return {last} | {
                i for i in range(last + 1, len(self._params)) if self._params[i].dim() <= 1
            }
        skip: set[int] = set()
        for item in exclude:
            tensors = list(item.parameters()) if isinstance(item, torch.nn.Module) else [item]
            for t in tensors:
                if id(t) not in self._index:
                    raise ValueError("agc_exclude names a parameter the optimizer does not hold")
                skip.add(self._index[id(t)])
        return skip

    def _fused_optimizer_kind(self) -> str | None:
        opt = self.optimizer
        if type(opt) is torch.optim.SGD:
            ok = all(not g.get("differentiable", False) for g in opt.param_groups)
            return "sgd" if ok else None
        if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
            for g in opt.param_groups:
                if g.get("amsgrad") or g.get("capturable") or g.get("differentiable"):
                    return None
                if isinstance(g["betas"][0], torch.Tensor) or isinstance(
                    g["betas"][1], torch.Tensor
                ):
                    return None
            return "adam"
        return None

    # ---- the inner optimizer's state, always its current objects ----

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's ``param_groups`` (the same list, whatever replaced it)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's ``state``."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def _run_step_hooks(self, post: bool) -> None:
        """Fire the step hooks once per real update (micro-steps are not optimizer steps).

        Hooks registered on the wrapper see the wrapper. When the fused pass replaces the inner
        optimizer's ``step()``, the inner optimizer's own hooks and torch's global optimizer hooks
        fire here too, so every path calls each hook exactly once per update.
        """
        from torch.optim import optimizer as topt

        own = self._optimizer_step_post_hooks if post else self._optimizer_step_pre_hooks
        for hook in list(own.values()):
            hook(self, (), {})
        if self._fused_kind is None:
            return  # the inner optimizer's step() runs and fires its own hooks
        inner = self.optimizer
        if post:
            hooks = [
                *inner._optimizer_step_post_hooks.values(),
                *topt._global_optimizer_post_hooks.values(),
            ]
        else:
            hooks = [
                *topt._global_optimizer_pre_hooks.values(),
                *inner._optimizer_step_pre_hooks.values(),
            ]
        for hook in hooks:
            hook(inner, (), {})

    @property
    def uses_fused_apply(self) -> bool:
        """True when the update is the core's fused pass (SGD, Adam, AdamW)."""
        return self._fused_kind is not None

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated in the current cycle."""
        return self._micro_step

    @property
    def accumulation_state(self) -> AccumulationState:
        """The cycle's position, total weight and non-finite flag."""
        return AccumulationState(
            self._micro_step, self._total_weight, self._nonfinite, self._updates
        )

    def is_boundary_next(self) -> bool:
        """True if the next ``step()`` call ends a cycle (and applies an update)."""
        return self._micro_step + 1 >= self.accum_steps

    def accumulators(self) -> list[torch.Tensor]:
        """The fp32 accumulators, one per parameter (views of one flat buffer)."""
        return list(self._accs)

    # ---- the loop ----

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' ``.grad`` (already folded into the accumulators by ``step``)."""
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, weight: float = 1.0) -> Any:
        """Accumulate this micro-batch's gradients; apply the update at the cycle's end.

        Args:
            closure: re-evaluates the loss (called once, before accumulating), as in torch.
            weight: this micro-batch's weight, finite and ≥ 0 (its sample or token count when
                losses are per-micro-batch means).

        Returns:
            The closure's loss, if a closure was given.

        A step is all or nothing: an error raised by it (bad input, a refused gradient, a
        non-finite cycle under ``on_nonfinite="raise"``) leaves the micro-batch uncounted and its
        ``.grad`` in place, so fixing the cause and calling ``step()`` again counts it once. A
        Ctrl-C arriving while the step writes is held until counters and buffers agree and then
        raised: the micro-batch has then been counted (:attr:`micro_step` moved) and must not be
        fed again.
        """
        _refuse_outer_accumulation()
        if sum(len(g["params"]) for g in self.optimizer.param_groups) != len(self._params):
            # A group added to the inner optimizer after wrapping: its gradients would never be
            # folded in, weighted or freed, and would reach the update summed over the cycles.
            raise RuntimeError(
                "the inner optimizer's parameter groups changed after it was wrapped in "
                "GradientAccumulateOptimizer (add_param_group on the inner optimizer?); add "
                "every group before wrapping, or wrap it again"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight = _validation.check_positive(weight, "weight", allow_zero=True)
        if self._overlapped:
            used = self._overlap_weight
            if weight != used and not (weight == 1.0 and self._next_weight is not None):
                raise ValueError(
                    f"weight={weight} differs from the weight {used} the gradients were already "
                    "reduced with during the backward; with overlap_reduce pass the weight to "
                    "accumulate(model, opt, weight=...) (or set overlap_reduce=False)"
                )
            weight = used
        elif self._next_weight is not None:
            # accumulate(model, opt, weight=...) named this micro-batch's weight.
            if weight == 1.0:
                weight = self._next_weight
            elif weight != self._next_weight:
                raise ValueError(
                    f"weight={weight} differs from the weight {self._next_weight} given to "
                    "accumulate(model, opt, weight=...); give it once"
                )
        if self._micro_step + 1 >= self.accum_steps and not all(
            p.is_contiguous() for p in self._params
        ):
            # A parameter converted since construction (e.g. model.to(memory_format=...)):
            # refuse before this micro-batch is folded in, naming it.
            self._check_layout()
        with _held_interrupts:
            self._accumulate(weight)
            self._next_weight = None
            self.update_applied = False
            if self._micro_step >= self.accum_steps:
                self._apply()
        return loss

    def _accumulate(self, weight: float) -> None:
        # A running mean over a total weight of 0 is empty: the next weighted micro-batch starts
        # it afresh (zero-weight micro-batches only count).
        first = self._micro_step == 0 or (
            self.reduction == "running_mean" and self._total_weight == 0 and not self._overlapped
        )
        boundary = self._micro_step + 1 >= self.accum_steps
        fresh_a, fresh_g, add_a, add_g = [], [], [], []
        touched = []
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise TypeError(
                    f"parameter {self._names[i]} has a sparse gradient, which is not " "supported"
                )
            if g.shape != p.shape:
                raise ValueError(
                    f"parameter {self._names[i]}'s .grad has shape "
                    f"{tuple(g.shape)}, not {tuple(p.shape)}"
                )
            g = g.detach()
            if not g.is_contiguous():
                g = g.contiguous()
            touched.append(i)
            # Accumulators unseen this cycle were zeroed on its first micro-step; a running mean
            # must still scale a late gradient by w/(W+w), so it adds rather than overwrites.
            if not first and (self._seen[i] or self.reduction == "running_mean"):
                add_a.append(self._accs[i])
                add_g.append(g)
            else:
                fresh_a.append(self._accs[i])
                fresh_g.append(g)
        mode = "running_mean" if self.reduction == "running_mean" else "sum"
        empty = mode == "running_mean" and self._total_weight + weight == 0
        if empty and not self._overlapped:
            fresh_a, fresh_g, add_a, add_g = [], [], [], []
        # At the boundary the pass also returns Σacc²: the clip norm, and the check that the
        # accumulated result is finite (finite gradients can overflow fp32 once summed).
        want_norm = (
            boundary
            and not self._distributed
            and self.reduction != "running_mean"
            and not self._cuda
        )
        # Validate everything before writing: both calls below check their lists first, and the
        # second cannot fail on input the first accepted (same checks, disjoint tensors).
        nonfinite = False
        sumsq = 0.0
        for accs, grads, overwrite in ((fresh_a, fresh_g, True), (add_a, add_g, False)):
            if not accs:
                continue
            r = core.accumulate(
                accs,
                grads,
                weight=weight,
                mode=mode,
                weight_before=self._total_weight,
                overwrite=overwrite,
                compute_sumsq=want_norm,
                nonfinite_out=self._device_flag,
            )
            if not self._cuda:
                nonfinite |= r.nonfinite
            if want_norm:
                sumsq += r.sumsq
        if first and empty and not self._overlapped:
            self._seen = [False] * len(self._params)
        elif first:
            # Parameters without a gradient in the cycle's first micro-batch start from zero.
            # (Gradients the overwrite hooks already consumed count as present.)
            self._seen = [s or p.grad is not None for s, p in zip(self._seen, self._params)]
            missing = [self._accs[i] for i, s in enumerate(self._seen) if not s]
            if missing:
                core.zero(missing)
        else:
            if self.reduction == "running_mean":
                # A micro-batch without a gradient for a parameter adds a zero to its mean:
                # acc ← acc·W/(W+w) for parameters seen earlier in the cycle but not now.
                now = set(touched) | self._hooked
                before = self._total_weight - (weight if self._overlapped else 0.0)
                stale = [self._accs[i] for i, s in enumerate(self._seen) if s and i not in now]
                if stale and before + weight > 0:
                    core.apply(
                        None,
                        stale,
                        optimizer="none",
                        grad_scale=before / (before + weight),
                        reset=False,
                    )
            for i, p in enumerate(self._params):
                if p.grad is not None:
                    self._seen[i] = True
        # The gradient now lives in the accumulator; free it (as zero_grad would).
        for p in self._params:
            p.grad = None
        self._nonfinite |= nonfinite
        if not self._overlapped:
            self._total_weight += weight
        self._overlapped = False
        self._hooked = set()
        self._micro_step += 1
        if want_norm:
            # Accumulators that this micro-batch did not touch still count towards the norm.
            now = set(touched)
            stale = [self._accs[i] for i, s in enumerate(self._seen) if s and i not in now]
            self._sumsq = sumsq + (core.sum_of_squares(stale) if stale else 0.0)
        else:
            self._sumsq = None

    def flush(self) -> bool:
        """End of data: apply a partial cycle with its true weight (``leftover="apply"``).

        The ``AccumBatchNorm*d`` layers this optimizer knows (those of ``model``, or those
        whose affine weight it holds) fold their partial cycle into the running statistics at
        the same time, so they stay in phase with the updates. With ``leftover="carry"`` the
        partial cycle — of the optimizer and of those layers — is kept and continues with the
        next data. Under torch.distributed every rank must call ``flush()`` (a rank with an
        empty partial cycle still takes part in the reduction).

        Returns:
            True if an update was applied.
        """
        self.update_applied = False
        if self.leftover == "carry":
            return False
        with _held_interrupts:
            applied = False
            if self._micro_step > 0 or self._distributed:
                self._sumsq = None
                self._flushing = True
                try:
                    applied = self._apply()
                finally:
                    self._flushing = False
            for layer in self._batchnorm_layers():
                layer.flush()
        return applied

    def _batchnorm_layers(self) -> list[torch.nn.Module]:
        """The AccumBatchNorm layers flushed with the optimizer, in an order every rank shares."""
        from gradient_accumulator.torch.batchnorm import _AccumBatchNormMixin, live_layers

        layers: list[torch.nn.Module] = []
        if self.model is not None:
            layers = [m for m in self.model.modules() if isinstance(m, _AccumBatchNormMixin)]
        known = {id(m) for m in layers}
        held = sorted(
            (self._index[id(m.weight)], m)
            for m in live_layers()
            if id(m) not in known
            and isinstance(m.weight, torch.Tensor)
            and id(m.weight) in self._index
        )
        return layers + [m for _, m in held]

    def _grad_scale(self) -> float:
        if self.reduction == "mean":
            if self._total_weight <= 0:
                return 0.0
            scale = 1.0 / self._total_weight
        else:
            scale = 1.0
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale /= float(self.grad_scaler.get_scale())
        return scale

    def _reset_cycle(self) -> None:
        self._micro_step = 0
        self._total_weight = 0.0
        self._nonfinite = False
        self._sumsq = None
        self._seen = [False] * len(self._params)

    def _update_scaler(self, found_inf: bool) -> None:
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return
        scale = float(scaler.get_scale())
        tracker = getattr(self, "_growth_tracker", 0)
        if found_inf:
            new_scale, tracker = scale * scaler.get_backoff_factor(), 0
        else:
            tracker += 1
            new_scale = scale
            if tracker >= scaler.get_growth_interval():
                new_scale, tracker = scale * scaler.get_growth_factor(), 0
        self._growth_tracker = tracker
        scaler.update(new_scale)

    def _collect_device_flag(self) -> None:
        """Fold the CUDA non-finite flag into ``_nonfinite`` (one device read per cycle)."""
        if self._device_flag is not None:
            self._nonfinite |= bool(self._device_flag.item())
            self._device_flag.zero_()

    def _reduce(self) -> None:
        """Sum the accumulators, weights and non-finite flags over all ranks (one round)."""
        assert self._reducer is not None
        unseen = [self._accs[i] for i, s in enumerate(self._seen) if not s]
        if unseen:  # stale values from an earlier cycle must not be summed
            core.zero(unseen)
        if self.reduction == "running_mean":
            self._flat[: -self._tail].mul_(self._total_weight)
        scalars = self._flat[-self._tail :]
        agree = agreement_slots(
            [
                self.accum_steps,
                int(self._layout[:2], 16),
                int(self._layout[2:4], 16),
                int(self._flushing),
            ]
        )
        host = [self._total_weight, 1.0 if self._nonfinite else 0.0] + agree
        host += [0.0] * (SCALAR_SLOTS - len(host))
        host += [1.0 if s else 0.0 for s in self._seen]
        host += [0.0] * (self._tail - len(host))
        scalars.copy_(torch.tensor(host, dtype=torch.float32))
        self._reducer.finish()
        reduced = scalars.tolist()
        bad = disagreement(
            reduced[AGREE_SLOT:], ["accum_steps", "parameter layout", "parameter layout", "flush"]
        )
        bad = list(dict.fromkeys(bad))
        if bad:
            # Every rank sees the same sums, so every rank raises here, in the same round.
            self._reset_cycle()
            self._bucket_done = [0] * self._reducer.num_buckets
            raise RuntimeError(
                "GradientAccumulateOptimizer: the ranks disagreed on "
                + ", ".join(bad)
                + " in this cycle's reduction (different accum_steps or models, or flush() "
                "called on some ranks and a regular step on others); the cycle was dropped"
            )
        self._total_weight = float(reduced[0])
        self._nonfinite = bool(reduced[1] > 0) or not math.isfinite(self._total_weight)
        if self.reduction == "running_mean" and self._total_weight > 0:
            self._flat[: -self._tail].div_(self._total_weight)
        # A parameter takes part in the update if any rank had a gradient for it (DDP with
        # find_unused_parameters leaves .grad None where no rank had one).
        seen = reduced[SCALAR_SLOTS : SCALAR_SLOTS + len(self._params)]
        self._seen = [count > 0 for count in seen]
        self._sumsq = None
        self._bucket_done = [0] * self._reducer.num_buckets

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: during the cycle's last backward, fold the gradient into
        its accumulator at once and start its bucket's reduction when the bucket is complete."""
        if self._micro_step + 1 < self.accum_steps or p.grad is None:
            return
        i = self._index[id(p)]
        if i in self._hooked:
            # A backward of this micro-batch raised after folding this gradient (and maybe
            # launching its bucket); the retried backward brings the same gradient again.
            p.grad = None
            return
        weight = self._next_weight if self._next_weight is not None else 1.0
        if not self._overlapped:
            self._overlapped = True
            self._overlap_weight = weight
            self._total_weight += weight
        with torch.no_grad():
            g = p.grad.detach()
            if not g.is_contiguous():
                g = g.contiguous()
            fresh = self._micro_step == 0 or (
                not self._seen[i] and self.reduction != "running_mean"
            )
            r = core.accumulate(
                [self._accs[i]],
                [g],
                weight=weight,
                mode="running_mean" if self.reduction == "running_mean" else "sum",
                weight_before=self._total_weight - weight,
                overwrite=fresh,
                nonfinite_out=self._device_flag,
            )
        if not self._cuda:
            self._nonfinite |= r.nonfinite
        self._seen[i] = True
        self._hooked.add(i)
        p.grad = None
        b = self._bucket_of[i]
        self._bucket_done[b] += 1
        if self._bucket_done[b] == self._bucket_size[b] and b != self._reducer.scalar_bucket:
            self._reducer.launch(b)

    @property
    def collectives(self) -> int:
        """Collectives launched by this optimizer's reductions so far (0 when not distributed)."""
        return self._reducer.collectives if self._reducer is not None else 0

    @property
    def bytes_reduced(self) -> int:
        """Bytes this rank has handed to all-reduce so far."""
        return self._reducer.bytes_reduced if self._reducer is not None else 0

    def _apply(self) -> bool:
        if self._distributed:
            self._collect_device_flag()
            self._reduce()
        idx = [i for i in range(len(self._params)) if self._seen[i]]
        scale = self._grad_scale()
        norm = self._check_accumulated(idx, scale)
        self._collect_device_flag()
        if self._nonfinite or not math.isfinite(self._total_weight):
            scaling = self.grad_scaler is not None and self.grad_scaler.is_enabled()
            if scaling or self.on_nonfinite != "apply":
                # Skip the whole cycle: nothing half-applied, accumulators start over.
                self._update_scaler(True)
                self._reset_cycle()
                self.last_grad_norm = float("nan")
                if not scaling:
                    if self.on_nonfinite == "raise":
                        self._nonfinite_counter.raise_error()
                    self._nonfinite_counter.record_skip(stacklevel=4)
                return False
        if not self._total_weight > 0:
            # Every micro-batch of the cycle had weight 0: there is no gradient to apply (an
            # update would still move weights through weight decay and momentum).
            self._reset_cycle()
            return False
        self._run_step_hooks(post=False)
        self._clip_coef = None
        if self.max_grad_norm is not None and self._cuda:
            # Norm and coefficient stay on the device; every apply call reads the coefficient.
            coef = _global_clip_coef(norm, self.max_grad_norm)
            self._clip_coef = coef.to(torch.float32).reshape(1)
            self.last_grad_norm = norm
        elif self.max_grad_norm is not None:
            self.last_grad_norm = norm
            scale *= _global_clip_coef(norm, self.max_grad_norm)
        if self._fused_kind is not None:
            self._fused_apply(idx, scale)
            # The inner optimizer's step() did not run; tell an LR scheduler built on it that
            # an optimizer step happened (torch warns on the first scheduler step otherwise).
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        else:
            self._fallback_apply(idx, scale)
        self._updates += 1
        self._update_scaler(False)
        self._reset_cycle()
        self.update_applied = True
        self._run_step_hooks(post=True)
        return True

    def _check_accumulated(self, idx: list[int], scale: float) -> Any:
        """The norm of the cycle's gradient (accumulators × scale), and whether it is finite.

        Finite micro-batch gradients can sum to more than fp32 holds (a huge weight, a loss
        scale that kept growing): the accumulated result itself is checked. On CPU the norm is
        a float and a non-finite one sets ``_nonfinite``; on CUDA it stays a device tensor and
        raises the device flag, read with the cycle's one flag read.
        """
        if self._cuda:
            if idx:
                norm = core.sum_of_squares([self._accs[i] for i in idx]).sqrt() * abs(scale)
            else:
                norm = torch.zeros((), dtype=torch.float64, device=self._flat.device)
            assert self._device_flag is not None
            self._device_flag.add_((~(norm <= _FLT_MAX)).to(torch.float32))
            return norm
        sumsq = self._sumsq
        if sumsq is None:
            sumsq = core.sum_of_squares([self._accs[i] for i in idx]) if idx else 0.0
        norm = math.sqrt(sumsq) * abs(scale)
        if not norm <= _FLT_MAX:
            self._nonfinite = True
        return norm

    def _agc_kwargs(self, ids: Sequence[int]) -> list[tuple[list[int], bool]]:
        """Split indices into (AGC-clipped, excluded) runs."""
        if not self.use_agc:
            return [(list(ids), False)]
        clipped = [i for i in ids if i not in self._agc_skip]
        excluded = [i for i in ids if i in self._agc_skip]
        return [(clipped, True), (excluded, False)]

    def _fused_apply(self, idx: list[int], scale: float) -> None:
        chosen = set(idx)
        for group in self.optimizer.param_groups:
            gidx = [self._index[id(p)] for p in group["params"] if self._index[id(p)] in chosen]
            if not gidx:
                continue
            if self._fused_kind == "sgd":
                self._apply_sgd(group, gidx, scale)
            else:
                self._apply_adam(group, gidx, scale)

    def _apply_sgd(self, group: dict, gidx: list[int], scale: float) -> None:
        momentum = _float(group["momentum"])
        for ids, agc in self._agc_kwargs(gidx):
            # Parameters on their first momentum step (no buffer yet) go in a call of their own.
            has_buf = [
                self.optimizer.state[self._params[i]].get("momentum_buffer") is not None
                for i in ids
            ]
            runs = (
                [ids]
                if momentum == 0
                else [
                    [i for i, h in zip(ids, has_buf) if h],
                    [i for i, h in zip(ids, has_buf) if not h],
                ]
            )
            for run in runs:
                if run:
                    self._apply_sgd_run(group, run, scale, agc)

    def _apply_sgd_run(self, group: dict, ids: list[int], scale: float, agc: bool) -> None:
        params = [self._params[i] for i in ids]
        momentum = _float(group["momentum"])
        bufs, initialized = None, True
        if momentum != 0:
            states = [self.optimizer.state[p] for p in params]
            initialized = states[0].get("momentum_buffer") is not None
            if not initialized:
                for s, p in zip(states, params):
                    s["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs = [s["momentum_buffer"] for s in states]
        core.apply(
            [p.detach() for p in params],
            [self._accs[i] for i in ids],
            optimizer="sgd",
            lr=_float(group["lr"]),
            grad_scale=scale,
            state1=bufs,
            agc=agc,
            clip_factor=self.clip_factor,
            agc_eps=self.eps,
            reset=False,
            weight_decay=_float(group["weight_decay"]),
            maximize=bool(group.get("maximize")),
            momentum=momentum,
            dampening=_float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
            momentum_initialized=initialized,
            clip_coef=None if agc else self._clip_coef,
        )
        # The core wrote through raw pointers: bump autograd's version counters as an in-place
        # torch op would, so a backward through a graph recorded before the update raises.
        torch.autograd.graph.increment_version(params)

    def _apply_adam(self, group: dict, gidx: list[int], scale: float) -> None:
        decoupled = bool(
            group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
        )
        # Group parameters by their step count (parameters that joined later have fewer steps).
        by_step: dict[float, list[int]] = {}
        for i in gidx:
            p = self._params[i]
            st = self.optimizer.state[p]
            if len(st) == 0:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            by_step.setdefault(_float(st["step"]), []).append(i)
        beta1, beta2 = (_float(b) for b in group["betas"])
        for step, sidx in by_step.items():
            for ids, agc in self._agc_kwargs(sidx):
                if not ids:
                    continue
                params = [self._params[i] for i in ids]
                states = [self.optimizer.state[p] for p in params]
                core.apply(
                    [p.detach() for p in params],
                    [self._accs[i] for i in ids],
                    optimizer="adamw" if decoupled else "adam",
                    lr=_float(group["lr"]),
                    grad_scale=scale,
                    state1=[s["exp_avg"] for s in states],
                    state2=[s["exp_avg_sq"] for s in states],
                    agc=agc,
                    clip_factor=self.clip_factor,
                    agc_eps=self.eps,
                    reset=False,
                    weight_decay=_float(group["weight_decay"]),
                    maximize=bool(group.get("maximize")),
                    betas=(beta1, beta2),
                    eps=_float(group["eps"]),
                    step=int(step) + 1,
                    clip_coef=None if agc else self._clip_coef,
                )
                torch.autograd.graph.increment_version(params)
                for s in states:
                    s["step"] += 1

    def _fallback_apply(self, idx: list[int], scale: float) -> None:
        chosen = set(idx)
        for i, p in enumerate(self._params):
            p.grad = torch.empty_like(p) if i in chosen else None
        for ids, agc in self._agc_kwargs(idx):
            if not ids:
                continue
            core.apply(
                [self._params[i].detach() for i in ids] if agc else None,
                [self._accs[i] for i in ids],
                optimizer="none",
                grad_scale=scale,
                grads_out=[self._params[i].grad for i in ids],
                agc=agc,
                clip_factor=self.clip_factor,
                agc_eps=self.eps,
                reset=False,
                clip_coef=None if agc else self._clip_coef,
            )
        self.optimizer.step()
        for p in self._params:
            p.grad = None

    # ---- state ----

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the accumulators and the cycle's position.

        ``"layout"`` is a fingerprint of the parameters' shapes, dtypes and groups, checked by
        :meth:`load_state_dict`.
        """
        self._collect_device_flag()
        return {
            "optimizer": self.optimizer.state_dict(),
            "accumulation": {
                "layout": self._layout,
                "accum_steps": self.accum_steps,
                "reduction": self.reduction,
                "micro_step": self._micro_step,
                "total_weight": self._total_weight,
                "nonfinite": self._nonfinite,
                "updates": self._updates,
                "seen": list(self._seen),
                "growth_tracker": getattr(self, "_growth_tracker", 0),
                "accumulators": self._flat.clone(),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (mid-cycle included).

        Everything is checked before anything is loaded: a state dict of another model (a
        different layout fingerprint, even with a buffer of the same size), of other settings,
        or with entries missing or of the wrong kind raises ``ValueError`` and leaves this
        optimizer and the inner one as they were.
        """
        if not isinstance(state_dict, dict) or "optimizer" not in state_dict:
            raise ValueError("state_dict was not produced by GradientAccumulateOptimizer")
        acc = state_dict.get("accumulation")
        if not isinstance(acc, dict):
            raise ValueError(
                "state_dict has no 'accumulation' entry (not produced by "
                "GradientAccumulateOptimizer, or truncated)"
            )
        missing = [
            k
            for k in (
                "layout",
                "accum_steps",
                "reduction",
                "micro_step",
                "total_weight",
                "nonfinite",
                "updates",
                "seen",
                "accumulators",
            )
            if k not in acc
        ]
        if missing:
            raise ValueError(
                f"state_dict['accumulation'] lacks {missing} (truncated, or saved "
                "by an older version)"
            )
        if acc["layout"] != self._layout:
            raise ValueError(
                f"state_dict was saved for another parameter layout (fingerprint "
                f"{acc['layout']!r}, this optimizer's is {self._layout!r}): the parameters' "
                "shapes, dtypes or groups differ"
            )
        flat = acc["accumulators"]
        if (
            not isinstance(flat, torch.Tensor)
            or flat.dtype != torch.float32
            or flat.shape != self._flat.shape
        ):
            raise ValueError("state_dict's accumulators do not match this optimizer's parameters")
        if acc["accum_steps"] != self.accum_steps or acc["reduction"] != self.reduction:
            raise ValueError(
                "state_dict was saved with accum_steps/reduction "
                f"{acc['accum_steps']}/{acc['reduction']}, this optimizer uses "
                f"{self.accum_steps}/{self.reduction}"
            )
        seen = acc["seen"]
        micro = acc["micro_step"]
        if (
            not isinstance(seen, (list, tuple))
            or len(seen) != len(self._params)
            or not isinstance(micro, int)
            or not 0 <= micro < self.accum_steps
        ):
            raise ValueError(
                "state_dict's cycle position (micro_step, seen) does not fit this "
                "optimizer (truncated or edited)"
            )
        inner = state_dict["optimizer"]
        if not (
            isinstance(inner, dict)
            and isinstance(inner.get("param_groups"), list)
            and isinstance(inner.get("state"), dict)
        ):
            raise ValueError("state_dict['optimizer'] is not an optimizer state dict")
        sizes = [len(g.get("params", ())) for g in inner["param_groups"]]
        if sizes != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise ValueError(
                f"state_dict['optimizer'] has groups of {sizes} parameters, the inner optimizer "
                f"{[len(g['params']) for g in self.optimizer.param_groups]}"
            )
        self.optimizer.load_state_dict(inner)
        self._flat.copy_(flat)
        if self._device_flag is not None:
            self._device_flag.zero_()
        self._micro_step = int(micro)
        self._total_weight = float(acc["total_weight"])
        self._nonfinite = bool(acc["nonfinite"])
        self._updates = int(acc["updates"])
        self._seen = [bool(s) for s in seen]
        self._growth_tracker = int(acc.get("growth_tracker", 0))
        self._sumsq = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after wrapping: the accumulator buffer is laid out once."""
        raise RuntimeError(
            "add the parameter group to the inner optimizer before wrapping it in "
            "GradientAccumulateOptimizer"
        )

    def __repr__(self) -> str:
        return (
            f"GradientAccumulateOptimizer({self.optimizer.__class__.__name__}, "
            f"accum_steps={self.accum_steps}, reduction={self.reduction!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
