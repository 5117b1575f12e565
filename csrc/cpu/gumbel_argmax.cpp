// gumbel_argmax on the CPU: per row r, argmax_j (scores[r, j] + g(ids[j])) with g the Gumbel
// noise verify_block draws for token ids[j] in verify row rows[r] of the request whose sampling
// offset is offsets[r] (sampling.h). A drafter that picks its tokens this way proposes, at
// temperature > 0, the very token the target will sample whenever both distributions agree on it
// under that noise, instead of its argmax, which only matches the target's sample with the
// target's probability of that token.
//
// Noise is drawn only where it can matter: a column whose score is more than the largest possible
// noise below the best score so far cannot win, and one whose cheap noise bound cannot reach the
// best skips the two double logs (the same pruning as verify_block's sampler; results are exact).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/sampling.h"

namespace sglang_dflash::cpu {
namespace {

template <typename scalar_t>
int64_t row_gumbel_argmax(const scalar_t* x, const int64_t* ids, int64_t n, uint64_t seed, uint64_t offset,
                          uint32_t row) {
  auto id_of = [&](int64_t j) { return ids == nullptr ? j : ids[j]; };
  auto noise_bits = [&](int64_t j) {
    uint32_t lanes[4];
    const int64_t id = id_of(j);
    philox_lanes4(seed, offset, row, static_cast<uint32_t>(id / 4), lanes);
    return lanes[id % 4];
  };
  // Seed the search with the largest score (first of ties, never NaN) so the pruning bound is
  // tight from the start.
  int64_t best_j = 0;
  float top = -INFINITY;
  bool found = false;
  for (int64_t j = 0; j < n; ++j) {
    const float s = static_cast<float>(x[j]);
    if (s > top || (!found && s == top)) {
      top = s;
      best_j = j;
      found = true;
    }
  }
  float best = static_cast<float>(x[best_j]) + gumbel_from_bits(noise_bits(best_j));
  for (int64_t j = 0; j < n; ++j) {
    const float s = static_cast<float>(x[j]);
    if (s + kMaxGumbelNoise < best) continue;
    const uint32_t bits = noise_bits(j);
    if (s + gumbel_upper_bound(bits) < best) continue;
    const float score = s + gumbel_from_bits(bits);
    if (score > best || (score == best && j < best_j)) {
      best = score;
      best_j = j;
    }
  }
  return best_j;
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
    const scalar_t* x = scores.const_data_ptr<scalar_t>();
    at::parallel_for(0, shape.rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        o[r] = row_gumbel_argmax(x + r * stride, id, shape.cols, static_cast<uint64_t>(seed),
                                 static_cast<uint64_t>(offset[r]), static_cast<uint32_t>(row[r]));
      }
    });
  });
  return out;
}

}  // namespace sglang_dflash::cpu
