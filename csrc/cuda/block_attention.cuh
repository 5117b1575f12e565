// What the block-attention kernels share (block_attention.cu: the launch, the first tensor-core
// kernel, the SIMT kernel and the split merge; block_attention_pipelined.cuh: the pipelined
// tensor-core kernels of the other variants): the launch parameters, each CTA's share of the work,
// the visibility rule, the slot lookup with its index check, and one warp's tensor-core math on a
// tile of keys (S = Q K^T, masked online softmax, O += P V) and its output.
#pragma once

#include <cstdint>

#include "cuda_common.cuh"
#include "mma_sm80.cuh"

namespace sglang_dflash::cuda::attention {

constexpr int kMmaRows = 64;  // query rows per CTA of the first tensor-core kernel (16 per warp)
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
  // > 0: a request whose visible key range holds n keys uses only min(splits, ceil(n / split_keys))
  // of the grid's splits (the others are empty), read on the device; 0: every request uses all.
  int64_t split_keys;
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
  int64_t splits = p.splits;
  if (p.split_keys > 0) splits = max(int64_t{1}, min(splits, ceil_div(hi - lo, p.split_keys)));
  // Slices past the request's own split count start at or past hi: empty.
  const int64_t chunk = ceil_div(ceil_div(hi - lo, splits), TILE) * TILE;
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

// Context key k's slot (k < w.ctx), read from req_to_token.
__device__ __forceinline__ int64_t key_slot(const AttnParams& p, const Work& w, int64_t k) {
  return read_index(p.table, p.table64, w.pool * p.table_s0 + k);
}

// Row pointers of key k's K and V vectors for kv head w.h, `slot` being its slot when k is a
// context key (k < w.ctx; key_slot); false (kp, vp untouched) when that slot is outside the KV
// cache, and the caller loads zeros for it instead.
template <typename T>
__device__ __forceinline__ bool rows_of_key(const AttnParams& p, const Work& w, int64_t k, int64_t slot,
                                            const T*& kp, const T*& vp) {
  if (k < w.ctx) {
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

// rows_of_key with the slot read here.
template <typename T>
__device__ __forceinline__ bool key_rows(const AttnParams& p, const Work& w, int64_t k, const T*& kp,
                                         const T*& vp) {
  return rows_of_key<T>(p, w, k, k < w.ctx ? key_slot(p, w, k) : int64_t{0}, kp, vp);
}

// Output element offset of CTA row `row` (q row b*B + row/group, q head h*group + row%group).
__device__ __forceinline__ int64_t out_offset(const AttnParams& p, const Work& w, int row) {
  const int64_t n = static_cast<int64_t>(w.b) * p.block_size + row / p.group;
  const int64_t hq = static_cast<int64_t>(w.h) * p.group + row % p.group;
  return (n * p.q_heads + hq) * p.head_dim;
}

// Element offset of CTA row `row`'s query vector in q.
__device__ __forceinline__ int64_t q_offset(const AttnParams& p, const Work& w, int row) {
  const int64_t n = static_cast<int64_t>(w.b) * p.block_size + row / p.group;
  const int64_t hq = static_cast<int64_t>(w.h) * p.group + row % p.group;
  return n * p.q_s0 + hq * p.q_s1;
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
// One warp's tensor-core work: 16 query rows (CTA rows warp_row0 .. +15; the thread holds
// fragment rows gid = lane / 4 and gid + 8, columns 2 * tq, +1 with tq = lane % 4 of each 8-wide
// tile) against one tile of keys in shared memory (rows of LD 16-bit elements).

// The smem row stride of a D-wide tile: +16 bytes, so the 8 rows of an ldmatrix hit distinct banks.
template <int D>
constexpr int kSmemLd = D + 8;

template <int D>
struct WarpState {
  float o[D / 8][4];  // un-normalised output, 16 x D
  float m[2];         // running max of each fragment row (log2 units)
  float l[2];         // running sum of each fragment row, over this thread's columns only
  int64_t brow[2];    // block row of each fragment row (padding rows borrow the CTA's last real one)

  __device__ __forceinline__ void init(const AttnParams& p, const Work& w, int warp_row0, int gid) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      m[half] = -INFINITY;
      l[half] = 0.0f;
      brow[half] = min(warp_row0 + gid + half * 8, w.row_end - 1) / p.group;
    }
  }
};

// The A fragment of Q columns [16 kk, 16 kk + 16) of the warp's 16 rows, read from q_s (rows of
// LD elements, the warp's first row first).
template <int LD>
__device__ __forceinline__ void load_q_fragment(uint32_t (&a)[4], const uint16_t* q_s, int kk, int lane) {
  ldmatrix_x4(a, q_s + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
}

// S = Q K^T against the TILE keys of kb; q_frag(kk, a) supplies Q's A fragment kk.
template <typename T, int D, int TILE, typename QFrag>
__device__ __forceinline__ void tile_scores(float (&s)[TILE / 8][4], const uint16_t* kb, int lane,
                                            QFrag&& q_frag) {
  constexpr int LD = kSmemLd<D>;
#pragma unroll
  for (int nt = 0; nt < TILE / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    q_frag(kk, a);
#pragma unroll
    for (int n2 = 0; n2 < TILE / 16; ++n2) {
      uint32_t bk[4];
      ldmatrix_x4(bk, kb + (n2 * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
      mma_16816<T>(s[2 * n2], a, bk[0], bk[1]);
      mma_16816<T>(s[2 * n2 + 1], a, bk[2], bk[3]);
    }
  }
}

// Masks the scores of keys [k0, k0 + TILE), folds them into the running softmax (log2 units) of
// the thread's two fragment rows, rescales the output accumulators and leaves P in s.
template <int D, int TILE>
__device__ __forceinline__ void tile_softmax(const AttnParams& p, const Work& w, int64_t k0, int tq,
                                             float scale_log2, float (&s)[TILE / 8][4], WarpState<D>& st) {
  // Tiles wholly inside the range, with no window and no causal key among them, need no mask.
  const bool need_mask = k0 + TILE > w.end || p.window > 0 ||
                         ((p.causal || p.tree_sees != nullptr) && k0 + TILE > w.ctx);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < TILE / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t k = k0 + nt * 8 + 2 * tq + e;
        float v = s[nt][half * 2 + e] * scale_log2;
        if (need_mask && !visible(p, w, k, st.brow[half])) v = -INFINITY;
        s[nt][half * 2 + e] = v;
        mx = fmaxf(mx, v);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(st.m[half], mx);
    const float sub = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = st.m[half] == -INFINITY ? 0.0f : exp2f(st.m[half] - m_new);
    st.m[half] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < TILE / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = exp2f(s[nt][half * 2 + e] - sub);
        s[nt][half * 2 + e] = pv;
        sum += pv;
      }
    }
    st.l[half] = st.l[half] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      st.o[dt][half * 2] *= alpha;
      st.o[dt][half * 2 + 1] *= alpha;
    }
  }
}

// O += P V against the TILE value rows of vb: the score accumulators of two adjacent 8-key tiles
// are one A fragment (P rounded to T, like FlashAttention-2).
template <typename T, int D, int TILE>
__device__ __forceinline__ void tile_pv(const float (&s)[TILE / 8][4], const uint16_t* vb, int lane,
                                        WarpState<D>& st) {
  constexpr int LD = kSmemLd<D>;
#pragma unroll
  for (int kk = 0; kk < TILE / 16; ++kk) {
    const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                            pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int d2 = 0; d2 < D / 16; ++d2) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, vb + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + d2 * 16 + (lane >> 4) * 8);
      mma_16816<T>(st.o[2 * d2], pa, bv[0], bv[1]);
      mma_16816<T>(st.o[2 * d2 + 1], pa, bv[2], bv[3]);
    }
  }
}

