// skinny_linear's bf16 path on AMX tiles (Intel Xeon 4th generation and later): bf16 x, bf16
// weight, fp32 sums, one rounding to bf16 at the end.
//
// The fp32 FMA paths (skinny_linear.cpp) convert bf16 to fp32 and are bound by their FMAs past
// ~5 rows on 2 cores: each verified row costs as much as a decode step's worth of weight reading.
// One TDPBF16PS multiplies a 16 x 32 weight tile by a 32 x 16 x tile (8192 products), so with AMX
// a verify of up to 16 rows reads the weight once and costs about what one row costs; each weight
// tile loaded serves two x tiles, so up to 32 rows still load it once. The weight
// is used as it lies: its rows are the tile's A operand (16 rows x 32 bf16, 64 bytes each, the
// row stride of the weight), and x, re-laid once a call into VNNI pairs, is the B operand; the
// 16 x 16 fp32 accumulator tile holds weight rows x x rows.
//
// Batch invariance: out[m, n] is the accumulator's (n, m) element, built by the same sequence of
// TDPBF16PS over k (32 at a time, in order), then the K tail (K % 32) in fp32 in order, then the
// bias: it depends on x row m and weight row n only, never on the other rows or their count. The
// products of bf16 values are exact in fp32, as on the FMA paths; only the order of the fp32 sums
// differs (and AMX reads bf16 denormals as zero), so AMX and FMA results differ in the last bits,
// and the path is chosen once per process (SGLANG_DFLASH_NO_AMX=1 keeps the FMA path).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "cpu_kernels.h"
#include "sglang_dflash/env.h"

namespace sglang_dflash::cpu {

#if SGLD_HAS_AMX
namespace {
#define SGLD_AMX_BF16 __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kTile = 16;  // weight rows (A tile rows) and x rows (B tile columns) a tile
constexpr int64_t kStep = 32;  // bf16 values of k a tile row holds (64 bytes)
constexpr int64_t kTileValues = kTile * kStep;
constexpr int64_t kPrefetchTilesAhead = 4;  // weight row tiles, into L2 while these are multiplied

// Tile registers (literals: the intrinsics paste them into the instruction): the accumulators of
// two weight row tiles x two x row tiles (up to four independent TDPBF16PS chains, which hide the
// instruction's latency; each weight tile load serves both x tiles, so a verify of 17-32 rows
// reads the weight from L2 once, not once per x tile), their A operands and the two x tiles.
#define SGLD_TILE_SUM_A_X0 0
#define SGLD_TILE_SUM_B_X0 1
#define SGLD_TILE_SUM_A_X1 2
#define SGLD_TILE_SUM_B_X1 3
#define SGLD_TILE_WEIGHT0 4
#define SGLD_TILE_WEIGHT1 5
#define SGLD_TILE_X0 6
#define SGLD_TILE_X1 7
constexpr int kTilesUsed = 8;

using WeightTile = WeightRowTile<c10::BFloat16>;

// out rows [m0, m0 + rows) x weight tile t's columns from the accumulator sums[n][m]: plus the
// K tail in fp32 in k order, plus the bias, one rounding (to nearest even). Without a K tail, 16
// columns at a time: a gathered accumulator column, the bias, VCVTNEPS2BF16 (which reads fp32
// denormals as zero; the scalar path keeps them: a path per K, so batch invariance holds).
SGLD_AMX_BF16 void store_tile(const float (&sums)[kTile][kTile], const WeightTile& wt, int64_t t,
                              const c10::BFloat16* x, int64_t m0, int64_t rows, int64_t K,
                              const c10::BFloat16* bias, int64_t N, c10::BFloat16* out) {
  const int64_t k_full = K - K % kStep;
  if (k_full == K) {
    const __mmask16 columns = static_cast<__mmask16>((1u << wt.count) - 1);
    const __m512i sum_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(kTile));
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i raw = _mm256_maskz_loadu_epi16(columns, bias + t * kTile);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int64_t m = 0; m < rows; ++m) {
      __m512 v = _mm512_i32gather_ps(sum_rows, &sums[0][m], sizeof(float));
      if (bias != nullptr) v = _mm512_add_ps(v, b);
      _mm256_mask_storeu_epi16(out + (m0 + m) * N + t * kTile, columns, (__m256i)_mm512_cvtneps_pbh(v));
    }
    return;
  }
  for (int64_t m = 0; m < rows; ++m) {
    const c10::BFloat16* xr = x + (m0 + m) * K;
    for (int64_t n = 0; n < wt.count; ++n) {
      float sum = sums[n][m];
      const c10::BFloat16* wr = wt.rows + n * wt.stride;
      for (int64_t k = k_full; k < K; ++k) sum += static_cast<float>(xr[k]) * static_cast<float>(wr[k]);
      if (bias != nullptr) sum += static_cast<float>(bias[t * kTile + n]);
      out[(m0 + m) * N + t * kTile + n] = c10::BFloat16(sum);
    }
  }
}

