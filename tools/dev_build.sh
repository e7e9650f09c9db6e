#!/usr/bin/env bash
# Developer build: compile the core and the _C module in build/dev and drop the module into the
# source tree, so `python -c "import gradient_accumulator"` works from the checkout.
# Usage: tools/dev_build.sh [extra cmake -D options]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build/dev"
# (A redirection on `exec` itself would apply to the rest of the script: make the folder first.)
mkdir -p "$root/build"
exec 9>"$root/build/.dev_build.lock"
flock 9
# Configure quietly, but show CMake's output when it fails (a missing pybind11 or GoogleTest).
if ! out=$(cmake -S "$root" -B "$build" -G Ninja -DGA_BUILD_PYTHON=ON -DGA_BUILD_TESTS=ON \
  -DGA_CUDA=OFF -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
  -DPython_EXECUTABLE="$(command -v python3)" "$@" 2>&1); then
  echo "$out" >&2
  echo "tools/dev_build.sh: CMake failed (pybind11 in this environment and libgtest-dev are needed; -DGA_BUILD_TESTS=OFF skips GoogleTest)" >&2
  exit 1
fi
cmake --build "$build" -j "$(nproc)"
cp "$build"/_C*.so "$root/gradient_accumulator/"
echo "built: $(ls "$build"/_C*.so)"
