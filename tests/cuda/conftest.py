"""GPU tests: run only where torch sees a CUDA device and the core was built with CUDA kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradient_accumulator import core  # noqa: E402


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device visible to torch"
    elif not core.has_cuda():
        reason = "this build of gradient-accumulator has no CUDA kernels"
    if reason is None:
        return
    here = str(config.rootpath / "tests" / "cuda")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def dev():
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 convolutions and matmuls in full fp32 (cuDNN uses TF32 by default on Ampere and
    later), so that fp32 training can be compared with an fp64 reference."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def rand(n, dtype, dev, seed, lo=-1.0, hi=1.0, offset=0):
    """n random values in [lo, hi) of `dtype` on `dev`, as a view starting `offset` elements into
    its storage (offset 1 leaves the data unaligned for 16-byte loads)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.empty(n + offset, dtype=torch.float64).uniform_(lo, hi, generator=g)
    return base.to(dtype).to(dev)[offset:]
