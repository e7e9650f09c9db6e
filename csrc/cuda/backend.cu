// The CUDA state shared by every op family (errors, SM counts, the scratch memory pool) and the
// device queries of cuda.h.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "../core/internal.h"
#include "gradient_accumulator/cuda.h"

namespace ga {
namespace cuda {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a sticky launch error so that the next call starts clean
    detail::fail(kGaRuntimeError, "",
                 std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
  }
}

int sm_count(int device) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  cache[device] = sms;
  return sms;
}

/// The memory pool of the library's scratch memory on `device`: stream-ordered allocations
/// (cudaMallocFromPoolAsync / cudaFreeAsync), so every call gets scratch of its own without a
/// synchronisation, from any thread, and inside CUDA graph capture. Up to 64 MiB stays reserved
/// between calls, so steady-state steps do not map memory.
cudaMemPool_t scratch_pool(int device) {
  static std::mutex mu;
  static std::map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mu);
  auto it = pools.find(device);
  if (it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool;
  check(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate");
  uint64_t keep = uint64_t(64) << 20;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
        "cudaMemPoolSetAttribute");
  pools[device] = pool;
  return pool;
}

}  // namespace cuda
}  // namespace ga

extern "C" {

int ga_has_cuda(void) { return 1; }

int ga_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // extern "C"
