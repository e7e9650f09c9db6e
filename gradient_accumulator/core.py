"""Functional API over the compiled core.

Every function takes tensors from any framework that speaks DLPack (NumPy, PyTorch, JAX,
TensorFlow) and works on their memory in place; nothing is copied. Tensors must be dense: C
contiguous, or a permutation of it such as channels-last, where the tensors updated together
(an accumulator and its gradient, a parameter and its optimizer state) share one layout. Lists
must match in length and element counts. A list may be replaced by a set of tensors registered
once (:func:`tensor_set`), which takes the per-tensor export and checks out of every call. Bad
input raises ``ValueError`` or ``TypeError`` naming the argument, and leaves every buffer as it was.

Outputs (accumulators, parameters, optimizer states, statistics) must be writable by the caller:
read-only arrays (the DLPack 1.x read-only flag), JAX arrays and TensorFlow tensors (immutable
values for their users), torch inference tensors outside ``torch.inference_mode()`` and torch
negative-bit views (``x._neg_view()``, ``x.conj().imag``) are refused with a ``ValueError``. As
inputs, negative-bit views are read with their sign (through a resolved copy).

CUDA: tensors on a CUDA device go to the CUDA kernels (when the build has them, see
:func:`has_cuda`). This module imports no framework: the stream a call is enqueued on, the
device made current around it and the device tensors it returns come from the CUDA adapter of
the tensor's framework, found by the top-level module of the tensor's type (see
:func:`register_cuda_adapter`). PyTorch's adapter, ``gradient_accumulator.torch._device``, is
imported on the first call with a torch CUDA tensor and enqueues on
``torch.cuda.current_stream()`` of the tensor's device. CUDA tensors of a framework without an
adapter are refused with a ``TypeError``. Nothing waits for the GPU: results that are Python
numbers for CPU tensors (the non-finite flag, sums of squares, the apply's norm, coefficient and
skip decision) are 0-dim device tensors instead.

Example:
    >>> import numpy as np
    >>> from gradient_accumulator import core
    >>> acc = [np.zeros(3, np.float32)]
    >>> _ = core.accumulate(acc, [np.ones(3, np.float32)], weight=2.0, overwrite=True)
    >>> _ = core.accumulate(acc, [np.ones(3, np.float32)], weight=2.0)
    >>> acc[0]
    array([4., 4., 4.], dtype=float32)
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gradient_accumulator._loader import load_core

__all__ = [
    "AccumulateResult",
    "ApplyResult",
    "CudaStatus",
    "accumulate",
    "adaptive_clip",
    "apply",
    "arena_plan",
    "bn_merge",
    "bn_moments",
    "bn_update_running",
    "cpu_isa",
    "cuda_device_count",
    "cuda_status",
    "global_norm",
    "has_cuda",
    "register_cuda_adapter",
    "sum_of_squares",
    "tensor_set",
    "unit_layout",
    "unitwise_norm",
    "wgrad_accumulate",
    "wgrad_path",
    "zero",
]

Tensor = Any  # any object with __dlpack__, or a DLPack capsule

_MODES = ("sum", "mean", "running_mean")
_OPTIMIZERS = ("none", "sgd", "adam", "adamw")


_INT64_LIMIT = 2**63


class AccumulateResult(NamedTuple):
    """What one accumulate pass observed.

    Attributes:
        nonfinite: True if any gradient element was NaN or infinite.
        sumsq: Σ acc² after the update when ``compute_sumsq=True``, else None.
    """

    nonfinite: Any
    sumsq: Any


class ApplyResult(NamedTuple):
    """What one fused apply did.

    Attributes:
        skipped: True if ``skip_nonfinite`` found a NaN/Inf and nothing was updated.
        grad_norm: L2 norm of the scaled gradient before clipping, when it was computed.
        clip_coef: global-norm clip coefficient that was used, when global clipping ran.

    For CUDA tensors the three are 0-dim float32 device tensors: ``skipped`` is 1.0 or 0.0,
    ``grad_norm`` is -1 when it was not computed, ``clip_coef`` is 1 when nothing was clipped.
    """

    skipped: Any
    grad_norm: Any
    clip_coef: Any


def _check_real(value: Any, name: str) -> float:
    if type(value) is float:  # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def cpu_isa() -> str:
    """Instruction set the CPU kernels dispatched to: ``"avx512"``, ``"avx2"`` or ``"generic"``."""
    return load_core().cpu_isa()


def has_cuda() -> bool:
    """Whether this build has CUDA kernels (the Linux wheels do); see :func:`cuda_status` for
    whether they can run on this machine."""
    return bool(load_core().has_cuda())


class CudaStatus(NamedTuple):
    """Whether the CUDA kernels can run on this machine, and why not (:func:`cuda_status`).

    Attributes:
        available: True when this build has CUDA kernels, an NVIDIA driver that runs them is
            loaded and it sees at least one device.
        reason: One line for people: ``"ok: 1 device, driver supports CUDA 13.0"``, or why the
            kernels cannot run: ``"no CUDA kernels in this build (GA_CUDA=OFF)"``, ``"no NVIDIA
            driver found (...)"``, ``"driver too old for the CUDA 13.0 runtime (driver supports
            CUDA 12.4); ..."``, ``"no CUDA device (...)"``, or the runtime's own error.
        device_count: CUDA devices visible (0 unless ``available``).
        driver_version: ``(major, minor)`` of the newest CUDA the driver supports; None without
            a driver or without CUDA kernels.
        runtime_version: ``(major, minor)`` of the CUDA runtime linked into the core; None
            without CUDA kernels.
    """

    available: bool
    reason: str
    device_count: int
    driver_version: tuple[int, int] | None
    runtime_version: tuple[int, int] | None


def _cuda_version(v: int) -> tuple[int, int] | None:
    return (v // 1000, v % 1000 // 10) if v > 0 else None


def cuda_status() -> CudaStatus:
    """Whether a usable NVIDIA driver and CUDA device are present for this build's kernels.

    Never raises: every outcome, an error of the CUDA runtime included, is a :class:`CudaStatus`
    whose ``reason`` says why the kernels cannot run. Loads the driver, as a first CUDA call
    does, but creates no context on a device. A CUDA tensor given to a build whose kernels
    cannot run is refused with the same reason.

    Example:
        >>> from gradient_accumulator import core
        >>> status = core.cuda_status()
        >>> status.available == (status.reason.startswith("ok"))
        True
    """
    try:
        code, count, driver, runtime, reason = load_core().cuda_probe()
    except Exception as e:  # the contract is a value, never an exception
        return CudaStatus(False, f"the CUDA probe failed: {e}", 0, None, None)
    return CudaStatus(
        available=code == 0,
        reason=str(reason),
        device_count=int(count),
        driver_version=_cuda_version(int(driver)),
        runtime_version=_cuda_version(int(runtime)),
    )


def cuda_device_count() -> int:
    """CUDA devices the core's runtime sees (0 without CUDA kernels, a driver or a GPU)."""
    return int(load_core().cuda_device_count())


