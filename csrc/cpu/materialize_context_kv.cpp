// CPU materialize_context_kv (docs/design.md §3.4): every draft layer's context K/V for N committed
// tokens in one call. Per layer one projection of all N rows (skinny_linear for decode-sized N,
// which streams the weight once; BLAS above), then one parallel pass over the rows doing, per
// (layer, kv head), the k RMSNorm, the RoPE and the conversion into the pools, all in fp32 on
// buffers of one head.
#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <vector>

#include "cpu_kernels.h"
#include "head_vector.h"
#include "to_float.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"

namespace sglang_dflash::cpu {
namespace {

constexpr int64_t kSkinnyMaxRows = 16;  // skinny_linear beats BLAS up to here (bench/bench_ops.py)

struct Layer {
  const void* kv;     // projection [N, 2 * Hkv * D], contiguous, ctx's dtype
  const void* norm;   // k_norm weight [D], contiguous, ctx's dtype
  void* k;            // pool base, pool dtype
  void* v;
  int64_t k_s0, k_s1, v_s0, v_s1;
};

template <typename in_t, typename pool_t>
void write_rows(const ContextKvShape& s, const std::vector<Layer>& layers, const at::Tensor& cos_sin,
                bool is_neox, const int64_t* pos, const int64_t* loc, float eps, float v_scale) {
  const int64_t L = s.layers, H = s.kv_heads, D = s.head_dim;
  const int64_t row_width = 2 * H * D;
  // ~32K elements per task: decode-sized calls run on one thread, prefill spreads.
  const int64_t grain = std::max<int64_t>(1, 32768 / (L * row_width));
  at::parallel_for(0, s.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> norm(L * D), cs(s.rotary_dim), buf(D);
    for (int64_t l = 0; l < L; ++l) to_float(static_cast<const in_t*>(layers[l].norm), norm.data() + l * D, D);
    for (int64_t r = begin; r < end; ++r) {
      if (loc[r] < 0) continue;
      cos_sin_row(cos_sin, pos[r], cs.data());
      for (int64_t l = 0; l < L; ++l) {
        const Layer& ly = layers[l];
        const in_t* kv = static_cast<const in_t*>(ly.kv) + r * row_width;
        const float* w = norm.data() + l * D;
        for (int64_t h = 0; h < H; ++h) {
          float* x = buf.data();
          to_float(kv + h * D, x, D);
          rms_norm(x, w, D, eps);
          rope(x, cs.data(), s.rotary_dim, is_neox);
          at::vec::convert(x, static_cast<pool_t*>(ly.k) + loc[r] * ly.k_s0 + h * ly.k_s1, D);

          to_float(kv + (H + h) * D, x, D);
          for (int64_t j = 0; j < D; ++j) x[j] *= v_scale;
          at::vec::convert(x, static_cast<pool_t*>(ly.v) + loc[r] * ly.v_s0 + h * ly.v_s1, D);
        }
      }
    }
  });
}

}  // namespace

void materialize_context_kv(const at::Tensor& ctx, at::TensorList kv_weights,
                            std::optional<at::TensorList> kv_biases, at::TensorList k_norm_weights,
                            double eps, const at::Tensor& cos_sin_cache, bool is_neox,
                            const at::Tensor& positions, const at::Tensor& out_loc, at::TensorList k_caches,
                            at::TensorList v_caches, double v_scale) {
  const auto shape = check_materialize_context_kv_args(ctx, kv_weights, kv_biases, k_norm_weights, cos_sin_cache,
                                                       positions, out_loc, k_caches, v_caches);
  check_materialize_context_kv_indices(positions, out_loc, shape);
  if (shape.rows == 0) return;
  const auto pos = positions.to(at::kLong).contiguous();
  const auto loc = out_loc.to(at::kLong).contiguous();

  std::vector<at::Tensor> keep_alive;  // projections and contiguous norm weights, for the pointers below
  std::vector<Layer> layers;
  for (int64_t l = 0; l < shape.layers; ++l) {
    const std::optional<at::Tensor> bias =
        kv_biases.has_value() ? std::optional<at::Tensor>((*kv_biases)[l]) : std::nullopt;
    const at::Tensor kv = shape.rows <= kSkinnyMaxRows ? skinny_linear(ctx, kv_weights[l], bias, std::nullopt)
                                                       : at::linear(ctx, kv_weights[l], bias).contiguous();
    const at::Tensor norm = k_norm_weights[l].contiguous();
    keep_alive.insert(keep_alive.end(), {kv, norm});
    layers.push_back({kv.const_data_ptr(), norm.const_data_ptr(), k_caches[l].mutable_data_ptr(),
                      v_caches[l].mutable_data_ptr(), k_caches[l].stride(0), k_caches[l].stride(1),
                      v_caches[l].stride(0), v_caches[l].stride(1)});
  }
  SGLD_DISPATCH_FLOAT_TYPES(ctx.scalar_type(), "materialize_context_kv", [&] {
    using in_t = scalar_t;
    SGLD_DISPATCH_FLOAT_TYPES(k_caches[0].scalar_type(), "materialize_context_kv", [&] {
      write_rows<in_t, scalar_t>(shape, layers, cos_sin_cache, is_neox, pos.const_data_ptr<int64_t>(),
                                 loc.const_data_ptr<int64_t>(), static_cast<float>(eps),
                                 static_cast<float>(v_scale));
    });
  });
}

}  // namespace sglang_dflash::cpu
