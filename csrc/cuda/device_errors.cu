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
#include <string>
#include <tuple>

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

// Asynchronous reads, for a server step that must not wait on the host for us: a snapshot queues,
// on the device's current stream, a copy of the record into pinned host memory, the record's reset
// and an event; a later read of that snapshot looks at its event (without waiting, or waiting when
// the caller is about to wait for that stream anyway). A ring of slots per device, so a caller may
// hold a few unread snapshots (one per step in flight).
constexpr int kSnapshotSlots = 8;

struct Snapshots {
  IndexError* host = nullptr;  // kSnapshotSlots records, pinned
  std::array<cudaEvent_t, kSnapshotSlots> events{};
  std::array<bool, kSnapshotSlots> unread{};
  int next = 0;
};

std::array<Snapshots, C10_COMPILE_TIME_MAX_GPUS> snapshots;
std::mutex snapshot_lock;

// The slot holding the snapshot, or -1 where no kernel of ours has run on `device` (nothing can
// have been recorded there, so nothing is queued).
int64_t snapshot_device_errors(int64_t device) {
  TORCH_CHECK(device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS,
              "sglang_dflash.snapshot_device_errors: no device cuda:", device);
  IndexError* record = records[device].load(std::memory_order_acquire);
  if (record == nullptr) return -1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  TORCH_CHECK(capture_status(stream) == cudaStreamCaptureStatusNone, "sglang_dflash.snapshot_device_errors: cuda:",
              device, "'s current stream is capturing a CUDA graph; take the snapshot after replaying it");
  const std::lock_guard<std::mutex> lock(snapshot_lock);
  Snapshots& ring = snapshots[device];
  if (ring.host == nullptr) {
    C10_CUDA_CHECK(cudaHostAlloc(&ring.host, kSnapshotSlots * sizeof(IndexError), cudaHostAllocDefault));
    for (cudaEvent_t& event : ring.events) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  const int slot = ring.next;
  TORCH_CHECK(!ring.unread[slot], "sglang_dflash.snapshot_device_errors: all ", kSnapshotSlots,
              " snapshots of cuda:", device, " are unread; read one (read_device_error_snapshot) before taking more");
  C10_CUDA_CHECK(cudaMemcpyAsync(&ring.host[slot], record, sizeof *record, cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaMemsetAsync(record, 0, sizeof *record, stream));
  C10_CUDA_CHECK(cudaEventRecord(ring.events[slot], stream));
  ring.unread[slot] = true;
  ring.next = (slot + 1) % kSnapshotSlots;
  return slot;
}

// (ready, message) of a snapshot: ready is false while the kernels queued before it still run (and
// `wait` is false); message is empty when nothing was recorded, else the error's text. A ready
// snapshot's slot is free again.
std::tuple<bool, std::string> read_device_error_snapshot(int64_t device, int64_t slot, bool wait) {
  TORCH_CHECK(device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS,
              "sglang_dflash.read_device_error_snapshot: no device cuda:", device);
  TORCH_CHECK(slot >= 0 && slot < kSnapshotSlots, "sglang_dflash.read_device_error_snapshot: slot ", slot,
              " is not in [0, ", kSnapshotSlots, ")");
  cudaEvent_t event;
  {
    const std::lock_guard<std::mutex> lock(snapshot_lock);
    TORCH_CHECK(snapshots[device].unread[slot], "sglang_dflash.read_device_error_snapshot: cuda:", device,
                " has no unread snapshot in slot ", slot);
    event = snapshots[device].events[slot];
  }
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  if (wait) {
    C10_CUDA_CHECK(cudaEventSynchronize(event));
  } else {
    const cudaError_t state = cudaEventQuery(event);
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();  // a not-ready query is no error; keep it out of the next check
      return {false, std::string()};
    }
    C10_CUDA_CHECK(state);
  }
  const std::lock_guard<std::mutex> lock(snapshot_lock);
  Snapshots& ring = snapshots[device];
  const IndexError found = ring.host[slot];
  ring.unread[slot] = false;
  if (found.check == static_cast<int32_t>(IndexCheck::kNone)) return {true, std::string()};
  return {true, describe(found) + " (found on cuda:" + std::to_string(device) +
                    " by a kernel queued before this snapshot; that call's outputs are not valid)"};
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
  m.def("snapshot_device_errors(int device) -> int", &sglang_dflash::cuda::snapshot_device_errors);
  m.def("read_device_error_snapshot(int device, int slot, bool wait) -> (bool, str)",
        &sglang_dflash::cuda::read_device_error_snapshot);
  // Whether this build traps on a failed device check (SGLANG_DFLASH_DEBUG=1) instead of recording it.
  m.def("device_checks_trap() -> bool", [] {
#if defined(SGLANG_DFLASH_DEVICE_TRAP)
    return true;
#else
    return false;
#endif
  });
}