using TileSums = float[kTile][kTile];

// sums[w + 2 j] = weight tile w (a, or b with `pair`) x x tile j (x0, or x1 with `two_x`), over
// k in order. Meanwhile the weight rows `prefetch` go into L2, a cache line of each per k step.
template <bool pair, bool two_x>
SGLD_AMX_BF16 void multiply_tiles(const WeightTile& a, const WeightTile& b, const uint32_t* x0, const uint32_t* x1,
                                  int64_t k_tiles, const char* const (&prefetch)[2 * kTile], TileSums (&sums)[4]) {
  _tile_zero(SGLD_TILE_SUM_A_X0);
  if constexpr (pair) _tile_zero(SGLD_TILE_SUM_B_X0);
  if constexpr (two_x) _tile_zero(SGLD_TILE_SUM_A_X1);
  if constexpr (pair && two_x) _tile_zero(SGLD_TILE_SUM_B_X1);
  for (int64_t kb = 0; kb < k_tiles; ++kb) {
    for (const char* row : prefetch) _mm_prefetch(row + kb * kStep * sizeof(c10::BFloat16), _MM_HINT_T1);
    _tile_loadd(SGLD_TILE_X0, x0 + kb * kTileValues / 2, kTile * sizeof(uint32_t));
    if constexpr (two_x) _tile_loadd(SGLD_TILE_X1, x1 + kb * kTileValues / 2, kTile * sizeof(uint32_t));
    _tile_loadd(SGLD_TILE_WEIGHT0, a.rows + kb * kStep, a.stride * sizeof(c10::BFloat16));
    if constexpr (pair) _tile_loadd(SGLD_TILE_WEIGHT1, b.rows + kb * kStep, b.stride * sizeof(c10::BFloat16));
    _tile_dpbf16ps(SGLD_TILE_SUM_A_X0, SGLD_TILE_WEIGHT0, SGLD_TILE_X0);
    if constexpr (pair) _tile_dpbf16ps(SGLD_TILE_SUM_B_X0, SGLD_TILE_WEIGHT1, SGLD_TILE_X0);
    if constexpr (two_x) _tile_dpbf16ps(SGLD_TILE_SUM_A_X1, SGLD_TILE_WEIGHT0, SGLD_TILE_X1);
    if constexpr (pair && two_x) _tile_dpbf16ps(SGLD_TILE_SUM_B_X1, SGLD_TILE_WEIGHT1, SGLD_TILE_X1);
  }
  _tile_stored(SGLD_TILE_SUM_A_X0, sums[0], kTile * sizeof(float));
  if constexpr (pair) _tile_stored(SGLD_TILE_SUM_B_X0, sums[1], kTile * sizeof(float));
  if constexpr (two_x) _tile_stored(SGLD_TILE_SUM_A_X1, sums[2], kTile * sizeof(float));
  if constexpr (pair && two_x) _tile_stored(SGLD_TILE_SUM_B_X1, sums[3], kTile * sizeof(float));
}

// Weight row tiles [begin, end), two at a time, against every x row tile, two at a time.
SGLD_AMX_BF16 void row_tiles(const c10::BFloat16* x, const uint32_t* x_tiles, int64_t M, int64_t N, int64_t K,
                             const c10::BFloat16* w, int64_t ldw, const c10::BFloat16* bias, c10::BFloat16* out,
                             int64_t begin, int64_t end) {
  static const TileConfig config = full_tiles(kTilesUsed);
  _tile_loadconfig(&config);  // tile configuration is per thread
  thread_local std::vector<c10::BFloat16> padded;
  const int64_t k_tiles = K / kStep, x_row_tiles = (M + kTile - 1) / kTile;
  TileSums sums[4];
  const char* prefetch[2 * kTile];
  for (int64_t t = begin; t < end; t += 2) {
    const bool pair = t + 1 < end;
    const WeightTile a = weight_row_tile(w, ldw, N, K, t, padded);
    const WeightTile b = pair ? weight_row_tile(w, ldw, N, K, t + 1, padded) : a;
    for (int64_t r = 0; r < 2 * kTile; ++r)  // near the end the last row again, not past the weight
      prefetch[r] = reinterpret_cast<const char*>(w + std::min((t + kPrefetchTilesAhead) * kTile + r, N - 1) * ldw);
    for (int64_t mb = 0; mb < x_row_tiles; mb += 2) {
      const bool two_x = mb + 1 < x_row_tiles;
      const uint32_t* x0 = x_tiles + mb * k_tiles * kTileValues / 2;
      const uint32_t* x1 = two_x ? x0 + k_tiles * kTileValues / 2 : x0;
      if (pair && two_x) {
        multiply_tiles<true, true>(a, b, x0, x1, k_tiles, prefetch, sums);
      } else if (pair) {
        multiply_tiles<true, false>(a, b, x0, x1, k_tiles, prefetch, sums);
      } else if (two_x) {
        multiply_tiles<false, true>(a, b, x0, x1, k_tiles, prefetch, sums);
      } else {
        multiply_tiles<false, false>(a, b, x0, x1, k_tiles, prefetch, sums);
      }
      for (int64_t j = 0; j < (two_x ? 2 : 1); ++j) {
        const int64_t m0 = (mb + j) * kTile, rows = std::min(kTile, M - m0);
        store_tile(sums[2 * j], a, t, x, m0, rows, K, bias, N, out);
        if (pair) store_tile(sums[2 * j + 1], b, t + 1, x, m0, rows, K, bias, N, out);
      }
    }
  }
  _tile_release();
}
}  // namespace
#endif  // SGLD_HAS_AMX

