#!/usr/bin/env bash
# Everything a GPU machine can check, in one command (about 7 minutes on 16 cores):
#   1. build the core with GA_CUDA=ON for the local GPU's architecture (CUDAARCHS, else read from
#      nvidia-smi) into build/dev, and drop the module into the source tree;
#   2. the GPU tests: tests/cuda, the CUDA dispatch and SASS tests;
#   3. benchmarks/gpu_core.py, gpu_profile.py, the kernel variants
#      (tools/gpu_accumulate_variants.sh) and gpu_e2e.py;
#   4. the Keras GPU subset on the torch and JAX backends;
#   5. compute-sanitizer memcheck (tests/cuda) and racecheck (the op tests).
# The figures come before the slow checks, so that a lease that ends early still brings them back.
# Where pytest-timeout is installed each test gets a time limit, so that a stuck test is named and
# the rest of its step still runs. The checkout is put on PYTHONPATH for every step.
# Logs and JSON go to $GA_GPU_CHECK_OUT (default build/gpu-check); a summary is printed last, and
# the exit status is that of the first failing check (benchmarks fail only if they crash).
#
# Usage: tools/gpu_check.sh [--dry-run] [--quick] [--full]
#   --dry-run  print the commands and exit 0 (no GPU needed; CI runs this)
#   --quick    the 1.1M benchmark shapes only (the end-to-end run stays at 124M)
#   --full     the end-to-end run adds the 1.3B configuration (about 2 minutes more)
# Where pytest-xdist is installed, the Keras suites run in 4 processes (JAX without
# preallocating the GPU's memory). Last, the logs and JSON are packed into one $out.tgz, to be
# copied off a machine that returns few files.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
quick=0
full=0
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    --quick) quick=1 ;;
    --full) full=1 ;;
    *) echo "unknown option: $a (use --dry-run, --quick, --full)" >&2; exit 2 ;;
  esac
done
out=${GA_GPU_CHECK_OUT:-build/gpu-check}
py=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
per_test=""
if [ $dry -eq 1 ] || $py -c "import pytest_timeout" 2>/dev/null; then
  per_test="--timeout 90"
fi
jobs=$(nproc 2>/dev/null || echo 4)

if [ -n "${CUDAARCHS:-}" ]; then
  arch=$CUDAARCHS
elif [ $dry -eq 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
else
  arch=90  # what a dry run shows
fi

keras_files="tests/keras/test_keras_equivalence.py tests/keras/test_keras_model.py \
tests/keras/test_keras_batchnorm.py tests/keras/test_keras_mixed_precision.py \
tests/keras/test_keras_agc.py"
bench_small=""
e2e_only="--only 124m"
if [ $quick -eq 1 ]; then
  bench_small="--small"
fi
if [ $full -eq 1 ]; then
  e2e_only=""
fi
parallel=""
if [ $dry -eq 1 ] || $py -c "import xdist" 2>/dev/null; then
  parallel="-n 4 -p no:benchmark"  # pytest-benchmark warns under xdist: an error here
fi

# name | time limit (s) | command
steps=(
  "build|300|GA_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$jobs bash tools/dev_build.sh -DGA_CUDA=ON -DGA_BUILD_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=${arch}-real"
  "gpu-tests|300|$py -m pytest -q $per_test tests/cuda tests/test_core_cuda_dispatch.py tests/test_cuda_sass.py"
  "gpu-core|600|$py benchmarks/gpu_core.py $bench_small --json $out/gpu_core.json"
  "gpu-profile|600|$py benchmarks/gpu_profile.py $bench_small --json $out/gpu_profile.json"
  "variants|300|CUDAARCHS=$arch bash tools/gpu_accumulate_variants.sh && cp build/accumulate-variants.tgz $out/"
  "gpu-e2e|600|$py benchmarks/gpu_e2e.py $e2e_only --json $out/gpu_e2e.json"
  "keras-torch|300|KERAS_BACKEND=torch $py -m pytest -q $parallel $per_test $keras_files"
  "keras-jax|300|KERAS_BACKEND=jax XLA_PYTHON_CLIENT_PREALLOCATE=false $py -m pytest -q $parallel $per_test $keras_files"
  "memcheck|600|compute-sanitizer --tool memcheck --error-exitcode 1 $py -m pytest -q -p no:cacheprovider tests/cuda"
  "racecheck|600|compute-sanitizer --tool racecheck --error-exitcode 1 $py -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_ops.py"
)

if [ $dry -eq 1 ]; then
  echo "gpu_check (dry run): CUDA architecture $arch, logs in $out/"
  for s in "${steps[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    printf '  %-12s (<= %3ss) %s\n' "$name" "$limit" "$cmd"
  done
  # What the steps name must exist: a renamed test or benchmark fails here, in CI, not on a GPU.
  missing=0
  for f in tools/dev_build.sh tests/cuda tests/test_core_cuda_dispatch.py tests/test_cuda_sass.py \
    $keras_files benchmarks/gpu_core.py benchmarks/gpu_profile.py benchmarks/gpu_e2e.py \
    tools/gpu_accumulate_variants.sh benchmarks/cuda/accumulate_variants.cu; do
    [ -e "$f" ] || { echo "missing: $f" >&2; missing=1; }
  done
  exit $missing
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU visible (nvidia-smi): use --dry-run to see the steps" >&2
  exit 1
fi
mkdir -p "$out"
nvidia-smi -L | tee "$out/device.txt"
status=0
summary=()
t_all=$(date +%s)
for s in "${steps[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  case "$name" in
    memcheck | racecheck)
      if ! command -v compute-sanitizer >/dev/null 2>&1; then
        summary+=("$(printf '%-12s skipped: compute-sanitizer not found' "$name")")
        continue
      fi
      ;;
    keras-jax)
      if ! $py -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
        summary+=("$(printf '%-12s skipped: JAX has no GPU backend here' "$name")")
        continue
      fi
      ;;
  esac
  echo "== $name: $cmd"
  t0=$(date +%s)
  timeout "$limit" bash -c "$cmd" >"$out/$name.log" 2>&1
  rc=$?
  dt=$(($(date +%s) - t0))
  tail -25 "$out/$name.log"
  line=$(grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|built:" "$out/$name.log" | tail -1)
  summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$dt" "$line")")
  if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; fi
  if [ "$name" = build ] && [ $rc -ne 0 ]; then break; fi
done
echo
echo "== gpu_check summary ($(($(date +%s) - t_all)) s, logs in $out/)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
tar -czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed: $out.tgz"
exit $status