#: DLPack device types of CUDA memory: kDLCUDA and kDLCUDAManaged.
_CUDA_DLPACK_DEVICES = (2, 13)

#: The methods a CUDA adapter has (see :func:`register_cuda_adapter`).
_ADAPTER_METHODS = ("stream", "device", "empty")

#: CUDA adapters, by the top-level module of the tensor types they serve.
_CUDA_ADAPTERS: dict[str, Any] = {}

#: The package's own adapters: the module imported on first need, which registers its adapter.
_ADAPTER_MODULES = {"torch": "gradient_accumulator.torch._device"}


def register_cuda_adapter(framework: str, adapter: Any) -> None:
    """Let the CUDA kernels take the CUDA tensors of ``framework``.

    The core launches its kernels on a stream it is given and on the current device, and
    returns device tensors for the results it does not read back. Only the tensor's framework
    knows its stream and how to make a device current or allocate, so each framework supplies
    an adapter with three methods:

    - ``stream(t) -> int``: the handle of the stream (``cudaStream_t``) the call on tensor ``t``
      is enqueued on, usually the framework's current stream on ``t``'s device;
    - ``device(t)``: a context manager that makes ``t``'s device current during the call;
    - ``empty(like, dtype, shape, fill)``: a new ``"float32"`` or ``"float64"`` tensor of
      ``shape`` (a tuple, ``()`` for a 0-dim tensor) on ``like``'s device, filled with ``fill``
      or left uninitialized when ``fill`` is None.

    A CUDA tensor is matched to the adapter registered under the top-level module of its type,
    ``type(t).__module__.split(".")[0]`` (``"torch"``, ``"cupy"``), or else of the first base
    class that has one. PyTorch's adapter is registered on the first call with a torch CUDA
    tensor; registering another one under ``"torch"`` replaces it.

    Args:
        framework: the top-level module name, without dots.
        adapter: an object with the methods ``stream``, ``device`` and ``empty``.

    Raises:
        TypeError: ``framework`` is not a string or ``adapter`` lacks one of the methods.
        ValueError: ``framework`` is empty or has a dot.
    """
    if not isinstance(framework, str):
        raise TypeError(f"framework must be a str, got {type(framework).__name__}")
    if not framework or "." in framework:
        raise ValueError(
            f"framework must be a top-level module name such as 'torch', got {framework!r}"
        )
    missing = [m for m in _ADAPTER_METHODS if not callable(getattr(adapter, m, None))]
    if missing:
        raise TypeError(
            f"adapter must have the methods stream, device and empty; a "
            f"{type(adapter).__name__} lacks {', '.join(missing)}"
        )
    _CUDA_ADAPTERS[framework] = adapter


def _cuda_adapter(t: Any) -> Any:
    """The CUDA adapter of ``t``; None for tensors not on a CUDA device (and for None)."""
    if t is None or isinstance(t, np.ndarray):
        return None
    kind = getattr(getattr(t, "device", None), "type", None)
    if kind is None:
        dl_device = getattr(t, "__dlpack_device__", None)
        if dl_device is None or dl_device()[0] not in _CUDA_DLPACK_DEVICES:
            return None
    elif kind != "cuda":  # a tensor whose device says where it is: torch's CPU, MPS, meta
        return None
    for cls in type(t).__mro__:
        framework = cls.__module__.split(".")[0]
        adapter = _CUDA_ADAPTERS.get(framework)
        if adapter is None and framework in _ADAPTER_MODULES:
            importlib.import_module(_ADAPTER_MODULES[framework])  # registers the adapter
            adapter = _CUDA_ADAPTERS.get(framework)
        if adapter is not None:
            return adapter
    framework = type(t).__module__.split(".")[0]
    raise TypeError(
        f"a {type(t).__name__} on a CUDA device: the CUDA kernels need its framework's stream, "
        f"and {framework!r} has no CUDA adapter; pass PyTorch tensors or CPU arrays, or "
        f"register one with core.register_cuda_adapter({framework!r}, adapter)"
    )


