// The pipelined tensor-core block-attention kernel (every block_attention variant but "default";
// block_attention.cu picks and launches it). Same work split, visibility, index checks, math and
// outputs as the first tensor-core kernel; what differs is how the K/V tiles arrive:
//  - Slot ids are read a stage ahead, one thread per key: at the end of iteration t, thread j
//    turns the slot of key j of tile t + S (read from req_to_token at the end of iteration t - 1,
//    into a register) into K/V row pointers in a shared ring of S tiles, and reads the slot of
//    tile t + S + 1. A tile's cp.async copies therefore never wait on a dependent table read.
//  - S cp.async stages (S - 1 tiles in flight while one is consumed), one barrier per tile.
//  - Q's A fragments stay in registers for head_dim <= 128 (read once from shared memory, whose
//    buffer then becomes the last stage); head_dim 256 reads them from shared memory per tile.
//  - All B x group query rows of a kv head in one CTA up to 16 x warps rows, so each K/V tile is
//    read once for all of them.
// Shared-memory layout (in this order): K row pointers [S][TILE], V row pointers [S][TILE], then
// per stage K [TILE][LD] and V [TILE][LD], then (head_dim 256) Q [ROWS][LD]. tests/
// test_cuda_emulation.py mirrors this file's index arithmetic line for line.
#pragma once

#include <utility>

#include "block_attention.cuh"

