// CPU linear layer with an int8 weight AND int8 activations (W8A8), for the drafter's few rows:
// out[m, n] = float(sum_k q[m, k] * w[n, k]) * x_scale[m] * w_scale[n] (+ bias[n]), where row m of
// x is quantized symmetrically on the fly: x_scale = max |x[m]| / 127, q = round(x * 127 / max).
//
// Why: with int8 weights and fp32 arithmetic (skinny_linear) a drafter step is bound by the FMA
// units, not by memory: every int8 weight vector is converted to fp32 (two instructions) for 8 MACs
// a row, and the shipped drafter's step costs ~0.28 ms per block row on this 2-core CPU, linear in
// rows. AVX512-VNNI's vpdpbusd multiplies 32 unsigned-by-signed byte pairs (256-bit form) and sums
// them into 8 int32 lanes in one instruction, with no weight conversion at all: 1.6-2.3x
// skinny_linear's int8 path at the drafter's shapes (bench/bench_ops.py, w8a8_linear rows).
//
// vpdpbusd wants one unsigned operand: the activations go in as u = q + 128 (1..255), and
// sum_k u*w - 128 * sum_k w = sum_k q*w, where sum_k w comes from the same loop (one more
// vpdpbusd per weight vector, against bytes of 1). The sums are exact integers (int32 arithmetic
// wraps, and the true sum fits: K <= kW8a8MaxK), so this kernel, the portable one below and the
// reference agree bit for bit, and each output row depends only on its own x row (batch invariant).
// Quantizing activations changes the drafts, never the output (drafts only propose): the shipped
// drafter's tau at fixed B moved by at most +-0.035 over the 27 fixed cells of `make e2e`.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "cpu_kernels.h"
#include "to_float.h"
#include "x86_paths.h"
#include "sglang_dflash/env.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"

// The epilogue's float products and sum round one at a time, as the reference's: no fused
// multiply-add contracted from them.
#pragma GCC optimize("fp-contract=off")

namespace sglang_dflash::cpu {
namespace {

constexpr int64_t kLine = 64;  // bytes: a cache line
constexpr int64_t kStep = 32;  // bytes of K per vector
// A tile: kCols weight rows against at most kRows x rows, kRows x kCols + kCols accumulators,
// kCols weight vectors, an x vector and the ones: 26 of the 32 ymm registers AVX-512 has.
constexpr int kCols = 4, kRows = 4;
constexpr int64_t kPrefetchRowsAhead = 2 * kCols;  // prefetch two tiles of weight rows ahead

// x quantized: u = q + 128 per element, rows zero padded to a multiple of kLine (a padded u of 0
// adds nothing), and each row's scale (NaN for a row with a non-finite value, which so comes out
// NaN, as a float product would). `row` is scratch: one x row in fp32, reused call after call.
struct QuantizedX {
  std::vector<uint8_t> u;
  std::vector<float> scale;
  int64_t stride;
  std::vector<float> row;
};

template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, QuantizedX& qx) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  qx.stride = (K + kLine - 1) / kLine * kLine;
  qx.u.assign(M * qx.stride, 0);
  qx.scale.resize(M);
  std::vector<float>& row = qx.row;
  row.resize(K);
  for (int64_t m = 0; m < M; ++m) {
    to_float(x + m * K, row.data(), K);
    // max |x|, NaN if any value is NaN (the vector maximum propagates it), inf if any is inf.
    Vec top(0.f);
    int64_t k = 0;
    for (; k + W <= K; k += W) top = at::vec::maximum(top, Vec::loadu(row.data() + k).abs());
    float amax = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, top);
    for (; k < K; ++k) amax = std::isnan(row[k]) || std::fabs(row[k]) > amax ? std::fabs(row[k]) : amax;
    uint8_t* u = qx.u.data() + m * qx.stride;
    if (!std::isfinite(amax)) {
      std::memset(u, 128, K);
      qx.scale[m] = NAN;
      continue;
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    // q + 128 in fp32, then as bytes. Vec::round rounds half to even, as nearbyint in the default
    // rounding mode and torch.round do.
    k = 0;
    for (; k + W <= K; k += W) {
      const Vec q = at::vec::clamp((Vec::loadu(row.data() + k) * Vec(inv)).round(), Vec(-127.f), Vec(127.f));
      (q + Vec(128.f)).store(row.data() + k);
    }
    for (; k < K; ++k) row[k] = std::min(std::max(std::nearbyint(row[k] * inv), -127.f), 127.f) + 128.f;
    for (k = 0; k < K; ++k) u[k] = static_cast<uint8_t>(static_cast<int32_t>(row[k]));
    qx.scale[m] = amax / 127.f;
  }
}

