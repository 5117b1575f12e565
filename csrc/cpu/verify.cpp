// CPU verification (docs/design.md §3.2). One task per request. The target's token of row i is only
// needed while the drafts still agree, so rows are sampled lazily inside the accept scan and the
// logits of rows past the first disagreement are not read; with fewer requests than threads, a
// sampled request's rows are sampled in parallel waves instead (see verify_kernel). The
// Gumbel-max search itself is gumbel_max.h's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <vector>

#include "cpu_kernels.h"
#include "gumbel_max.h"
#include "sglang_dflash/accept.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/sampling.h"

namespace sglang_dflash::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;

// Lowest index of the maximum of x[0, n), read through load(v) (a Vec of x[v, v + W)) and
// load1(v) (x[v]), each index exactly once. One pass: each lane keeps its running max and the
// first index where it occurred (indices < 2^24 are exact in fp32), then the lanes merge.
template <typename Load, typename Load1>
int64_t argmax_of(int64_t n, Load load, Load1 load1) {
  constexpr int64_t W = Vec::size();
  float best;
  int64_t best_id = 0, v;
  if (n >= W) {
    float lane_max[W], lane_idx[W];
    Vec vidx = Vec::arange(0.0f, 1.0f), cur = vidx, vmax = load(0);
    const Vec step(static_cast<float>(W));
    for (v = W, cur += step; v + W <= n; v += W, cur += step) {
      const Vec xv = load(v);
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
  } else {
    best = load1(0);
    v = 1;
  }
  for (; v < n; ++v) {
    const float xv = load1(v);
    if (xv > best) {
      best = xv;
      best_id = v;
    }
  }
  return best_id;
}

// The greedy token.
int64_t row_argmax(const float* x, int64_t n) {
  return argmax_of(
      n, [x](int64_t v) { return Vec::loadu(x + v); }, [x](int64_t v) { return x[v]; });
}

// Number of x >= t. Four accumulators: the counts are integers below 2^24, exact in fp32 in any
// order, so the adds need not wait on each other.
int64_t count_at_least(const float* x, int64_t n, float t) {
  constexpr int64_t W = Vec::size();
  const Vec vt(t), one(1.0f);
  Vec c0(0.0f), c1(0.0f), c2(0.0f), c3(0.0f);
  int64_t v = 0;
  for (; v + 4 * W <= n; v += 4 * W) {
    c0 += (Vec::loadu(x + v) >= vt) & one;
    c1 += (Vec::loadu(x + v + W) >= vt) & one;
    c2 += (Vec::loadu(x + v + 2 * W) >= vt) & one;
    c3 += (Vec::loadu(x + v + 3 * W) >= vt) & one;
  }
  for (; v + W <= n; v += W) c0 += (Vec::loadu(x + v) >= vt) & one;
  int64_t count = static_cast<int64_t>(
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, (c0 + c1) + (c2 + c3)));
  for (; v < n; ++v) count += x[v] >= t;
  return count;
}

// Sum of e[v] over x[v] > t[j] for each of K thresholds, every sum added in the same order
// whatever K is (vector lane l adds the e[v] of v = l mod W in order, vec_reduce_all sums the
// lanes, then the tail follows in order). A sum is a chain of dependent adds, latency-bound: K
// independent chains in one pass cost about what one does.
template <int K>
std::array<float, K> sum_above(const float* x, const float* e, int64_t n,
                               const std::array<float, K>& t) {
  std::array<Vec, K> vt, vsum;
  for (int j = 0; j < K; ++j) vt[j] = Vec(t[j]), vsum[j] = Vec(0.0f);
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size()) {
    const Vec xv = Vec::loadu(x + v), ev = Vec::loadu(e + v);
    for (int j = 0; j < K; ++j) vsum[j] += (xv > vt[j]) & ev;
  }
  std::array<float, K> sum;
  for (int j = 0; j < K; ++j) {
    sum[j] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum[j]);
    for (int64_t u = v; u < n; ++u) sum[j] += x[u] > t[j] ? e[u] : 0.0f;
  }
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
  const float target = top_p * sum_above<1>(x, e, n, {-INFINITY})[0];
  // The smallest key in [lo, hi) whose mass is below target, or hi. The mass is nonincreasing in
  // the key (fp32 rounding is monotone), so any probes in [lo, hi) narrow it down to the same key
  // a bisection finds: four per pass split the range in five, ~14 passes instead of 32, each
  // about as fast.
  uint64_t lo = float_to_key(floor), hi = float_to_key(max);
  while (lo < hi) {
    std::array<uint64_t, 4> probe;
    std::array<float, 4> t;
    for (int j = 0; j < 4; ++j) {
      probe[j] = lo + (hi - lo) * (j + 1) / 5;
      t[j] = key_to_float(static_cast<uint32_t>(probe[j]));
    }
    const std::array<float, 4> mass = sum_above<4>(x, e, n, t);
    int j = 0;  // the first probe that meets the test (the probes are in increasing order)
    while (j < 4 && !(mass[j] < target)) ++j;
    if (j > 0) lo = probe[j - 1] + 1;
    if (j < 4) hi = probe[j];
  }
  return key_to_float(static_cast<uint32_t>(lo));
}

