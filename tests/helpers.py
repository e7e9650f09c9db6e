"""Shared helpers of the core tests: tolerances, input kinds and fp64 NumPy references.

Every reference works in float64 on the values the core actually sees (inputs already rounded
to their dtype), so a comparison measures only the core's own rounding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

# ---- tolerances: the one place they are set ----------------------------------------------


@dataclass(frozen=True)
class Tol:
    """Bounds for ``np.testing.assert_allclose``: |actual − expected| ≤ atol + rtol·|expected|."""

    rtol: float
    atol: float


#: Keyed by the dtype in which the core *stores* the result (where its last rounding happens).
TOL: dict[str, Tol] = {
    # fp64 arithmetic on exact inputs: a few ulps of summation-order difference.
    "float64": Tol(rtol=1e-12, atol=1e-12),
    # fp32 arithmetic over a handful of operations on O(1) values.
    "float32": Tol(rtol=1e-5, atol=2e-6),
    # one fp16 rounding (unit roundoff 2^-11), with a floor for subnormals.
    "float16": Tol(rtol=2.0**-10, atol=1e-6),
    # one bf16 rounding (unit roundoff 2^-8), with a floor near zero.
    "bfloat16": Tol(rtol=2.0**-8, atol=1e-6),
    # the core against torch.optim / torch.nn.utils, both computing in fp32.
    "torch": Tol(rtol=1e-5, atol=1e-7),
}

#: Unit roundoff of bfloat16 (8 significant bits): one rounding moves a value by ≤ this, relative.
BF16_UNIT_ROUNDOFF = 2.0**-8


def assert_close(actual: Any, expected: Any, tol: str, err_msg: str = "") -> None:
    """Compare a tensor (any kind) with an fp64 reference under ``TOL[tol]``."""
    t = TOL[tol]
    np.testing.assert_allclose(
        to_f64(actual), to_f64(expected), rtol=t.rtol, atol=t.atol, err_msg=err_msg
    )


# ---- input kinds -------------------------------------------------------------------------

#: (kind, dtype) pairs the core accepts as inputs; NumPy has no bfloat16.
KIND_DTYPES = [
    pytest.param("numpy", "float32", id="numpy-float32"),
    pytest.param("numpy", "float64", id="numpy-float64"),
    pytest.param("numpy", "float16", id="numpy-float16"),
    pytest.param("torch", "float32", id="torch-float32"),
    pytest.param("torch", "float64", id="torch-float64"),
    pytest.param("torch", "float16", id="torch-float16"),
    pytest.param("torch", "bfloat16", id="torch-bfloat16"),
]

#: Low-precision dtypes (need torch for bfloat16).
LOW_DTYPES = [
    pytest.param("numpy", "float16", id="numpy-float16"),
    pytest.param("torch", "float16", id="torch-float16"),
    pytest.param("torch", "bfloat16", id="torch-bfloat16"),
]

#: The two kinds of input tensors every op is run with.
KINDS = ["numpy", "torch"]


def need_torch():
    """The torch module, or skip the test when it is not installed."""
    return pytest.importorskip("torch")


def make(data: Any, dtype: str = "float32", kind: str = "numpy") -> Any:
    """A new contiguous tensor of ``kind`` holding ``data`` rounded to ``dtype``.

    Values go through float32 first for 16-bit dtypes, so NumPy and torch round identically.
    """
    arr = np.asarray(data)
    if dtype in ("float16", "bfloat16", "float32"):
        arr = arr.astype(np.float32)
    else:
        arr = arr.astype(np.float64)
    if kind == "numpy":
        if dtype == "bfloat16":
            raise ValueError("numpy has no bfloat16")
        return np.ascontiguousarray(arr.astype(dtype))
    if kind == "torch":
        torch = need_torch()
        return torch.from_numpy(np.ascontiguousarray(arr)).to(getattr(torch, dtype)).contiguous()
    raise ValueError(f"unknown kind {kind!r}")


def zeros(shape: Any, dtype: str = "float32", kind: str = "numpy") -> Any:
    """A zero tensor of ``kind``."""
    return make(np.zeros(shape), dtype, kind)


def to_f64(t: Any) -> np.ndarray:
    """A float64 NumPy copy of a NumPy array, torch tensor (any dtype) or Python number."""
    if hasattr(t, "detach"):
        return t.detach().to("cpu").double().numpy().copy()
    return np.array(t, dtype=np.float64)


def copy_of(t: Any) -> Any:
    """An independent copy with the same kind and dtype."""
    return t.detach().clone() if hasattr(t, "detach") else np.array(t, copy=True)


def snapshot(buffers: list) -> list:
    """Copies of ``buffers`` (to check later that a call left them alone)."""
    return [copy_of(b) for b in buffers]


def assert_unchanged(before: list, buffers: list) -> None:
    """Every buffer still holds exactly what ``snapshot`` saw (bitwise, NaNs included)."""
    assert len(before) == len(buffers)
    for i, (b, a) in enumerate(zip(before, buffers)):
        if hasattr(a, "detach"):
            assert a.dtype == b.dtype
            a = a.detach().reshape(-1).float().numpy()
            b = b.detach().reshape(-1).float().numpy()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"buffer {i} changed")


def rng(seed: int) -> np.random.Generator:
    """A seeded generator (tests are deterministic)."""
    return np.random.default_rng(seed)


def round_bf16(x: Any) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float64."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


# ---- fp64 references ---------------------------------------------------------------------


def ref_accumulate(
    acc: np.ndarray,
    g: np.ndarray,
    *,
    weight: float = 1.0,
    mode: str = "sum",
    weight_before: float = 0.0,
    overwrite: bool = False,
) -> np.ndarray:
    """The accumulator after one micro-step, in float64."""
    acc, g = to_f64(acc), to_f64(g)
    if mode == "running_mean":
        before = 0.0 if overwrite else weight_before
        total = before + weight
        return (0.0 if overwrite else acc * (before / total)) + g * (weight / total)
    return weight * g if overwrite else acc + weight * g


def ref_sgd(
    p,
    g,
    buf,
    *,
    lr,
    momentum=0.0,
    dampening=0.0,
    nesterov=False,
    weight_decay=0.0,
    maximize=False,
    first=False,
):
    """One torch.optim.SGD step in float64: returns (param, momentum buffer)."""
    p, g = to_f64(p), to_f64(g)
    g = -g if maximize else g
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        buf = g.copy() if first else momentum * to_f64(buf) + (1.0 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


def ref_adam(
    p,
    g,
    m,
    v,
    *,
    lr,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    step=1,
    decoupled=False,
    maximize=False,
):
    """One torch.optim.Adam (``decoupled=False``) or AdamW step in float64: (param, m, v)."""
    p, g, m, v = to_f64(p), to_f64(g), to_f64(m), to_f64(v)
    b1, b2 = betas
    g = -g if maximize else g
    if decoupled:
        p = p * (1.0 - lr * weight_decay)
    elif weight_decay:
        g = g + weight_decay * p
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    bc1, bc2 = 1.0 - b1**step, 1.0 - b2**step
    p = p - (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + eps)
    return p, m, v


def ref_global_norm(tensors: list) -> float:
    """L2 norm over every element of every tensor, in float64."""
    return float(np.sqrt(sum(np.sum(to_f64(t) ** 2) for t in tensors)))


def ref_clip_coef(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient."""
    return min(1.0, max_norm / (norm + 1e-6))