namespace sglang_dflash::cuda::attention {

template <int D, int C>
struct Pipe {
  static constexpr int kTile = D <= 128 ? kPipeConfigs[C].keys : kPipeConfigs[C].keys / 2;
  static constexpr int kStages = kPipeConfigs[C].stages;
  static constexpr int kWarps = kPipeConfigs[C].warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * kWarps;
  static constexpr int kLd = kSmemLd<D>;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr bool kQInRegisters = D <= 128;
  static constexpr int kStageElems = 2 * kTile * kLd;  // K then V
  static constexpr size_t kRingBytes = sizeof(void*) * 2 * kStages * kTile;
  static constexpr size_t kSmemBytes =
      kRingBytes + sizeof(uint16_t) * (kStages * kStageElems + (kQInRegisters ? 0 : kRows * kLd));
  // Two CTAs of 4 warps per SM (the registers allow no more); 8-warp CTAs one.
  static constexpr int kMinBlocks = kWarps == 4 ? 2 : 1;
  static_assert(kTile % 16 == 0 && kTile <= kThreads, "one thread per key of a tile");
  static_assert(kStages >= 2, "a tile in flight while one is consumed");
  static_assert(!kQInRegisters || kRows * kLd <= kStageElems, "Q is staged in the last stage's buffer");
};

template <typename T, int D, int C>
__global__ void __launch_bounds__(Pipe<D, C>::kThreads, Pipe<D, C>::kMinBlocks)
    block_attention_pipelined_kernel(const AttnParams p) {
  using Cfg = Pipe<D, C>;
  constexpr int TILE = Cfg::kTile, S = Cfg::kStages, ROWS = Cfg::kRows, THREADS = Cfg::kThreads;
  constexpr int LD = Cfg::kLd, CH = Cfg::kChunks;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const T** kp_s = reinterpret_cast<const T**>(smem_bytes);  // [S][TILE]
  const T** vp_s = kp_s + S * TILE;                          // [S][TILE]
  uint16_t* stage_s = reinterpret_cast<uint16_t*>(smem_bytes + Cfg::kRingBytes);  // [S][K, V][TILE][LD]
  uint16_t* q_s = stage_s + (Cfg::kQInRegisters ? (S - 1) * Cfg::kStageElems : S * Cfg::kStageElems);

  const Work w = cta_work<ROWS, TILE>(p);
  if (w.begin >= w.end) {
    write_empty_partials(p, w);
    return;
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n_tiles = static_cast<int>(ceil_div(w.end - w.begin, TILE));

  // Thread j < TILE owns key j of every tile: its slot (context keys) is read one stage early.
  auto slot_of = [&](int tile) -> int64_t {
    const int64_t k = w.begin + static_cast<int64_t>(tile) * TILE + tid;
    return k < w.end && k < w.ctx ? key_slot(p, w, k) : int64_t{0};
  };
  // K/V row pointers of the thread's key of `tile` into ring entry tile % S; null: load zeros
  // (past the range, or a slot outside the KV cache, recorded as an index error).
  auto resolve = [&](int tile, int64_t slot) {
    const int64_t k = w.begin + static_cast<int64_t>(tile) * TILE + tid;
    const T* kp = nullptr;
    const T* vp = nullptr;
    if (k < w.end) rows_of_key<T>(p, w, k, slot, kp, vp);
    kp_s[(tile % S) * TILE + tid] = kp;
    vp_s[(tile % S) * TILE + tid] = vp;
  };
  // Copies of tile `tile` into stage tile % S, from its ring entry.
  auto load_tile = [&](int tile) {
    uint16_t* ks = stage_s + (tile % S) * Cfg::kStageElems;
    uint16_t* vs = ks + TILE * LD;
#pragma unroll
    for (int idx = tid; idx < TILE * CH; idx += THREADS) {
      const int j = idx / CH, c = idx % CH;
      const T* kp = kp_s[(tile % S) * TILE + j];
      const T* vp = vp_s[(tile % S) * TILE + j];
      const bool ok = kp != nullptr;  // else zero-filled, not read
      cp_async16(ks + j * LD + c * 8, ok ? kp + c * 8 : static_cast<const T*>(p.k_block), ok);
      cp_async16(vs + j * LD + c * 8, ok ? vp + c * 8 : static_cast<const T*>(p.v_block), ok);
    }
  };

  // Prologue: the ring for tiles 0 .. S-1, then Q (with tile 0's group) and tiles 0 .. S-2.
  int64_t next_slot = 0;
  if (tid < TILE) {
#pragma unroll
    for (int tile = 0; tile < S; ++tile) resolve(tile, slot_of(tile));
    next_slot = slot_of(S);
  }
  const T* q_base = static_cast<const T*>(p.q);
  for (int idx = tid; idx < ROWS * CH; idx += THREADS) {
    const int r = idx / CH, c = idx % CH, row = w.row0 + r;
    const bool ok = row < w.row_end;  // rows past row_end are zeros, never written out
    cp_async16(q_s + r * LD + c * 8, ok ? q_base + q_offset(p, w, row) + c * 8 : q_base, ok);
  }
  __syncthreads();  // the ring
#pragma unroll
  for (int tile = 0; tile < S - 1; ++tile) {
    if (tile < n_tiles) load_tile(tile);
    cp_async_commit();  // one group per tile, empty past the range, so the wait count is fixed
  }

  const int gid = lane >> 2, tq = lane & 3;
  const int warp_row0 = w.row0 + warp * 16;
  WarpState<D> st;
  st.init(p, w, warp_row0, gid);
  const float scale_log2 = p.sm_scale * 1.4426950408889634f;  // scores in log2 units
  uint32_t qf[Cfg::kQInRegisters ? D / 16 : 1][4];

  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<S - 2>();  // tile t (and Q, with tile 0) has landed
    __syncthreads();         // for every thread; and stage (t - 1) % S is consumed
    if constexpr (Cfg::kQInRegisters) {
      if (t == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) load_q_fragment<LD>(qf[kk], q_s + warp * 16 * LD, kk, lane);
        __syncthreads();  // Q's buffer is the stage tile S - 1 goes to
      }
    }
    if (t + S - 1 < n_tiles) load_tile(t + S - 1);
    cp_async_commit();

    const uint16_t* kb = stage_s + (t % S) * Cfg::kStageElems;
    float s[TILE / 8][4];
    if constexpr (Cfg::kQInRegisters) {
      tile_scores<T, D, TILE>(s, kb, lane, [&](int kk, uint32_t(&a)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = qf[kk][i];
      });
    } else {
      tile_scores<T, D, TILE>(s, kb, lane, [&](int kk, uint32_t(&a)[4]) {
        load_q_fragment<LD>(a, q_s + warp * 16 * LD, kk, lane);
      });
    }
    tile_softmax<D, TILE>(p, w, w.begin + static_cast<int64_t>(t) * TILE, tq, scale_log2, s, st);
    tile_pv<T, D, TILE>(s, kb + TILE * LD, lane, st);

    // Ring entry t % S served tile t's copies (issued S - 1 iterations ago): it takes tile t + S,
    // read by the copies of iteration t + 1, after its barrier.
    if (tid < TILE) {
      resolve(t + S, next_slot);
      next_slot = slot_of(t + S + 1);
    }
  }
  cp_async_wait<0>();  // no copy may still be landing when the CTA exits
  store_rows<T, D>(p, w, warp_row0, gid, tq, st);
}

template <typename T, int D, int C>
KernelLaunch pipelined_entry() {
  return {reinterpret_cast<const void*>(&block_attention_pipelined_kernel<T, D, C>), Pipe<D, C>::kThreads,
          Pipe<D, C>::kSmemBytes};
}

template <int D, int... C>
KernelLaunch pipelined_kernel_of(int config, bool bf16, std::integer_sequence<int, C...>) {
  KernelLaunch launch{};
  ((config == C ? (launch = bf16 ? pipelined_entry<c10::BFloat16, D, C>() : pipelined_entry<c10::Half, D, C>(), 0)
                : 0),
   ...);
  TORCH_CHECK(launch.fn != nullptr, "sglang_dflash.block_attention: no pipelined configuration ", config);
  return launch;
}

template <int D>
KernelLaunch pipelined_kernel(int config, bool bf16) {
  return pipelined_kernel_of<D>(config, bf16, std::make_integer_sequence<int, kPipeConfigCount>{});
}

}  // namespace sglang_dflash::cuda::attention