void pack_b_tiles(const uint8_t* x, int64_t stride, int64_t M, int64_t bytes, uint32_t flip,
                  std::vector<uint32_t>& packed) {
  constexpr int64_t kWords = kAmxRowBytes / 4;
  const int64_t row_tiles = (M + kAmxRows - 1) / kAmxRows, k_tiles = bytes / kAmxRowBytes;
  packed.assign(row_tiles * k_tiles * kAmxRows * kWords, 0);
  for (int64_t m = 0; m < M; ++m) {
    uint32_t* column = packed.data() + (m / kAmxRows) * k_tiles * kAmxRows * kWords + m % kAmxRows;
    for (int64_t kb = 0; kb < k_tiles; ++kb) {
      uint32_t words[kWords];
      std::memcpy(words, x + m * stride + kb * kAmxRowBytes, sizeof(words));
      for (int64_t p = 0; p < kWords; ++p) column[(kb * kWords + p) * kAmxRows] = words[p] ^ flip;
    }
  }
}

TileConfig full_tiles(int tiles) {
  TileConfig config;
  for (int t = 0; t < tiles; ++t) {
    config.bytes_per_row[t] = kAmxRowBytes;
    config.rows[t] = kAmxRows;
  }
  return config;
}

bool amx_usable(unsigned edx_bit) {
#if SGLD_HAS_AMX
  static const bool tiles = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (env_flag("SGLANG_DFLASH_NO_AMX", false) || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    __builtin_cpu_init();
    // Linux hands out the 8 KiB of tile state per process on request only (arch_prctl
    // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return (edx & (1u << 24)) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return tiles && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << edx_bit));
#else
  (void)edx_bit;
  return false;
#endif
}

bool amx_bf16_wanted() {
#if SGLD_HAS_AMX
  constexpr unsigned kAmxBf16 = 22;
  static const bool wanted = amx_usable(kAmxBf16) && __builtin_cpu_supports("avx512bf16");
  return wanted;
#else
  return false;
#endif
}

void amx_bf16_linear(const c10::BFloat16* x, int64_t M, int64_t N, int64_t K, const c10::BFloat16* w, int64_t ldw,
                     const c10::BFloat16* bias, c10::BFloat16* out) {
#if SGLD_HAS_AMX
  thread_local std::vector<uint32_t> x_tiles;
  // x's bf16 pairs as 32-bit words: tile (mb, kb) holds k [32 kb, 32 kb + 32) of x rows 16 mb..
  pack_b_tiles(reinterpret_cast<const uint8_t*>(x), K * sizeof(c10::BFloat16), M,
               K / kStep * kStep * sizeof(c10::BFloat16), 0, x_tiles);
  const uint32_t* xt = x_tiles.data();  // the calling thread's, read by every worker
  const int64_t tiles = (N + kTile - 1) / kTile;
  // Tasks of pairs of weight tiles (row_tiles' passes), ~64 KiB of weight a task.
  const int64_t pair_bytes = 2 * kTile * std::max<int64_t>(K, 1) * sizeof(c10::BFloat16);
  at::parallel_for(0, (tiles + 1) / 2, std::max<int64_t>(1, 65536 / pair_bytes), [&](int64_t begin, int64_t end) {
    row_tiles(x, xt, M, N, K, w, ldw, bias, out, 2 * begin, std::min(2 * end, tiles));
  });
#else
  TORCH_CHECK(false, "sglang_dflash.skinny_linear: AMX path called on a build without it");
#endif
}

}  // namespace sglang_dflash::cpu
