// CUDA block attention (docs/design.md §3.1), the same semantics as csrc/cpu/block_attention.cpp.
//
// Keys are addressed by absolute position: context token j is key j (slot
// req_to_token[pool, j]), block row r is key ctx + r (read from k_block / v_block), so query row i
// (position ctx + i) sees key k when k < ctx + B, k <= ctx + i if causal_block, and
// |ctx + i - k| < window if the window is on; in tree mode, block key ctx + c only when node c is
// node i or its ancestor (a bitmask per node, built from tree_parents by a first small kernel into
// a shape-sized workspace). One CTA takes all the query rows that share a kv
// head (B x group rows, 64 per CTA on the tensor-core path) against one slice of that key range,
// so each K/V tile is read once for all of them; when bs x Hkv x row tiles is too few CTAs to fill
// the GPU, the key range is split across CTAs (flash-decoding) and a second kernel merges the
// partial softmax states. The split count depends only on shapes (never on ctx_lens, which stay
// on the device), each CTA divides its own request's actual key range, and the workspace comes
// from the caching allocator with a shape-only size: no host sync, CUDA-graph capturable.
// SGLANG_DFLASH_ATTN_SPLITS=n (read once per process) overrides the split count, for tuning.
//
// Kernels that compute the tiles:
//  - mma: bf16/fp16, head_dim 64/128/256, 16-byte aligned rows. cp.async 16-byte gathers of K/V
//    rows into double-buffered shared memory, ldmatrix + mma.sync m16n8k16 for Q K^T and P V
//    with fp32 accumulation, online softmax in registers (P rounded to the input type for P V).
//  - pipelined (block_attention_pipelined.cuh): the same math with slot ids read a stage ahead,
//    2-4 cp.async stages and Q's fragments in registers, in several configurations.
//  - simt: every other case (fp32, other head_dim up to 256, unaligned views): fp32 dot products
//    from shared memory, one lane per key.
// Kernel variants (variants.h; sglang_dflash/ops/variants.py): "default" is the mma kernel with
// the shape-only split count above; the others are pipelined configurations ("k64s3w4": 64 keys
// per tile, 3 stages, 4 warps), by default with the work split policy (one full wave of resident
// CTAs, each request using the splits its own key range fills, read on the device), and the first
// configuration also with the shape-only policy (".shapes") and forced split counts (".splitN").
// The thread's selected variant applies to the bf16 / fp16 tensor-core path; the SIMT path takes
// only its split policy.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "block_attention.cuh"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/env.h"
#include "sglang_dflash/online_softmax.h"
#include "sglang_dflash/variants.h"

