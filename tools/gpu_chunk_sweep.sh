#!/usr/bin/env bash
# Where the accumulate kernel's time goes, one knob at a time: the CUDA chunk size (elements per
# block's unit of work, GA_CUDA_CHUNK). For each size, build the module with it and run
# benchmarks/gpu_profile.py (kernel time against the copy-bandwidth floor, per call). The default
# build is restored at the end. About 1 minute per size on 16 cores.
#
# Usage: tools/gpu_chunk_sweep.sh [SIZE ...]   (default: 16384 32768 65536)
# Output: build/chunk-sweep/profile-SIZE.{log,json} and one build/chunk-sweep.tgz
set -uo pipefail
cd "$(dirname "$0")/.."
sizes=("$@")
[ ${#sizes[@]} -eq 0 ] && sizes=(16384 32768 65536)
py=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
jobs=$(nproc 2>/dev/null || echo 4)
arch=${CUDAARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')}
out=build/chunk-sweep
mkdir -p "$out"
build() {
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs bash tools/dev_build.sh -DGA_CUDA=ON -DGA_BUILD_TESTS=OFF \
    "-DCMAKE_CUDA_ARCHITECTURES=${arch}-real" "-DCMAKE_CUDA_FLAGS=$1"
}
status=0
for n in "${sizes[@]}"; do
  echo "== chunk $n"
  if ! build "-DGA_CUDA_CHUNK=$n" >"$out/build-$n.log" 2>&1; then
    echo "build failed (see $out/build-$n.log)"
    status=1
    continue
  fi
  timeout 300 $py benchmarks/gpu_profile.py --json "$out/profile-$n.json" >"$out/profile-$n.log" 2>&1 \
    || status=1
  grep -E "^== |^[a-z_]+ +\*" "$out/profile-$n.log" || true
done
build "" >"$out/build-default.log" 2>&1 || status=1
tar -czf "$out.tgz" -C build chunk-sweep && echo "packed: $out.tgz"
exit $status
