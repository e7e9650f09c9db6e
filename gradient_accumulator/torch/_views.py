"""``gradient_as_view=True``: fp32 parameters' ``.grad`` are views of their accumulators.

Autograd then adds each micro-batch's gradient into the accumulator in place, during the
backward, and ``step()`` makes no pass over the gradients at all. The accumulators hold the
weighted sum divided by the weight the coming gradient carries (``scale``, 1 unless a weight was
named before the backward), so the gradient autograd adds unweighted lands with its weight:
``step()`` multiplies by ``scale`` once (a pass only for a weight other than 1).

bf16/fp16 parameters cannot have an fp32 view as ``.grad``: a hook after autograd accumulated
each one's gradient folds it into its fp32 accumulator with the micro-batch's weight (the
engine's ``fold_one``) and drops the low-precision ``.grad``, so at most one parameter's
low-precision gradient is alive at a time and ``step()`` makes no pass for them either. Under
``backward(create_graph=True)`` the hook leaves ``.grad`` alone (it may be part of a graph) and
``step()`` folds it as in the default mode.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from gradient_accumulator import core
from gradient_accumulator._engine import Cycle

# Every view a GradViews installed as a .grad, by id, held weakly (tensors compare elementwise,
# so no WeakSet): a new wrapper replaces an old wrapper's view.
_VIEWS: dict[int, weakref.ref] = {}


def _is_a_view(t: torch.Tensor) -> bool:
    ref = _VIEWS.get(id(t))
    return ref is not None and ref() is t


def _remember(t: torch.Tensor) -> None:
    key = id(t)
    _VIEWS[key] = weakref.ref(t, lambda _, key=key: _VIEWS.pop(key, None))


def _hooks(ref: weakref.ref, i: int) -> tuple[Callable, Callable]:
    """Parameter ``i``'s hooks: before its gradient is accumulated, whether ``.grad`` is the view;
    after, that the view was written (or replaced out of place, under ``create_graph``)."""
    was_view = [False]

    def before(grad: torch.Tensor) -> None:
        views = ref()
        was_view[0] = views is not None and views.holds(i)

    def after(p: torch.Tensor) -> None:
        views = ref()
        if views is None:
            return
        views.touched.add(i)
        if was_view[0] and not views.holds(i):
            # backward(create_graph=True) accumulates out of place: .grad = view + gradient.
            views.replaced.add(i)

    return before, after


def _fold_hook(ref: weakref.ref, i: int) -> Callable:
    """Low-precision parameter ``i``'s hook after its gradient is accumulated: fold ``.grad``
    into the accumulator with the micro-batch's weight, then drop it."""

    def fold(p: torch.Tensor) -> None:
        views, grad = ref(), p.grad
        if views is None or grad is None:
            return
        if torch.is_grad_enabled() or grad.requires_grad:
            # backward(create_graph=True): .grad may be part of a graph the caller still
            # differentiates; step() folds it, as in the default mode.
            return
        if grad.layout != torch.strided or grad.shape != p.shape or not grad.is_contiguous():
            return  # step() folds it, or names what is wrong with it
        cycle = views.cycle
        cycle.fold_one(i, grad, cycle.hook_weight())
        views.folded.add(i)
        p.grad = None

    return fold


