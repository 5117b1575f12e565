// CPU top_k_logprobs (the contract is in sglang_dflash/ops/__init__.py): per row, the k largest
// logits, best first (the lower index first among equals), and their log-probabilities under the
// row's softmax. A draft tree takes k choices at each of its positions from one draft forward;
// torch's log_softmax then topk over a [7, 49152] draft read the row four times and wrote it once
// (~0.3 ms of a SmolLM2 tree step on 2 cores), this reads it twice and writes 2k values.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"
#include "to_float.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"

namespace sglang_dflash::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;

// The k best (value, index) pairs seen so far, best first; among equal values the one seen first
// (the lower index) stays ahead, as a stable descending sort orders them.
class TopK {
 public:
  explicit TopK(int64_t k) : k_(k), values_(k), ids_(k) {}
  // The value a newcomer must exceed to enter: -inf until k are held, so the first k all enter.
  float bar() const { return size_ < k_ ? -INFINITY : values_[k_ - 1]; }
  bool full() const { return size_ == k_; }
  void offer(float v, int64_t id) {
    if (full() && !(v > values_[k_ - 1])) return;
    int64_t p = std::min(size_, k_ - 1);  // the slot it takes: after every value >= v
    while (p > 0 && values_[p - 1] < v) {
      values_[p] = values_[p - 1];
      ids_[p] = ids_[p - 1];
      --p;
    }
    values_[p] = v;
    ids_[p] = id;
    size_ = std::min(size_ + 1, k_);
  }
  const std::vector<float>& values() const { return values_; }
  const std::vector<int64_t>& ids() const { return ids_; }

 private:
  int64_t k_, size_ = 0;
  std::vector<float> values_;
  std::vector<int64_t> ids_;
};

template <typename T>
void row_top_k(const T* x, int64_t n, int64_t k, int64_t row, float* values, int64_t* ids) {
  constexpr int64_t W = Vec::size();
  constexpr int kNoLane = (1 << W) - 1;  // zero_mask() of a comparison no lane passed
  TopK top(k);
  Vec vmax(-INFINITY), any_nan(0.0f);
  float lanes[W];
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const Vec v = load_float_vector(x + j);
    vmax = at::vec::maximum(vmax, v);  // NaN stays NaN
    any_nan = any_nan | v.isnan();
    // Most vectors hold nothing above the k-th best: one compare skips them.
    if (top.full() && (v > Vec(top.bar())).zero_mask() == kNoLane) continue;
    v.store(lanes);
    for (int64_t l = 0; l < W; ++l) top.offer(lanes[l], j + l);
  }
  float row_max = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); },
                                                 vmax);
  bool nan = any_nan.zero_mask() != kNoLane;
  for (; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    nan = nan || std::isnan(v);
    row_max = std::max(row_max, v);
    top.offer(v, j);
  }
  TORCH_CHECK_VALUE(!nan, "sglang_dflash.top_k_logprobs: logits row ", row, " holds NaN");
  // log-probability = logit - (max + log(sum of exp(logit - max))); an all -inf row shifts by 0.
  const float shift = row_max == -INFINITY ? 0.0f : row_max;
  Vec vsum(0.0f);
  j = 0;
  for (; j + W <= n; j += W) vsum = vsum + (load_float_vector(x + j) - Vec(shift)).exp_u20();
  float sum = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, vsum);
  for (; j < n; ++j) sum += std::exp(static_cast<float>(x[j]) - shift);
  const float log_norm = shift + std::log(sum);
  for (int64_t i = 0; i < k; ++i) {
    values[i] = top.values()[i] - log_norm;
    ids[i] = top.ids()[i];
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> top_k_logprobs(const at::Tensor& logits, int64_t k) {
  check_top_k_logprobs_args(logits, k);
  auto out_shape = logits.sizes().vec();
  out_shape.back() = k;
  at::Tensor values = at::empty(out_shape, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty(out_shape, logits.options().dtype(at::kLong));
  const int64_t n = logits.size(-1), rows = n ? logits.numel() / n : 0;
  if (rows == 0) return {values, ids};
  const at::Tensor x = logits.reshape({rows, n}).contiguous();  // a view where logits are contiguous
  float* value_ptr = values.data_ptr<float>();
  int64_t* id_ptr = ids.data_ptr<int64_t>();
  SGLD_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "top_k_logprobs", [&] {
    const scalar_t* base = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row_top_k(base + r * n, n, k, r, value_ptr + r * k, id_ptr + r * k);
    });
  });
  return {values, ids};
}

}  // namespace sglang_dflash::cpu
