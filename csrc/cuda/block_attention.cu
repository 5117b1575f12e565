// CUDA block attention (DESIGN.md 3.1), the same semantics as csrc/cpu/block_attention.cpp.
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
// Two kernels compute the tiles:
//  - mma: bf16/fp16, head_dim 64/128/256, 16-byte aligned rows. cp.async 16-byte gathers of K/V
//    rows into double-buffered shared memory, ldmatrix + mma.sync m16n8k16 for Q K^T and P V
//    with fp32 accumulation, online softmax in registers (P rounded to the input type for P V).
//  - simt: every other case (fp32, other head_dim up to 256, unaligned views): fp32 dot products
//    from shared memory, one lane per key.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <type_traits>

#include "cuda_common.cuh"
#include "mma_sm80.cuh"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/online_softmax.h"

namespace sglang_dflash::cuda {
namespace {

constexpr int kThreads = 128;     // 4 warps per CTA, both kernels
constexpr int kMmaRows = 64;      // query rows per CTA on the mma path (16 per warp)
constexpr int kSimtRows = 16;     // query rows per CTA on the simt path (4 per warp)
constexpr int kSimtKeys = 32;     // keys per tile on the simt path (one per lane)
constexpr int kMaxHeadDim = 256;
constexpr int kMaxSplits = 32;
constexpr int64_t kMinKeysPerSplit = 256;

struct AttnParams {
  const void* q;
  const void* k_block;
  const void* v_block;
  const void* k_cache;
  const void* v_cache;
  int64_t q_s0, q_s1, kb_s0, kb_s1, vb_s0, vb_s1, kc_s0, kc_s1, vc_s0, vc_s1;  // in elements
  const void* table;  // req_to_token, rows of stride table_s0, contiguous columns
  const void* pools;  // req_pool_indices
  const void* ctx_lens;
  int64_t table_s0, table_width, table_rows, n_slots, n_rows;
  bool table64, pools64, ctx64, causal;
  int block_size, group, kv_heads, q_heads, head_dim, rows, row_tiles, splits, window;
  float sm_scale;
  const uint32_t* tree_sees;  // tree mode: [N, tree_words], bit c of row b*B+i = node c is i or its ancestor
  int tree_words;
  void* out;        // [N, Hq, D] contiguous, q's dtype
  float* part_o;    // [splits, N, Hq, D] un-normalised partial outputs (splits > 1)
  float* part_ml;   // [splits, N, Hq, 2] (max, sum) of each partial softmax (splits > 1)
  IndexError* errors;  // the device's error record (cuda_common.cuh)
};

// What one CTA computes: query rows [row0, row_end) of the B x group rows of (request b, kv head
// h), row r being block row r / group of q head h * group + r % group, against keys
// [begin, end).
struct Work {
  int b, h, row0, row_end;
  int64_t ctx, pool, begin, end;
};

template <int ROWS, int TILE>
__device__ __forceinline__ Work cta_work(const AttnParams& p) {
  Work w;
  const int64_t x = blockIdx.x;
  const int row_tile = static_cast<int>(x % p.row_tiles);
  const int64_t bh = x / p.row_tiles;
  w.b = static_cast<int>(bh / p.kv_heads);
  w.h = static_cast<int>(bh % p.kv_heads);
  w.row0 = row_tile * ROWS;
  w.row_end = min(p.rows, w.row0 + ROWS);
  w.pool = read_index(p.pools, p.pools64, w.b);
  w.ctx = read_index(p.ctx_lens, p.ctx64, w.b);
  // A request with its table row or context length out of range attends to its block only: its
  // output is not valid, but nothing outside req_to_token is read.
  if (!index_ok(w.pool >= 0 && w.pool < p.table_rows, p.errors, IndexCheck::kAttentionPool, w.b, 0,
                w.pool, p.table_rows) ||
      !index_ok(w.ctx >= 0 && w.ctx <= p.table_width, p.errors, IndexCheck::kAttentionCtxLen, w.b, 0,
                w.ctx, p.table_width)) {
    w.ctx = 0;
  }
  // Keys any of this CTA's rows can see.
  const int64_t i_min = w.row0 / p.group, i_max = (w.row_end - 1) / p.group;
  int64_t lo = 0, hi = w.ctx + p.block_size;
  if (p.window > 0) {
    lo = max(int64_t{0}, w.ctx + i_min - p.window + 1);
    hi = min(hi, w.ctx + i_max + p.window);
  }
  if (p.causal) hi = min(hi, w.ctx + i_max + 1);
  const int64_t chunk = ceil_div(ceil_div(hi - lo, p.splits), TILE) * TILE;
  w.begin = lo + blockIdx.y * chunk;
  w.end = min(hi, w.begin + chunk);
  return w;
}

// Whether block row i sees key k (k >= the CTA's begin is implied).
__device__ __forceinline__ bool visible(const AttnParams& p, const Work& w, int64_t k, int64_t i) {
  if (k >= w.end) return false;
  if (p.tree_sees != nullptr && k >= w.ctx) {
    const int64_t c = k - w.ctx;
    const uint32_t word = p.tree_sees[(static_cast<int64_t>(w.b) * p.block_size + i) * p.tree_words + c / 32];
    return (word >> (c % 32)) & 1u;
  }
  const int64_t pos = w.ctx + i;
  return (!p.causal || k <= pos) && (p.window <= 0 || (pos >= k ? pos - k : k - pos) < p.window);
}

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

// Row pointers of key k's K and V vectors for kv head w.h; false (kp, vp untouched) when its slot
// is outside the KV cache, and the caller loads zeros for it instead.
template <typename T>
__device__ __forceinline__ bool key_rows(const AttnParams& p, const Work& w, int64_t k,
                                         const T*& kp, const T*& vp) {
  if (k < w.ctx) {
    const int64_t slot = read_index(p.table, p.table64, w.pool * p.table_s0 + k);
    if (!index_ok(slot >= 0 && slot < p.n_slots, p.errors, IndexCheck::kAttentionSlot, w.pool, k,
                  slot, p.n_slots)) {
      return false;
    }
    kp = static_cast<const T*>(p.k_cache) + slot * p.kc_s0 + w.h * p.kc_s1;
    vp = static_cast<const T*>(p.v_cache) + slot * p.vc_s0 + w.h * p.vc_s1;
  } else {
    const int64_t r = static_cast<int64_t>(w.b) * p.block_size + (k - w.ctx);
    kp = static_cast<const T*>(p.k_block) + r * p.kb_s0 + w.h * p.kb_s1;
    vp = static_cast<const T*>(p.v_block) + r * p.vb_s0 + w.h * p.vb_s1;
  }
  return true;
}

// Output element offset of CTA row `row` (q row b*B + row/group, q head h*group + row%group).
__device__ __forceinline__ int64_t out_offset(const AttnParams& p, const Work& w, int row) {
  const int64_t n = static_cast<int64_t>(w.b) * p.block_size + row / p.group;
  const int64_t hq = static_cast<int64_t>(w.h) * p.group + row % p.group;
  return (n * p.q_heads + hq) * p.head_dim;
}

// A CTA whose slice of the key range is empty still owns its partial states: mark them empty.
__device__ __forceinline__ void write_empty_partials(const AttnParams& p, const Work& w) {
  for (int row = w.row0 + threadIdx.x; row < w.row_end; row += blockDim.x) {
    const int64_t base = blockIdx.y * p.n_rows * p.q_heads * p.head_dim + out_offset(p, w, row);
    float* ml = p.part_ml + base / p.head_dim * 2;
    ml[0] = -INFINITY;
    ml[1] = 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path.

template <int D>
struct MmaConfig {
  static constexpr int kTile = D <= 128 ? 64 : 32;  // keys per tile
  static constexpr int kLd = D + 8;                 // smem row stride in elements (+16 bytes:
                                                    // ldmatrix rows hit distinct banks)
  static constexpr int kChunks = D / 8;             // 16-byte chunks per row
  static constexpr size_t kSmemBytes = sizeof(uint16_t) * kLd * (kMmaRows + 4 * kTile);
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) block_attention_mma_kernel(const AttnParams p) {
  using Cfg = MmaConfig<D>;
  constexpr int TILE = Cfg::kTile, LD = Cfg::kLd, CH = Cfg::kChunks;
  constexpr int NT = TILE / 8;  // score tiles (16 x 8) per warp
  constexpr int DT = D / 8;     // output tiles (16 x 8) per warp
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
    const T* src = q_base;
    if (ok) {
      const int64_t n = static_cast<int64_t>(w.b) * p.block_size + row / p.group;
      const int64_t hq = static_cast<int64_t>(w.h) * p.group + row % p.group;
      src = q_base + n * p.q_s0 + hq * p.q_s1 + c * 8;
    }
    cp_async16(q_s + r * LD + c * 8, src, ok);
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
  // Block row of each of the thread's two fragment rows (padding rows borrow the last real one).
  int64_t brow[2];
  for (int half = 0; half < 2; ++half) {
    const int row = min(w.row0 + warp * 16 + gid + half * 8, w.row_end - 1);
    brow[half] = row / p.group;
  }
  const float scale_log2 = p.sm_scale * 1.4426950408889634f;  // scores in log2 units
  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // l: this thread's columns only

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
    const uint16_t* kb = k_s + buf * TILE * LD;
    const uint16_t* vb = v_s + buf * TILE * LD;

    // S = Q K^T for this warp's 16 rows.
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, q_s + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        uint32_t bk[4];
        ldmatrix_x4(bk, kb + (n2 * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 +
                            ((lane >> 3) & 1) * 8);
        mma_16816<T>(s[2 * n2], a, bk[0], bk[1]);
        mma_16816<T>(s[2 * n2 + 1], a, bk[2], bk[3]);
      }
    }

    // Mask, online softmax (log2 domain), rescale the accumulators.
    const int64_t k0 = w.begin + static_cast<int64_t>(t) * TILE;
    // Tiles wholly inside the range, with no window and no causal key among them, need no mask.
    const bool need_mask = k0 + TILE > w.end || p.window > 0 ||
                           ((p.causal || p.tree_sees != nullptr) && k0 + TILE > w.ctx);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t k = k0 + nt * 8 + 2 * tq + e;
          float v = s[nt][half * 2 + e] * scale_log2;
          if (need_mask && !visible(p, w, k, brow[half])) v = -INFINITY;
          s[nt][half * 2 + e] = v;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[half], mx);
      const float sub = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = m[half] == -INFINITY ? 0.0f : exp2f(m[half] - m_new);
      m[half] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = exp2f(s[nt][half * 2 + e] - sub);
          s[nt][half * 2 + e] = pv;
          sum += pv;
        }
      }
      l[half] = l[half] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][half * 2] *= alpha;
        o[dt][half * 2 + 1] *= alpha;
      }
    }

    // O += P V: the score accumulators of two adjacent key tiles are one A fragment.
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                              pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, vb + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + d2 * 16 +
                                  (lane >> 4) * 8);
        mma_16816<T>(o[2 * d2], pa, bv[0], bv[1]);
        mma_16816<T>(o[2 * d2 + 1], pa, bv[2], bv[3]);
      }
    }
    __syncthreads();  // this buffer is refilled by the next iteration's load
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = l[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = w.row0 + warp * 16 + gid + half * 8;
    if (row >= w.row_end) continue;
    const int64_t off = out_offset(p, w, row);
    if (p.splits == 1) {
      T* out = static_cast<T*>(p.out) + off;
      const float inv = 1.0f / sum;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        out[dt * 8 + 2 * tq] = static_cast<T>(o[dt][half * 2] * inv);
        out[dt * 8 + 2 * tq + 1] = static_cast<T>(o[dt][half * 2 + 1] * inv);
      }
    } else {
      const int64_t base = blockIdx.y * p.n_rows * p.q_heads * p.head_dim + off;
      float* po = p.part_o + base;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<float2*>(po + dt * 8 + 2 * tq) =
            make_float2(o[dt][half * 2], o[dt][half * 2 + 1]);
      }
      if (tq == 0) {
        float* ml = p.part_ml + base / p.head_dim * 2;
        ml[0] = m[half] == -INFINITY ? -INFINITY : m[half] * 0.6931471805599453f;  // natural log
        ml[1] = sum;
      }
    }
  }
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