#: Axes the original Keras package reduces over, by rank, for "trailing" unit-wise norms.
KERAS_UNIT_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def _unit_sumsq(x: np.ndarray, layout: str) -> np.ndarray:
    """Per-unit Σx², shaped to broadcast against ``x`` (keepdims)."""
    if x.ndim <= 1:
        return np.sum(x * x, keepdims=True).reshape((1,) * x.ndim)
    if layout == "leading":
        return np.sum(x * x, axis=tuple(range(1, x.ndim)), keepdims=True)
    return np.sum(x * x, axis=KERAS_UNIT_AXES[x.ndim], keepdims=True)


def ref_unitwise_norm(x: Any, layout: str = "leading") -> np.ndarray:
    """Unit-wise L2 norms, flattened in unit order (fp64)."""
    return np.sqrt(_unit_sumsq(to_f64(x), layout)).reshape(-1)


def ref_agc(
    p: Any, g: Any, *, clip_factor: float = 0.01, eps: float = 1e-3, layout: str = "leading"
) -> np.ndarray:
    """Adaptive gradient clipping as in the NFNets paper and the original Keras package."""
    p, g = to_f64(p), to_f64(g)
    pn = np.sqrt(_unit_sumsq(p, layout))
    gn = np.sqrt(_unit_sumsq(g, layout))
    max_norm = np.maximum(pn, eps) * clip_factor
    clipped = g * (max_norm / np.maximum(gn, 1e-6))
    return np.where(gn < max_norm, g, clipped)


def ref_bn_moments(x: Any, axis: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-channel (mean, M2, count) of ``x`` with channels on ``axis``, in float64."""
    x = to_f64(x)
    axis %= x.ndim
    axes = tuple(a for a in range(x.ndim) if a != axis)
    mean = x.mean(axis=axes, keepdims=True)
    m2 = np.sum((x - mean) ** 2, axis=axes)
    return mean.reshape(-1), m2, x.size // x.shape[axis]


def ref_bn_update_running(rm, rv, mean, m2, count, *, momentum, unbiased):
    """running ← (1 − momentum)·running + momentum·batch (torch's momentum), float64."""
    var = to_f64(m2) / (count - 1 if unbiased else count)
    rm = (1.0 - momentum) * to_f64(rm) + momentum * to_f64(mean)
    rv = (1.0 - momentum) * to_f64(rv) + momentum * var
    return rm, rv


# ---- tensors that DLPack places on a CUDA device -----------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_keep: list = []  # the descriptors must outlive every capsule made from them


class FakeCudaTensor:
    """A float tensor that DLPack reports on cuda:`device` (host memory, never dereferenced)."""

    def __init__(self, n: int, bits: int = 32, device: int = 0, code: int = 2):
        self.host = np.zeros(max(n, 1), dtype=np.float64)  # backing memory, 8-byte aligned
        self.shape_arr = (ctypes.c_int64 * 1)(n)
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = self.host.ctypes.data
        t.device = _DLDevice(2, device)
        t.ndim = 1
        t.dtype = _DLDataType(code, bits, 1)
        t.shape = self.shape_arr
        t.strides = None
        self.shape = (n,)
        _keep.append(self)

    def __dlpack__(self, **kwargs):
        return _new_capsule(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, 0)