// A finished sum times x_scale and w_scale (+ bias) in fp32, in this order, as the reference.
template <typename O>
inline O dequantized(int32_t sum, float x_scale, float w_scale, bool has_bias, float bias) {
  const float v = static_cast<float>(sum) * x_scale * w_scale;
  return static_cast<O>(has_bias ? v + bias : v);
}

// The finished sums of a tile (dequantized).
template <typename O>
inline void store_tile(const int32_t (&sums)[kRows][kCols], int64_t m0, int64_t rows, const int64_t (&n)[kCols],
                       const float* x_scale, const float* w_scale, const O* bias, int64_t N, O* out) {
  float ws[kCols], b[kCols];
  for (int c = 0; c < kCols; ++c) {
    ws[c] = w_scale[n[c]];
    b[c] = bias != nullptr ? static_cast<float>(bias[n[c]]) : 0.f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float xs = x_scale[m0 + r];
    O* o = out + (m0 + r) * N;
    for (int c = 0; c < kCols; ++c) o[n[c]] = dequantized<O>(sums[r][c], xs, ws[c], bias != nullptr, b[c]);
  }
}

#if SGLD_HAS_X86
#define SGLD_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// The lane sums of four vectors, [sum v[0], ..., sum v[3]]: pairwise adds that interleave the four
// (7 instructions where four full reductions take ~24).
SGLD_VNNI inline __m128i lane_sums(const __m256i (&v)[kCols]) {
  static_assert(kCols == 4, "lane_sums folds four vectors");
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// One step of dot_tile_vnni: kStep bytes of K (`mask`: those before K, for the last step).
template <int R, bool kMasked>
SGLD_VNNI inline void dot_step(const uint8_t* u, int64_t stride, int64_t k, __mmask32 mask,
                               const int8_t* const (&w)[kCols], __m256i (&acc)[R][kCols], __m256i (&wsum)[kCols]) {
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i wv[kCols];
  for (int c = 0; c < kCols; ++c) {
    wv[c] = kMasked ? _mm256_maskz_loadu_epi8(mask, w[c] + k)
                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[c] + k));
    wsum[c] = _mm256_dpbusd_epi32(wsum[c], ones, wv[c]);
  }
  for (int r = 0; r < R; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + r * stride + k));
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_dpbusd_epi32(acc[r][c], xv, wv[c]);
  }
}

