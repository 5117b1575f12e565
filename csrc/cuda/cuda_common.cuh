// Small device helpers shared by the CUDA kernels of this extension.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <utility>

namespace sglang_dflash::cuda {

// A failed device-side check stops the kernel with a trap (the launch then fails with an
// unspecified launch failure, like a device assert), so an out-of-range index never turns into
// a read of wild memory. Independent of NDEBUG, unlike assert().
#define SGLD_DEVICE_CHECK(cond, msg)                                         \
  do {                                                                      \
    if (__builtin_expect(!(cond), 0)) {                                     \
      printf("sglang_dflash device check failed: %s (%s:%d)\n", msg, __FILE__, __LINE__); \
      __trap();                                                             \
    }                                                                       \
  } while (0)

// Index tensors may be int32 or int64; the kernels take them as untyped pointers plus a flag,
// so one kernel instantiation serves both (the branch is uniform across the grid).
__device__ __forceinline__ int64_t read_index(const void* ptr, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(ptr)[i]
              : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[i]);
}

// Argmax reductions: the larger value wins, the lower index on equal values; NaN never enters
// (callers skip it).
struct Best {
  float value;
  int index;  // INT_MAX: none yet
};

__device__ __forceinline__ void consider(Best& b, float value, int index) {
  if (value > b.value || (value == b.value && index < b.index)) {
    b.value = value;
    b.index = index;
  }
}

// Block-wide best with a fixed combination order (lanes by shuffle, then warps 0..kWarps-1), so it
// is deterministic for a fixed block size; `slots` is kWarps entries of shared memory. Every
// thread gets the result.
template <int kWarps>
__device__ Best block_best(Best b, Best* slots) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, b.value, off);
    const int i = __shfl_xor_sync(0xffffffffu, b.index, off);
    consider(b, v, i);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) slots[warp] = b;
  __syncthreads();
  Best r = slots[0];
  for (int w = 1; w < kWarps; ++w) consider(r, slots[w].value, slots[w].index);
  __syncthreads();
  return r;
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Raises a kernel's dynamic shared-memory limit to `bytes` on the current device, once per
// (kernel, device), so after a warm-up call it never runs inside a CUDA-graph capture.
inline void allow_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device})) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  done.insert({kernel, device});
}

}  // namespace sglang_dflash::cuda