template <typename T, int D>
void launch_mma(const AttnParams& p, dim3 grid, cudaStream_t stream) {
  const size_t smem = MmaConfig<D>::kSmemBytes;
  auto kernel = block_attention_mma_kernel<T, D>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<grid, kThreads, smem, stream>>>(p);
}

// Only bf16 / fp16 have an mma instantiation; the caller takes the mma path for nothing else.
template <typename T>
void launch_mma_for_dtype(const AttnParams& p, dim3 grid, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    if (p.head_dim == 64) {
      launch_mma<T, 64>(p, grid, stream);
    } else if (p.head_dim == 128) {
      launch_mma<T, 128>(p, grid, stream);
    } else {
      launch_mma<T, 256>(p, grid, stream);
    }
  } else {
    TORCH_CHECK(false, "sglang_dflash.block_attention: no tensor-core kernel for ", c10::CppTypeToScalarType<T>::value);
  }
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
  const int rows_per_cta = use_mma ? kMmaRows : kSimtRows;
  p.row_tiles = static_cast<int>(ceil_div(p.rows, rows_per_cta));
  // window < 0 is off; a window wider than any key distance is the same as off.
  p.window = window < 0 ? -1 : static_cast<int>(std::min<int64_t>(window, (int64_t{1} << 30)));
  p.sm_scale = static_cast<float>(sm_scale);
  p.out = out.data_ptr();
  p.errors = device_error_record(q.get_device());

  // Flash-decoding split: from shapes only. Fill one wave of ~2 CTAs per SM without spilling
  // into a second (floor), and never split the longest possible key range (req_to_token's width
  // + B) below kMinKeysPerSplit keys per split.
  const int64_t ctas = shape.batch * shape.kv_heads * p.row_tiles;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t max_keys = table.size(1) + block_size;
  int64_t splits = (2 * sms) / ctas;
  splits = std::min<int64_t>(splits, ceil_div(max_keys, kMinKeysPerSplit));
  // Tuning / testing knob: SGLANG_DFLASH_ATTN_SPLITS=n forces n splits (read once).
  static const int64_t forced_splits = [] {
    const char* env = std::getenv("SGLANG_DFLASH_ATTN_SPLITS");
    return env ? std::atoll(env) : int64_t{0};
  }();
  if (forced_splits > 0) splits = forced_splits;
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
  SGLD_DISPATCH_FLOAT_TYPES(q.scalar_type(), "block_attention", [&] {
    if (use_mma) {
      launch_mma_for_dtype<scalar_t>(p, grid, stream);
    } else {
      const size_t smem = sizeof(float) * (kSimtRows * D + kSimtKeys * (D + 1) + kSimtKeys * D);
      auto kernel = block_attention_simt_kernel<scalar_t>;
      // The limit for the largest head_dim, so one setting serves every call.
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), sizeof(float) * (kSimtRows * kMaxHeadDim +
                                                  kSimtKeys * (2 * kMaxHeadDim + 1)));
      kernel<<<grid, kThreads, smem, stream>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (splits > 1) {
      const int64_t warps = q.size(0) * shape.q_heads;
      const auto blocks = static_cast<unsigned>(ceil_div(warps * 32, kThreads));
      merge_splits_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

}  // namespace sglang_dflash::cuda

TORCH_LIBRARY_IMPL(sglang_dflash, CUDA, m) {
  m.impl("block_attention", &sglang_dflash::cuda::block_attention);
}
