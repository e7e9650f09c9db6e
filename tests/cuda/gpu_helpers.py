"""Comparison helpers of the GPU tests, importable (and tested, tests/test_gpu_helpers.py) on a
machine without a GPU."""

from __future__ import annotations

import contextlib
import warnings

import torch


def f64(x) -> torch.Tensor:
    """`x` as a float64 CPU tensor, without a detour through float32: ``torch.as_tensor`` of a
    Python float makes a float32 tensor, which rounds an fp64 sum (3195089.7934… → …7500)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64)
    return torch.tensor(x, dtype=torch.float64)


def ulp(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at each value of `want` (fp64): one unit in the last place."""
    finfo = torch.finfo(dtype)
    _, exp = torch.frexp(want.abs().clamp_min(finfo.tiny))
    return torch.ldexp(torch.ones_like(want), exp - 1) * finfo.eps


def close(got, want, rel: float, floor: float = 0.0, ulps: int = 0) -> None:
    """|got − want| ≤ rel·(|want| + floor) + ulps units in the last place of got's dtype.

    ``ulps=1`` for results stored in fp16/bf16 that the GPU and the CPU compute from
    coefficients summed in different orders: a last-bit difference of an fp32 coefficient can
    move the rounding of a 16-bit result by one unit.
    """
    dtype = got.dtype if isinstance(got, torch.Tensor) else torch.float64
    got, want = f64(got), f64(want)
    bound = rel * (want.abs() + floor)
    if ulps:
        bound = bound + ulps * ulp(want, dtype)
    bad = (got - want).abs() > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {got.numel()} off; worst |diff| "
        f"{float((got - want).abs().max()):.3e}"
    )


def rel(a, b) -> float:
    """max |a − b| / max |b| over two lists of tensors (parameters may require grad)."""
    num = max(float((f64(x) - f64(y)).abs().max()) for x, y in zip(a, b))
    return num / max(float(f64(y).abs().max()) for y in b)


@contextlib.contextmanager
def sync_debug_error():
    """``torch.cuda.set_sync_debug_mode("error")`` inside the block. Torch warns that the mode
    is a prototype each time it is switched on; the test configuration turns warnings into
    errors, so that notice (and only it) is ignored here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Synchronization debug mode is a prototype", category=UserWarning
        )
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="Synchronization debug mode is a prototype", category=UserWarning
            )
            torch.cuda.set_sync_debug_mode("default")
