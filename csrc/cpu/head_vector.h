// One fp32 head vector's RMSNorm and RoPE (SGLang's cos_sin_cache layout), shared by the CPU kernels
// that normalize and rotate keys / queries (materialize_context_kv, rms_norm_rope).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>

#include "to_float.h"
#include "sglang_dflash/dispatch.h"

namespace sglang_dflash::cpu {

// x[j] * rsqrt(mean(x^2) + eps) * w[j] for j < D, in place.
inline void rms_norm(float* x, const float* w, int64_t D, float eps) {
  using Vec = at::vec::Vectorized<float>;
  const float ss = at::vec::map_reduce_all<float>([](Vec a) { return a * a; }, [](Vec a, Vec b) { return a + b; },
                                                  x, D);
  const float inv_rms = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t j = 0; j < D; ++j) x[j] = x[j] * inv_rms * w[j];
}

// Row `pos` of the cache (any float dtype) in fp32: rotary_dim values, cos half then sin half.
inline void cos_sin_row(const at::Tensor& cache, int64_t pos, float* dst) {
  SGLD_DISPATCH_FLOAT_TYPES(cache.scalar_type(), "cos_sin_row", [&] {
    to_float(cache.const_data_ptr<scalar_t>() + pos * cache.stride(0), dst, cache.size(1));
  });
}

// Rotates the first rotary_dim values of x in place: pairs (i, i + rot/2) when is_neox, else
// (2i, 2i + 1), each by the angle whose cos / sin are cs[i] / cs[rot/2 + i].
inline void rope(float* x, const float* cs, int64_t rotary_dim, bool is_neox) {
  const int64_t half = rotary_dim / 2;
  const float* sin = cs + half;
  const int64_t stride = is_neox ? 1 : 2, partner = is_neox ? half : 1;
  for (int64_t i = 0; i < half; ++i) {
    float* a = x + i * stride;
    const float x1 = a[0], x2 = a[partner];
    a[0] = x1 * cs[i] - x2 * sin[i];
    a[partner] = x2 * cs[i] + x1 * sin[i];
  }
}

}  // namespace sglang_dflash::cpu
