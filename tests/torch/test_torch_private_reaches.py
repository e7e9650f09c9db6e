"""Every private part of torch (and of the interpreter) the package relies on is still there.

Each record of ``torch/_glue.py``'s and ``_reaches.py``'s ``REACHES`` has a probe here that
exercises it as the package does; a probe that fails names the record, the installed version
and the one it was checked against.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradient_accumulator import _reaches
from gradient_accumulator._reaches import Reach, moved
from gradient_accumulator.torch import _glue
from gradient_accumulator.torch._options import HOOK_DICTS


def _hook_dicts() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    for name in HOOK_DICTS:
        assert isinstance(getattr(opt, name, None), dict), f"no dict {name} on an optimizer"


def _global_hooks() -> None:
    from torch.optim import optimizer as topt

    seen = []
    handle = topt.register_optimizer_step_pre_hook(lambda *a: seen.append("pre"))
    handle_post = topt.register_optimizer_step_post_hook(lambda *a: seen.append("post"))
    try:
        assert len(topt._global_optimizer_pre_hooks) >= 1
        assert len(topt._global_optimizer_post_hooks) >= 1
        for hook in topt._global_optimizer_pre_hooks.values():
            hook(None, (), {})
        for hook in topt._global_optimizer_post_hooks.values():
            hook(None, (), {})
        assert seen == ["pre", "post"]
    finally:
        handle.remove()
        handle_post.remove()


def _opt_called() -> None:
    def scheduler_warns(mark: bool) -> bool:
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        if mark:
            opt._opt_called = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        return any("optimizer.step()" in str(w.message) for w in caught)

    assert scheduler_warns(False), "the scheduler no longer warns about a missing step"
    assert not scheduler_warns(True), "the scheduler no longer reads _opt_called"


def _foreach_add() -> None:
    steps = [torch.tensor(1.0), torch.tensor(4.0)]
    torch._foreach_add_(steps, 1)
    assert [float(s) for s in steps] == [2.0, 5.0]


def _scaler_scale() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert scaler._scale is None, "a new GradScaler has a scale tensor before scaling"
    scaler.scale(torch.ones(()))
    assert isinstance(scaler._scale, torch.Tensor) and float(scaler._scale) == 8.0


def _module_buffers() -> None:
    bn = nn.BatchNorm1d(3)
    assert bn._buffers["running_mean"] is bn.running_mean
    bn._buffers["running_mean"] = torch.ones(3)
    assert float(bn.running_mean.sum()) == 3.0


def _tensor_version() -> None:
    t = torch.zeros(2)
    before = t._version
    t.add_(1)
    assert t._version > before


def _tensor_impl_layout() -> None:
    from gradient_accumulator import core

    assert core.load_core()._torch_direct_reads(), (
        "the compiled module no longer recognises torch's TensorImpl layout (registered sets "
        "are re-checked through torch's accessors: correct, slower)"
    )


def _sync_patch() -> None:
    from gradient_accumulator.torch.batchnorm import AccumBatchNorm1d

    model = nn.Sequential(nn.Linear(2, 2), AccumBatchNorm1d(2, accum_steps=2), nn.BatchNorm1d(2))
    out = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(out[1]) is AccumBatchNorm1d, "an AccumBatchNorm1d was replaced"
    assert type(out[2]) is nn.SyncBatchNorm, "torch's own conversion no longer runs"
    original = _glue._torch_convert_sync()
    assert original.__module__ == "torch.nn.modules.batchnorm"


def _frames() -> None:
    from gradient_accumulator.torch import GradientAccumulateOptimizer

    w = nn.Parameter(torch.zeros(2))
    opt = GradientAccumulateOptimizer(torch.optim.SGD([w], lr=0.1), 1)
    w.grad = torch.tensor([float("nan"), 0.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # the warning must point here
    files = [w.filename for w in caught]
    assert files == [__file__], f"the skipped-cycle warning points at {files}"


def _fsdp2_model():
    """A one-rank FSDP2 model (a Gloo group of one process made here when none exists) and the
    function that ends that group."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    made = not dist.is_initialized()
    if made:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    return model, (dist.destroy_process_group if made else (lambda: None))