struct SamplingParams {
  float temperature;
  int64_t top_k;
  float top_p;
  uint64_t seed, offset;
};

// Gumbel-max sample of one row of logits `src` over the tokens the top-k / top-p filters keep,
// with x = logits * (1 / temperature) in fp32. x and e are scratch rows (src may be x): with
// filters on, x is written there for their searches; without, it is recomputed where needed,
// which is cheaper than writing it and reading it back.
int64_t sample_row(const float* src, float* x, float* e, int64_t n, uint32_t row,
                   const SamplingParams& p) {
  const float inv_t = 1.0f / p.temperature;
  const bool filtered = (p.top_k > 0 && p.top_k < n) || p.top_p < 1.0f;
  const Vec vinv(inv_t);
  const int64_t first_max = argmax_of(
      n,
      [&](int64_t v) {
        const Vec xv = Vec::loadu(src + v) * vinv;
        if (filtered) xv.store(x + v);
        return xv;
      },
      [&](int64_t v) {
        const float xv = src[v] * inv_t;
        if (filtered) x[v] = xv;
        return xv;
      });
  const float max = filtered ? x[first_max] : src[first_max] * inv_t;  // src may be x, rescaled
  float floor = -INFINITY;
  if (p.top_k > 0 && p.top_k < n) floor = kth_largest(x, n, p.top_k, max);
  if (p.top_p < 1.0f) floor = top_p_threshold(x, e, n, floor, max, p.top_p);

  // Seed the search with the most likely token so the pruning bound is tight from the start.
  uint32_t lanes[4];
  philox_lanes4(p.seed, p.offset, row, static_cast<uint32_t>(first_max / 4), lanes);
  GumbelMax search{floor, max + gumbel_from_bits(lanes[first_max % 4]), first_max};
  if (filtered) {
    search.run(x, 1.0f, n, NoiseKey{p.seed, p.offset, row});
  } else {
    search.run(src, inv_t, n, NoiseKey{p.seed, p.offset, row});
  }
  return search.best_id;
}

// The target's token of one row of logits `src` (vocab values): greedy (the lowest index of the
// maximum) where temperature <= 0, else sample_row's Gumbel-max sample under `params` and `row`.
// x and e are scratch rows of vocab floats.
template <typename scalar_t>
int64_t target_token(const scalar_t* src, int64_t vocab, const SamplingParams& params, uint32_t row, float* x,
                     float* e) {
  const float* values;
  if constexpr (std::is_same_v<scalar_t, float>) {
    values = src;
  } else {
    for (int64_t v = 0; v < vocab; ++v) x[v] = static_cast<float>(src[v]);
    values = x;
  }
  if (params.temperature <= 0.0f) return row_argmax(values, vocab);
  return sample_row(values, x, e, vocab, row, params);
}

// Scratch rows are left uninitialized: pages nothing touches (greedy fp32 rows) cost nothing.
std::unique_ptr<float[]> scratch_row(int64_t vocab) { return std::make_unique_for_overwrite<float[]>(vocab); }

// A verify call's target logits [rows, V] and per-request sampling arguments [bs] (contiguous),
// read by its tasks.
template <typename scalar_t>
struct TargetRows {
  const scalar_t* logits;
  int64_t row_stride, vocab;
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const int64_t* offsets;
  uint64_t seed;

  TargetRows(const at::Tensor& logits_, const at::Tensor& temperature_, const at::Tensor& top_k_,
             const at::Tensor& top_p_, uint64_t seed_, const at::Tensor& offsets_)
      : logits(logits_.data_ptr<scalar_t>()), row_stride(logits_.stride(0)), vocab(logits_.size(1)),
        temperature(temperature_.data_ptr<float>()), top_k(top_k_.data_ptr<int32_t>()),
        top_p(top_p_.data_ptr<float>()), offsets(offsets_.data_ptr<int64_t>()), seed(seed_) {}

  // The target's token of logits row `row`, with request b's sampling arguments and its noise keyed
  // (offsets[b] + shift, verify_row); x and e are scratch rows.
  int64_t token(int64_t b, int64_t row, uint64_t shift, uint32_t verify_row, float* x, float* e) const {
    const SamplingParams params{temperature[b], top_k[b], top_p[b], seed, static_cast<uint64_t>(offsets[b]) + shift};
    return target_token(logits + row * row_stride, vocab, params, verify_row, x, e);
  }
};

