// materialize_context_kv on CUDA, the same semantics as csrc/cpu/materialize_context_kv.cpp: per
// layer one cuBLAS projection of the N rows (at::linear, bias fused), then ONE kernel for all layers
// doing the k RMSNorm, the RoPE, v * v_scale and the conversion into the pools. A warp owns one
// (row, layer, kv head): lanes stride over D (coalesced), the sum of squares is a shuffle
// reduction, and the normed k sits in shared memory so each lane can read its RoPE partner.
// Out-of-range positions / out_loc are recorded in the device's error record (checking them on the
// host needs a sync; check_device_errors raises them) and their rows are not written.
#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "cuda_common.cuh"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"

namespace sglang_dflash::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxLayers = 16;     // per launch (the parameter block stays ~1 KiB); more layers: more launches
constexpr int64_t kMaxHeadDim = 1024;  // shared memory: kWarps * D floats

struct LayerArgs {
  const void* kv;    // projection [N, 2 * Hkv * D], contiguous, input dtype
  const void* norm;  // k_norm weight [D], contiguous, input dtype
  void* k;           // pools, pool dtype
  void* v;
  int64_t k_s0, k_s1, v_s0, v_s1;
};

struct Params {
  LayerArgs layer[kMaxLayers];
  int layers, kv_heads, head_dim, rotary_dim;
  int64_t rows, max_positions, slots;
  const void* cos_sin;
  int64_t cos_sin_stride;
  at::ScalarType cos_sin_dtype;
  const void* positions;
  const void* out_loc;
  bool positions64, out_loc64, is_neox;
  float eps, v_scale;
  IndexError* errors;  // the device's error record (cuda_common.cuh)
};

// The cache is read in whatever float dtype it has; the branch is uniform across the grid.
__device__ __forceinline__ float load_cos_sin(const Params& p, int64_t i) {
  switch (p.cos_sin_dtype) {
    case c10::ScalarType::BFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(p.cos_sin)[i]);
    case c10::ScalarType::Half: return static_cast<float>(static_cast<const c10::Half*>(p.cos_sin)[i]);
    default: return static_cast<const float*>(p.cos_sin)[i];
  }
}

template <typename in_t, typename pool_t>
__global__ void __launch_bounds__(kThreads) context_kv_kernel(const Params p) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= p.rows * p.layers * p.kv_heads) return;  // whole warps only: the shuffles stay full
  const int h = static_cast<int>(item % p.kv_heads);
  const int l = static_cast<int>(item / p.kv_heads % p.layers);
  const int64_t r = item / (static_cast<int64_t>(p.kv_heads) * p.layers);
  const int64_t slot = read_index(p.out_loc, p.out_loc64, r);
  const int64_t pos = read_index(p.positions, p.positions64, r);
  // Positions before out_loc, as the host checks them. A bad row is not written (uniform per warp).
  if (!index_ok(pos >= 0 && pos < p.max_positions, p.errors, IndexCheck::kContextPosition, r, 0, pos,
                p.max_positions) ||
      !index_ok(slot >= -1 && slot < p.slots, p.errors, IndexCheck::kContextOutLoc, r, 0, slot, p.slots) ||
      slot < 0) {
    return;
  }

  const LayerArgs& ly = p.layer[l];
  const int D = p.head_dim;
  const in_t* kv = static_cast<const in_t*>(ly.kv) + r * 2 * p.kv_heads * D;
  const in_t* k_in = kv + h * D;
  const in_t* v_in = kv + (p.kv_heads + h) * D;
  const in_t* w = static_cast<const in_t*>(ly.norm);
  float* x = smem + warp * D;

  float ss = 0.f;
  for (int j = lane; j < D; j += 32) {
    const float v = static_cast<float>(k_in[j]);
    x[j] = v;
    ss += v * v;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float inv_rms = rsqrtf(ss / static_cast<float>(D) + p.eps);
  __syncwarp();

  const int half = p.rotary_dim / 2;
  const int64_t cs_row = pos * p.cos_sin_stride;
  pool_t* k_out = static_cast<pool_t*>(ly.k) + slot * ly.k_s0 + h * ly.k_s1;
  for (int j = lane; j < D; j += 32) {
    float y = x[j] * inv_rms * static_cast<float>(w[j]);
    if (j < p.rotary_dim) {
      // Pair i of the rotation: (i, i + half) for neox, (2i, 2i + 1) interleaved. The first
      // member gets x1 * cos - x2 * sin, the second x2 * cos + x1 * sin.
      const bool first = p.is_neox ? j < half : (j & 1) == 0;
      const int i = p.is_neox ? (first ? j : j - half) : j / 2;
      const int partner = p.is_neox ? (first ? j + half : j - half) : j ^ 1;
      const float other = x[partner] * inv_rms * static_cast<float>(w[partner]);
      const float c = load_cos_sin(p, cs_row + i), s = load_cos_sin(p, cs_row + half + i);
      y = first ? y * c - other * s : y * c + other * s;
    }
    k_out[j] = static_cast<pool_t>(y);
  }
  pool_t* v_out = static_cast<pool_t*>(ly.v) + slot * ly.v_s0 + h * ly.v_s1;
  for (int j = lane; j < D; j += 32) v_out[j] = static_cast<pool_t>(static_cast<float>(v_in[j]) * p.v_scale);
}

}  // namespace

