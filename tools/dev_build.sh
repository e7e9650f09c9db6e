#!/usr/bin/env bash
# Developer build: compile the core and the _C module in build/dev and drop the module into the
# source tree, so `python -c "import gradient_accumulator"` works from the checkout.
# Usage: tools/dev_build.sh [extra cmake -D options]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build/dev"
exec 9>"$root/build/.dev_build.lock" 2>/dev/null || { mkdir -p "$root/build"; exec 9>"$root/build/.dev_build.lock"; }
flock 9
cmake -S "$root" -B "$build" -G Ninja -DGA_BUILD_PYTHON=ON -DGA_BUILD_TESTS=ON -DGA_CUDA=OFF \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" "$@" >/dev/null
cmake --build "$build" -j "$(nproc)"
cp "$build"/_C*.so "$root/gradient_accumulator/"
echo "built: $(ls "$build"/_C*.so)"
