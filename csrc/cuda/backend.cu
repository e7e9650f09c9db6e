// The CUDA state shared by every op family (errors, SM counts, the scratch memory pool) and the
// device queries of cuda.h.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "../core/internal.h"
#include "gradient_accumulator/cuda.h"

namespace ga {
namespace cuda {

namespace {

std::string cuda_version(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// Errors that say the kernels cannot run on this machine at all, whatever the call.
bool is_setup_error(cudaError_t e) {
  return e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
         e == cudaErrorInitializationError || e == cudaErrorSystemDriverMismatch ||
         e == cudaErrorCompatNotSupportedOnDevice || e == cudaErrorDevicesUnavailable;
}

}  // namespace

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a sticky launch error so that the next call starts clean
    std::string message = std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e);
    if (is_setup_error(e)) {
      // Say why in the words of ga_cuda_probe: no driver, a driver too old, no device.
      ga_cuda_probe_result probe;
      ga_cuda_probe(&probe);
      message += std::string(" -- the CUDA kernels cannot run here: ") + probe.reason;
    } else if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorUnsupportedPtxVersion) {
      message += " -- this build has kernels for " GA_CUDA_ARCHITECTURES_STRING
                 "; build from source for this GPU (GA_CUDA=ON CUDAARCHS=native pip install "
                 "--no-binary gradient-accumulator gradient-accumulator)";
    }
    detail::fail(kGaRuntimeError, "", message);
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

void ga_cuda_probe(ga_cuda_probe_result* result) {
  if (result == nullptr) return;
  ga_cuda_probe_result r{};
  r.runtime_version = CUDART_VERSION;
  // 0 when no driver is installed; cudaDriverGetVersion does not fail for that.
  if (cudaDriverGetVersion(&r.driver_version) != cudaSuccess) r.driver_version = 0;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  const std::string runtime = "CUDA " + ga::cuda::cuda_version(r.runtime_version);
  const std::string driver = "CUDA " + ga::cuda::cuda_version(r.driver_version);
  std::string reason;
  if (e == cudaSuccess && n > 0) {
    r.code = kGaCudaAvailable;
    r.device_count = n;
    reason = "ok: " + std::to_string(n) + (n == 1 ? " device" : " devices") + ", driver supports " +
             driver;
  } else if (r.driver_version == 0) {
    r.code = kGaCudaNoDriver;
    reason =
        "no NVIDIA driver found (libcuda.so could not be loaded; the CUDA kernels need a "
        "driver that supports " +
        runtime + ")";
  } else if (e == cudaErrorInsufficientDriver ||
             r.driver_version < r.runtime_version / 1000 * 1000) {
    r.code = kGaCudaDriverTooOld;
    reason = "driver too old for the " + runtime + " runtime (driver supports " + driver +
             "); update the NVIDIA driver";
  } else if (e == cudaSuccess || e == cudaErrorNoDevice) {
    r.code = kGaCudaNoDevice;
    reason = "no CUDA device (driver supports " + driver + ")";
  } else {
    r.code = kGaCudaError;
    reason = std::string("the CUDA runtime failed to initialise: ") + cudaGetErrorName(e) + ": " +
             cudaGetErrorString(e);
  }
  std::snprintf(r.reason, sizeof(r.reason), "%s", reason.c_str());
  *result = r;
}

}  // extern "C"
