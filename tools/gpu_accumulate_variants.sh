#!/usr/bin/env bash
# The chunked kernels against their floors, variant by variant
# (benchmarks/cuda/accumulate_variants.cu: accumulate, sum of squares and the fused AdamW pass,
# each under the library's grid and the others): one build per (chunk, accumulate unroll) pair,
# compiled in parallel with the library's nvcc flags, each run on the local GPU; then Nsight
# Compute's throughput sections for the library's accumulate launch, where ncu can read the
# counters. About 2 minutes on 16 cores.
#
# Usage: tools/gpu_accumulate_variants.sh [--dry-run]
# Output: build/accumulate-variants/{variants-CHUNK-UNROLL.log,ncu.log} and one .tgz beside it
set -uo pipefail
cd "$(dirname "$0")/.."
chunks=(8192 16384 32768 65536)
unrolls=(1 2 4)
arch=${CUDAARCHS:-90}
out=build/accumulate-variants
src=benchmarks/cuda/accumulate_variants.cu
flags=(-O3 -std=c++17 --fmad=false --expt-relaxed-constexpr "-arch=sm_${arch}" -Icsrc/include
  -Icsrc/core -Xptxas -v)
if [ "${1:-}" = "--dry-run" ]; then
  for c in "${chunks[@]}"; do for u in "${unrolls[@]}"; do
    echo "nvcc ${flags[*]} -DGA_CUDA_CHUNK=$c -DGA_CUDA_ACCUMULATE_UNROLL=$u $src"
  done; done
  [ -e "$src" ] || { echo "missing: $src" >&2; exit 1; }
  exit 0
fi
mkdir -p "$out"
nvidia-smi -L | tee "$out/device.txt"
t0=$(date +%s)
for c in "${chunks[@]}"; do for u in "${unrolls[@]}"; do
  nvcc "${flags[@]}" -DGA_CUDA_CHUNK=$c -DGA_CUDA_ACCUMULATE_UNROLL=$u "$src" -o "$out/av-$c-$u" \
    >"$out/build-$c-$u.log" 2>&1 || echo "build failed: chunk $c, unroll $u" &
done; done
wait
echo "built in $(($(date +%s) - t0)) s"
status=0
for c in "${chunks[@]}"; do for u in "${unrolls[@]}"; do
  b=$out/av-$c-$u
  [ -x "$b" ] || { status=1; continue; }
  timeout 120 "$b" --repeats 30 >"$out/variants-$c-$u.log" 2>&1 || status=1
  echo "== chunk $c, unroll $u"
  grep -E "^(accumulate|sumsq|adamw|copy|==)|WRONG|error" "$out/variants-$c-$u.log"
done; done
if command -v ncu >/dev/null 2>&1; then
  timeout 120 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats -k regex:chunk_kernel "$out/av-16384-1" --ncu \
    >"$out/ncu.log" 2>&1 || echo "ncu failed (see $out/ncu.log)"
  grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Registers|L2 Hit|Mem Busy|Max Bandwidth" \
    "$out/ncu.log" | head -40
fi
echo "total $(($(date +%s) - t0)) s"
tar --exclude='av-*' -czf "$out.tgz" -C build accumulate-variants && echo "packed: $out.tgz"
exit $status