class GradViews:
    """The fp32 parameters' ``.grad`` as views of their accumulators; the bf16/fp16 ones'
    gradients folded during the backward.

    Args:
        params: the wrapper's parameters; ``cycle``: the engine's cycle over their fp32
            accumulators.
    """

    def __init__(self, params: Sequence[torch.Tensor], cycle: Cycle) -> None:
        self.params = list(params)
        self.cycle = cycle
        self.accs = list(cycle.accs)
        self.index = [i for i, p in enumerate(self.params) if p.dtype == torch.float32]
        low = [i for i, p in enumerate(self.params) if p.dtype != torch.float32]
        self.folded: set[int] = set()  # low-precision gradients folded in this micro-batch
        self.scale = 1.0  # the views hold Σ wᵢgᵢ / scale
        self.touched: set[int] = set()  # views autograd wrote in this micro-batch's backward
        self.replaced: set[int] = set()  # views autograd replaced by view + gradient instead
        # The hooks hold this object weakly: a wrapper that is dropped takes its views' hooks
        # (and its buffer, once no .grad points into it) with it.
        self.hooks = []
        for i in self.index:
            before, after = _hooks(weakref.ref(self), i)
            self.hooks.append(self.params[i].register_hook(before))
            self.hooks.append(self.params[i].register_post_accumulate_grad_hook(after))
        for i in low:
            hook = _fold_hook(weakref.ref(self), i)
            self.hooks.append(self.params[i].register_post_accumulate_grad_hook(hook))
        self.install()

    def __del__(self) -> None:
        for hook in getattr(self, "hooks", ()):
            hook.remove()

    def install(self) -> None:
        """Make each fp32 parameter without a ``.grad`` (or with another wrapper's view, whose
        partial cycle is abandoned with that wrapper) point at its accumulator."""
        for i in self.index:
            p = self.params[i]
            if p.grad is None or (p.grad is not self.accs[i] and _is_a_view(p.grad)):
                p.grad = self.accs[i]
                _remember(self.accs[i])

    def holds(self, i: int) -> bool:
        """Whether parameter ``i``'s ``.grad`` is its accumulator."""
        return self.params[i].grad is self.accs[i]

    def _rescale(self, factor: float) -> None:
        views = [self.accs[i] for i in self.index]
        if views and factor != 1.0:
            core.apply(None, views, optimizer="none", grad_scale=factor, reset=False)

    def expect(self, weight: float) -> None:
        """Before a backward: its gradients carry ``weight``.

        Raises:
            ValueError: this micro-batch's backward already added gradients into the views with
                another weight (nothing changed; its bf16/fp16 folds are checked by the cycle).
        """
        held = self.held()
        if held and weight != self.scale:
            raise ValueError(
                f"weight={weight}, but with gradient_as_view this micro-batch's backward already "
                f"added its gradients into the accumulators with weight {self.scale}; name the "
                "weight once, before the backward"
            )
        if weight == 0.0:
            # Σ/0 does not exist: this backward writes fresh tensors, folded with weight 0.
            for i in self.index:
                if self.holds(i):
                    self.params[i].grad = None
            return
        self._rescale(self.scale / weight)
        self.scale = weight

    def settle_check(self, weight: float, name: Callable[[int], str]) -> None:
        """At ``step()``, before anything is written: ``weight`` must be the weight the
        gradients autograd already added into the views carry.

        Raises:
            ValueError: it is not (nothing changed: ``step(weight=<that weight>)`` then counts
                the micro-batch once).
        """
        for i in sorted(self.touched):
            if self.params[i].grad is None:
                raise ValueError(self.dropped_message(name(i)))
            if i in self.replaced:
                # Folding view + gradient would count the cycle's sum so far twice.
                raise ValueError(
                    f"parameter {name(i)}'s .grad is part of a graph (backward with "
                    "create_graph=True): gradient_as_view accumulates in place and cannot take "
                    "it; use gradient_as_view=False for double backward (the accumulators are "
                    "as before this backward)"
                )
        held = self.held()
        if held and weight != self.scale:
            raise ValueError(
                f"weight={weight}, but with gradient_as_view the gradient of parameter "
                f"{name(held[0])} and others was already added into the accumulators with weight "
                f"{self.scale} during the backward; name a micro-batch's weight before its "
                "backward (accumulate(model, opt, weight=...)), then step() takes it. Calling "
                f"step(weight={self.scale}) counts this micro-batch"
            )

    def dropped_message(self, name: str) -> str:
        return (
            f"parameter {name}'s gradient was added into its accumulator during the backward "
            "(gradient_as_view), so the micro-batch cannot be dropped after it: call step() to "
            "count it, or use gradient_as_view=False to drop micro-batches after their backward"
        )

    def held(self) -> list[int]:
        """The views this micro-batch's backward added into that still are ``.grad``, sorted."""
        return sorted(i for i in self.touched if self.holds(i))

    def in_flight(self) -> bool:
        """Whether a backward has put gradients into the accumulators since the last step."""
        return bool(self.folded or self.held())

    def check_drop(self, name: Callable[[int], str]) -> None:
        """``zero_grad()`` between a backward and its ``step()`` would drop a micro-batch whose
        gradient is already in the accumulators.

        Raises:
            RuntimeError: it is (nothing changed: ``step()`` still counts the micro-batch).
        """
        held = self.held() + sorted(self.folded)
        if held:
            raise RuntimeError(self.dropped_message(name(held[0])))

    def settle(self) -> list[int]:
        """At ``step()``: the parameters whose gradient autograd added into their accumulator,
        after which the accumulators hold the weighted sum again (scale 1)."""
        held = self.held()
        self._rescale(self.scale)
        self.scale = 1.0
        return held

    def saved(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of the accumulator buffer ``flat`` holding the weighted sums (scale 1)."""
        out = flat.clone()
        if self.scale != 1.0:
            for i in self.index:
                start = (self.accs[i].data_ptr() - flat.data_ptr()) // flat.element_size()
                out[start : start + self.accs[i].numel()].mul_(self.scale)
        return out

    def done(self) -> None:
        """After ``step()``: the next backward writes into the views again."""
        self.folded.clear()
        self.touched.clear()
        self.replaced.clear()
        self.install()

    def clear(self) -> None:
        """A cycle ended: the views start from zero (autograd adds into them)."""
        views = [self.accs[i] for i in self.index]
        if views:
            core.zero(views)
        self.scale = 1.0
        self.folded.clear()
        self.touched.clear()
        self.replaced.clear()
        self.install()

    def after_step(self, micro_step: int) -> None:
        """After ``step()`` or a flush: zeroed views for a new cycle, else the same views."""
        if micro_step == 0:
            self.clear()
        else:
            self.done()

    def after_load(self, micro_step: int, named_weight: float | None) -> None:
        """After ``load_state_dict()`` wrote the accumulators: they hold weighted sums (scale
        1); a weight named before the load still holds for the coming backward."""
        self.scale = 1.0
        self.folded.clear()
        if micro_step == 0:
            self.clear()
        if named_weight is not None:
            self.expect(named_weight)