template <typename scalar_t>
void verify_kernel(const at::Tensor& candidates, const at::Tensor& logits,
                   const at::Tensor& temperature, const at::Tensor& top_k,
                   const at::Tensor& top_p, uint64_t seed, const at::Tensor& offsets,
                   at::Tensor& accept_len, at::Tensor& bonus, at::Tensor& out_tokens) {
  const int64_t batch = candidates.size(0), block = candidates.size(1), vocab = logits.size(1);
  const int64_t* cand = candidates.data_ptr<int64_t>();
  const TargetRows<scalar_t> target(logits, temperature, top_k, top_p, seed, offsets);

  // The target's token of row i of request b; x and e are scratch rows.
  auto row_token = [&](int64_t b, int i, float* x, float* e) -> int64_t {
    return target.token(b, b * block + i, 0, static_cast<uint32_t>(i), x, e);
  };
  auto accept = [&](int64_t b, auto target) {
    bonus.data_ptr<int64_t>()[b] = accept_block(cand + b * block, static_cast<int>(block), target,
                                                out_tokens.data_ptr<int64_t>() + b * block,
                                                accept_len.data_ptr<int32_t>() + b);
  };

  auto scratch = [vocab] { return scratch_row(vocab); };
  const int threads = at::get_num_threads();
  if (batch >= threads) {  // one task per request
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      const auto x = scratch(), e = scratch();
      for (int64_t b = begin; b < end; ++b) {
        accept(b, [&](int i) { return row_token(b, i, x.get(), e.get()); });
      }
    });
    return;
  }
  // Fewer requests than threads: a sampled request's rows go in waves of `threads` rows at once.
  // Sampling a row is compute-bound (Philox), so this divides its time by the thread count; the
  // rows of a wave past the first rejection are computed for nothing, on threads that would
  // otherwise idle. Greedy rows stay one at a time: they are cheap and memory-bound.
  std::vector<std::unique_ptr<float[]>> xs(threads), es(threads);
  for (int t = 0; t < threads; ++t) xs[t] = scratch(), es[t] = scratch();
  std::vector<int64_t> tokens(block);
  for (int64_t b = 0; b < batch; ++b) {
    const int wave = target.temperature[b] > 0.0f ? threads : 1;
    int64_t ready = 0;  // tokens[0, ready) are this request's
    accept(b, [&](int i) {
      if (i >= ready) {
        ready = std::min<int64_t>(block, i + wave);
        at::parallel_for(i, ready, 1, [&](int64_t begin, int64_t end) {
          float *x = xs[at::get_thread_num()].get(), *e = es[at::get_thread_num()].get();
          for (int64_t r = begin; r < end; ++r) tokens[r] = row_token(b, static_cast<int>(r), x, e);
        });
      }
      return tokens[i];
    });
  }
}

// Tree verification (docs/design.md §3.3): each request's walk (accept.h, accept_tree) asks for the
// target's token of the nodes it reaches only, the root and the accepted path, so the logits of the
// other nodes are never read. Node i of request b is sampled as verify_block samples a one-row
// block at offset offsets[b] + depths[b, i] (ops.verify_tree's contract): one task per request.
template <typename scalar_t>
void verify_tree_kernel(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depths,
                        const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                        const at::Tensor& top_p, uint64_t seed, const at::Tensor& offsets, at::Tensor& accept_len,
                        at::Tensor& path, at::Tensor& out_tokens) {
  const int64_t batch = tokens.size(0), n = tokens.size(1), vocab = logits.size(1);
  const TargetRows<scalar_t> target(logits, temperature, top_k, top_p, seed, offsets);
  const int64_t* depth = depths.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    const auto x = scratch_row(vocab), e = scratch_row(vocab);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* parent = parents.const_data_ptr<int64_t>() + b * n;
      auto node_token = [&](int64_t i) {
        return target.token(b, b * n + i, static_cast<uint64_t>(depth[b * n + i]), 0, x.get(), e.get());
      };
      accept_len.data_ptr<int32_t>()[b] =
          accept_tree(tokens.const_data_ptr<int64_t>() + b * n, [parent](int64_t i) { return parent[i]; }, n,
                      node_token, path.data_ptr<int64_t>() + b * n, out_tokens.data_ptr<int64_t>() + b * n);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree(const at::Tensor& tokens_in, const at::Tensor& parents_in,
                                                        const at::Tensor& depths_in, const at::Tensor& logits,
                                                        const at::Tensor& temperature, const at::Tensor& top_k,
                                                        const at::Tensor& top_p, int64_t seed,
                                                        const at::Tensor& offsets) {
  const auto shape = check_verify_tree_sampling_args(tokens_in, parents_in, depths_in, logits, temperature, top_k,
                                                     top_p, offsets);
  check_verify_tree_tokens(tokens_in, logits.size(1));
  const auto parents = parents_in.to(at::kLong).contiguous();
  const auto depths = depths_in.contiguous();
  check_verify_tree_values(parents, depths);
  const auto tokens = tokens_in.contiguous();
  const auto opts = tokens.options();
  auto accept_len = at::empty({shape.batch}, opts.dtype(at::kInt));
  auto path = at::empty({shape.batch, shape.nodes}, opts);
  auto out_tokens = at::empty({shape.batch, shape.nodes}, opts);
  SGLD_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "verify_tree", [&] {
    verify_tree_kernel<scalar_t>(tokens, parents, depths, logits, temperature.contiguous(), top_k.contiguous(),
                                 top_p.contiguous(), static_cast<uint64_t>(seed), offsets.contiguous(), accept_len,
                                 path, out_tokens);
  });
  return {accept_len, path, out_tokens};
}

}  // namespace sglang_dflash::cpu