void materialize_context_kv(const at::Tensor& ctx, at::TensorList kv_weights,
                            std::optional<at::TensorList> kv_biases, at::TensorList k_norm_weights,
                            double eps, const at::Tensor& cos_sin_cache, bool is_neox,
                            const at::Tensor& positions, const at::Tensor& out_loc, at::TensorList k_caches,
                            at::TensorList v_caches, double v_scale) {
  const auto shape = check_materialize_context_kv_args(ctx, kv_weights, kv_biases, k_norm_weights, cos_sin_cache,
                                                       positions, out_loc, k_caches, v_caches);
  TORCH_CHECK_VALUE(shape.head_dim <= kMaxHeadDim, "sglang_dflash.materialize_context_kv: the CUDA kernel supports ",
                    "head_dim <= ", kMaxHeadDim, ", got ", shape.head_dim);
  if (shape.rows == 0) return;
  const c10::cuda::CUDAGuard guard(ctx.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto pos = positions.contiguous();
  const auto loc = out_loc.contiguous();

  Params p{};
  p.kv_heads = static_cast<int>(shape.kv_heads);
  p.head_dim = static_cast<int>(shape.head_dim);
  p.rotary_dim = static_cast<int>(shape.rotary_dim);
  p.rows = shape.rows;
  p.max_positions = shape.max_positions;
  p.slots = shape.slots;
  p.cos_sin = cos_sin_cache.const_data_ptr();
  p.cos_sin_stride = cos_sin_cache.stride(0);
  p.cos_sin_dtype = cos_sin_cache.scalar_type();
  p.positions = pos.const_data_ptr();
  p.out_loc = loc.const_data_ptr();
  p.positions64 = pos.scalar_type() == at::kLong;
  p.out_loc64 = loc.scalar_type() == at::kLong;
  p.is_neox = is_neox;
  p.eps = static_cast<float>(eps);
  p.v_scale = static_cast<float>(v_scale);
  p.errors = device_error_record(ctx.get_device());
  const size_t smem = sizeof(float) * kWarps * shape.head_dim;

  std::vector<at::Tensor> keep_alive;  // projections and contiguous norm weights until the launch
  for (int64_t l0 = 0; l0 < shape.layers; l0 += kMaxLayers) {
    p.layers = static_cast<int>(std::min<int64_t>(kMaxLayers, shape.layers - l0));
    for (int i = 0; i < p.layers; ++i) {
      const int64_t l = l0 + i;
      const std::optional<at::Tensor> bias =
          kv_biases.has_value() ? std::optional<at::Tensor>((*kv_biases)[l]) : std::nullopt;
      const at::Tensor kv = at::linear(ctx, kv_weights[l], bias).contiguous();
      const at::Tensor norm = k_norm_weights[l].contiguous();
      keep_alive.insert(keep_alive.end(), {kv, norm});
      p.layer[i] = {kv.const_data_ptr(), norm.const_data_ptr(), k_caches[l].mutable_data_ptr(),
                    v_caches[l].mutable_data_ptr(), k_caches[l].stride(0), k_caches[l].stride(1),
                    v_caches[l].stride(0), v_caches[l].stride(1)};
    }
    const int64_t warps = shape.rows * p.layers * shape.kv_heads;
    TORCH_CHECK(ceil_div(warps, kWarps) <= std::numeric_limits<int32_t>::max(),
                "sglang_dflash.materialize_context_kv: too many (row, layer, kv head) items for one launch");
    const auto blocks = static_cast<unsigned>(ceil_div(warps, kWarps));
    SGLD_DISPATCH_FLOAT_TYPES(ctx.scalar_type(), "materialize_context_kv", [&] {
      using in_t = scalar_t;
      SGLD_DISPATCH_FLOAT_TYPES(k_caches[0].scalar_type(), "materialize_context_kv", [&] {
        context_kv_kernel<in_t, scalar_t><<<blocks, kThreads, smem, stream>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
}

}  // namespace sglang_dflash::cuda

TORCH_LIBRARY_IMPL(sglang_dflash, CUDA, m) {
  m.impl("materialize_context_kv", &sglang_dflash::cuda::materialize_context_kv);
}
