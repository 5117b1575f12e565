// Small device helpers shared by the CUDA kernels of this extension.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <utility>

#include "sglang_dflash/index_errors.h"

namespace sglang_dflash::cuda {

// The device's error record (device_errors.cu), where a kernel's failed index check goes (the first
// failure since the last check_device_errors wins). Allocated on the device's first call, so, like
// allow_dynamic_smem, after a warm-up call it is never allocated inside a CUDA-graph capture.
IndexError* device_error_record(int device);

#if defined(SGLANG_DFLASH_DEVICE_TRAP)
// Debug builds: the failing thread that recorded the error prints its text.
__device__ inline void print_index_error(const IndexError& e) {
  switch (static_cast<IndexCheck>(e.check)) {
#define SGLD_PRINT_INDEX_ERROR(name, op, format, ...)                                           \
  case IndexCheck::name:                                                                         \
    printf("sglang_dflash device check failed: sglang_dflash." op ": " format "\n", __VA_ARGS__); \
    break;
    SGLD_INDEX_CHECKS(SGLD_PRINT_INDEX_ERROR)
#undef SGLD_PRINT_INDEX_ERROR
    default:
      break;
  }
}
#endif

// A kernel's check of index `value` (element [i] or [i, j] of its tensor, `bound` as the message
// names it). Returns `ok`. On failure it records the error in `record` and the caller skips what
// the index would address, so no memory outside the inputs is touched and the CUDA context survives
// (a trap would end it, and with it the server); the host raises the error at its next
// check_device_errors. Debug builds (SGLANG_DFLASH_DEBUG=1 defines SGLANG_DFLASH_DEVICE_TRAP) print
// it and trap instead, stopping in the faulting kernel for compute-sanitizer / cuda-gdb.
__device__ __forceinline__ bool index_ok(bool ok, IndexError* record, IndexCheck check, int64_t i,
                                         int64_t j, int64_t value, int64_t bound) {
  if (__builtin_expect(ok, 1)) return true;
  if (atomicCAS(&record->check, 0, static_cast<int32_t>(check)) == 0) {
    record->i = i;
    record->j = j;
    record->value = value;
    record->bound = bound;
#if defined(SGLANG_DFLASH_DEVICE_TRAP)
    print_index_error(*record);
#endif
  }
#if defined(SGLANG_DFLASH_DEVICE_TRAP)
  __trap();
#endif
  return false;
}

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