// rows x kCols sums of q * w over K, q read as u = q + 128 (see the top of the file). 256-bit
// vectors: on this Zen 4 the 512-bit vpdpbusd issues at half the rate, so it does no more work a
// cycle, and it took masked loads (slow) for K = 576 = 9 x 64 where 256 bits need none.
template <int R>
SGLD_VNNI void dot_tile_vnni(const uint8_t* u, int64_t stride, int64_t K, const int8_t* const (&w)[kCols],
                             const char* const (&pf)[kCols], int32_t (&sums)[kRows][kCols]) {
  __m256i acc[R][kCols], wsum[kCols];
  for (int c = 0; c < kCols; ++c) {
    wsum[c] = _mm256_setzero_si256();
    for (int r = 0; r < R; ++r) acc[r][c] = _mm256_setzero_si256();
  }
  int64_t k = 0;
  for (; k + kLine <= K; k += kLine) {
    for (int c = 0; c < kCols; ++c) _mm_prefetch(pf[c] + k, _MM_HINT_T1);  // into L2, a line per line consumed
    dot_step<R, false>(u, stride, k, 0, w, acc, wsum);
    dot_step<R, false>(u, stride, k + kStep, 0, w, acc, wsum);
  }
  for (; k + kStep <= K; k += kStep) dot_step<R, false>(u, stride, k, 0, w, acc, wsum);
  if (k < K) dot_step<R, true>(u, stride, k, (1u << (K - k)) - 1, w, acc, wsum);  // zeros past K
  // Integer sums wrap modulo 2^32 in any order and the true sums fit, so they are exact.
  const __m128i offset = _mm_slli_epi32(lane_sums(wsum), 7);  // 128 * sum_k w
  for (int r = 0; r < R; ++r)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums[r]), _mm_sub_epi32(lane_sums(acc[r]), offset));
}

template <typename O>
SGLD_VNNI void column_tiles_vnni(const QuantizedX& qx, int64_t M, int64_t N, int64_t K, const int8_t* w,
                                 int64_t ldw, const float* w_scale, const O* bias, O* out, int64_t begin,
                                 int64_t end) {
  int32_t sums[kRows][kCols];
  for (int64_t t = begin; t < end; ++t) {
    int64_t n[kCols];
    const int8_t* rows[kCols];
    const char* pf[kCols];
    for (int c = 0; c < kCols; ++c) {
      n[c] = std::min(t * kCols + c, N - 1);  // the last tile repeats row N - 1: same value stored again
      rows[c] = w + n[c] * ldw;
      pf[c] = reinterpret_cast<const char*>(w + std::min(t * kCols + kPrefetchRowsAhead + c, N - 1) * ldw);
    }
    // As few x-row tiles as kRows allows, balanced (5 rows: 3 + 2): they take turns on the weight
    // rows while those sit in L1.
    const int64_t tiles = (M + kRows - 1) / kRows;
    for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
      const int64_t r = M / tiles + (i < M % tiles ? 1 : 0);
      const uint8_t* u = qx.u.data() + m0 * qx.stride;
      switch (r) {
        case 4: dot_tile_vnni<4>(u, qx.stride, K, rows, pf, sums); break;
        case 3: dot_tile_vnni<3>(u, qx.stride, K, rows, pf, sums); break;
        case 2: dot_tile_vnni<2>(u, qx.stride, K, rows, pf, sums); break;
        default: dot_tile_vnni<1>(u, qx.stride, K, rows, pf, sums); break;
      }
      store_tile(sums, m0, r, n, qx.scale.data(), w_scale, bias, N, out);
      m0 += r;
    }
  }
}

#endif  // SGLD_HAS_X86

// The same sums without VNNI, one output at a time (CPUs without AVX512-VNNI; the drafter takes
// skinny_linear's fp32 path there instead, see models/skinny.py).
template <typename O>
void column_tiles_portable(const QuantizedX& qx, int64_t M, int64_t N, int64_t K, const int8_t* w, int64_t ldw,
                           const float* w_scale, const O* bias, O* out, int64_t begin, int64_t end) {
  int32_t sums[kRows][kCols];
  for (int64_t t = begin; t < end; ++t) {
    int64_t n[kCols];
    for (int c = 0; c < kCols; ++c) n[c] = std::min(t * kCols + c, N - 1);
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - m0);
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* u = qx.u.data() + (m0 + r) * qx.stride;
        for (int c = 0; c < kCols; ++c) {
          const int8_t* wr = w + n[c] * ldw;
          int32_t s = 0;
          for (int64_t k = 0; k < K; ++k) s += (static_cast<int32_t>(u[k]) - 128) * wr[k];
          sums[r][c] = s;
        }
      }
      store_tile(sums, m0, rows, n, qx.scale.data(), w_scale, bias, N, out);
    }
  }
}

