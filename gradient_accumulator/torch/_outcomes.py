"""What boundaries decided on the device did: counted there, read on the host only when asked.

On CUDA the wrapper's boundary does not wait for the GPU: whether the cycle's gradient was finite
is a flag in device memory, which the fused apply reads to skip or update, and Adam's step
counters advance there. The host learns the outcome later: :class:`DeviceOutcomes` adds each
boundary's skip to a device counter, copies that counter to pinned host memory after the
boundary, and reads the copy at a later boundary once it has arrived (warning then of the cycles
skipped meanwhile), so nothing waits. Reading ``updates`` or ``update_applied``, saving and
``flush()`` read the device (they need the answer now).
"""

from __future__ import annotations

from typing import Any

import torch

from gradient_accumulator.nonfinite import NonFiniteCounter


class DeviceOutcomes:
    """The skips of device-decided boundaries.

    Args:
        counter: the wrapper's skipped-cycle counter, which warns.
    """

    def __init__(self, counter: NonFiniteCounter) -> None:
        self.counter = counter
        self.boundaries = 0  # device-decided boundaries since the last clear()
        self.skips: torch.Tensor | None = None  # their skipped ones, counted on the device
        self.warned = 0  # skips already passed to the counter
        self.last: torch.Tensor | None = None  # the last boundary's skip, not read yet
        self._copy: torch.Tensor | None = None  # pinned host copy of `skips`
        self._arrived: Any = None  # CUDA event recorded after the copy

    def __getstate__(self) -> dict[str, Any]:
        self.settle()  # a copy starts with everything read
        state = self.__dict__.copy()
        state.update(_copy=None, _arrived=None)
        return state

    def record(self, flag: torch.Tensor) -> torch.Tensor:
        """Count a boundary whose skip is ``flag != 0`` and lower the flag (all queued after the
        boundary's apply). Returns the skip as a 0-dim bool tensor."""
        skipped = flag != 0
        if self.skips is None:
            self.skips = torch.zeros((), dtype=torch.int64, device=flag.device)
        self.skips.add_(skipped)
        flag.zero_()
        self.boundaries += 1
        self.last = skipped
        if flag.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return skipped  # a CUDA graph: replays count on the device, read on demand
            self._warn_arrived()
            if self._copy is None:
                self._copy = torch.zeros((), dtype=torch.int64).pin_memory()
                self._arrived = torch.cuda.Event()
            self._copy.copy_(self.skips, non_blocking=True)
            self._arrived.record()
        else:
            self._warn(int(self.skips))
        return skipped

    def _warn_arrived(self) -> None:
        """Warn of the skips whose copy has reached the host (never waits)."""
        if self._arrived is not None and self._arrived.query():
            self._warn(int(self._copy))

    def _warn(self, total: int) -> None:
        while self.warned < total:
            self.warned += 1
            self.counter.record_skip(stacklevel=None)

    def settle(self) -> int:
        """Read the device (waits for it): warn of every skip not yet warned of; returns the
        updates the device-decided boundaries applied."""
        if self.skips is None or self.boundaries == 0:
            return 0
        total = int(self.skips)
        self._warn(total)
        return self.boundaries - total

    def last_skipped(self) -> bool | None:
        """Whether the last boundary was skipped (reads the device), or None if it was decided
        on the host or already read."""
        if self.last is None:
            return None
        skipped, self.last = bool(self.last), None
        self._warn(int(self.skips))  # the device was just read: warn of what it skipped
        return skipped

    def clear(self) -> int:
        """Settle, then start counting afresh; returns what :meth:`settle` returned."""
        applied = self.settle()
        self.boundaries, self.warned, self.last = 0, 0, None
        if self.skips is not None:
            self.skips.zero_()
        if self._copy is not None:
            self._copy.zero_()
        return applied
