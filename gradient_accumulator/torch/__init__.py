"""PyTorch adapter: exact gradient accumulation for any ``torch.optim`` optimizer.

Example:
    >>> import torch
    >>> from gradient_accumulator.torch import GradientAccumulateOptimizer
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4)
"""

try:
    import torch as _torch  # noqa: F401  (only to name the install when it is missing)
except ImportError as _e:
    raise ImportError(
        "gradient_accumulator.torch needs PyTorch: pip install 'gradient-accumulator[torch]' "
        f"(or a CUDA build of torch from pytorch.org). Import failed with: {_e}"
    ) from _e

from gradient_accumulator.torch.agc import adaptive_clip_grad, unitwise_norm
from gradient_accumulator.torch.batchnorm import (
    AccumBatchNorm1d,
    AccumBatchNorm2d,
    AccumBatchNorm3d,
    AccumSyncBatchNorm,
    convert_batchnorm,
    flush_batchnorm,
)
from gradient_accumulator.torch.context import accumulate
from gradient_accumulator.torch.fused import (
    FusedLinear,
    FusionReport,
    fuse_accumulation,
    fused_path,
)
from gradient_accumulator.torch.optimizer import AccumulationState, GradientAccumulateOptimizer

__all__ = [
    "AccumBatchNorm1d",
    "AccumBatchNorm2d",
    "AccumBatchNorm3d",
    "AccumSyncBatchNorm",
    "AccumulationState",
    "FusedLinear",
    "FusionReport",
    "GradientAccumulateOptimizer",
    "accumulate",
    "adaptive_clip_grad",
    "convert_batchnorm",
    "flush_batchnorm",
    "fuse_accumulation",
    "fused_path",
    "unitwise_norm",
]