def _on_device(adapter: Any, t: Any) -> Any:
    """Make a CUDA tensor's device current for a core call (the core never switches devices)."""
    if adapter is None:
        return contextlib.nullcontext()
    return adapter.device(t)


def _stream(adapter: Any, t: Any) -> int:
    """The stream handle a call on ``t`` is enqueued on; 0 (unused) for CPU tensors."""
    if adapter is None:
        return 0
    return int(adapter.stream(t))


def _first(tensors: Any) -> Any:
    if isinstance(tensors, (list, tuple)) and tensors:
        return tensors[0]
    if type(tensors).__name__ == "TensorSet" and len(tensors):
        return None if not tensors.is_cuda else tensors[0]  # CPU sets need no adapter
    return None


def tensor_set(tensors: Sequence[Tensor], *, writable: bool = True) -> Any:
    """Register ``tensors`` once for many calls: a set any function here takes in place of a list.

    A call on a list exports every tensor through DLPack and checks it (its dtype, device,
    layout, whether it may be written), which costs microseconds per tensor — more than the
    arithmetic on small tensors. A set is checked once, here; each call then re-checks only what
    can have changed since, through the tensor's own cheap accessors (for PyTorch tensors: that
    it is alive, its dtype, shape, strides and data pointer), and refuses a tensor that was
    freed, resized, re-allocated, moved to another device or given another dtype or layout with
    a ``ValueError`` naming it, before anything is read or written. Tensors of other frameworks
    are exported and checked on every call, as in a list.

    The set holds its tensors weakly: it keeps none of them alive. A list of PyTorch gradients
    passed beside a set of accumulators (``accumulate(acc_set, grads)``) is read through the
    same accessors when each gradient has its accumulator's shape and layout.

    Args:
        tensors: a list or tuple of tensors (not DLPack capsules, which can be read once).
        writable: whether calls may write the tensors (checked here: read-only arrays, JAX and
            TensorFlow tensors and the other outputs the functions refuse are refused); a set
            registered with ``writable=False`` is refused where a call writes.

    Returns:
        An opaque ``TensorSet``: ``len(s)``, ``s[i]`` (the tensor, or None once freed),
        ``s.writable`` and ``s.is_cuda``.

    Example:
        >>> import numpy as np
        >>> acc = [np.zeros(2, np.float32)]
        >>> accs = core.tensor_set(acc)
        >>> _ = core.accumulate(accs, [np.ones(2, np.float32)], weight=3.0)
        >>> acc[0]
        array([3., 3.], dtype=float32)
    """
    return load_core().TensorSet(tensors, bool(writable), "tensors")