bool vnni_wanted() {
#if SGLD_HAS_X86
  // SGLANG_DFLASH_NO_VNNI=1 takes the portable path (tests run both); read once.
  static const bool wanted = [] {
    __builtin_cpu_init();
    return !env_flag("SGLANG_DFLASH_NO_VNNI", false) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return wanted;
#else
  return false;
#endif
}

#if SGLD_HAS_AMX
// The AMX path (CPUs with AMX-INT8): one TDPBSSD multiplies a 16 x 64 tile of weight rows (signed
// bytes, the A operand, as they lie) by a 64 x 16 tile of x rows (q as signed bytes, re-laid once
// a call: pack_b_tiles), 16384 products into 16 x 16 int32 sums, where vpdpbusd does 32. The sums
// are the same exact integers, so this path, VNNI's and the reference agree bit for bit, and a
// step of up to 16 rows costs about what one row costs. K must be a multiple of 64 (the drafters'
// 576 and 1536 are) and x at least kAmxMinRows rows; other calls take VNNI.
#define SGLD_AMX_INT8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
// Tile registers (literals: the intrinsics paste them): two weight row tiles' sums (two independent
// TDPBSSD chains hide its latency), their A operands, the x tile.
#define SGLD_I8_SUM0 0
#define SGLD_I8_SUM1 1
#define SGLD_I8_WEIGHT0 2
#define SGLD_I8_WEIGHT1 3
#define SGLD_I8_X 4
constexpr int kInt8TilesUsed = 5;
constexpr int64_t kXTileWords = kAmxRows * kAmxRowBytes / 4;
constexpr int64_t kAmxMinRows = 3;  // bench_ops: AMX 0.8-0.9x VNNI at 1 row, 1.2-1.3x at 5

bool amx_int8_wanted() {
  constexpr unsigned kAmxInt8 = 25;
  static const bool wanted = vnni_wanted() && amx_usable(kAmxInt8);  // VNNI takes the other K
  return wanted;
}

// Weight row tiles [begin, end), two at a time, against every x row tile; sums[n][m] dequantized
// into out[m, n].
template <typename O>
SGLD_AMX_INT8 void row_tiles_int8(const uint32_t* x_tiles, const float* x_scale, int64_t M, int64_t N, int64_t K,
                                  const int8_t* w, int64_t ldw, const float* w_scale, const O* bias, O* out,
                                  int64_t begin, int64_t end) {
  static const TileConfig config = full_tiles(kInt8TilesUsed);
  _tile_loadconfig(&config);  // tile configuration is per thread
  thread_local std::vector<int8_t> padded;
  const int64_t k_tiles = K / kAmxRowBytes, x_row_tiles = (M + kAmxRows - 1) / kAmxRows;
  int32_t sums[2][kAmxRows][kAmxRows];
  for (int64_t t = begin; t < end; t += 2) {
    const bool pair = t + 1 < end;
    const WeightRowTile<int8_t> a = weight_row_tile(w, ldw, N, K, t, padded);
    const WeightRowTile<int8_t> b = pair ? weight_row_tile(w, ldw, N, K, t + 1, padded) : a;
    for (int64_t mb = 0; mb < x_row_tiles; ++mb) {
      const uint32_t* xt = x_tiles + mb * k_tiles * kXTileWords;
      _tile_zero(SGLD_I8_SUM0);
      _tile_zero(SGLD_I8_SUM1);
      for (int64_t kb = 0; kb < k_tiles; ++kb) {
        _tile_loadd(SGLD_I8_X, xt + kb * kXTileWords, kAmxRowBytes);
        _tile_loadd(SGLD_I8_WEIGHT0, a.rows + kb * kAmxRowBytes, a.stride);
        _tile_dpbssd(SGLD_I8_SUM0, SGLD_I8_WEIGHT0, SGLD_I8_X);
        if (pair) {
          _tile_loadd(SGLD_I8_WEIGHT1, b.rows + kb * kAmxRowBytes, b.stride);
          _tile_dpbssd(SGLD_I8_SUM1, SGLD_I8_WEIGHT1, SGLD_I8_X);
        }
      }
      _tile_stored(SGLD_I8_SUM0, sums[0], kAmxRows * sizeof(int32_t));
      if (pair) _tile_stored(SGLD_I8_SUM1, sums[1], kAmxRows * sizeof(int32_t));
      const int64_t m0 = mb * kAmxRows, rows = std::min(kAmxRows, M - m0);
      for (int64_t p = 0; p < (pair ? 2 : 1); ++p) {
        const int64_t n0 = (t + p) * kAmxRows, count = (p ? b : a).count;
        for (int64_t m = 0; m < rows; ++m) {
          O* o = out + (m0 + m) * N + n0;
          for (int64_t n = 0; n < count; ++n) {
            o[n] = dequantized<O>(sums[p][n][m], x_scale[m0 + m], w_scale[n0 + n], bias != nullptr,
                                  bias != nullptr ? static_cast<float>(bias[n0 + n]) : 0.f);
          }
        }
      }
    }
  }
  _tile_release();
}
#endif  // SGLD_HAS_AMX
}  // namespace

