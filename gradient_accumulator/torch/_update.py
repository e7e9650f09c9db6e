"""How the boundary's gradient reaches a ``torch.optim`` optimizer.

For ``SGD``, ``Adam`` and ``AdamW`` (amsgrad, capturable and differentiable off) the core's fused
pass averages, unscales, clips and updates in one sweep, writing the optimizer's own state tensors,
so its ``state_dict()`` stays that of the plain optimizer. Any other optimizer gets the final
gradient in ``.grad`` and runs its own ``step()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradient_accumulator import core


def _float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def _same(t: Any) -> Any:
    return t


def fused_kind(opt: torch.optim.Optimizer) -> str | None:
    """``"sgd"`` or ``"adam"`` when the core's fused update is the optimizer's own formula."""
    if type(opt) is torch.optim.SGD:
        ok = all(not g.get("differentiable", False) for g in opt.param_groups)
        return "sgd" if ok else None
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        for g in opt.param_groups:
            if g.get("amsgrad") or g.get("capturable") or g.get("differentiable"):
                return None
            if any(isinstance(b, torch.Tensor) for b in g["betas"]):
                return None
        return "adam"
    return None


class InnerUpdate:
    """Applies the accumulated gradient of chosen parameters through a torch optimizer.

    Args:
        optimizer: the inner optimizer (its groups, hyperparameters and state).
        params: its parameters, in the order of ``accs``.
        accs: their fp32 accumulators.
        agc_skip: indices excluded from adaptive clipping (``None``: AGC off).
        clip_factor, eps: AGC's λ and ε.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        accs: Sequence[torch.Tensor],
        *,
        agc_skip: set[int] | None,
        clip_factor: float,
        eps: float,
        local: Any = None,
    ) -> None:
        # local: tensor -> the tensor the core writes (a DTensor's local shard), or None.
        self._local = local if local is not None else _same
        self.optimizer = optimizer
        self.params = list(params)
        self.accs = list(accs)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.agc_skip = agc_skip
        self.clip_factor = clip_factor
        self.eps = eps
        self.kind = fused_kind(optimizer)
        # Registered tensor sets (core.tensor_set) of the parameters, accumulators and optimizer
        # state of each run of a call, made on first use; dropped when the optimizer's state
        # object is replaced (load_state_dict) or a set is refused as out of date.
        self._sets: dict[Any, Any] = {}
        self._sets_state: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sets"], state["_sets_state"] = {}, None  # registrations of this process's tensors
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (pickle, deepcopy) holds new parameter objects: the id-keyed index is rebuilt.
        self.__dict__.update(state)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self._sets, self._sets_state = {}, None

    def _set(self, key: Any, tensors: Any) -> Any:
        """The registered set ``key`` of the tensors ``tensors()`` returns (made on first use)."""
        if key is None:
            return core.tensor_set(tensors())
        if self._sets_state is not self.optimizer.state:
            self._sets, self._sets_state = {}, self.optimizer.state
        found = self._sets.get(key)
        if found is None:
            found = self._sets[key] = core.tensor_set(tensors())
        return found

    def _apply(self, key: Any, tensors: dict[str, Any], **kw: Any) -> None:
        """``core.apply`` with the tensors of ``tensors`` (name → a function returning the list)
        as registered sets; a set refused as out of date (a parameter re-allocated, state
        replaced) is registered again from the current tensors and the call made once more:
        the refusal comes before anything is written."""
        for attempt in (0, 1):
            try:
                sets = {
                    n: self._set(None if key is None else (key, n), fn) for n, fn in tensors.items()
                }
                core.apply(**sets, **kw)
                return
            except core.load_core().StaleTensorError:
                if attempt:
                    raise
                self._sets = {}

    def decides_on_device(self) -> bool:
        """Whether the update can take its skip from a device flag: the fused pass, no step
        hooks on the inner optimizer or global ones (they would fire for a skipped cycle), and
        no SGD momentum with dampening (a skipped first step would leave the buffers
        initialised to zero, which dampening tells apart from torch's first step)."""
        from torch.optim import optimizer as topt

        inner = self.optimizer
        if self.kind is None or inner._optimizer_step_pre_hooks or inner._optimizer_step_post_hooks:
            return False
        if topt._global_optimizer_pre_hooks or topt._global_optimizer_post_hooks:
            return False
        if self.kind == "sgd":
            return not any(
                _float(g["momentum"]) != 0 and _float(g["dampening"]) != 0
                for g in inner.param_groups
            )
        return True

    def __call__(
        self,
        index: list[int],
        scale: float,
        clip_coef: torch.Tensor | None,
        skip_flag: torch.Tensor | None = None,
    ) -> None:
        """Update the parameters ``index`` with accumulators × ``scale`` (× ``clip_coef``, a
        device scalar, for those outside AGC). ``skip_flag`` (see :meth:`decides_on_device`):
        a device scalar that, raised, makes every call of the update a no-op, and Adam's steps
        then advance on the device."""
        if self.kind is None:
            self._fallback(index, scale, clip_coef)
            return
        chosen = set(index)
        for group in self.optimizer.param_groups:
            gidx = [self.index[id(p)] for p in group["params"] if self.index[id(p)] in chosen]
            if gidx and self.kind == "sgd":
                self._sgd(group, gidx, scale, clip_coef, skip_flag)
            elif gidx:
                self._adam(group, gidx, scale, clip_coef, skip_flag)
        # The inner optimizer's step() did not run; tell an LR scheduler built on it that an
        # optimizer step happened (torch warns on the first scheduler step otherwise).
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _runs(self, ids: Sequence[int]) -> list[tuple[list[int], bool]]:
        """``ids`` split into runs the core takes in one call: AGC-clipped or excluded, and one
        parameter dtype (a call's optimizer state is of one dtype)."""
        runs: dict[tuple[bool, torch.dtype], list[int]] = {}
        for i in ids:
            agc = self.agc_skip is not None and i not in self.agc_skip
            runs.setdefault((agc, self.params[i].dtype), []).append(i)
        return [(run, agc) for (agc, _), run in runs.items()]

    def _common(self, group: dict, agc: bool, coef: Any, skip_flag: Any) -> dict[str, Any]:
        return dict(
            skip_flag=skip_flag,
            lr=_float(group["lr"]),
            agc=agc,
            clip_factor=self.clip_factor,
            agc_eps=self.eps,
            reset=False,
            weight_decay=_float(group["weight_decay"]),
            maximize=bool(group.get("maximize")),
            clip_coef=None if agc else coef,
        )

    def _sgd(self, group: dict, gidx: list[int], scale: float, coef: Any, skip_flag: Any) -> None:
        momentum = _float(group["momentum"])
        state = self.optimizer.state
        for ids, agc in self._runs(gidx):
            # Parameters on their first momentum step (no buffer yet) go in a call of their own.
            runs = [ids]
            if momentum != 0:
                has = [state[self.params[i]].get("momentum_buffer") is not None for i in ids]
                runs = [[i for i, h in zip(ids, has) if h], [i for i, h in zip(ids, has) if not h]]
            for run in (r for r in runs if r):
                params = [self.params[i] for i in run]
                bufs, initialized = None, True
                if momentum != 0:
                    states = [state[p] for p in params]
                    initialized = states[0].get("momentum_buffer") is not None
                    if not initialized:
                        for s, p in zip(states, params):
                            s["momentum_buffer"] = torch.zeros_like(
                                p, memory_format=torch.preserve_format
                            )
                    bufs = [s["momentum_buffer"] for s in states]
                # A first momentum step's buffers are new: registered for that call only.
                key = ("sgd", tuple(run), len(state)) if initialized else None
                self._apply(
                    key,
                    {
                        "params": lambda run=run: [self._local(self.params[i]) for i in run],
                        "accumulators": lambda run=run: [self.accs[i] for i in run],
                        **(
                            {"state1": lambda bufs=bufs: [self._local(b) for b in bufs]}
                            if bufs is not None
                            else {}
                        ),
                    },
                    optimizer="sgd",
                    grad_scale=scale,
                    momentum=momentum,
                    dampening=_float(group["dampening"]),
                    nesterov=bool(group["nesterov"]),
                    momentum_initialized=initialized,
                    **self._common(group, agc, coef, skip_flag),
                )
                # The core wrote through raw pointers: bump autograd's version counters as an
                # in-place torch op would, so a backward through an older graph raises.
                torch.autograd.graph.increment_version(params)

    def _adam(self, group: dict, gidx: list[int], scale: float, coef: Any, skip_flag: Any) -> None:
        decoupled = bool(
            group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
        )
        # On the device (skip_flag given), every parameter's ``step`` is a float32 scalar
        # beside it (as torch keeps it for capturable Adam), which the core reads and advances
        # only when the update is applied; on the host, parameters are grouped by their step
        # count (those that joined later have fewer steps) and the host advances it.
        on_device = skip_flag is not None
        by_step: dict[float, list[int]] = {}
        for i in gidx:
            p = self.params[i]
            st = self.optimizer.state[p]
            if len(st) == 0:
                st["step"] = torch.zeros(
                    (), dtype=torch.float32, device=p.device if on_device else "cpu"
                )
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif on_device and (st["step"].device != p.device or st["step"].dtype != torch.float32):
                # A host step (made by the host-decided path, or loaded): moved once.
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
            by_step.setdefault(0.0 if on_device else _float(st["step"]), []).append(i)
        betas = tuple(_float(b) for b in group["betas"])
        for step, sidx in by_step.items():
            for ids, agc in self._runs(sidx):
                params = [self.params[i] for i in ids]
                states = [self.optimizer.state[p] for p in params]
                steps = [s["step"] for s in states]
                self._apply(
                    ("adam", on_device, tuple(ids), len(self.optimizer.state)),
                    {
                        "params": lambda ids=ids: [self._local(self.params[i]) for i in ids],
                        "accumulators": lambda ids=ids: [self.accs[i] for i in ids],
                        "state1": lambda states=states: [self._local(s["exp_avg"]) for s in states],
                        "state2": lambda states=states: [
                            self._local(s["exp_avg_sq"]) for s in states
                        ],
                    },
                    optimizer="adamw" if decoupled else "adam",
                    grad_scale=scale,
                    betas=betas,
                    eps=_float(group["eps"]),
                    **(dict(step_counters=steps) if on_device else dict(step=int(step) + 1)),
                    **self._common(group, agc, coef, skip_flag),
                )
                torch.autograd.graph.increment_version(params)
                if not on_device:
                    torch._foreach_add_(steps, 1)

    def _fallback(self, index: list[int], scale: float, coef: Any) -> None:
        chosen = set(index)
        for i, p in enumerate(self.params):
            p.grad = torch.empty_like(p) if i in chosen else None
        for ids, agc in self._runs(index):
            core.apply(
                [self._local(self.params[i].detach()) for i in ids] if agc else None,
                [self.accs[i] for i in ids],
                optimizer="none",
                grad_scale=scale,
                grads_out=[self._local(self.params[i].grad) for i in ids],
                agc=agc,
                clip_factor=self.clip_factor,
                agc_eps=self.eps,
                reset=False,
                clip_coef=None if agc else coef,
            )
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def run_step_hooks(self, wrapper: Any, hooks: dict, post: bool) -> None:
        """Fire the step hooks once per real update (micro-steps are not optimizer steps).

        ``hooks`` (registered on the wrapper) see ``wrapper``. When the fused pass replaces the
        inner optimizer's ``step()``, the inner optimizer's own hooks and torch's global
        optimizer hooks fire here too, so every path calls each hook exactly once per update.
        """
        from torch.optim import optimizer as topt

        for hook in list(hooks.values()):
            hook(wrapper, (), {})
        if self.kind is None:
            return  # the inner optimizer's step() runs and fires its own hooks
        inner = self.optimizer
        if post:
            more = [
                *inner._optimizer_step_post_hooks.values(),
                *topt._global_optimizer_post_hooks.values(),
            ]
        else:
            more = [
                *topt._global_optimizer_pre_hooks.values(),
                *inner._optimizer_step_pre_hooks.values(),
            ]
        for hook in more:
            hook(inner, (), {})


class LossScale:
    """A ``torch.amp.GradScaler`` seen once per cycle: the scale the losses were multiplied by,
    and the scaler's own rule applied at the boundary (back off after a non-finite cycle, grow
    after ``growth_interval`` good ones). ``scaler`` may be None or disabled: scale 1."""

    def __init__(self, scaler: Any, device: torch.device) -> None:
        self.scaler = scaler
        self.device = device  # where the scaled losses live (the parameters' device)
        self.growth_tracker = 0

    def enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled() else 1.0

    def update(self, found_inf: bool) -> None:
        if not self.enabled():
            return
        scaler, scale = self.scaler, self.scale()
        if found_inf:
            new_scale, self.growth_tracker = scale * scaler.get_backoff_factor(), 0
        else:
            self.growth_tracker += 1
            new_scale = scale
            if self.growth_tracker >= scaler.get_growth_interval():
                new_scale, self.growth_tracker = scale * scaler.get_growth_factor(), 0
        if getattr(scaler, "_scale", 0) is None:
            # Nothing was scaled with it since it was made or loaded (a resumed run that ends
            # with flush()): scaling once creates the scale tensor that update() writes.
            scaler.scale(torch.ones((), device=self.device))
        scaler.update(new_scale)