def accumulate(
    accumulators: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    weight: float = 1.0,
    mode: str = "sum",
    weight_before: float = 0.0,
    overwrite: bool = False,
    compute_sumsq: bool = False,
    nonfinite_out: Tensor | None = None,
) -> AccumulateResult:
    """Fold one micro-batch of gradients into the accumulators, in one pass.

    ``"sum"`` and ``"mean"`` both store acc ← acc + weight·g (the mean divides by the total
    weight at apply time); ``"running_mean"`` keeps acc equal to the weighted mean so far,
    acc ← acc·W/(W+w) + g·w/(W+w) with W = ``weight_before``. On a cycle's first micro-step
    pass ``overwrite=True``: acc ← weight·g, so the accumulators never need zeroing.

    Args:
        accumulators: float32 (or float64) tensors, updated in place.
        grads: float32, bfloat16, float16 or float64 tensors with the same element counts.
        weight: this micro-batch's weight (samples, tokens, or 1), finite and ≥ 0. float32
            accumulators are updated in float32, so there it must be 0 or a normal float32
            (about 1.2e-38 to 3.4e38): anything else is refused rather than rounded to 0 or inf.
        mode: ``"sum"``, ``"mean"`` or ``"running_mean"``.
        weight_before: total weight already accumulated (``"running_mean"`` only).
        overwrite: replace instead of add.
        compute_sumsq: also return Σ acc² of the result (the norm for clipping, for free).
        nonfinite_out: a one-element float32 tensor on the accumulators' device, set to 1 when
            a gradient element is NaN or ±Inf and left as it was otherwise — so one flag
            collects a whole cycle without reading anything back from a GPU.

    Returns:
        AccumulateResult with the non-finite flag and the optional sum of squares (on CUDA:
        ``nonfinite`` is ``nonfinite_out``, or a new 0-dim float32 device tensor, and ``sumsq``
        a 0-dim float64 device tensor).

    Example:
        >>> import numpy as np
        >>> acc = [np.zeros(2, np.float32)]
        >>> core.accumulate(acc, [np.array([1.0, np.inf], np.float32)], overwrite=True).nonfinite
        True
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    weight = _check_real(weight, "weight")
    weight_before = _check_real(weight_before, "weight_before")
    cuda = _cuda_adapter(_first(accumulators))
    if cuda is not None:
        stream = _stream(cuda, accumulators[0])
        flag = nonfinite_out
        if flag is None:
            flag = cuda.empty(accumulators[0], "float32", (), 0.0)
        sumsq_t = cuda.empty(accumulators[0], "float64", (), None) if compute_sumsq else None
        with _on_device(cuda, accumulators[0]):
            load_core().accumulate(
                accumulators,
                grads,
                weight,
                mode,
                weight_before,
                bool(overwrite),
                bool(compute_sumsq),
                stream=stream,
                nonfinite_out=flag,
                sumsq_out=sumsq_t,
            )
        return AccumulateResult(flag, sumsq_t)
    nonfinite, sumsq = load_core().accumulate(
        accumulators,
        grads,
        weight,
        mode,
        weight_before,
        bool(overwrite),
        bool(compute_sumsq),
        nonfinite_out=nonfinite_out,
    )
    return AccumulateResult(bool(nonfinite), sumsq)


def _onednn_library() -> str | None:
    """Where oneDNN's library is: ``GA_ONEDNN_PATH``, else the onednn-cpu-gomp package's
    ``libdnnl.so.3`` (pip puts it in the environment's ``lib``), else None (the soname)."""
    path = os.environ.get("GA_ONEDNN_PATH")
    if path:
        return path
    return _installed_file(("onednn-cpu-gomp", "onednn"), "libdnnl.so.3")


def _installed_file(distributions: Sequence[str], filename: str) -> str | None:
    """The absolute path of ``filename`` in the first installed distribution of these that
    lists it (their RECORD), else None."""
    import importlib.metadata as metadata

    for name in distributions:
        try:
            files = metadata.distribution(name).files or ()
        except metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name == filename:
                return os.path.abspath(str(f.locate()))
    return None


def _cublaslt_wheel_library(major: int) -> str | None:
    """``libcublasLt.so.<major>`` of PyPI's cuBLAS wheel for CUDA ``major`` where it is installed
    (``nvidia-cublas`` for CUDA 13 and newer, ``nvidia-cublas-cu12`` for 12), else None. Those
    wheels put the library outside the loader's search path: torch preloads its own by path."""
    return _installed_file(("nvidia-cublas", f"nvidia-cublas-cu{major}"), f"libcublasLt.so.{major}")


def _load_cublaslt(core: Any) -> tuple[bool, str]:
    """``GA_CUBLASLT_PATH``, else the copy already loaded or found by soname, else the cuBLAS
    wheel of the core's CUDA major (a core built for CUDA 13 beside a torch built for 12 finds
    no ``libcublasLt.so.13`` by soname)."""
    path = os.environ.get("GA_CUBLASLT_PATH")
    done = tuple(core.cublaslt_load(path))
    if done[0] or path:
        return done
    version = cuda_status().runtime_version
    wheel = _cublaslt_wheel_library(version[0]) if version is not None else None
    return tuple(core.cublaslt_load(wheel)) if wheel is not None else done


_LOADED: dict[str, tuple[bool, str]] = {}


def _load_library(kind: str) -> tuple[bool, str]:
    """Load oneDNN (``"cpu"``) or cuBLASLt (``"cuda"``) into the core once; (loaded, why not)."""
    done = _LOADED.get(kind)
    if done is None:
        core = load_core()
        if kind == "cpu":
            done = tuple(core.onednn_load(_onednn_library()))
        else:
            done = _load_cublaslt(core)
        _LOADED[kind] = done
    return done


def wgrad_path(dtype: str, n: int, out_features: int, in_features: int) -> tuple[bool, str]:
    """Which path a fused weight-gradient fold of this shape takes on the CPU.

    Returns:
        ``(True, "onednn:<kernel>")`` where oneDNN has a kernel for ``dtype`` (``"float32"``,
        ``"bfloat16"`` or ``"float16"``) on this CPU, else ``(False, reason)``: oneDNN is not
        installed (``pip install onednn-cpu-gomp``), or has no kernel for the dtype here.
    """
    _load_library("cpu")
    fused, what = load_core().wgrad_cpu_path(dtype, int(n), int(out_features), int(in_features))
    return bool(fused), str(what)


def wgrad_accumulate(
    acc: Tensor,
    dy: Tensor,
    x: Tensor,
    *,
    weight: float = 1.0,
    mode: str = "sum",
    weight_before: float = 0.0,
    overwrite: bool = False,
    bias_acc: Tensor | None = None,
    bias_overwrite: bool = False,
) -> tuple[bool, str]:
    """Fold a linear layer's weight gradient dyᵀx into its fp32 accumulator in one GEMM.

    For y = x·Wᵀ with ``x`` of shape (n, in), ``dy`` (n, out) and ``acc`` (out, in), this is
    :func:`accumulate` of the gradient dyᵀx — the same ``weight``, ``mode``, ``weight_before``
    and ``overwrite`` — without the gradient ever being formed: the GEMM (oneDNN on the CPU,
    cuBLASLt on CUDA) writes the accumulator with the product scaled by the weight added in,
    in fp32.

    Args:
        acc: float32 (out, in), dense and row-major; updated in place.
        dy, x: float32, bfloat16 or float16 (the same), 2-D, any dense layout.
        bias_acc: float32 (out,), or None: also fold the bias's gradient Σdy (its column sums,
            in fp32) into it, with the same weight and ``bias_overwrite`` for its first write
            (CPU; on CUDA pass None and :func:`accumulate` the sum).

    Returns:
        ``(True, "")`` when folded; ``(False, reason)`` with nothing written where this build,
        machine or dtype has no fused path (see :func:`wgrad_path`): the caller then forms the
        gradient and calls :func:`accumulate`.

    Raises:
        ValueError / TypeError: shapes that do not chain, dtypes, devices, a bad weight.

    Example:
        >>> import numpy as np
        >>> acc = np.zeros((2, 3), np.float32)
        >>> dy, x = np.ones((4, 2), np.float32), np.ones((4, 3), np.float32)
        >>> done, why = core.wgrad_accumulate(acc, dy, x, weight=0.5, overwrite=True)
        >>> bool(not done or acc[0, 0] == 2.0)
        True
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    weight = _check_real(weight, "weight")
    weight_before = _check_real(weight_before, "weight_before")
    cuda = _cuda_adapter(acc)
    stream = 0
    if cuda is not None:
        _load_library("cuda")
        stream = _stream(cuda, acc)
        with _on_device(cuda, acc):
            done, why = load_core().wgrad_accumulate(
                acc, dy, x, weight, mode, weight_before, bool(overwrite), stream, bias_acc
            )
        return bool(done), str(why)
    _load_library("cpu")
    done, why = load_core().wgrad_accumulate(
        acc,
        dy,
        x,
        weight,
        mode,
        weight_before,
        bool(overwrite),
        stream,
        bias_acc,
        bool(bias_overwrite),
    )
    return bool(done), str(why)


def sum_of_squares(tensors: Sequence[Tensor]) -> Any:
    """Σ x² over all elements of all tensors, in fp64 and a fixed order (deterministic).

    A float for CPU tensors; a 0-dim float64 device tensor for CUDA tensors.
    """
    cuda = _cuda_adapter(_first(tensors))
    if cuda is not None:
        stream = _stream(cuda, tensors[0])
        out = cuda.empty(tensors[0], "float64", (), None)
        with _on_device(cuda, tensors[0]):
            load_core().sum_of_squares(tensors, stream=stream, out=out)
        return out
    return float(load_core().sum_of_squares(tensors))


def global_norm(tensors: Sequence[Tensor]) -> Any:
    """L2 norm over all elements of all tensors (deterministic, one pass).

    A float for CPU tensors; a 0-dim float64 device tensor for CUDA tensors.

    Example:
        >>> import numpy as np
        >>> core.global_norm([np.array([3.0], np.float32), np.array([4.0], np.float32)])
        5.0
    """
    s = sum_of_squares(tensors)
    if not isinstance(s, float):
        return s.sqrt()
    return float(np.sqrt(s))


def unit_layout(shape: Sequence[int], layout: str = "leading") -> tuple[int, str]:
    """Number of AGC units of a tensor of ``shape`` and where they sit.

    ``"leading"`` (PyTorch weights, ``(out, in, *kernel)``): rank ≤ 1 is one unit, otherwise
    ``shape[0]`` units over the remaining axes. ``"trailing"`` (Keras weights,
    ``(*kernel, in, out)``) follows the original package's rules: rank ≤ 1 is one unit; rank 2
    and 3 norm over axis 0; rank 4 over axes (0, 1, 2); rank 5 over (0, 1, 2, 3); rank ≥ 6 is an
    error.

    Returns:
        ``(num_units, layout)`` as ``apply`` and ``adaptive_clip`` take it.
    """
    shape = tuple(int(d) for d in shape)
    numel = int(np.prod(shape)) if shape else 1
    if layout == "leading":
        if len(shape) <= 1:
            return 1, "leading"
        return max(shape[0], 1), "leading"
    if layout == "trailing":
        rank = len(shape)
        if rank <= 1:
            return 1, "trailing"
        if rank in (2, 3):
            return max(numel // max(shape[0], 1), 1), "trailing"
        if rank == 4:
            return max(shape[3], 1), "trailing"
        if rank == 5:
            return max(shape[4], 1), "trailing"
        raise ValueError(f"unit-wise norms support tensors of rank <= 5, got shape {shape}")
    raise ValueError(f"layout must be 'leading' or 'trailing', got {layout!r}")


def _shape(t: Tensor, name: str) -> tuple[int, ...]:
    shape = getattr(t, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be a tensor with a shape, got {type(t).__name__}")
    return tuple(int(d) for d in shape)


def unitwise_norm(tensor: Tensor, *, layout: str = "leading", out: Tensor | None = None) -> Any:
    """Per-unit L2 norms of ``tensor`` (see :func:`unit_layout`).

    Returns:
        ``out`` if given (float32 or float64, one element per unit), else a new 1-D float32
        array (a NumPy array, or, for a CUDA ``tensor``, a tensor of its framework on its
        device).
    """
    num_units, lay = unit_layout(_shape(tensor, "tensor"), layout)
    cuda = _cuda_adapter(tensor)
    stream = _stream(cuda, tensor)
    if out is None:
        if cuda is not None:
            out = cuda.empty(tensor, "float32", (num_units,), None)
        else:
            out = np.empty(num_units, np.float32)
    with _on_device(cuda, tensor):
        load_core().unitwise_norm(tensor, out, num_units, lay, stream=stream)
    return out


def _units(
    tensors: Sequence[Tensor], layout: str | Sequence[tuple[int, str]], name: str = "params"
) -> list:
    if type(tensors).__name__ == "TensorSet":
        # A set's shapes are fixed (a call refuses a resized tensor): its units are worked out once.
        cache = tensors.__dict__.setdefault("_units", {})
        if isinstance(layout, str):
            key = layout
        else:
            # The last list of (fan-in, order) tuples, compared item by item (identical tuples
            # compare without a look inside), saves hashing one tuple per tensor per call.
            last = cache.get(None)
            if last is not None and isinstance(layout, list) and last[0] == layout:
                return last[1]
            key = tuple(map(tuple, layout))
        if key not in cache:
            cache[key] = _units([tensors[i] for i in range(len(tensors))], layout, name)
        if isinstance(layout, list) and all(type(u) is tuple for u in layout):
            cache[None] = (list(layout), cache[key])  # tuples: what they hold cannot change
        return cache[key]
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    shapes = [_shape(t, f"{name}[{i}]") for i, t in enumerate(tensors)]
    if isinstance(layout, str):
        return [unit_layout(shape, layout) for shape in shapes]
    units = list(layout)
    if len(units) != len(shapes):
        raise ValueError(f"layout has {len(units)} entries but {name} has {len(shapes)} tensors")
    for i, (u, shape) in enumerate(zip(units, shapes)):
        if not (
            isinstance(u, (tuple, list))
            and len(u) == 2
            and isinstance(u[0], (int, np.integer))
            and not isinstance(u[0], bool)
            and u[1] in ("leading", "trailing")
        ):
            raise ValueError(
                f"layout[{i}] must be a pair (num_units, 'leading' or 'trailing'), got {u!r}"
            )
        numel = int(np.prod(shape)) if shape else 1
        if u[0] < 1 or numel % int(u[0]) != 0:
            raise ValueError(
                f"layout[{i}]: {u[0]} units do not divide the {numel} elements of {name}[{i}]"
            )
    return [(int(u[0]), str(u[1])) for u in units]


def adaptive_clip(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
    layout: str | Sequence[tuple[int, str]] = "leading",
) -> None:
    """Adaptive gradient clipping (NFNets) of ``grads`` in place.

    Per unit u: g_u ← g_u · min(1, λ·max(‖w_u‖, ε) / max(‖g_u‖, 1e-6)).

    Args:
        params: the parameters (float32, bfloat16 or float16).
        grads: their float32 gradients, clipped in place (float64 ones are clipped in float64).
        clip_factor: λ > 0.
        eps: ε ≥ 0, the floor of a unit's weight norm.
        layout: ``"leading"``, ``"trailing"`` or explicit ``(num_units, layout)`` per tensor.
    """
    units = _units(params, layout)
    cuda = _cuda_adapter(_first(grads))
    stream = _stream(cuda, _first(grads))
    with _on_device(cuda, _first(grads)):
        load_core().adaptive_clip(
            params,
            grads,
            units,
            _check_real(clip_factor, "clip_factor"),
            _check_real(eps, "eps"),
            stream=stream,
        )


def apply(
    params: Sequence[Tensor] | None,
    accumulators: Sequence[Tensor],
    *,
    optimizer: str,
    lr: float = 0.0,
    grad_scale: float = 1.0,
    state1: Sequence[Tensor] | None = None,
    state2: Sequence[Tensor] | None = None,
    grads_out: Sequence[Tensor] | None = None,
    max_norm: float | None = None,
    clip_coef: Tensor | None = None,
    agc: bool = False,
    clip_factor: float = 0.01,
    agc_eps: float = 1e-3,
    layout: str | Sequence[tuple[int, str]] = "leading",
    skip_nonfinite: bool = False,
    reset: bool = True,
    weight_decay: float = 0.0,
    maximize: bool = False,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    momentum_initialized: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    step: int = 1,
    step_counters: Sequence[Tensor] | None = None,
    skip_flag: Tensor | None = None,
) -> ApplyResult:
    """End-of-cycle update in one fused pass per tensor.

    gradient = accumulator · ``grad_scale`` (pass 1/total weight, times 1/loss scale), then
    clipping (``max_norm`` or ``clip_coef`` for the global norm, or ``agc=True``), then the
    optimizer's update writing ``params`` and the optimizer state in place, then the
    accumulator is zeroed (``reset``). The formulas are PyTorch's: ``"sgd"`` (momentum,
    dampening, Nesterov, L2 weight decay), ``"adam"`` (L2 weight decay) and ``"adamw"``
    (decoupled weight decay), amsgrad off. ``"none"`` only writes the final gradient, to
    ``grads_out`` or in place, for optimizers the core does not implement.

    Args:
        params: parameters updated in place (float32, bfloat16, float16); None for "none"
            without AGC.
        accumulators: float32 accumulated gradients, updated in float32; or float64 ones, for
            which the whole update runs in float64 and rounds once to each stored dtype.
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"none"``.
        lr: learning rate.
        grad_scale: factor applied to the accumulators before anything else. With float32
            accumulators it, ``lr``, ``weight_decay``, ``momentum``, ``1 - dampening`` and
            ``eps`` are used in float32 and must be 0 or normal float32 numbers (refused
            otherwise).
        state1: SGD momentum buffers / Adam first moments (param dtype or float32).
        state2: Adam second moments.
        grads_out: destination of the final gradient for ``"none"``.
        max_norm: clip the global norm of the scaled gradient to this value.
        clip_coef: a one-element float32 tensor holding a precomputed clip coefficient.
        agc: adaptive gradient clipping with ``clip_factor``, ``agc_eps`` and ``layout``.
        skip_nonfinite: check first; if the gradient, or any value the update would store
            (parameter, state, output gradient, in its own dtype), is NaN/Inf, update nothing
            (and still reset). This costs one extra read-only pass.
        reset: zero the accumulators in the same pass.
        weight_decay, maximize, momentum, dampening, nesterov: as in ``torch.optim``.
        momentum_initialized: False on SGD's first step (buffer ← gradient).
        betas, eps: Adam's coefficients.
        step: the optimizer step this update makes (1 for the first), for bias correction.
        step_counters: Adam and AdamW, instead of ``step``: one one-element float32 tensor per
            tensor, on the tensors' device, holding the steps it has made (torch's ``step``
            state). Each tensor's update uses its own counter + 1, and the counters advance
            only when the update is applied, decided where the tensors are: on CUDA nothing is
            read on the host, so a skipped update needs no synchronisation.
        skip_flag: a one-element float32 tensor on the tensors' device; non-zero skips the
            update (only ``reset`` acts), as a non-finite gradient with ``skip_nonfinite``
            would. On CUDA it is read on the device.

    Returns:
        ApplyResult (with device tensors for CUDA tensors; ``clip_coef`` may then be a device
        tensor too, so the coefficient is never read on the host).

    Example:
        >>> import numpy as np
        >>> p, a = [np.ones(2, np.float32)], [np.full(2, 4.0, np.float32)]
        >>> _ = core.apply(p, a, optimizer="sgd", lr=0.5, grad_scale=0.25)
        >>> p[0], a[0]
        (array([0.5, 0.5], dtype=float32), array([0., 0.], dtype=float32))
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
    if max_norm is not None and agc:
        raise ValueError("max_norm and agc are exclusive: choose one clipping rule")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError("betas must be a pair (beta1, beta2)")
    clip = "none"
    if max_norm is not None or clip_coef is not None:
        clip = "global_norm"
    elif agc:
        clip = "agc"
    units = None
    if agc:
        if params is None:
            raise ValueError("params is None, but agc=True needs the parameters")
        agc_eps_value = _check_real(agc_eps, "agc_eps")
        if not (np.isfinite(agc_eps_value) and agc_eps_value >= 0):
            raise ValueError(f"agc_eps must be finite and >= 0, got {agc_eps!r}")
        units = _units(params, layout)
    lib = load_core()
    o = lib.ApplyOptions()  # the C struct ga_apply_options, field for field
    o.optimizer = optimizer
    o.grad_scale = _check_real(grad_scale, "grad_scale")
    o.clip = clip
    o.max_norm = _check_real(max_norm, "max_norm") if max_norm is not None else 0.0
    o.clip_coef = clip_coef
    o.clip_factor = _check_real(clip_factor, "clip_factor")
    o.agc_eps = _check_real(agc_eps, "agc_eps")
    o.units = units
    o.skip_nonfinite = bool(skip_nonfinite)
    o.reset = bool(reset)
    o.lr = _check_real(lr, "lr")
    o.weight_decay = _check_real(weight_decay, "weight_decay")
    o.maximize = bool(maximize)
    o.momentum = _check_real(momentum, "momentum")
    o.dampening = _check_real(dampening, "dampening")
    o.nesterov = bool(nesterov)
    o.momentum_initialized = bool(momentum_initialized)
    o.beta1 = _check_real(betas[0], "betas[0]")
    o.beta2 = _check_real(betas[1], "betas[1]")
    o.adam_eps = _check_real(eps, "eps")
    o.step = int(step)
    if step_counters is not None and optimizer not in ("adam", "adamw"):
        raise ValueError(f"step_counters is for adam and adamw only, not {optimizer!r}")
    o.step_counters = step_counters
    o.skip_flag = skip_flag
    cuda = _cuda_adapter(_first(accumulators))
    stream = _stream(cuda, _first(accumulators))
    stats = cuda.empty(accumulators[0], "float32", (3,), None) if cuda is not None else None
    with _on_device(cuda, _first(accumulators)):
        r = lib.apply(
            params, accumulators, state1, state2, grads_out, o, stream=stream, stats_out=stats
        )
    if stats is not None:
        return ApplyResult(stats[2], stats[0], stats[1])
    return ApplyResult(r["skipped"], r["grad_norm"], r["clip_coef"])


