// gumbel_argmax on the CPU: per row r, argmax_j (scores[r, j] + g(ids[j])) with g the Gumbel
// noise verify_block draws for token ids[j] in verify row rows[r] of the request whose sampling
// offset is offsets[r] (sampling.h). A drafter that picks its tokens this way proposes, at
// temperature > 0, the very token the target will sample whenever both distributions agree on it
// under that noise, instead of its argmax, which only matches the target's sample with the
// target's probability of that token.
//
// The search is gumbel_max.h's (the same as verify_block's sampler; results are exact).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"
#include "gumbel_max.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/sampling.h"

namespace sglang_dflash::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;

// Lowest index of the largest non-NaN value (-inf counts), 0 if every value is NaN. Each lane
// keeps its running max and the first index where it occurred (exact in fp32 below 2^24, so the
// vector loop stops there), then the lanes merge.
int64_t first_max_ignoring_nan(const float* x, int64_t n) {
  constexpr int64_t W = Vec::size();
  float top = -INFINITY;
  int64_t top_id = -1, j = 0;
  if (n >= W) {
    float lane_max[W], lane_idx[W];
    Vec vmax(-INFINITY), vidx(INFINITY), cur = Vec::arange(0.0f, 1.0f);
    const Vec step(static_cast<float>(W));
    for (; j + W <= std::min<int64_t>(n, int64_t{1} << 24); j += W, cur += step) {
      const Vec xv = Vec::loadu(x + j);
      // -inf is taken by the first index that holds it, as any larger value is.
      const Vec better = (xv > vmax) | ((xv == vmax) & (vidx == Vec(INFINITY)));
      vmax = Vec::blendv(vmax, xv, better);
      vidx = Vec::blendv(vidx, cur, better);
    }
    vmax.store(lane_max);
    vidx.store(lane_idx);
    for (int64_t lane = 0; lane < W; ++lane) {
      if (lane_idx[lane] == INFINITY) continue;
      const auto id = static_cast<int64_t>(lane_idx[lane]);
      if (top_id < 0 || lane_max[lane] > top || (lane_max[lane] == top && id < top_id)) {
        top = lane_max[lane];
        top_id = id;
      }
    }
  }
  for (; j < n; ++j) {
    if (x[j] > top || (top_id < 0 && x[j] == top)) {
      top = x[j];
      top_id = j;
    }
  }
  return std::max<int64_t>(top_id, 0);
}

int64_t row_gumbel_argmax(const float* x, const int64_t* ids, int64_t n, const NoiseKey& key) {
  // Seed the search with the largest score so the pruning bound is tight from the start.
  const int64_t top = first_max_ignoring_nan(x, n);
  const int64_t top_id = ids == nullptr ? top : ids[top];
  uint32_t lanes[4];
  philox_lanes4(key.seed, key.offset, key.row, static_cast<uint32_t>(top_id / 4), lanes);
  GumbelMax search{-INFINITY, x[top] + gumbel_from_bits(lanes[top_id % 4]), top};
  if (ids == nullptr) {
    search.run(x, 1.0f, n, key);
  } else {
    search.run(x, ids, n, key);
  }
  return search.best_id;
}

template <typename scalar_t>
void gumbel_argmax_rows(const scalar_t* x, int64_t stride, int64_t rows, int64_t cols,
                        const int64_t* ids, uint64_t seed, const int64_t* offsets,
                        const int64_t* row_ids, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<scalar_t, float> ? 0 : cols);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* src = x + r * stride;
      const float* row_x;
      if constexpr (std::is_same_v<scalar_t, float>) {
        row_x = src;
      } else {
        for (int64_t j = 0; j < cols; ++j) buf[j] = static_cast<float>(src[j]);
        row_x = buf.data();
      }
      out[r] = row_gumbel_argmax(
          row_x, ids, cols, {seed, static_cast<uint64_t>(offsets[r]), static_cast<uint32_t>(row_ids[r])});
    }
  });
}

}  // namespace

at::Tensor gumbel_argmax(const at::Tensor& scores, const std::optional<at::Tensor>& ids_in, int64_t seed,
                         const at::Tensor& offsets_in, const at::Tensor& rows_in) {
  const auto shape = check_gumbel_argmax_args(scores, ids_in, offsets_in, rows_in);
  check_gumbel_argmax_values(ids_in, rows_in);
  at::Tensor out = at::empty({shape.rows}, scores.options().dtype(at::kLong));
  const at::Tensor ids = ids_in.has_value() ? ids_in->contiguous() : at::Tensor();
  const at::Tensor offsets = offsets_in.contiguous(), rows = rows_in.contiguous();
  const int64_t* id = ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr;
  const int64_t* offset = offsets.const_data_ptr<int64_t>();
  const int64_t* row = rows.const_data_ptr<int64_t>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  const int64_t stride = scores.stride(0);
  SGLD_DISPATCH_FLOAT_TYPES(scores.scalar_type(), "gumbel_argmax", [&] {
    gumbel_argmax_rows(scores.const_data_ptr<scalar_t>(), stride, shape.rows, shape.cols, id,
                       static_cast<uint64_t>(seed), offset, row, o);
  });
  return out;
}

}  // namespace sglang_dflash::cpu
