// CPU rms_norm_rope: the RMSNorm of every head vector, then (optionally) its RoPE, in one pass over
// the rows in fp32 with one rounding to the output dtype. A draft step on the CPU is bound by op
// count, not arithmetic: the PyTorch form of a q/k norm + RoPE is ~14 elementwise ops on a few
// hundred values each, this is one.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_kernels.h"
#include "head_vector.h"
#include "to_float.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"

namespace sglang_dflash::cpu {
namespace {

template <typename scalar_t>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps, const at::Tensor* cos_sin,
               const int64_t* pos, bool is_neox, at::Tensor& out) {
  const int64_t n = x.size(0), heads = x.size(1), D = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const int64_t rot = cos_sin != nullptr ? cos_sin->size(1) : 0;
  const scalar_t* src = x.const_data_ptr<scalar_t>();
  scalar_t* dst = out.mutable_data_ptr<scalar_t>();
  std::vector<float> w(D);
  to_float(weight.const_data_ptr<scalar_t>(), w.data(), D);
  // ~16K values per task: a decode step's few rows run on the calling thread (no pool wake-up).
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));
  at::parallel_for(0, n * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D), cs(rot);
    int64_t cs_row = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / heads, h = i % heads;
      float* v = buf.data();
      to_float(src + r * s0 + h * s1, v, D);
      rms_norm(v, w.data(), D, eps);
      if (rot > 0) {
        if (cs_row != r) {  // the row's cos / sin, once for all its heads
          cos_sin_row(*cos_sin, pos[r], cs.data());
          cs_row = r;
        }
        rope(v, cs.data(), rot, is_neox);
      }
      at::vec::convert(v, dst + i * D, D);
    }
  });
}

}  // namespace

at::Tensor rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, double eps,
                         const std::optional<at::Tensor>& cos_sin_cache, const std::optional<at::Tensor>& positions,
                         bool is_neox) {
  check_rms_norm_rope_args(x, weight, cos_sin_cache, positions);
  check_rms_norm_rope_positions(cos_sin_cache, positions);
  const bool rope = cos_sin_cache.has_value();
  // Without RoPE any [..., D] is a stack of rows: viewed as [rows, 1, D] (a copy only where the
  // leading dimensions cannot be flattened by strides).
  const at::Tensor rows = rope ? x : x.reshape({-1, 1, x.size(-1)});
  at::Tensor out = at::empty(rows.sizes(), x.options());
  if (out.numel() == 0) return out.view(x.sizes());
  const at::Tensor pos = rope ? positions->to(at::kLong).contiguous() : at::Tensor();
  SGLD_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm_rope", [&] {
    norm_rows<scalar_t>(rows, weight.contiguous(), static_cast<float>(eps), rope ? &*cos_sin_cache : nullptr,
                        rope ? pos.const_data_ptr<int64_t>() : nullptr, is_neox, out);
  });
  return out.view(x.sizes());
}

}  // namespace sglang_dflash::cpu