def bn_moments(
    x: Tensor, *, channels_axis: int = 1, mean: Tensor | None = None, m2: Tensor | None = None
) -> tuple[Any, Any, int]:
    """Per-channel mean and M2 = Σ(x − mean)² of ``x`` (fp64 arithmetic).

    Args:
        x: input of rank ≥ 2; ``channels_axis`` picks the channel axis (1 for NCHW, -1 for
            channels-last).
        mean, m2: optional float32/float64 outputs, one element per channel; new float64 NumPy
            arrays otherwise.

    Returns:
        ``(mean, m2, count)`` with count the number of values per channel.
    """
    shape = _shape(x, "x")
    if len(shape) < 2:
        raise ValueError(f"x must have rank >= 2, got shape {shape}")
    if isinstance(channels_axis, bool) or not isinstance(channels_axis, (int, np.integer)):
        raise TypeError(f"channels_axis must be an int, got {type(channels_axis).__name__}")
    if not -len(shape) <= channels_axis < len(shape):
        raise ValueError(f"channels_axis {channels_axis} is out of range for x of shape {shape}")
    axis = channels_axis % len(shape)
    channels = shape[axis]
    outer = int(np.prod(shape[:axis])) if axis else 1
    inner = int(np.prod(shape[axis + 1 :])) if axis + 1 < len(shape) else 1
    if mean is None:
        mean = np.empty(channels, np.float64)
    if m2 is None:
        m2 = np.empty(channels, np.float64)
    load_core().bn_moments(x, outer, channels, inner, mean, m2)
    return mean, m2, outer * inner


