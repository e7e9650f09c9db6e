"""PyTorch internals the package relies on, in one place.

:data:`REACHES` lists every private attribute, function or class of torch the package touches
and the one global patch it installs, with the torch versions they were checked against;
``tests/torch/test_torch_private_reaches.py`` probes each against the installed torch and
names the one an upgrade moved. The patch itself is installed from here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gradient_accumulator._reaches import Reach

__all__ = ["REACHES", "keep_on_sync_conversion"]

TORCH = "2.13.0"

REACHES = (
    Reach(
        "torch",
        "torch.optim.Optimizer()._optimizer_step_pre_hooks (and the five other hook dicts "
        "Optimizer.__init__ makes)",
        TORCH,
        "the optimizer wrapper, which never calls Optimizer.__init__, providing the hook "
        "registries (torch/_options.py HOOK_DICTS) and running the inner optimizer's hooks "
        "around a fused update (torch/_update.py)",
    ),
    Reach(
        "torch",
        "torch.optim.optimizer._global_optimizer_pre_hooks, _global_optimizer_post_hooks",
        TORCH,
        "running the global optimizer step hooks around a fused update (torch/_update.py)",
    ),
    Reach(
        "torch",
        "torch.optim.Optimizer()._opt_called",
        TORCH,
        "telling an LR scheduler that the inner optimizer stepped when the fused update ran "
        "instead of its step() (torch/_update.py; the scheduler warns otherwise)",
    ),
    Reach(
        "torch",
        "torch._foreach_add_",
        TORCH,
        "advancing the Adam/AdamW step counts of a fused update in one call (torch/_update.py)",
    ),
    Reach(
        "torch",
        "torch.amp.GradScaler()._scale",
        TORCH,
        "seeing that a GradScaler has no scale tensor yet before update() (torch/_update.py)",
    ),
    Reach(
        "torch",
        "torch.nn.Module()._buffers",
        TORCH,
        "reading and replacing AccumBatchNorm's buffers without the Module attribute lookup "
        "(torch/batchnorm.py)",
    ),
    Reach(
        "torch",
        "torch.Tensor()._version",
        TORCH,
        "seeing that something other than the Keras torch-backend path wrote its cycle "
        "variables (keras/_core_path.py)",
    ),
    Reach(
        "torch",
        "c10::TensorImpl / StorageImpl memory layout (read by the compiled module)",
        TORCH,
        "re-checking registered tensor sets without torch's Python accessors "
        "(csrc/python/tensor_set.cc; probed at first use, falls back to the accessors when "
        "the layout is not recognised; GA_TORCH_DIRECT_READS=0 turns it off)",
    ),
    Reach(
        "torch",
        "patch: torch.nn.SyncBatchNorm.convert_sync_batchnorm",
        TORCH,
        "keeping AccumBatchNorm layers (which merge across ranks themselves) when a model is "
        "converted for DDP (installed by keep_on_sync_conversion, from torch/batchnorm.py)",
    ),
    Reach(
        "torch",
        "torch.distributed.fsdp.FSDPModule()._get_fsdp_state()._fsdp_param_groups "
        "(.fsdp_params: .sharded_param, .fsdp_placement; .reduce_grads)",
        TORCH,
        "matching the optimizer's parameters to FSDP2's records, the dimension a parameter is "
        "sharded on (AGC's units) and whether gradient sync is off (torch/fsdp.py)",
    ),
    Reach(
        "torch",
        "torch.distributed.fsdp FSDPParam()._unsharded_param",
        TORCH,
        "weighting each micro-batch's gradient before FSDP2 adds it into its unsharded "
        "gradients when gradient sync is off (a tensor hook; torch/fsdp.py)",
    ),
    Reach(
        "torch",
        "torch.distributed.tensor.DTensor()._local_tensor",
        TORCH,
        "the rank's shard of a DTensor parameter as the same tensor object each cycle (the "
        "core's registered tensor sets keep track of it; to_local() makes a new one each "
        "call), falling back to to_local() without it (torch/fsdp.py)",
    ),
    Reach(
        "torch",
        "torch.distributed.device_mesh.DeviceMesh()._flatten().get_group()",
        TORCH,
        "one process group over a multi-dimensional FSDP2 mesh, for the cycle's weights and "
        "flags (torch/fsdp.py)",
    ),
    Reach(
        "torch",
        "torch.nn.modules.batchnorm._BatchNorm",
        TORCH,
        "AccumSyncBatchNorm's base class and telling torch's batch norms apart in "
        "convert_batchnorm (torch/batchnorm.py)",
    ),
)


def _torch_convert_sync() -> Any:
    """torch's own ``convert_sync_batchnorm`` function, also when ours is installed."""
    installed = nn.SyncBatchNorm.__dict__["convert_sync_batchnorm"].__func__
    return installed.__wrapped__ if getattr(installed, "_keeps_layers", None) else installed


def keep_on_sync_conversion(layer_type: type) -> None:
    """Make ``nn.SyncBatchNorm.convert_sync_batchnorm`` keep layers of ``layer_type``.

    torch's conversion replaces every ``_BatchNorm`` with a ``SyncBatchNorm``; a layer of
    ``layer_type`` is kept and given the process group instead (it merges its statistics
    across the group's ranks itself). Installing it again adds ``layer_type`` to those kept.
    """
    torch_convert = _torch_convert_sync()
    installed = nn.SyncBatchNorm.__dict__["convert_sync_batchnorm"].__func__
    kept = tuple(getattr(installed, "_keeps_layers", ())) + (layer_type,)

    def convert_sync_batchnorm(cls: type, module: nn.Module, process_group: Any = None) -> Any:
        if isinstance(module, kept):
            module.process_group = process_group
            return module
        return torch_convert(cls, module, process_group)

    convert_sync_batchnorm.__doc__ = torch_convert.__doc__
    convert_sync_batchnorm._keeps_layers = kept  # type: ignore[attr-defined]
    convert_sync_batchnorm.__wrapped__ = torch_convert  # type: ignore[attr-defined]
    nn.SyncBatchNorm.convert_sync_batchnorm = classmethod(convert_sync_batchnorm)
