"""What a step guards against from outside: Ctrl-C mid-write and accumulation done twice."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable


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
held_interrupts = _InterruptGate()


def refuse_outer_accumulation() -> None:
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