def bn_merge(
    count_a: float, mean_a: Tensor, m2_a: Tensor, count_b: float, mean_b: Tensor, m2_b: Tensor
) -> float:
    """Merge (count_b, mean_b, M2_b) into (count_a, mean_a, M2_a) in place (Chan et al.).

    Returns:
        The merged count.
    """
    cuda = _cuda_adapter(mean_a)
    with _on_device(cuda, mean_a):
        return float(
            load_core().bn_merge(
                _check_real(count_a, "count_a"),
                mean_a,
                m2_a,
                _check_real(count_b, "count_b"),
                mean_b,
                m2_b,
                stream=_stream(cuda, mean_a),
            )
        )


def bn_update_running(
    running_mean: Tensor,
    running_var: Tensor,
    mean: Tensor,
    m2: Tensor,
    count: float,
    *,
    momentum: float,
    unbiased: bool,
) -> None:
    """running ← (1 − momentum)·running + momentum·batch, in place.

    ``momentum`` is PyTorch's (the weight of the new value); pass ``1 - momentum`` for Keras.
    The batch variance is M2/(count − 1) when ``unbiased`` (PyTorch) else M2/count (Keras).
    """
    cuda = _cuda_adapter(running_mean)
    with _on_device(cuda, running_mean):
        load_core().bn_update_running(
            running_mean,
            running_var,
            mean,
            m2,
            _check_real(count, "count"),
            _check_real(momentum, "momentum"),
            bool(unbiased),
            stream=_stream(cuda, running_mean),
        )