// Writes the warp's rows: normalised into out (one split), or the un-normalised partial output and
// its (max, sum) in natural-log units into the split workspace.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const AttnParams& p, const Work& w, int warp_row0, int gid, int tq,
                                           const WarpState<D>& st) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = st.l[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = warp_row0 + gid + half * 8;
    if (row >= w.row_end) continue;
    const int64_t off = out_offset(p, w, row);
    if (p.splits == 1) {
      T* out = static_cast<T*>(p.out) + off;
      const float inv = 1.0f / sum;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        out[dt * 8 + 2 * tq] = static_cast<T>(st.o[dt][half * 2] * inv);
        out[dt * 8 + 2 * tq + 1] = static_cast<T>(st.o[dt][half * 2 + 1] * inv);
      }
    } else {
      const int64_t base = blockIdx.y * p.n_rows * p.q_heads * p.head_dim + off;
      float* po = p.part_o + base;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<float2*>(po + dt * 8 + 2 * tq) = make_float2(st.o[dt][half * 2], st.o[dt][half * 2 + 1]);
      }
      if (tq == 0) {
        float* ml = p.part_ml + base / p.head_dim * 2;
        ml[0] = st.m[half] == -INFINITY ? -INFINITY : st.m[half] * 0.6931471805599453f;  // natural log
        ml[1] = sum;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The pipelined kernels (block_attention_pipelined.cuh), compiled one head_dim per file.

// A kernel entry and its launch shape, so the host code of block_attention.cu launches (and sizes
// the split grid for) kernels compiled in other files.
struct KernelLaunch {
  const void* fn;
  int threads;
  size_t smem;
};

// Configuration `config` (kPipeConfigs) of the pipelined kernel for head_dim D and 16-bit type
// bf16 ? bf16 : fp16; defined in block_attention_pipelined_d{64,128,256}.cu.
template <int D>
KernelLaunch pipelined_kernel(int config, bool bf16);

// Keys per tile, cp.async stages, warps (16 query rows each) of the pipelined kernel's
// configurations. head_dim 256 halves the tile (registers and shared memory).
struct PipeConfig {
  int keys, stages, warps;
};
constexpr PipeConfig kPipeConfigs[] = {{64, 3, 4}, {64, 2, 4}, {32, 4, 4}, {64, 4, 4}, {64, 3, 8}};
constexpr int kPipeConfigCount = sizeof(kPipeConfigs) / sizeof(kPipeConfigs[0]);

}  // namespace sglang_dflash::cuda::attention
