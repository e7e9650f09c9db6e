"""Lightning's internals, and the framework proxies of the optimizer wrapper: Lightning's
``LightningOptimizer`` and accelerate's ``AcceleratedOptimizer`` must act on the real wrapper,
never on a copy.

:data:`REACHES` lists the parts of Lightning's optimizer proxy this relies on, with the Lightning
versions they were checked against (probed by ``tests/integrations/test_integ_private_reaches.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from gradient_accumulator._reaches import Reach

LIGHTNING = "2.6.6"

REACHES = (
    Reach(
        "lightning",
        "lightning.pytorch.core.optimizer.LightningOptimizer._to_lightning_optimizer "
        "(a subclass of the wrapped optimizer's class, named LightningOptimizer's way)",
        LIGHTNING,
        "recognising the proxy class when it is made (is_lightning_proxy, from the wrapper's "
        "__init_subclass__) to forward everything to the real wrapper",
    ),
    Reach(
        "lightning",
        "LightningOptimizer()._optimizer, ._strategy, ._on_before_step, ._on_after_step",
        LIGHTNING,
        "reaching the real wrapper behind the proxy, and counting a flush() that updates as "
        "Lightning's optimizer step (install_lightning_forwarding, inner_of)",
    ),
)


def is_lightning_proxy(cls: type) -> bool:
    """Whether ``cls`` is Lightning's optimizer proxy class (built per wrapped class)."""
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


def inner_of(proxy: Any) -> Any:
    """The optimizer a framework's proxy holds (Lightning's ``LightningOptimizer._optimizer``,
    accelerate's ``AcceleratedOptimizer.optimizer``), or None for anything else."""
    return vars(proxy).get("_optimizer", vars(proxy).get("optimizer"))


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


def install_lightning_forwarding(cls: type, wrapper: type) -> None:
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
    proxy_bases = [b for b in mro[: mro.index(wrapper)] if not issubclass(b, wrapper)]
    own = {n for b in proxy_bases for n in vars(b)}
    names = {n for n in vars(wrapper) if not n.startswith("_")}
    for name in sorted(names - own - {"step", "flush"}):
        value = vars(wrapper)[name]
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

    step.__doc__ = wrapper.step.__doc__
    flush.__doc__ = wrapper.flush.__doc__
    cls.step = step
    cls.flush = flush
