"""How the bindings route tensors that DLPack says live on a CUDA device, on any machine.

The tensors here are DLPack capsules whose descriptor says "CUDA device 0" while the memory is
host memory that nothing dereferences: validation runs on the host before any launch, so bad
input is reported as such even without a GPU, and a valid call reaches the CUDA runtime, which
fails cleanly when there is no device. Builds without CUDA kernels refuse with RuntimeError.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FakeCudaTensor

from gradient_accumulator import _C, core


def _runtime_failure_message() -> str:
    return "CUDA" if core.has_cuda() else "no CUDA kernels"


def test_a_valid_cuda_call_reaches_the_cuda_path():
    acc, g = FakeCudaTensor(10), FakeCudaTensor(10, bits=16, code=4)
    flag = FakeCudaTensor(1)
    if core.has_cuda() and core.cuda_device_count() > 0:
        pytest.skip("a real GPU is present: tests/cuda covers the calls")
    # No device (or no CUDA build): a RuntimeError from the CUDA runtime or the build, not a crash.
    with pytest.raises(RuntimeError, match=_runtime_failure_message()):
        _C.accumulate([acc], [g], 1.0, "sum", 0.0, True, False, stream=0, nonfinite_out=flag)
    with pytest.raises(RuntimeError, match=_runtime_failure_message()):
        _C.zero([acc], stream=0)


@pytest.mark.skipif(not core.has_cuda(), reason="this build has no CUDA kernels")
def test_cuda_calls_validate_before_touching_the_device():
    acc = FakeCudaTensor(10)
    with pytest.raises(TypeError, match=r"grads\[0\].*CPU tensor"):
        _C.accumulate([acc], [np.ones(10, np.float32)], 1.0, "sum", 0.0, True, False)
    with pytest.raises(TypeError, match=r"grads\[0\].*cuda:1"):
        _C.accumulate([acc], [FakeCudaTensor(10, device=1)], 1.0, "sum", 0.0, True, False)
    with pytest.raises(TypeError, match=r"accumulators\[0\].*float32"):
        _C.accumulate(
            [FakeCudaTensor(10, bits=64)], [FakeCudaTensor(10)], 1.0, "sum", 0.0, True, False
        )
    with pytest.raises(ValueError, match="weight"):
        _C.accumulate([acc], [FakeCudaTensor(10)], -1.0, "sum", 0.0, True, False)
    with pytest.raises(TypeError, match="nonfinite_out"):
        _C.accumulate(
            [acc],
            [FakeCudaTensor(10)],
            1.0,
            "sum",
            0.0,
            True,
            False,
            nonfinite_out=np.zeros(1, np.float32),
        )
    with pytest.raises(ValueError, match="out is required"):
        _C.sum_of_squares([acc])


def test_the_cpu_path_still_refuses_cuda_tensors_mixed_in():
    acc = np.zeros(10, np.float32)
    with pytest.raises((TypeError, RuntimeError), match=r"grads\[0\]"):
        core.accumulate([acc], [FakeCudaTensor(10)])


def test_cuda_tensors_from_other_frameworks_are_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="PyTorch"):
        core.accumulate([FakeCudaTensor(10)], [FakeCudaTensor(10)])
    with pytest.raises(TypeError, match="PyTorch"):
        core.sum_of_squares([FakeCudaTensor(10)])


def test_cpu_results_also_go_to_the_optional_outputs():
    acc = [np.zeros(4, np.float32)]
    flag = np.zeros(1, np.float32)
    r = core.accumulate(
        acc, [np.array([1, 2, 3, np.inf], np.float32)], overwrite=True, nonfinite_out=flag
    )
    assert r.nonfinite and flag[0] == 1.0
    core.accumulate(acc, [np.ones(4, np.float32)], overwrite=True, nonfinite_out=flag)
    assert flag[0] == 1.0  # never cleared by a later finite call
    with pytest.raises(TypeError, match="nonfinite_out"):
        core.accumulate(acc, [np.ones(4, np.float32)], nonfinite_out=np.zeros(2, np.float32))
    assert core.cuda_device_count() >= 0
