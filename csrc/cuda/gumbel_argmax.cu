// gumbel_argmax on CUDA, the same semantics as csrc/cpu/gumbel_argmax.cpp: one CTA per row.
// Pass 1 reduces the row's max score (lowest column on ties); its exact noise seeds the best
// score. Pass 2 draws the noise of sampling.h only for columns that can still beat it and reduces
// argmax(score + noise), lowest column on ties. Both reductions have a fixed order, so the result
// is deterministic; against the CPU twin it differs only when the double log of the noise rounds
// differently and that decides a tie.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cmath>

#include "cuda_common.cuh"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/sampling.h"

namespace sglang_dflash::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t noise_bits(uint64_t seed, uint64_t offset, uint32_t row, int64_t id) {
  uint32_t lanes[4];
  philox_lanes4(seed, offset, row, static_cast<uint32_t>(id / 4), lanes);
  return lanes[id % 4];
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    gumbel_argmax_kernel(const scalar_t* scores, int64_t stride, int n, const int64_t* ids, uint64_t seed,
                         const int64_t* offsets, const int64_t* rows, int64_t* out, IndexError* errors) {
  __shared__ Best slots[kWarps];
  const int64_t r = blockIdx.x;
  const scalar_t* x = scores + r * stride;
  const uint64_t offset = static_cast<uint64_t>(offsets[r]);
  // Out-of-range rows / ids address no memory: recorded (raised by check_device_errors), they draw
  // the noise of the row's low 32 bits / of id 0 (a negative id would index past the Philox lanes).
  const int64_t row64 = rows[r];
  index_ok(row64 >= 0 && row64 < (int64_t{1} << 32), errors, IndexCheck::kGumbelRow, r, 0, row64, 0);
  const uint32_t row = static_cast<uint32_t>(row64);
  auto id_of = [&](int j) -> int64_t {
    const int64_t id = ids == nullptr ? j : ids[j];
    return index_ok(id >= 0 && id < (int64_t{1} << 34), errors, IndexCheck::kGumbelId, j, 0, id, 0) ? id : 0;
  };

  Best top{-INFINITY, INT_MAX};
  for (int j = threadIdx.x; j < n; j += kThreads) consider(top, static_cast<float>(x[j]), j);
  top = block_best<kWarps>(top, slots);
  if (top.index == INT_MAX) top.index = 0;  // every score -inf (or NaN): column 0, as on the CPU
  Best best{__fadd_rn(static_cast<float>(x[top.index]), gumbel_from_bits(noise_bits(seed, offset, row, id_of(top.index)))),
            top.index};
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const float s = static_cast<float>(x[j]);
    if (!(s + kMaxGumbelNoise >= best.value)) continue;
    const uint32_t bits = noise_bits(seed, offset, row, id_of(j));
    if (s + gumbel_upper_bound(bits) < best.value) continue;
    consider(best, __fadd_rn(s, gumbel_from_bits(bits)), j);
  }
  best = block_best<kWarps>(best, slots);
  if (threadIdx.x == 0) out[r] = best.index;
}

}  // namespace

at::Tensor gumbel_argmax(const at::Tensor& scores, const std::optional<at::Tensor>& ids_in, int64_t seed,
                         const at::Tensor& offsets_in, const at::Tensor& rows_in) {
  const auto shape = check_gumbel_argmax_args(scores, ids_in, offsets_in, rows_in);
  TORCH_CHECK_VALUE(shape.cols < INT_MAX, "sglang_dflash.gumbel_argmax: scores has ", shape.cols,
                    " columns, more than this kernel indexes (2^31 - 1)");
  const c10::cuda::CUDAGuard guard(scores.device());
  at::Tensor out = at::empty({shape.rows}, scores.options().dtype(at::kLong));
  if (shape.rows == 0) return out;
  const at::Tensor ids = ids_in.has_value() ? ids_in->contiguous() : at::Tensor();
  const at::Tensor offsets = offsets_in.contiguous(), rows = rows_in.contiguous();
  SGLD_DISPATCH_FLOAT_TYPES(scores.scalar_type(), "gumbel_argmax", [&] {
    gumbel_argmax_kernel<scalar_t><<<shape.rows, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        scores.const_data_ptr<scalar_t>(), scores.stride(0), static_cast<int>(shape.cols),
        ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr, static_cast<uint64_t>(seed),
        offsets.const_data_ptr<int64_t>(), rows.const_data_ptr<int64_t>(), out.mutable_data_ptr<int64_t>(),
        device_error_record(scores.get_device()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace sglang_dflash::cuda

TORCH_LIBRARY_IMPL(sglang_dflash, CUDA, m) { m.impl("gumbel_argmax", &sglang_dflash::cuda::gumbel_argmax); }
