"""The machine code of the hot CUDA kernels, checked without a GPU: compiled for sm_90 with the
build's flags (csrc/tests/sass_hot_kernels.cu instantiates exactly the kernels the library
launches), disassembled with nvdisasm, and read back.

* every hot kernel — accumulate (bf16 → fp32, fp32 → fp32), the global norm, the fused apply
  (SGD with momentum, Adam, AdamW with fp32 and bf16 parameters) and AGC (unit sums, clip) —
  moves its data with 128-bit global loads (``LDG.E….128``; stores ``STG.E….128`` where it
  writes). Before this was checked, the accumulate and apply kernels compiled to 32-bit
  accesses only: the 16-byte word loads of the source had been split by the optimiser;
* ``ptxas -v``: no kernel spills registers to local memory.

Skipped where nvcc or nvdisasm (pip package ``nvidia-cuda-nvdisasm``) is missing. About 5 s of
CPU time.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "tests" / "sass_hot_kernels.cu"
# The flags of csrc/cuda/CMakeLists.txt (Release), for sm_90 only.
FLAGS = ["-O3", "-std=c++17", "--fmad=false", "--expt-relaxed-constexpr", "-arch=sm_90"]

# Mangled-name fragments of the kernels that must read (and write) with 16-byte accesses.
HOT = {
    "accumulate bf16->fp32": ("chunk_kernelILb0ELi2ENS0_12AccumulateOpINS0_4bf16E", True),
    "accumulate bf16->fp32 + sumsq": ("chunk_kernelILb1ELi2ENS0_12AccumulateOpINS0_4bf16E", True),
    "accumulate fp32->fp32": ("chunk_kernelILb0ELi2ENS0_12AccumulateOpIfE", True),
    "global norm": ("chunk_kernelILb1ELi1ENS0_7SumsqOpIfE", False),
    "apply SGD momentum": ("ApplyOpILNS0_3OptE1ELb1ELb1ELb0EfffE", True),
    "apply Adam": ("ApplyOpILNS0_3OptE2ELb0ELb1ELb0EfffE", True),
    "apply AdamW": ("ApplyOpILNS0_3OptE3ELb0ELb1ELb0EfffE", True),
    "apply AdamW bf16 params": ("ApplyOpILNS0_3OptE3ELb0ELb1ELb0ENS0_4bf16EffE", True),
    "AGC unit sums": ("unit_kernelILi2EffE", False),
    "AGC clip": ("ApplyOpILNS0_3OptE0ELb0ELb0ELb1EfffE", True),
}


def _nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")  # pip: nvidia-cuda-nvdisasm
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_nvdisasm", "cu12"):
            cand = Path(base) / sub / "bin" / "nvdisasm"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    nvcc, nvdisasm = shutil.which("nvcc"), _nvdisasm()
    if nvcc is None or nvdisasm is None:
        pytest.skip("needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    out = tmp_path_factory.mktemp("sass") / "hot.cubin"
    proc = subprocess.run(
        [nvcc, *FLAGS, f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'core'}"]
        + ["-cubin", "-Xptxas", "-v", str(SOURCE), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sass = subprocess.run([nvdisasm, str(out)], capture_output=True, text=True, check=True).stdout
    return sass, proc.stdout + proc.stderr


def _functions(sass: str) -> dict[str, str]:
    """Body of every function of the disassembly, by mangled name."""
    parts = re.split(r"^\s*\.text\.(\S+):\s*$", sass, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _ptxas(report: str) -> dict[str, tuple[int, int]]:
    """(registers, spill bytes) of every kernel in a ``ptxas -v`` report."""
    out, name, spill = {}, None, 0
    for line in report.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name] = (int(m.group(1)), spill)
            name = None
    return out


@pytest.mark.parametrize("kernel", list(HOT))
def test_hot_kernel_moves_data_with_128_bit_accesses(compiled, kernel):
    sass, _ = compiled
    fragment, writes = HOT[kernel]
    bodies = [b for n, b in _functions(sass).items() if fragment in n]
    assert len(bodies) == 1, f"{kernel}: {len(bodies)} functions match {fragment}"
    body = bodies[0]
    assert re.search(r"\bLDG\.E(\.[A-Z0-9_]+)*\.128\b", body), f"{kernel}: no 128-bit load"
    if writes:
        assert re.search(r"\bSTG\.E(\.[A-Z0-9_]+)*\.128\b", body), f"{kernel}: no 128-bit store"


def test_no_hot_kernel_spills_registers(compiled):
    _, report = compiled
    kernels = _ptxas(report)
    assert len(kernels) >= len(HOT), report[-2000:]
    spilling = {n: r for n, r in kernels.items() if r[1] != 0}
    assert not spilling, spilling
    # Printed for docs/cuda.md (pytest -s): registers per thread of every hot kernel.
    for kernel, (fragment, _) in HOT.items():
        regs = [r for n, (r, _) in kernels.items() if fragment in n]
        print(f"{kernel}: {regs[0] if regs else '?'} registers, 0 spills")


def test_the_kernel_variant_benchmark_compiles(tmp_path):
    """benchmarks/cuda/accumulate_variants.cu (run on GPU machines by
    tools/gpu_accumulate_variants.sh) includes the library's launch code: a change there that
    breaks it fails here, not on a lease. Two of the (chunk, unroll) pairs the script builds
    compile: its first chunk with its last unroll, and its last chunk with its first (the
    extremes of both)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    src = ROOT / "benchmarks" / "cuda" / "accumulate_variants.cu"
    script = (ROOT / "tools" / "gpu_accumulate_variants.sh").read_text()
    chunks = re.search(r"^chunks=\(([\d ]+)\)", script, re.M).group(1).split()
    unrolls = re.search(r"^unrolls=\(([\d ]+)\)", script, re.M).group(1).split()
    assert "16384" in chunks and "1" in unrolls  # the library's defaults are among them
    for chunk, unroll in [(chunks[0], unrolls[-1]), (chunks[-1], unrolls[0])]:
        proc = subprocess.run(
            [nvcc, *FLAGS, f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'core'}"]
            + [f"-DGA_CUDA_CHUNK={chunk}", f"-DGA_CUDA_ACCUMULATE_UNROLL={unroll}"]
            + ["-c", str(src), "-o", str(tmp_path / f"av-{chunk}-{unroll}.o")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