def _fsdp2_records() -> None:
    from torch.distributed.fsdp import FSDPModule

    model, end = _fsdp2_model()
    try:
        groups = model[0]._get_fsdp_state()._fsdp_param_groups
        records = [fp for g in groups for fp in g.fsdp_params]
        assert {id(fp.sharded_param) for fp in records} == {id(p) for p in model[0].parameters()}
        assert all(fp.fsdp_placement.dim == 0 for fp in records)
        assert isinstance(model[0], FSDPModule) and all(g.reduce_grads for g in groups)
        model.set_requires_gradient_sync(False)
        assert not any(g.reduce_grads for g in groups), "reduce_grads does not follow sync"
    finally:
        end()


def _fsdp2_unsharded() -> None:
    model, end = _fsdp2_model()
    try:
        model.set_requires_gradient_sync(False)
        model(torch.ones(2, 3)).sum().backward()  # the first forward makes them
        groups = model[0]._get_fsdp_state()._fsdp_param_groups
        records = [fp for g in groups for fp in g.fsdp_params]
        params = [fp._unsharded_param for fp in records]
        first = [p.grad.clone() for p in params]
        for p in params:
            p.register_hook(lambda g: g * 3.0)
        model(torch.ones(2, 3)).sum().backward()  # sync off: FSDP2 adds into these gradients
        for p, g in zip(params, first):
            torch.testing.assert_close(p.grad, 4.0 * g, msg="a hook's result was not added in")
    finally:
        end()


def _one_rank_group() -> Callable[[], None]:
    """A Gloo group of one process (made here when none exists) and the function that ends it."""
    import os
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        return lambda: None
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.destroy_process_group


def _dtensor_local() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from gradient_accumulator.torch.fsdp import local

    end = _one_rank_group()
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.arange(4.0), mesh)
        held = d._local_tensor
        assert isinstance(held, torch.Tensor) and held is d._local_tensor, "not one object"
        assert held.data_ptr() == d.to_local().data_ptr(), "not the rank's shard"
        assert local(d) is held
    finally:
        end()


def _mesh_flatten() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    end = _one_rank_group()
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        flat = mesh._flatten()
        assert flat.ndim == 1 and flat.size() == mesh.size()
        assert dist.get_world_size(flat.get_group()) == mesh.size()
    finally:
        end()


def _batchnorm_base() -> None:
    from torch.nn.modules.batchnorm import _BatchNorm

    from gradient_accumulator.torch.batchnorm import AccumSyncBatchNorm, _batchnorm_like

    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        assert issubclass(cls, _BatchNorm), f"{cls.__name__} is not a _BatchNorm"
    assert _batchnorm_like(nn.BatchNorm2d(3)) and not _batchnorm_like(nn.LayerNorm(3))
    bn = AccumSyncBatchNorm(3, accum_steps=1)
    bn(torch.randn(4, 3, 5))
    assert int(bn.num_batches_tracked) == 1 and bn.running_mean.shape == (3,)


PROBES: dict[str, Callable[[], None]] = {
    _glue.REACHES[0].target: _hook_dicts,
    _glue.REACHES[1].target: _global_hooks,
    _glue.REACHES[2].target: _opt_called,
    _glue.REACHES[3].target: _foreach_add,
    _glue.REACHES[4].target: _scaler_scale,
    _glue.REACHES[5].target: _module_buffers,
    _glue.REACHES[6].target: _tensor_version,
    _glue.REACHES[7].target: _tensor_impl_layout,
    _glue.REACHES[8].target: _sync_patch,
    _glue.REACHES[9].target: _fsdp2_records,
    _glue.REACHES[10].target: _fsdp2_unsharded,
    _glue.REACHES[11].target: _dtensor_local,
    _glue.REACHES[12].target: _mesh_flatten,
    _glue.REACHES[13].target: _batchnorm_base,
    _reaches.REACHES[0].target: _frames,
}
REACHES = _glue.REACHES + _reaches.REACHES


def test_every_reach_has_a_probe():
    assert {r.target for r in REACHES} == set(PROBES)
    assert all(r.library in ("torch", "python") for r in REACHES)


@pytest.mark.parametrize("reach", REACHES, ids=lambda r: r.target.split(" ")[0])
def test_reach_is_where_it_was(reach: Reach):
    try:
        PROBES[reach.target]()
    except Exception as e:  # whatever the upgrade broke, name the reach
        pytest.fail(moved(reach, f"{type(e).__name__}: {e}"), pytrace=False)


def test_the_message_names_the_reach_and_versions():
    message = moved(_glue.REACHES[2], "AttributeError: gone")
    assert message.startswith(f"torch {torch.__version__.split('+')[0]}") or "torch 2" in message
    assert "_opt_called" in message and "checked against torch 2.13.0" in message
    assert "AttributeError: gone" in message and "LR scheduler" in message
