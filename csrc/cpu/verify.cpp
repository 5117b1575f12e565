// CPU verification (DESIGN.md 3.2). One task per request. The target's token of row i is only
// needed while the drafts still agree, so rows are sampled lazily inside the accept scan and the
// logits of rows past the first disagreement are never read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"
#include "sglang_dflash/accept.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/sampling.h"

namespace sglang_dflash::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;

// Lowest index of the maximum: the greedy token. One pass: each lane keeps its running max and
// the first index where it occurred (indices < 2^24 are exact in fp32), then the lanes merge.
int64_t row_argmax(const float* x, int64_t n) {
  constexpr int64_t W = Vec::size();
  float best = x[0];
  int64_t best_id = 0, v = 0;
  if (n >= W) {
    float lane_max[W], lane_idx[W];
    Vec vidx = Vec::arange(0.0f, 1.0f), cur = vidx, vmax = Vec::loadu(x);
    const Vec step(static_cast<float>(W));
    for (v = W, cur += step; v + W <= n; v += W, cur += step) {
      const Vec xv = Vec::loadu(x + v);
      const Vec better = xv > vmax;
      vmax = Vec::blendv(vmax, xv, better);
      vidx = Vec::blendv(vidx, cur, better);
    }
    vmax.store(lane_max);
    vidx.store(lane_idx);
    best = lane_max[0];
    best_id = static_cast<int64_t>(lane_idx[0]);
    for (int64_t lane = 1; lane < W; ++lane) {
      const auto id = static_cast<int64_t>(lane_idx[lane]);
      if (lane_max[lane] > best || (lane_max[lane] == best && id < best_id)) {
        best = lane_max[lane];
        best_id = id;
      }
    }
  }
  for (; v < n; ++v) {
    if (x[v] > best) {
      best = x[v];
      best_id = v;
    }
  }
  return best_id;
}

// Number of x >= t.
int64_t count_at_least(const float* x, int64_t n, float t) {
  const Vec vt(t), one(1.0f);
  Vec vcount(0.0f);
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size()) vcount += (Vec::loadu(x + v) >= vt) & one;
  int64_t count = static_cast<int64_t>(
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vcount));
  for (; v < n; ++v) count += x[v] >= t;
  return count;
}

// Sum of e[v] over x[v] > t.
float sum_above(const float* x, const float* e, int64_t n, float t) {
  const Vec vt(t);
  Vec vsum(0.0f);
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size())
    vsum += (Vec::loadu(x + v) > vt) & Vec::loadu(e + v);
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; v < n; ++v) sum += x[v] > t ? e[v] : 0.0f;
  return sum;
}

// The k-th largest value of x: the largest t with count(x >= t) >= k, by bisection over the
// order-preserving keys of floats (at most 32 passes; every key in [key(-inf), key(max)] is a
// number, never a NaN).
float kth_largest(const float* x, int64_t n, int64_t k, float max) {
  uint64_t lo = float_to_key(-INFINITY), hi = float_to_key(max);
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo + 1) / 2;
    if (count_at_least(x, n, key_to_float(static_cast<uint32_t>(mid))) >= k) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return key_to_float(static_cast<uint32_t>(lo));
}

// Smallest threshold t >= floor such that the tokens kept by x >= t are the top-p set of the
// tokens with x >= floor: the smallest t whose mass strictly above it is < top_p of the total.
float top_p_threshold(const float* x, float* e, int64_t n, float floor, float max, float top_p) {
  int64_t v = 0;
  const Vec vmax(max), vfloor(floor);
  for (; v + Vec::size() <= n; v += Vec::size()) {
    const Vec xv = Vec::loadu(x + v);
    ((xv >= vfloor) & (xv - vmax).exp()).store(e + v);
  }
  for (; v < n; ++v) e[v] = x[v] >= floor ? std::exp(x[v] - max) : 0.0f;
  const float target = top_p * sum_above(x, e, n, -INFINITY);
  uint64_t lo = float_to_key(floor), hi = float_to_key(max);
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (sum_above(x, e, n, key_to_float(static_cast<uint32_t>(mid))) < target) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return key_to_float(static_cast<uint32_t>(lo));
}

struct SamplingParams {
  float temperature;
  int64_t top_k;
  float top_p;
  uint64_t seed, offset;
};

