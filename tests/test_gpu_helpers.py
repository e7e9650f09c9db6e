"""The comparison helpers of the GPU tests (tests/cuda/gpu_helpers.py), checked where they can be:
on any machine. Two GPU failures on an H200 were bugs of these helpers, not of the kernels: an
fp64 sum of squares compared through float32, and a parameter that requires grad turned into a
Python float under warnings-as-errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda"))
import gpu_helpers  # noqa: E402


def test_close_compares_an_fp64_python_float_in_fp64():
    # The GPU's Σx² (a float64 tensor) against the CPU core's (a Python float) at 1e-12: the
    # old helper rounded the float to float32 (3195089.75) and reported a 1.4e-8 difference.
    x = 3195089.7934525968
    gpu_helpers.close(torch.tensor(x, dtype=torch.float64), x, 1e-12)
    with pytest.raises(AssertionError, match="1 of 1 off"):
        gpu_helpers.close(torch.tensor(x * (1 + 1e-10), dtype=torch.float64), x, 1e-12)


def test_close_allows_exactly_the_ulps_asked_for_16_bit_results():
    want = torch.tensor([0.7085, -1.5, 1e-3, 300.0], dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16):
        w = want.to(dtype)
        step = gpu_helpers.ulp(w.double(), dtype)
        one_up = (w.double() + step).to(dtype)
        two_up = (w.double() + 2 * step).to(dtype)
        assert torch.equal((one_up.double() - w.double()).abs(), step)  # exactly one ulp
        gpu_helpers.close(one_up, w, 1e-9, ulps=1)
        with pytest.raises(AssertionError):
            gpu_helpers.close(one_up, w, 1e-9)
        with pytest.raises(AssertionError):
            gpu_helpers.close(two_up, w, 1e-9, ulps=1)


def test_rel_of_parameters_that_require_grad_raises_no_warning():
    # pytest runs with warnings as errors: float() of a tensor that requires grad warns.
    a = [torch.nn.Parameter(torch.tensor([1.0, -2.0])), torch.nn.Parameter(torch.tensor([4.0]))]
    b = [torch.tensor([1.0, -2.5], dtype=torch.float64), torch.tensor([4.0], dtype=torch.float64)]
    assert gpu_helpers.rel(a, b) == pytest.approx(0.5 / 4.0, rel=1e-15)
