// The device error records of the CUDA kernels' index checks (cuda_common.cuh, index_ok) and the
// ops that read them.
//
// A bad index in a device tensor cannot be found on the host without a device sync per call, and a
// device-side trap would end the CUDA context, and with it every request of a server. So a kernel
// that finds one records it here (one record per device, the first failure since the last check),
// skips the work the index would address, and goes on; check_device_errors reads the record where
// the caller synchronizes anyway (the worker reading a step's results) and raises it as a Python
// RuntimeError, which a server can report for the step's requests.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMacros.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <mutex>

#include "cuda_common.cuh"

namespace sglang_dflash::cuda {
namespace {

std::array<std::atomic<IndexError*>, C10_COMPILE_TIME_MAX_GPUS> records{};
std::mutex allocation;

cudaStreamCaptureStatus capture_status(cudaStream_t stream) {
  cudaStreamCaptureStatus status;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status;
}

// Raises the error recorded on `device` since the last check (and clears it), if any. It reads the
// record on the device's current stream, so it sees the failures of the kernels queued there (or
// on streams that stream has synchronized with): one 32-byte copy and a sync of that stream.
void check_device(int device) {
  IndexError* record = records[device].load(std::memory_order_acquire);
  if (record == nullptr) return;  // no kernel of ours has run there
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  TORCH_CHECK(capture_status(stream) == cudaStreamCaptureStatusNone,
              "sglang_dflash.check_device_errors: cuda:", device,
              "'s current stream is capturing a CUDA graph; check after replaying it");
  IndexError found;
  C10_CUDA_CHECK(cudaMemcpyAsync(&found, record, sizeof found, cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (found.check == static_cast<int32_t>(IndexCheck::kNone)) return;
  C10_CUDA_CHECK(cudaMemsetAsync(record, 0, sizeof *record, stream));
  TORCH_CHECK(false, describe(found), " (found on cuda:", device,
              " by a kernel that ran before this check; that call's outputs are not valid)");
}

// device < 0: every device our kernels have run on.
void check_device_errors(int64_t device) {
  TORCH_CHECK(device < C10_COMPILE_TIME_MAX_GPUS, "sglang_dflash.check_device_errors: no device cuda:", device);
  if (device >= 0) return check_device(static_cast<int>(device));
  for (int d = 0; d < C10_COMPILE_TIME_MAX_GPUS; ++d) check_device(d);
}

}  // namespace

IndexError* device_error_record(int device) {
  TORCH_CHECK(device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS, "sglang_dflash: no device cuda:", device);
  if (IndexError* record = records[device].load(std::memory_order_acquire)) return record;
  const std::lock_guard<std::mutex> lock(allocation);
  IndexError* record = records[device].load(std::memory_order_relaxed);
  if (record == nullptr) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    TORCH_CHECK(capture_status(at::cuda::getCurrentCUDAStream()) == cudaStreamCaptureStatusNone,
                "sglang_dflash: the first call of a kernel on cuda:", device,
                " is inside a CUDA-graph capture; run it once before capturing (a warm-up)");
    C10_CUDA_CHECK(cudaMalloc(&record, sizeof *record));  // for the process's lifetime
    C10_CUDA_CHECK(cudaMemset(record, 0, sizeof *record));
    C10_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any stream's kernel can use it
    records[device].store(record, std::memory_order_release);
  }
  return record;
}

}  // namespace sglang_dflash::cuda

TORCH_LIBRARY_FRAGMENT(sglang_dflash, m) {
  m.def("check_device_errors(int device=-1) -> ()", &sglang_dflash::cuda::check_device_errors);
  // Whether this build traps on a failed device check (SGLANG_DFLASH_DEBUG=1) instead of recording it.
  m.def("device_checks_trap() -> bool", [] {
#if defined(SGLANG_DFLASH_DEVICE_TRAP)
    return true;
#else
    return false;
#endif
  });
}
