"""core.cuda_status(): whether the CUDA kernels can run here, and why not — on any machine.

A CPU build says it has no kernels; a build with kernels on a machine without a driver or a GPU
(the release wheel's test machines, this suite's CI) says which of the two is missing, and a
CUDA tensor given to it (a DLPack producer that says kDLCUDA, no framework needed) is refused
with that same reason, not as a build without kernels. On a GPU machine the status is "ok".
NumPy only: tools/wheel_test.py runs this file against every release wheel.
"""

from __future__ import annotations

import re

import pytest
from helpers import FakeCudaTensor

from gradient_accumulator import _C, core

#: The reasons of a build with kernels where they cannot run (csrc/cuda/backend.cu).
NOT_RUNNABLE = (
    r"no NVIDIA driver found",
    r"driver too old for the CUDA \d+\.\d+ runtime \(driver supports CUDA \d+\.\d+\)",
    r"no CUDA device \(driver supports CUDA \d+\.\d+\)",
    r"the CUDA runtime failed to initialise: cuda\w+",
)


def test_cuda_status_is_a_typed_value_that_agrees_with_the_build():
    status = core.cuda_status()
    assert isinstance(status, core.CudaStatus)
    assert status._fields == (
        "available",
        "reason",
        "device_count",
        "driver_version",
        "runtime_version",
    )
    assert isinstance(status.available, bool) and isinstance(status.reason, str)
    assert status.available == status.reason.startswith("ok: ")
    assert status.available == (status.device_count > 0)
    assert status.device_count == core.cuda_device_count()
    if not core.has_cuda():
        assert status == core.CudaStatus(
            False, "no CUDA kernels in this build (GA_CUDA=OFF)", 0, None, None
        )
        return
    major, minor = status.runtime_version
    assert major >= 12 and 0 <= minor < 100
    if status.available:
        assert re.fullmatch(r"ok: \d+ devices?, driver supports CUDA \d+\.\d+", status.reason)
        assert status.driver_version >= (major, 0)
    else:
        assert any(re.match(r, status.reason) for r in NOT_RUNNABLE), status.reason
        no_driver = status.reason.startswith("no NVIDIA driver")
        assert (status.driver_version is None) == no_driver


def test_cuda_status_is_stable_across_calls():
    assert core.cuda_status() == core.cuda_status()


@pytest.mark.skipif(core.cuda_status().available, reason="a usable GPU: tests/cuda run the calls")
def test_a_cuda_tensor_is_refused_with_the_reason_the_kernels_cannot_run():
    """What a GPU user whose driver or device is missing sees at the first CUDA tensor: the
    reason from cuda_status(), not "rebuild with GA_CUDA=ON" (unless that is the reason)."""
    status = core.cuda_status()
    acc, grad, flag = FakeCudaTensor(8), FakeCudaTensor(8, bits=16, code=4), FakeCudaTensor(1)
    calls = {
        "accumulate": lambda: _C.accumulate(
            [acc], [grad], 1.0, "sum", 0.0, True, False, stream=0, nonfinite_out=flag
        ),
        "zero": lambda: _C.zero([acc], stream=0),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        if core.has_cuda():
            assert status.reason in message, (name, message)
            assert "no CUDA kernels" not in message and "GA_CUDA" not in message, message
        else:
            assert "no CUDA kernels" in message, (name, message)


def test_cublaslt_is_found_in_the_cuda_major_s_pip_wheel(tmp_path, monkeypatch):
    """A core built for CUDA 13 beside a torch built for 12 finds no ``libcublasLt.so.13`` by
    soname: the library of PyPI's cuBLAS wheel of the core's major is taken (an installed
    distribution is all the lookup reads: one is made here, with its RECORD)."""
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublasLt.so.13").write_bytes(b"")
    info = tmp_path / "nvidia_cublas-13.1.0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nvidia-cublas\nVersion: 13.1.0.3\n"
    )
    (info / "RECORD").write_text(
        "nvidia/cu13/lib/libcublasLt.so.13,,\nnvidia_cublas-13.1.0.3.dist-info/RECORD,,\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = core._cublaslt_wheel_library(13)
    assert found == str(lib / "libcublasLt.so.13")
    assert core._cublaslt_wheel_library(97) is None  # no wheel of that major
