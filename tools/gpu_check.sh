#!/usr/bin/env bash
# Everything a GPU machine can check, in one command (about 7 minutes on 16 cores):
#   1. build the core with GA_CUDA=ON for the local GPU's architecture (CUDAARCHS, else read from
#      nvidia-smi) into build/dev, and drop the module into the source tree;
#   2. the GPU tests: tests/cuda, the CUDA dispatch and SASS tests; the fused weight-gradient
#      GEMM's GoogleTest cases (ga_cuda_wgrad_tests, against an fp64 reference) and its timing
#      beside torch.mm (benchmarks/gpu_wgrad.py);
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
# Usage: tools/gpu_check.sh [--dry-run] [--quick] [--full] [--wheel FILE]
#   --dry-run  print the commands and exit 0 (no GPU needed; CI runs this)
#   --wheel FILE  check a built wheel (the release's Linux wheel, carried to the GPU machine)
#              instead of a source build: step 1 installs it with pip (no dependencies: the
#              machine's torch stays), the checkout is not put on PYTHONPATH, pytest runs with
#              -P (the checkout's folder does not shadow the installed package), and a first
#              step fails unless the package imported is the wheel's, with its CUDA kernels
#   --quick    the 1.1M benchmark shapes only (the end-to-end run stays at 124M)
#   --full     the end-to-end run adds the 1.3B configuration (about 2 minutes more)
# The GPU machines have no GoogleTest package: copy its sources here first and carry them
# (`cp -r /usr/src/googletest build/googletest-src`, carry build/googletest-src); the wgrad test
# step builds them (GA_GTEST_SOURCE_DIR) and is reported skipped when neither is there.
# Where pytest-xdist is installed, the Keras suites run in 4 processes (JAX without
# preallocating the GPU's memory). Last, the logs and JSON are packed into one $out.tgz, to be
# copied off a machine that returns few files.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
quick=0
full=0
wheel=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --quick) quick=1 ;;
    --full) full=1 ;;
    --wheel)
      [ $# -ge 2 ] || { echo "--wheel needs a file" >&2; exit 2; }
      wheel=$2
      shift
      ;;
    *) echo "unknown option: $1 (use --dry-run, --quick, --full, --wheel FILE)" >&2; exit 2 ;;
  esac
  shift