namespace sglang_dflash::cuda {
namespace {

using namespace attention;  // NOLINT(build/namespaces): this file's kernels are the attention ones

constexpr int kThreads = 128;     // 4 warps per CTA, the first tensor-core and the SIMT kernels
constexpr int kSimtRows = 16;     // query rows per CTA on the simt path (4 per warp)
constexpr int kSimtKeys = 32;     // keys per tile on the simt path (one per lane)

// Tree mode: row n = b*B + i of `sees` gets the bits of node i and of its ancestors, one thread
// per node walking up tree_parents. A parent that is not a node before its child (nor -1) is
// recorded in the device's error record and ends the walk: the rows stay in range whatever the
// parents hold, and the call's outputs are not valid.
template <typename index_t>
__global__ void __launch_bounds__(kThreads) tree_sees_kernel(const index_t* parents, int64_t n_rows,
                                                             int block_size, int words, uint32_t* sees,
                                                             IndexError* errors) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= n_rows) return;
  const int64_t b = n / block_size;
  uint32_t* row = sees + n * words;
  for (int x = 0; x < words; ++x) row[x] = 0u;
  int64_t c = n % block_size;
  while (true) {
    row[c / 32] |= 1u << (c % 32);
    const int64_t parent = static_cast<int64_t>(parents[b * block_size + c]);
    if (parent == -1 || !index_ok(parent >= 0 && parent < c, errors, IndexCheck::kAttentionTreeParent, b, c,
                                  parent, c)) {
      break;
    }
    c = parent;
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path, first kernel (the "default" variant): double-buffered tiles, each tile's slots
// read by the threads that copy it.

template <int D>
struct MmaConfig {
  static constexpr int kTile = D <= 128 ? 64 : 32;  // keys per tile
  static constexpr int kLd = kSmemLd<D>;            // smem row stride in elements
  static constexpr int kChunks = D / 8;             // 16-byte chunks per row
  static constexpr size_t kSmemBytes = sizeof(uint16_t) * kLd * (kMmaRows + 4 * kTile);
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) block_attention_mma_kernel(const AttnParams p) {
  using Cfg = MmaConfig<D>;
  constexpr int TILE = Cfg::kTile, LD = Cfg::kLd, CH = Cfg::kChunks;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;                  // [64][LD]
  uint16_t* k_s = q_s + kMmaRows * LD;   // [2][TILE][LD]
  uint16_t* v_s = k_s + 2 * TILE * LD;   // [2][TILE][LD]

  const Work w = cta_work<kMmaRows, TILE>(p);
  if (w.begin >= w.end) {
    write_empty_partials(p, w);
    return;
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* q_base = static_cast<const T*>(p.q);

  // Q rows of this CTA (rows past row_end are zeros and never written out).
  for (int idx = tid; idx < kMmaRows * CH; idx += kThreads) {
    const int r = idx / CH, c = idx % CH, row = w.row0 + r;
    const bool ok = row < w.row_end;
    cp_async16(q_s + r * LD + c * 8, ok ? q_base + q_offset(p, w, row) + c * 8 : q_base, ok);
  }
  auto load_tile = [&](int64_t k0, int buf) {
    for (int idx = tid; idx < TILE * CH; idx += kThreads) {
      const int j = idx / CH, c = idx % CH;
      const int64_t k = k0 + j;
      const T* kp = static_cast<const T*>(p.k_block);
      const T* vp = static_cast<const T*>(p.v_block);
      const bool ok = k < w.end && key_rows<T>(p, w, k, kp, vp);  // else zero-filled, not read
      cp_async16(k_s + (buf * TILE + j) * LD + c * 8, kp + (ok ? c * 8 : 0), ok);
      cp_async16(v_s + (buf * TILE + j) * LD + c * 8, vp + (ok ? c * 8 : 0), ok);
    }
  };
  load_tile(w.begin, 0);
  cp_async_commit();

  const int gid = lane >> 2, tq = lane & 3;  // mma fragment coordinates
  const int warp_row0 = w.row0 + warp * 16;
  WarpState<D> st;
  st.init(p, w, warp_row0, gid);
  const float scale_log2 = p.sm_scale * 1.4426950408889634f;  // scores in log2 units

  const int n_tiles = static_cast<int>(ceil_div(w.end - w.begin, TILE));
  for (int t = 0; t < n_tiles; ++t) {
    const int buf = t & 1;
    if (t + 1 < n_tiles) {
      load_tile(w.begin + static_cast<int64_t>(t + 1) * TILE, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    float s[TILE / 8][4];
    tile_scores<T, D, TILE>(s, k_s + buf * TILE * LD, lane, [&](int kk, uint32_t(&a)[4]) {
      load_q_fragment<LD>(a, q_s + warp * 16 * LD, kk, lane);
    });
    tile_softmax<D, TILE>(p, w, w.begin + static_cast<int64_t>(t) * TILE, tq, scale_log2, s, st);
    tile_pv<T, D, TILE>(s, v_s + buf * TILE * LD, lane, st);
    __syncthreads();  // this buffer is refilled by the next iteration's load
  }
  store_rows<T, D>(p, w, warp_row0, gid, tq, st);
}

// ---------------------------------------------------------------------------------------------
// Generic path: fp32 (or any accepted dtype), head_dim <= 256, any alignment.

template <typename T>
__global__ void __launch_bounds__(kThreads) block_attention_simt_kernel(const AttnParams p) {
  constexpr int ROWS = kSimtRows, TILE = kSimtKeys, PER_WARP = ROWS / (kThreads / 32);
  constexpr int DV = kMaxHeadDim / 32;  // accumulator columns per lane
  extern __shared__ __align__(16) float fsm[];
  const int D = p.head_dim;
  float* q_s = fsm;                 // [ROWS][D], scaled by sm_scale
  float* k_s = q_s + ROWS * D;      // [TILE][D + 1]
  float* v_s = k_s + TILE * (D + 1);  // [TILE][D]
  __shared__ const T* kp_s[TILE];
  __shared__ const T* vp_s[TILE];

  const Work w = cta_work<ROWS, TILE>(p);
  if (w.begin >= w.end) {
    write_empty_partials(p, w);
    return;
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* q_base = static_cast<const T*>(p.q);
  for (int idx = tid; idx < ROWS * D; idx += kThreads) {
    const int r = idx / D, d = idx % D, row = w.row0 + r;
    float v = 0.0f;
    if (row < w.row_end) {
      const int64_t n = static_cast<int64_t>(w.b) * p.block_size + row / p.group;
      const int64_t hq = static_cast<int64_t>(w.h) * p.group + row % p.group;
      v = static_cast<float>(q_base[n * p.q_s0 + hq * p.q_s1 + d]) * p.sm_scale;
    }
    q_s[idx] = v;
  }
  int64_t brow[PER_WARP];
#pragma unroll
  for (int rr = 0; rr < PER_WARP; ++rr) {
    brow[rr] = min(w.row0 + warp * PER_WARP + rr, w.row_end - 1) / p.group;
  }
  float acc[PER_WARP][DV];
  float m[PER_WARP], l[PER_WARP];
#pragma unroll
  for (int rr = 0; rr < PER_WARP; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int dd = 0; dd < DV; ++dd) acc[rr][dd] = 0.0f;
  }

  for (int64_t k0 = w.begin; k0 < w.end; k0 += TILE) {
    __syncthreads();  // the previous tile is consumed (first pass: q_s is written)
    if (tid < TILE) {
      const T* kp = nullptr;  // null: zeros (past the range, or a slot outside the cache)
      const T* vp = nullptr;
      if (k0 + tid < w.end) key_rows<T>(p, w, k0 + tid, kp, vp);
      kp_s[tid] = kp;
      vp_s[tid] = vp;
    }
    __syncthreads();
    for (int idx = tid; idx < TILE * D; idx += kThreads) {
      const int j = idx / D, d = idx % D;
      const T* kp = kp_s[j];
      const T* vp = vp_s[j];
      k_s[j * (D + 1) + d] = kp ? static_cast<float>(kp[d]) : 0.0f;
      v_s[j * D + d] = vp ? static_cast<float>(vp[d]) : 0.0f;
    }
    __syncthreads();

    const int64_t k = k0 + lane;
    const float* k_row = k_s + lane * (D + 1);
#pragma unroll
    for (int rr = 0; rr < PER_WARP; ++rr) {
      const float* q_row = q_s + (warp * PER_WARP + rr) * D;
      float s = 0.0f;
      for (int d = 0; d < D; ++d) s += q_row[d] * k_row[d];
      if (!visible(p, w, k, brow[rr])) s = -INFINITY;
      float mx = s;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[rr], mx);
      if (m_new == -INFINITY) continue;  // nothing visible yet (uniform across the warp)
      const float scale = rescale_factor(m[rr], m_new);
      const float e = expf(s - m_new);
      float sum = e;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l[rr] = l[rr] * scale + sum;
      m[rr] = m_new;
#pragma unroll
      for (int dd = 0; dd < DV; ++dd) acc[rr][dd] *= scale;
      for (int j = 0; j < TILE; ++j) {
        const float pj = __shfl_sync(0xffffffffu, e, j);
        const float* v_row = v_s + j * D;
#pragma unroll
        for (int dd = 0; dd < DV; ++dd) {
          const int d = lane + 32 * dd;
          if (d < D) acc[rr][dd] += pj * v_row[d];
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < PER_WARP; ++rr) {
    const int row = w.row0 + warp * PER_WARP + rr;
    if (row >= w.row_end) continue;
    const int64_t off = out_offset(p, w, row);
    if (p.splits == 1) {
      T* out = static_cast<T*>(p.out) + off;
      const float inv = 1.0f / l[rr];
#pragma unroll
      for (int dd = 0; dd < DV; ++dd) {
        const int d = lane + 32 * dd;
        if (d < D) out[d] = static_cast<T>(acc[rr][dd] * inv);
      }
    } else {
      const int64_t base = blockIdx.y * p.n_rows * p.q_heads * p.head_dim + off;
#pragma unroll
      for (int dd = 0; dd < DV; ++dd) {
        const int d = lane + 32 * dd;
        if (d < D) p.part_o[base + d] = acc[rr][dd];
      }
      if (lane == 0) {
        float* ml = p.part_ml + base / p.head_dim * 2;
        ml[0] = m[rr];
        ml[1] = l[rr];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Merge of the split partial states: one warp per (q row, q head).

template <typename T>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(const AttnParams p) {
  const int64_t pair = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t n_pairs = p.n_rows * p.q_heads;
  if (pair >= n_pairs) return;
  const int D = p.head_dim;
  const int64_t split_stride = n_pairs * D;
  float acc[kMaxHeadDim / 32];
#pragma unroll
  for (int dd = 0; dd < kMaxHeadDim / 32; ++dd) acc[dd] = 0.0f;
  SoftmaxState state{-INFINITY, 0.0f};
  for (int s = 0; s < p.splits; ++s) {
    const float* ml = p.part_ml + (s * n_pairs + pair) * 2;
    const SoftmaxState part{ml[0], ml[1]};
    if (part.max == -INFINITY) continue;  // this split saw no key of the row
    float scale_acc, scale_part;
    merge_softmax(state, part, scale_acc, scale_part);
    const float* po = p.part_o + s * split_stride + pair * D;
#pragma unroll
    for (int dd = 0; dd < kMaxHeadDim / 32; ++dd) {
      const int d = lane + 32 * dd;
      if (d < D) acc[dd] = acc[dd] * scale_acc + po[d] * scale_part;
    }
  }
  T* out = static_cast<T*>(p.out) + pair * D;
  const float inv = 1.0f / state.sum;
#pragma unroll
  for (int dd = 0; dd < kMaxHeadDim / 32; ++dd) {
    const int d = lane + 32 * dd;
    if (d < D) out[d] = static_cast<T>(acc[dd] * inv);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

bool rows_aligned16(const at::Tensor& t) {
  const int64_t elems = 16 / t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % elems == 0 &&
         t.stride(1) % elems == 0;
}

// How a variant sizes the split grid (grid.y) and each request's share of it.
enum class SplitPolicy {
  kShapes,  // from shapes only: floor(2 * SMs / CTAs), every request uses every split
  kWork,    // one full wave of resident CTAs; each request uses ceil(its keys / 256) of the splits
  kForced,  // a fixed count
};

struct AttnVariant {
  std::string name;
  int config;  // kPipeConfigs index of the pipelined kernel; -1: the first tensor-core kernel
  SplitPolicy policy;
  int forced_splits;
};

// The variants, in the registered order (index = selected_kernel_variant). Each configuration of
// the pipelined kernel runs with the work policy; the first one also with the others.
const std::vector<AttnVariant>& attn_variants() {
  static const std::vector<AttnVariant> variants = [] {
    std::vector<AttnVariant> v{{"default", -1, SplitPolicy::kShapes, 0}};
    auto name = [](const PipeConfig& c) {
      return "k" + std::to_string(c.keys) + "s" + std::to_string(c.stages) + "w" + std::to_string(c.warps);
    };
    for (int c = 0; c < kPipeConfigCount; ++c) v.push_back({name(kPipeConfigs[c]), c, SplitPolicy::kWork, 0});
    v.push_back({name(kPipeConfigs[0]) + ".shapes", 0, SplitPolicy::kShapes, 0});
    for (const int n : {1, 4, 16, kMaxSplits}) {
      v.push_back({name(kPipeConfigs[0]) + ".split" + std::to_string(n), 0, SplitPolicy::kForced, n});
    }
    return v;
  }();
  return variants;
}

[[maybe_unused]] const bool variants_registered = [] {
  std::vector<std::string> names;
  for (const auto& v : attn_variants()) names.push_back(v.name);
  return register_kernel_variants(VariantOp::kBlockAttention, std::move(names));
}();

// CTAs of `launch` that fit on one SM at once (cached per kernel and device; a host query, so also
// allowed during a CUDA-graph capture).
int resident_ctas(const KernelLaunch& launch) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> known;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find({launch.fn, device});
  if (it != known.end()) return it->second;
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, launch.fn, launch.threads, launch.smem));
  n = std::max(n, 1);
  known[{launch.fn, device}] = n;
  return n;
}

template <typename T, int D>
KernelLaunch first_mma_kernel() {
  return {reinterpret_cast<const void*>(&block_attention_mma_kernel<T, D>), kThreads, MmaConfig<D>::kSmemBytes};
}

// The tensor-core kernel of `variant` for 16-bit type T and head_dim D (64, 128 or 256), and its
// query rows per CTA.
template <typename T>
std::pair<KernelLaunch, int> mma_kernel(const AttnVariant& variant, int64_t D) {
  if (variant.config < 0) {
    const KernelLaunch k = D == 64 ? first_mma_kernel<T, 64>() : D == 128 ? first_mma_kernel<T, 128>()
                                                                          : first_mma_kernel<T, 256>();
    return {k, kMmaRows};
  }
  const bool bf16 = std::is_same_v<T, c10::BFloat16>;
  const KernelLaunch k = D == 64    ? pipelined_kernel<64>(variant.config, bf16)
                         : D == 128 ? pipelined_kernel<128>(variant.config, bf16)
                                    : pipelined_kernel<256>(variant.config, bf16);
  return {k, 16 * kPipeConfigs[variant.config].warps};
}

// The kernel a call runs, its query rows per CTA, and the dynamic shared memory its attribute must
// allow (the SIMT kernel's for the largest head_dim, so one setting serves every call).
struct Chosen {
  KernelLaunch launch;
  int rows_per_cta;
  size_t smem_limit;
};

template <typename T>
Chosen choose_kernel(const AttnVariant& variant, bool use_mma, int64_t D) {
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    if (use_mma) {
      const auto [launch, rows] = mma_kernel<T>(variant, D);
      return {launch, rows, launch.smem};
    }
  }
  const size_t smem = sizeof(float) * (kSimtRows * D + kSimtKeys * (D + 1) + kSimtKeys * D);
  return {{reinterpret_cast<const void*>(&block_attention_simt_kernel<T>), kThreads, smem}, kSimtRows,
          sizeof(float) * (kSimtRows * kMaxHeadDim + kSimtKeys * (2 * kMaxHeadDim + 1))};
}

}  // namespace

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k_block,
                           const at::Tensor& v_block, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& req_to_token,
                           const at::Tensor& req_pool_indices, const at::Tensor& ctx_lens,
                           int64_t block_size, double sm_scale, int64_t window,
                           bool causal_block, const std::optional<at::Tensor>& tree_parents) {
  const auto shape = check_block_attention_args(q, k_block, v_block, k_cache, v_cache,
                                                req_to_token, req_pool_indices, ctx_lens,
                                                block_size, window, causal_block, tree_parents);
  TORCH_CHECK_VALUE(shape.head_dim <= kMaxHeadDim,
                    "sglang_dflash.block_attention: the CUDA kernel supports head_dim <= ",
                    kMaxHeadDim, ", got ", shape.head_dim);
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({q.size(0), shape.q_heads, shape.head_dim}, q.options());
  if (q.size(0) == 0) return out;
  // Index values cannot be checked here without a device sync: the kernels record the bad ones in
  // the device's error record (check_device_errors raises them).
  const auto table = req_to_token.stride(1) == 1 ? req_to_token : req_to_token.contiguous();
  const auto pools = req_pool_indices.contiguous();
  const auto lens = ctx_lens.contiguous();

  const bool mma_dtype = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  const int64_t D = shape.head_dim;
  const bool use_mma = mma_dtype && (D == 64 || D == 128 || D == 256) && rows_aligned16(q) &&
                       rows_aligned16(k_block) && rows_aligned16(v_block) &&
                       rows_aligned16(k_cache) && rows_aligned16(v_cache);
  // The thread's selected variant picks the tensor-core kernel and the split policy (the SIMT
  // kernel, which has one configuration, takes the split policy only).
  const AttnVariant& variant = attn_variants()[selected_kernel_variant(VariantOp::kBlockAttention)];
  Chosen chosen{};
  SGLD_DISPATCH_FLOAT_TYPES(q.scalar_type(), "block_attention", [&] {
    chosen = choose_kernel<scalar_t>(variant, use_mma, D);
  });

  AttnParams p{};
  p.q = q.data_ptr();
  p.k_block = k_block.data_ptr();
  p.v_block = v_block.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.q_s0 = q.stride(0);
  p.q_s1 = q.stride(1);
  p.kb_s0 = k_block.stride(0);
  p.kb_s1 = k_block.stride(1);
  p.vb_s0 = v_block.stride(0);
  p.vb_s1 = v_block.stride(1);
  p.kc_s0 = k_cache.stride(0);
  p.kc_s1 = k_cache.stride(1);
  p.vc_s0 = v_cache.stride(0);
  p.vc_s1 = v_cache.stride(1);
  p.table = table.data_ptr();
  p.pools = pools.data_ptr();
  p.ctx_lens = lens.data_ptr();
  p.table_s0 = table.stride(0);
  p.table_width = table.size(1);
  p.table_rows = table.size(0);
  p.n_slots = k_cache.size(0);
  p.n_rows = q.size(0);
  p.table64 = table.scalar_type() == at::kLong;
  p.pools64 = pools.scalar_type() == at::kLong;
  p.ctx64 = lens.scalar_type() == at::kLong;
  p.causal = causal_block;
  p.block_size = static_cast<int>(block_size);
  p.group = static_cast<int>(shape.q_heads / shape.kv_heads);
  p.kv_heads = static_cast<int>(shape.kv_heads);
  p.q_heads = static_cast<int>(shape.q_heads);
  p.head_dim = static_cast<int>(D);
  p.rows = p.block_size * p.group;
  p.row_tiles = static_cast<int>(ceil_div(p.rows, chosen.rows_per_cta));
  // window < 0 is off; a window wider than any key distance is the same as off.
  p.window = window < 0 ? -1 : static_cast<int>(std::min<int64_t>(window, (int64_t{1} << 30)));
  p.sm_scale = static_cast<float>(sm_scale);
  p.out = out.data_ptr();
  p.errors = device_error_record(q.get_device());
  const auto* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK_VALUE(chosen.launch.smem <= props->sharedMemPerBlockOptin, "sglang_dflash.block_attention: kernel "
                    "variant \"", variant.name, "\" needs ", chosen.launch.smem, " bytes of shared memory per CTA at "
                    "head_dim ", D, "; this GPU allows ", props->sharedMemPerBlockOptin);
  allow_dynamic_smem(chosen.launch.fn, chosen.smem_limit);

  // Flash-decoding split, from shapes only (no ctx_lens on the host). Never split the longest
  // possible key range (req_to_token's width + B) below kMinKeysPerSplit keys per split.
  const int64_t ctas = shape.batch * shape.kv_heads * p.row_tiles;
  const int64_t sms = props->multiProcessorCount;
  const int64_t max_keys = table.size(1) + block_size;
  int64_t splits = 1;
  if (variant.policy == SplitPolicy::kShapes) {
    // Fill one wave of ~2 CTAs per SM without spilling into a second (floor).
    splits = std::min<int64_t>((2 * sms) / ctas, ceil_div(max_keys, kMinKeysPerSplit));
  } else if (variant.policy == SplitPolicy::kWork) {
    // At least one full wave of resident CTAs (ceil); each request takes the splits its own key
    // range fills with kMinKeysPerSplit keys, read on the device (the rest exit at once).
    splits = std::min<int64_t>(ceil_div(resident_ctas(chosen.launch) * sms, ctas),
                               ceil_div(max_keys, kMinKeysPerSplit));
    p.split_keys = kMinKeysPerSplit;
  } else {
    splits = variant.forced_splits;
  }
  // Tuning / testing knob: SGLANG_DFLASH_ATTN_SPLITS=n forces n splits (read once), for every
  // variant without a split count of its own.
  static const int64_t forced_splits = env_int("SGLANG_DFLASH_ATTN_SPLITS", 0);
  if (forced_splits > 0 && variant.policy != SplitPolicy::kForced) {
    splits = forced_splits;
    p.split_keys = 0;
  }
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, kMaxSplits));
  p.splits = static_cast<int>(splits);
  at::Tensor part_o, part_ml;
  if (splits > 1) {
    auto fopts = q.options().dtype(at::kFloat);
    part_o = at::empty({splits, q.size(0), shape.q_heads, D}, fopts);
    part_ml = at::empty({splits, q.size(0), shape.q_heads, 2}, fopts);
    p.part_o = part_o.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  }
  TORCH_CHECK(ctas <= std::numeric_limits<int32_t>::max(),
              "sglang_dflash.block_attention: too many (request, kv head) pairs for one launch");

  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor sees;  // tree mode: the nodes' ancestor bitmasks, from the caching allocator (shape-sized)
  if (tree_parents) {
    const auto parents = tree_parents->contiguous();
    p.tree_words = static_cast<int>(ceil_div(block_size, int64_t{32}));
    sees = at::empty({q.size(0), p.tree_words}, q.options().dtype(at::kInt));
    auto* rows = reinterpret_cast<uint32_t*>(sees.data_ptr<int32_t>());
    p.tree_sees = rows;
    const auto blocks = static_cast<unsigned>(ceil_div(q.size(0), int64_t{kThreads}));
    if (parents.scalar_type() == at::kLong) {
      tree_sees_kernel<<<blocks, kThreads, 0, stream>>>(parents.data_ptr<int64_t>(), q.size(0), p.block_size,
                                                        p.tree_words, rows, p.errors);
    } else {
      tree_sees_kernel<<<blocks, kThreads, 0, stream>>>(parents.data_ptr<int32_t>(), q.size(0), p.block_size,
                                                        p.tree_words, rows, p.errors);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(splits));
  void* args[] = {&p};
  C10_CUDA_CHECK(cudaLaunchKernel(chosen.launch.fn, grid, dim3(chosen.launch.threads), args, chosen.launch.smem,
                                  stream));
  if (splits > 1) {
    SGLD_DISPATCH_FLOAT_TYPES(q.scalar_type(), "block_attention", [&] {
      const int64_t warps = q.size(0) * shape.q_heads;
      const auto blocks = static_cast<unsigned>(ceil_div(warps * 32, kThreads));
      merge_splits_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return out;
}

}  // namespace sglang_dflash::cuda

TORCH_LIBRARY_IMPL(sglang_dflash, CUDA, m) {
  m.impl("block_attention", &sglang_dflash::cuda::block_attention);
}