std::string int8_dot_isa() {
#if SGLD_HAS_AMX
  if (amx_int8_wanted()) return "amx_int8";
#endif
  return vnni_wanted() ? "avx512_vnni" : "portable";
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& bias) {
  const auto shape = check_w8a8_linear_args(x, weight, weight_scale, bias);
  const int64_t M = shape.rows, N = shape.out, K = shape.in;
  at::Tensor out = empty_linear_output(x, N);
  if (M == 0 || N == 0) return out;
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  const at::Tensor scale = weight_scale.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t ldw = weight.stride(0);
  const int64_t tiles = (N + kCols - 1) / kCols;
  const int64_t grain = std::max<int64_t>(1, 65536 / (kCols * std::max<int64_t>(K, 1)));  // ~64 KiB of weight a task
  const bool vnni = vnni_wanted();
  SGLD_DISPATCH_FLOAT_TYPES(x.scalar_type(), "w8a8_linear", [&] {
    thread_local QuantizedX qx;
    quantize_x(xc.const_data_ptr<scalar_t>(), M, K, qx);
    const int8_t* w = weight.const_data_ptr<int8_t>();
    const float* ws = scale.const_data_ptr<float>();
    const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const QuantizedX& q = qx;  // the calling thread's, read by every worker
#if SGLD_HAS_AMX
    // Below kAmxMinRows VNNI's per-row cost is still below the tiles' fixed one (packing x,
    // whole 16 x 16 tiles); both give the same bits, so the choice can be made per call.
    if (amx_int8_wanted() && K % kAmxRowBytes == 0 && M >= kAmxMinRows) {
      thread_local std::vector<uint32_t> x_tiles;
      // q = u - 128 as a signed byte is u with its top bit flipped.
      pack_b_tiles(q.u.data(), q.stride, M, K, 0x80808080u, x_tiles);
      const uint32_t* xt = x_tiles.data();
      const int64_t amx_tiles = (N + kAmxRows - 1) / kAmxRows;
      // Tasks of pairs of weight tiles (row_tiles_int8's passes), ~64 KiB of weight a task.
      at::parallel_for(0, (amx_tiles + 1) / 2, std::max<int64_t>(1, 65536 / (2 * kAmxRows * K)),
                       [&](int64_t begin, int64_t end) {
        row_tiles_int8(xt, q.scale.data(), M, N, K, w, ldw, ws, bp, o, 2 * begin, std::min(2 * end, amx_tiles));
      });
      return;
    }
#endif
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
#if SGLD_HAS_X86
      if (vnni) {
        column_tiles_vnni(q, M, N, K, w, ldw, ws, bp, o, begin, end);
        return;
      }
#endif
      column_tiles_portable(q, M, N, K, w, ldw, ws, bp, o, begin, end);
    });
  });
  return out;
}

}  // namespace sglang_dflash::cpu
