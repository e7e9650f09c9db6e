"""The optimizer wrapper's read-outs, as the properties its class takes over: what the loop's
cycle, update, reducer and device-decided outcomes say (on CUDA, ``update_applied`` and
``step_was_skipped`` read the device's outcome of the last boundary, waiting for it once:
``_outcomes.py``)."""

from __future__ import annotations

from typing import Any

from gradient_accumulator.torch._options import AccumulationState


@property
def update_applied(self) -> bool:
    """Whether the last step() or flush() updated the weights. On CUDA, where the boundary
    leaves the non-finite skip to the device, the first read after a boundary waits for
    the GPU (docs/cuda.md)."""
    return self._loop.update_applied


@property
def last_grad_norm(self) -> Any:
    """With ``max_grad_norm``, the norm of the last cycle's averaged gradient before
    clipping: a float for CPU parameters, a 0-dim device tensor for CUDA ones (the step
    never waits for the GPU). NaN after a skipped cycle."""
    return self._loop.last_grad_norm


@property
def uses_fused_apply(self) -> bool:
    """True when the update is the core's fused pass (SGD, Adam, AdamW)."""
    return self._loop.update.kind is not None


@property
def micro_step(self) -> int:
    """Micro-batches accumulated in the current cycle."""
    return self._loop.cycle.micro_step


@property
def step_was_skipped(self) -> bool:
    """True unless the last ``step()`` or ``flush()`` applied an update (accelerate's
    prepared scheduler reads it: stepped on every micro-batch, it advances once per
    update)."""
    return not self._loop.update_applied


@property
def accumulation_state(self) -> AccumulationState:
    """The cycle's position, total weight and non-finite flag."""
    c = self._loop.cycle
    return AccumulationState(c.micro_step, c.total_weight, c.nonfinite, self._loop.updates)


@property
def reduces_across_ranks(self) -> bool:
    """Whether the accumulators are reduced over a torch.distributed group once per cycle."""
    return self._loop.distributed


@property
def collectives(self) -> int:
    """Collectives launched by this optimizer's reductions so far (0 when not distributed)."""
    reducer = self._loop.reducer
    return 0 if reducer is None else reducer.collectives


@property
def bytes_reduced(self) -> int:
    """Bytes this rank has handed to all-reduce so far."""
    reducer = self._loop.reducer
    return 0 if reducer is None else reducer.bytes_reduced


@property
def num_buckets(self) -> int:
    """Reduction buckets (one collective each per cycle; 0 when not distributed)."""
    reducer = self._loop.reducer
    return 0 if reducer is None else reducer.num_buckets
