// CUDA tree verification from the target's token ids (docs/design.md §3.3), the same checks and walk as
// csrc/cpu/verify_tree.cpp (accept.h). One thread per request: a tree has tens of nodes and its walk
// is a chain of dependent reads, so there is nothing to share among threads. A tree that breaks a
// rule is recorded for check_device_errors (checking it on the host would cost a device sync); the
// walk addresses only the request's own nodes whatever the values, so it still runs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_common.cuh"
#include "sglang_dflash/accept.h"
#include "sglang_dflash/checks.h"

namespace sglang_dflash::cuda {
namespace {

struct TreeArgs {
  const int64_t* tokens;  // [bs, N]
  const void* parents;    // [bs, N] int32 or int64
  bool parents64;
  const int64_t* depths;  // [bs, N]
  const void* target;     // [bs * N] int32 or int64
  bool target64;
  int64_t batch, nodes;
  int32_t* accept_len;  // [bs]
  int64_t* path;        // [bs, N]
  int64_t* out_tokens;  // [bs, N]
  IndexError* errors;
};

__global__ void verify_tree_kernel(const TreeArgs a) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.batch) return;
  const int64_t row = b * a.nodes;
  const auto parent = [&](int64_t i) { return read_index(a.parents, a.parents64, row + i); };
  for (int64_t i = 0; i < a.nodes; ++i) {
    const IndexError e = check_tree_node(parent, a.depths + row, b, i);
    if (!index_ok(e.check == static_cast<int32_t>(IndexCheck::kNone), a.errors, static_cast<IndexCheck>(e.check),
                  e.i, e.j, e.value, e.bound)) {
      break;  // the first broken rule names the request's tree
    }
  }
  a.accept_len[b] = accept_tree(
      a.tokens + row, parent, a.nodes, [&](int64_t i) { return read_index(a.target, a.target64, row + i); },
      a.path + row, a.out_tokens + row);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_from_ids(const at::Tensor& tokens_in,
                                                                    const at::Tensor& parents_in,
                                                                    const at::Tensor& depths_in,
                                                                    const at::Tensor& target_ids) {
  const auto shape = check_verify_tree_args(tokens_in, parents_in, depths_in, target_ids);
  const c10::cuda::CUDAGuard guard(tokens_in.device());
  const auto tokens = tokens_in.contiguous();
  const auto parents = parents_in.contiguous();
  const auto depths = depths_in.contiguous();
  const auto ids = target_ids.contiguous();
  const auto opts = tokens.options();
  auto accept_len = at::empty({shape.batch}, opts.dtype(at::kInt));
  auto path = at::empty({shape.batch, shape.nodes}, opts);
  auto out_tokens = at::empty({shape.batch, shape.nodes}, opts);
  if (shape.batch == 0) return {accept_len, path, out_tokens};

  const TreeArgs a{tokens.data_ptr<int64_t>(), parents.data_ptr(), parents.scalar_type() == at::kLong,
                   depths.data_ptr<int64_t>(), ids.data_ptr(), ids.scalar_type() == at::kLong, shape.batch,
                   shape.nodes, accept_len.data_ptr<int32_t>(), path.data_ptr<int64_t>(),
                   out_tokens.data_ptr<int64_t>(), device_error_record(tokens.get_device())};
  constexpr int kThreads = 128;
  verify_tree_kernel<<<static_cast<unsigned>(ceil_div(shape.batch, kThreads)), kThreads, 0,
                       at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept_len, path, out_tokens};
}

}  // namespace sglang_dflash::cuda

TORCH_LIBRARY_IMPL(sglang_dflash, CUDA, m) {
  m.impl("verify_tree_from_ids", &sglang_dflash::cuda::verify_tree_from_ids);
}