done
out=${GA_GPU_CHECK_OUT:-build/gpu-check}
py=${PYTHON:-python3}  # the interpreter tools/dev_build.sh builds the module for
pytest_py=$py
if [ -z "$wheel" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  [ $dry -eq 1 ] || [ -f "$wheel" ] || { echo "no such wheel: $wheel" >&2; exit 2; }
  pytest_py="$py -P"  # Python >= 3.11: the current folder is not put first on sys.path
fi
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

# cuBLASLt for the fused weight-gradient GEMM (csrc/cuda/wgrad.cu): cublasLt.h for the build when the
# toolkit has none, and the library for the tests, both from the NVIDIA wheels torch installed
# (site-packages/nvidia/cu13 or nvidia/cublas), where their major version is nvcc's.
if [ $dry -eq 0 ] && command -v nvcc >/dev/null 2>&1; then
  cuda_major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  lt_dirs=$($py -c "import nvidia, os; print(' '.join(os.path.join(p, d) for p in nvidia.__path__ for d in os.listdir(p)))" 2>/dev/null || true)
  for d in $lt_dirs; do
    if [ -e "$d/lib/libcublasLt.so.$cuda_major" ]; then
      export GA_CUBLASLT_PATH=${GA_CUBLASLT_PATH:-$d/lib/libcublasLt.so.$cuda_major}
      [ -e "$d/include/cublasLt.h" ] && export GA_CUBLASLT_INCLUDE_DIR=${GA_CUBLASLT_INCLUDE_DIR:-$d/include}
    fi
  done
  echo "cuBLASLt: headers ${GA_CUBLASLT_INCLUDE_DIR:-from the toolkit}, library ${GA_CUBLASLT_PATH:-by soname}"
  export GA_REQUIRE_CUBLASLT=1  # the GEMM's GoogleTest cases fail, not skip, without it
fi
gtest_src=""
[ -f build/googletest-src/CMakeLists.txt ] && gtest_src="-DGA_GTEST_SOURCE_DIR=$PWD/build/googletest-src"

# name | time limit (s) | command
if [ -z "$wheel" ]; then
  build="build|300|GA_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$jobs bash tools/dev_build.sh -DGA_CUDA=ON -DGA_BUILD_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=${arch}-real"
  installed=""
else
  build="install|300|$py -m pip install --no-deps --force-reinstall $wheel"
  # The package imported from outside the checkout is the wheel's, and it can run its kernels.
  installed="installed|60|cd /tmp && $py -c 'import gradient_accumulator as g, gradient_accumulator.core as c, sys; s = c.cuda_status(); print(g.__file__, s); sys.exit(0 if c.has_cuda() and s.available and \"$PWD\" not in g.__file__ else 1)'"
fi
steps=(
  "$build"
  ${installed:+"$installed"}
  "gpu-tests|300|$pytest_py -m pytest -q $per_test tests/cuda tests/test_core_cuda_dispatch.py tests/test_cuda_sass.py tests/test_core_cuda_status.py"
  "wgrad-test|300|cmake -S . -B build/dev -DGA_BUILD_TESTS=ON $gtest_src >/dev/null && cmake --build build/dev --target ga_cuda_wgrad_tests -j $jobs && build/dev/ga_cuda_wgrad_tests"
  "wgrad-bench|300|$py benchmarks/gpu_wgrad.py --json $out/gpu_wgrad.json"
  "gpu-core|600|$py benchmarks/gpu_core.py $bench_small --json $out/gpu_core.json"
  "gpu-profile|600|$py benchmarks/gpu_profile.py $bench_small --json $out/gpu_profile.json"
  "variants|300|CUDAARCHS=$arch bash tools/gpu_accumulate_variants.sh && cp build/accumulate-variants.tgz $out/"
  "gpu-e2e|600|$py benchmarks/gpu_e2e.py $e2e_only --json $out/gpu_e2e.json"
  "keras-torch|300|KERAS_BACKEND=torch $pytest_py -m pytest -q $parallel $per_test $keras_files"
  "keras-jax|300|KERAS_BACKEND=jax XLA_PYTHON_CLIENT_PREALLOCATE=false $pytest_py -m pytest -q $parallel $per_test $keras_files"
  "memcheck|600|compute-sanitizer --tool memcheck --error-exitcode 1 $pytest_py -m pytest -q -p no:cacheprovider tests/cuda"
  "racecheck|600|compute-sanitizer --tool racecheck --error-exitcode 1 $pytest_py -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_ops.py"
)

if [ $dry -eq 1 ]; then
  echo "gpu_check (dry run): CUDA architecture $arch, logs in $out/${wheel:+, wheel $wheel}"
  for s in "${steps[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    printf '  %-12s (<= %3ss) %s\n' "$name" "$limit" "$cmd"
  done
  # What the steps name must exist: a renamed test or benchmark fails here, in CI, not on a GPU.
  missing=0
  for f in tools/dev_build.sh tests/cuda tests/test_core_cuda_dispatch.py tests/test_cuda_sass.py \
    tests/test_core_cuda_status.py \
    $keras_files benchmarks/gpu_core.py benchmarks/gpu_profile.py benchmarks/gpu_e2e.py \
    tools/gpu_accumulate_variants.sh benchmarks/cuda/accumulate_variants.cu \
    benchmarks/gpu_wgrad.py csrc/tests/cuda_wgrad_test.cc; do
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
    wgrad-test)
      if [ -z "$gtest_src" ] && [ ! -f /usr/include/gtest/gtest.h ]; then
        summary+=("$(printf '%-12s skipped: no GoogleTest (carry build/googletest-src)' "$name")")
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
  line=$(grep -E "passed|failed|PASSED|FAILED|ERROR SUMMARY|RACECHECK SUMMARY|built:" "$out/$name.log" | tail -1)
  summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$dt" "$line")")
  if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; fi
  case "$name" in build | install | installed) [ $rc -eq 0 ] || break ;; esac
done
echo
echo "== gpu_check summary ($(($(date +%s) - t_all)) s, logs in $out/)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
tar -czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed: $out.tgz"
exit $status
