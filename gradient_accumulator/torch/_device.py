"""PyTorch's CUDA adapter for :mod:`gradient_accumulator.core`.

The core imports no framework; on the first call with a torch CUDA tensor it imports this module,
which registers the adapter under ``"torch"`` (see
:func:`gradient_accumulator.core.register_cuda_adapter`). Calls are enqueued on
``torch.cuda.current_stream()`` of the tensor's device, that device is made current around them,
and the core's device results are torch tensors on it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from gradient_accumulator import core

__all__ = ["TorchCudaAdapter"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class TorchCudaAdapter:
    """Streams, devices and result tensors of torch CUDA tensors for the core."""

    def stream(self, t: torch.Tensor) -> int:
        """The handle of the current stream of ``t``'s device."""
        return int(torch.cuda.current_stream(t.device).cuda_stream)

    def device(self, t: torch.Tensor) -> Any:
        """``torch.cuda.device`` of ``t``'s device when it is not the current one, else a null
        context (also for tensors not on CUDA)."""
        device = t.device
        if device.type != "cuda" or device.index is None:
            return contextlib.nullcontext()
        if device.index == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(device.index)

    def empty(
        self, like: torch.Tensor, dtype: str, shape: tuple[int, ...], fill: float | None
    ) -> torch.Tensor:
        """A new ``dtype`` tensor of ``shape`` on ``like``'s device, filled with ``fill`` unless
        it is None."""
        dt = _DTYPES.get(dtype)
        if dt is None:
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        if fill is None:
            return torch.empty(shape, dtype=dt, device=like.device)
        return torch.full(shape, fill, dtype=dt, device=like.device)


core.register_cuda_adapter("torch", TorchCudaAdapter())
