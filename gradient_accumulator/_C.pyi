"""Type stub of the compiled core (gradient_accumulator._C). Use gradient_accumulator.core."""

from collections.abc import Sequence
from typing import Any

__version__: str

def cpu_isa() -> str: ...
def num_threads() -> int: ...
def has_cuda() -> bool: ...
def cuda_device_count() -> int: ...
def cuda_probe() -> tuple[int, int, int, int, str]:
    """ga_cuda_probe: (code, device_count, driver_version, runtime_version, reason)."""

def _torch_direct_reads() -> bool:
    """Whether registered torch tensors are re-checked by reading torch's metadata directly."""

class StaleTensorError(ValueError):
    """A registered tensor changed since its set was registered (freed, resized, moved...)."""

class TensorSet:
    """Tensors imported and checked once; every list argument below also takes one."""

    def __init__(
        self, tensors: Sequence[Any], writable: bool = True, name: str = "tensors"
    ) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...
    @property
    def writable(self) -> bool: ...
    @property
    def is_cuda(self) -> bool: ...

def accumulate(
    accumulators: Sequence[Any],
    grads: Sequence[Any],
    weight: float,
    mode: str,
    weight_before: float,
    overwrite: bool,
    compute_sumsq: bool,
    stream: int = 0,
    nonfinite_out: Any | None = None,
    sumsq_out: Any | None = None,
) -> tuple[bool | None, float | None]: ...
def sum_of_squares(
    tensors: Sequence[Any], stream: int = 0, out: Any | None = None
) -> float | None: ...
def unitwise_norm(
    tensor: Any, norms: Any, num_units: int, layout: str, stream: int = 0
) -> None: ...
def adaptive_clip(
    params: Sequence[Any],
    grads: Sequence[Any],
    units: Sequence[tuple[int, str]],
    clip_factor: float,
    eps: float,
    stream: int = 0,
) -> None: ...

class ApplyOptions:
    """``ga_apply_options`` (apply.h), field for field; strings for the enums."""

    optimizer: str  # "none", "sgd", "adam", "adamw"
    clip: str  # "none", "global_norm", "agc"
    clip_coef: Any | None
    units: Sequence[tuple[int, str]] | None
    step_counters: Sequence[Any] | None  # one float32 scalar per tensor (Adam, AdamW)
    skip_flag: Any | None  # a float32 scalar: non-zero skips the update
    grad_scale: float
    max_norm: float
    clip_factor: float
    agc_eps: float
    skip_nonfinite: bool
    reset: bool
    lr: float
    weight_decay: float
    maximize: bool
    momentum: float
    dampening: float
    nesterov: bool
    momentum_initialized: bool
    beta1: float
    beta2: float
    adam_eps: float
    step: int
    def __init__(self) -> None: ...

def apply(
    params: Sequence[Any] | None,
    accumulators: Sequence[Any],
    state1: Sequence[Any] | None,
    state2: Sequence[Any] | None,
    grads_out: Sequence[Any] | None,
    options: ApplyOptions,
    stream: int = 0,
    stats_out: Any | None = None,
) -> dict[str, Any]: ...
def bn_moments(x: Any, outer: int, channels: int, inner: int, mean: Any, m2: Any) -> None: ...
def bn_merge(
    count_a: float,
    mean_a: Any,
    m2_a: Any,
    count_b: float,
    mean_b: Any,
    m2_b: Any,
    stream: int = 0,
) -> float: ...
def bn_update_running(
    running_mean: Any,
    running_var: Any,
    mean: Any,
    m2: Any,
    count: float,
    new_weight: float,
    unbiased: bool,
    stream: int = 0,
) -> None: ...
def zero(tensors: Sequence[Any], stream: int = 0) -> None: ...
def arena_plan(
    numels: Sequence[int], alignment: int, bucket_numel: int, reverse: bool
) -> tuple[list[int], list[int], list[int], int]: ...
