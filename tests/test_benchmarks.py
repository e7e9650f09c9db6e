"""The PyTorch benchmark runs against the package under test and its cross-checks hold.

Benchmarks are timed by hand (never asserted here), but a script that no longer runs is a
benchmark nobody can reproduce: ``benchmarks/torch_step.py`` refused to start after
``accum_steps`` got its upper bound. The smallest configuration runs once here, and the
correctness lines it prints before timing anything are read back: after one and two cycles
ours agrees with torch's clip + fused AdamW and ``gradient_as_view`` with the default mode (1e-5
after one update, 1e-4 after two), and the fp32 accumulators hold the exact sum of bf16
gradients.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradient_accumulator

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_torch_step_runs_and_cross_checks():
    pytest.importorskip("torch")
    pkg_parent = str(Path(gradient_accumulator.__file__).resolve().parents[1])
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "torch_step.py"), "--small", "--repeats", "1"],
        env={**os.environ, "PYTHONPATH": pkg_parent},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCHMARKS.parent,
    )
    assert proc.returncode == 0, f"torch_step.py exited {proc.returncode}:\n{proc.stderr}"
    out = proc.stdout
    # The script's own bounds (see check_fp32_cycle): 1e-5 after one AdamW update, 1e-4 after
    # two (Adam's m/sqrt(v) amplifies fp32 rounding where two gradients nearly cancel).
    match = re.search(r"weights max rel diff (\S+) after one, (\S+) after two", out)
    assert match, out
    assert float(match.group(1)) <= 1e-5 and float(match.group(2)) <= 1e-4
    match = re.search(r"gradient_as_view vs default after two: (\S+)", out)
    assert match, out
    assert float(match.group(1)) <= 1e-4
    match = re.search(r"vs fp32 sum of the bf16 grads: max rel diff (\S+);", out)
    assert match, out
    assert float(match.group(1)) <= 1e-6


def test_fused_wgrad_runs_and_cross_checks():
    pytest.importorskip("torch")
    proc = _run_benchmark(str(BENCHMARKS / "fused_wgrad.py"), "--small")
    assert proc.returncode == 0, f"fused_wgrad.py exited {proc.returncode}:\n{proc.stderr}"
    diffs = [float(d) for d in re.findall(r"fused vs unfused: max rel diff (\S+)", proc.stdout)]
    assert len(diffs) == 4, proc.stdout  # fp32 and bf16, 1 and 2 threads
    assert max(diffs[:2]) <= 1e-6 and max(diffs[2:]) <= 1e-2, diffs
    for ratio in ("fused ÷ unfused", "fused ÷ torch .grad", "fused ÷ fresh"):
        assert ratio in proc.stdout
    proc = _run_benchmark(str(BENCHMARKS / "fused_wgrad.py"), "--small", "--sweep")
    assert proc.returncode == 0, f"fused_wgrad.py --sweep exited {proc.returncode}:\n{proc.stderr}"
    assert "(left unfused by default)" in proc.stdout


def _run_benchmark(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    pkg_parent = str(Path(gradient_accumulator.__file__).resolve().parents[1])
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "PYTHONPATH": pkg_parent},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCHMARKS.parent,
    )


@pytest.mark.parametrize("script", ["gpu_core.py", "gpu_profile.py", "gpu_e2e.py"])
def test_gpu_benchmarks_import_and_parse_their_arguments(script):
    # No GPU here: the scripts must still import (syntax, imports of cpu_core and the package)
    # and describe their options, so that they do not rot between GPU runs.
    pytest.importorskip("torch")
    proc = _run_benchmark(str(BENCHMARKS / script), "--help", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "--json" in proc.stdout


def test_gpu_e2e_recipes_agree_on_a_tiny_model_on_the_cpu():
    # The end-to-end benchmark's two recipes (naive accumulation and ours), one tiny GPT-2 on
    # the CPU: the same weights after two cycles, so the GPU timings compare equal work.
    pytest.importorskip("transformers")
    proc = _run_benchmark(str(BENCHMARKS / "gpu_e2e.py"), "--smoke")
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"ours vs naive after 2 cycles: max rel diff (\S+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(1)) <= 1e-5


def test_gpu_check_dry_run_lists_every_step_without_a_gpu():
    proc = subprocess.run(
        ["bash", str(BENCHMARKS.parent / "tools" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for step in (
        "GA_CUDA=ON",
        "tests/cuda",
        "KERAS_BACKEND=torch",
        "KERAS_BACKEND=jax",
        "memcheck",
        "racecheck",
        "gpu_accumulate_variants.sh",
        "gpu_core.py",
        "gpu_profile.py",
        "gpu_e2e.py",
        "ga_cuda_wgrad_tests",
        "gpu_wgrad.py",
    ):
        assert step in proc.stdout, (step, proc.stdout)


def test_gpu_check_of_a_wheel_installs_it_and_never_builds_or_imports_the_checkout():
    """``--wheel FILE``: the GPU machine checks the release wheel itself, not a source build."""
    proc = subprocess.run(
        [
            "bash",
            str(BENCHMARKS.parent / "tools" / "gpu_check.sh"),
            "--dry-run",
            "--wheel",
            "x.whl",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    steps = proc.stdout.splitlines()[1:]
    assert steps[0].split()[0] == "install" and "pip install --no-deps" in steps[0]
    assert "x.whl" in steps[0] and "dev_build" not in proc.stdout
    assert steps[1].split()[0] == "installed" and "cuda_status()" in steps[1]
    pytest_lines = [s for s in steps if "-m pytest" in s]
    assert len(pytest_lines) == 5 and all(" -P -m pytest" in s for s in pytest_lines)
    missing = subprocess.run(
        ["bash", str(BENCHMARKS.parent / "tools" / "gpu_check.sh"), "--wheel"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "--wheel needs a file" in missing.stderr


def test_keras_jax_executable_runs_and_counts_the_state_arrays():
    # The compiled-step benchmark (Keras on JAX) runs, and counts the arrays each step carries:
    # the digits-sized MLP's 4 weights, 2 metric totals and the optimizer's state. Plain Adam
    # has 10 of its own; the built-in accumulation 4 more accumulators; the wrapper its
    # iteration counter, the 2 packed vectors and 1 flat accumulator beside Adam's (30 in all
    # before the packing of its scalars, 23 with one accumulator per variable).
    pytest.importorskip("jax")
    pytest.importorskip("keras")
    proc = _run_benchmark(
        str(BENCHMARKS / "keras_jax_executable.py"), "--k", "4", "--steps", "3", "--repeats", "1"
    )
    assert proc.returncode == 0, proc.stderr
    arrays = {
        m.group(1).strip(): int(m.group(2))
        for m in re.finditer(
            r"^(plain Adam|built-in|GradientAccumulateOptimizer)\s+(\d+)\s", proc.stdout, re.M
        )
    }
    assert arrays == {
        "plain Adam": 16,
        "built-in": 20,
        "GradientAccumulateOptimizer": 20,
    }, proc.stdout


def test_keras_tf_phases_runs_and_every_variant_matches_the_built_in():
    # The per-phase TensorFlow benchmark runs its four implementations on a tiny MLP, and after
    # the same steps on the same batches each one's weights are bit-identical to the built-in
    # accumulation's (the elementwise check, the summed one and no check give one result).
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    proc = _run_benchmark(
        str(BENCHMARKS / "keras_tf_phases.py"),
        *("--k", "4", "--repeats", "1", "--features", "16", "--width", "32", "--depth", "1"),
    )
    assert proc.returncode == 0, proc.stderr
    rows = {
        m.group(1).strip(): float(m.group(2))
        for m in re.finditer(
            r"^(built-in|GradientAccumulateOptimizer|elementwise check|no check)\s.*\s(\S+)$",
            proc.stdout,
            re.M,
        )
    }
    assert rows == {
        "built-in": 0.0,
        "GradientAccumulateOptimizer": 0.0,
        "elementwise check": 0.0,
        "no check": 0.0,
    }, proc.stdout