// Gumbel-max sample of one row over the tokens the top-k / top-p filters keep. `x` holds the
// row's logits and is overwritten with logits / temperature; `e` is scratch of the same size.
int64_t sample_row(float* x, float* e, int64_t n, uint32_t row, const SamplingParams& p) {
  const float inv_t = 1.0f / p.temperature;
  for (int64_t v = 0; v < n; ++v) x[v] *= inv_t;
  const int64_t first_max = row_argmax(x, n);
  const float max = x[first_max];
  float floor = -INFINITY;
  if (p.top_k > 0 && p.top_k < n) floor = kth_largest(x, n, p.top_k, max);
  if (p.top_p < 1.0f) floor = top_p_threshold(x, e, n, floor, max, p.top_p);

  // Seed the search with the most likely token so the pruning bound is tight from the start.
  uint32_t lanes[4];
  philox_lanes4(p.seed, p.offset, row, static_cast<uint32_t>(first_max / 4), lanes);
  float best = max + gumbel_from_bits(lanes[first_max % 4]);
  int64_t best_id = first_max;
  for (int64_t group = 0; group * 4 < n; ++group) {
    const int64_t end = std::min<int64_t>(n, group * 4 + 4);
    bool any = false;
    for (int64_t v = group * 4; v < end; ++v) any |= x[v] >= floor && x[v] + kMaxGumbelNoise >= best;
    if (!any) continue;
    philox_lanes4(p.seed, p.offset, row, static_cast<uint32_t>(group), lanes);
    for (int64_t v = group * 4; v < end; ++v) {
      const uint32_t bits = lanes[v - group * 4];
      // The exact noise (two double logs) only for tokens whose noise bound can still win.
      if (x[v] < floor || x[v] + gumbel_upper_bound(bits) < best) continue;
      const float score = x[v] + gumbel_from_bits(bits);
      if (score > best || (score == best && v < best_id)) {
        best = score;
        best_id = v;
      }
    }
  }
  return best_id;
}

template <typename scalar_t>
void verify_kernel(const at::Tensor& candidates, const at::Tensor& logits,
                   const at::Tensor& temperature, const at::Tensor& top_k,
                   const at::Tensor& top_p, uint64_t seed, const at::Tensor& offsets,
                   at::Tensor& accept_len, at::Tensor& bonus, at::Tensor& out_tokens) {
  const int64_t batch = candidates.size(0), block = candidates.size(1), vocab = logits.size(1);
  const int64_t* cand = candidates.data_ptr<int64_t>();
  const scalar_t* logit_ptr = logits.data_ptr<scalar_t>();
  const int64_t row_stride = logits.stride(0);
  const float* temp = temperature.data_ptr<float>();
  const int32_t* topk = top_k.data_ptr<int32_t>();
  const float* topp = top_p.data_ptr<float>();
  const int64_t* offset = offsets.data_ptr<int64_t>();

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(vocab), e(vocab);
    for (int64_t b = begin; b < end; ++b) {
      const SamplingParams params{temp[b], topk[b], topp[b], seed, static_cast<uint64_t>(offset[b])};
      auto target = [&](int i) -> int64_t {
        const scalar_t* src = logit_ptr + (b * block + i) * row_stride;
        const float* row;
        if constexpr (std::is_same_v<scalar_t, float>) {
          row = src;
          if (params.temperature > 0.0f) std::copy(src, src + vocab, x.data());
        } else {
          for (int64_t v = 0; v < vocab; ++v) x[v] = static_cast<float>(src[v]);
          row = x.data();
        }
        if (params.temperature <= 0.0f) return row_argmax(row, vocab);
        return sample_row(x.data(), e.data(), vocab, static_cast<uint32_t>(i), params);
      };
      bonus.data_ptr<int64_t>()[b] =
          accept_block(cand + b * block, static_cast<int>(block), target,
                       out_tokens.data_ptr<int64_t>() + b * block, accept_len.data_ptr<int32_t>() + b);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_results(const at::Tensor& candidates) {
  const int64_t batch = candidates.size(0), block = candidates.size(1);
  auto opts = candidates.options();
  return {at::empty({batch}, opts.dtype(at::kInt)), at::empty({batch}, opts.dtype(at::kLong)),
          at::empty({batch, block}, opts.dtype(at::kLong))};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block(
    const at::Tensor& candidates_in, const at::Tensor& logits, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, int64_t seed, const at::Tensor& offsets) {
  const auto shape = check_verify_args(candidates_in, logits, temperature, top_k, top_p, offsets);
  check_verify_values(candidates_in, shape.vocab);
  const auto candidates = candidates_in.contiguous();
  auto [accept_len, bonus, out_tokens] = empty_results(candidates);
  SGLD_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "verify_block", [&] {
    verify_kernel<scalar_t>(candidates, logits, temperature.contiguous(), top_k.contiguous(),
                            top_p.contiguous(), static_cast<uint64_t>(seed), offsets.contiguous(),
                            accept_len, bonus, out_tokens);
  });
  return {accept_len, bonus, out_tokens};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block_from_ids(const at::Tensor& candidates_in,
                                                                     const at::Tensor& target_ids) {
  const auto shape = check_verify_ids_args(candidates_in, target_ids);
  const auto candidates = candidates_in.contiguous();
  const auto ids = target_ids.to(at::kLong).contiguous();
  auto [accept_len, bonus, out_tokens] = empty_results(candidates);
  const int64_t* cand = candidates.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t block = shape.block_size;
  for (int64_t b = 0; b < shape.batch; ++b) {
    bonus.data_ptr<int64_t>()[b] = accept_block(
        cand + b * block, static_cast<int>(block), [&](int i) { return id[b * block + i]; },
        out_tokens.data_ptr<int64_t>() + b * block, accept_len.data_ptr<int32_t>() + b);
  }
  return {accept_len, bonus, out_tokens};
}

}  // namespace sglang_dflash::cpu