def zero(tensors: Sequence[Tensor]) -> None:
    """Set every tensor to zero."""
    cuda = _cuda_adapter(_first(tensors))
    with _on_device(cuda, _first(tensors)):
        load_core().zero(tensors, stream=_stream(cuda, _first(tensors)))


class ArenaPlan(NamedTuple):
    """Layout of an accumulator arena.

    Attributes:
        offsets: element offset of each tensor (in the order given).
        bucket_of: bucket index of each tensor.
        bucket_start: ``num_buckets + 1`` element offsets; bucket b is
            ``[bucket_start[b], bucket_start[b + 1])``.
        total: arena size in elements.
    """

    offsets: list[int]
    bucket_of: list[int]
    bucket_start: list[int]
    total: int


def arena_plan(
    numels: Sequence[int],
    *,
    alignment: int = 16,
    bucket_numel: int = 25 * 2**20 // 4,
    reverse: bool = True,
) -> ArenaPlan:
    """Plan one flat fp32 buffer for tensors of ``numels`` elements.

    Tensors start on ``alignment``-element boundaries (16 = 64 bytes), are laid out last-first
    when ``reverse`` (the order backward produces gradients), and are grouped into buckets of at
    least ``bucket_numel`` elements (default 25 MiB) for one collective each.
    """
    try:
        counts = [int(n) for n in numels]
    except TypeError as e:
        raise TypeError(f"numels must be a sequence of element counts: {e}") from None
    for i, n in enumerate(counts):
        if not 0 <= n < _INT64_LIMIT:
            raise ValueError(f"numels[{i}] must be in [0, 2**63), got {n}")
    for name, value in (("alignment", alignment), ("bucket_numel", bucket_numel)):
        if not 0 < int(value) < _INT64_LIMIT:
            raise ValueError(f"{name} must be in [1, 2**63), got {value!r}")
    offsets, bucket_of, bucket_start, total = load_core().arena_plan(
        counts, int(alignment), int(bucket_numel), bool(reverse)
    )
    return ArenaPlan(list(offsets), list(bucket_of), list(bucket_start), int(total))
