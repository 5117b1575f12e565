// CPU linear layer for few rows (decode and verify steps): out = x @ weight^T + bias.
//
// With a handful of rows the product is bound by reading the weight once from memory, and BLAS
// GEMMs waste that: they pack (copy) the weight, and for 2-16 rows MKL's fp32 path runs 2-4x
// slower than one pass over the weight (bench/bench_ops.py). Here every
// thread streams a contiguous band of weight rows exactly once; while a tile of rows sits in L1 it
// is multiplied by all rows of x (fp32, converted once, small enough for L1/L2). Each thread also
// prefetches its weight stream two tiles ahead into L2, one cache line per line consumed, from
// inside the FMA loop: the hardware prefetchers alone leave the FMAs of a tile and the arrival of
// the next bytes serialized, and a burst of prefetches per tile did not fix that (likely: the burst
// stalls the loads behind it once the miss buffers fill). Standalone A/B on SmolLM2's shapes, 2
// threads, 4 rows: 6.9 -> 5.0 ms per 60 MLP-sized matrices; 1 row unchanged or better; 1 row with
// no prefetching at all: 1.6x slower.
//
// An int8 weight (weight-only quantization, one fp32 scale per weight row) streams a quarter of
// the fp32 bytes: its values convert exactly to fp32, and the row's scale multiplies the finished
// sum, so the arithmetic is the float path's plus one rounding.
//
// Each output element is one fixed sequence of fp32 FMAs over k plus a fixed lane reduction, so it
// depends only on its own x row and weight row: the result for a row is bitwise the same whatever
// the other rows are or how many there are. A verify pass over B tokens therefore computes exactly
// the values plain decoding computes one token at a time.
//
// Where the CPU has AVX-512 (checked at run time; SGLANG_DFLASH_NO_AVX512=1 keeps AVX2), the same
// loops run on 16-lane vectors with 32 registers: 4 weight rows x up to 6 x rows a tile. Past ~5
// rows the fp32 path is bound by its FMAs, not its bytes (AVX2, 3 x 4 tiles: ~45 GMAC/s on 2 cores
// of an Intel Xeon with two 512-bit FMA units), and a draft tree's verify has 5-16 rows. The
// choice is made once per process, so every call of a run sums in the same order and batch
// invariance holds on either path (their results differ from each other in the last bits).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "to_float.h"
#include "x86_paths.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/env.h"

namespace sglang_dflash::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

// Weight rows per tile (their dot products run side by side, each x vector loaded once for all)
// and at most this many x rows per register tile, so that Rows x Cols accumulators + Cols weight
// vectors + an x vector fit in the 16 AVX2 registers. Every weight vector a tile loads is
// converted to fp32 (F16C for fp16, a shift for bf16, two conversions for int8), so each one
// should feed as many FMAs as the registers allow, and each x vector as many weight rows: 3 weight
// rows x 4 x rows (12 chains). Against the tiles before (float 2 x 6, which converted each weight
// vector for 2 FMAs a row and loaded each x vector for 2; int8 4 x 2), standalone over SmolLM2's
// shapes on 2 threads: fp16 weights 1.3-1.7x faster at 3-20 rows, bf16 1.1-1.4x, fp32 (bound by
// reading its weight below ~6 rows) up to 1.15x at 8-20, int8 (the drafter's) 1.1-1.2x at 3-32
// rows and 0.85x at 1 row (3 chains, bound by the FMA latency). A tile of fewer than 8 chains is
// latency bound, so row tiles are balanced (column_tile).
constexpr int kCols = 3, kRows = 4;

// The inner loop on raw registers where the ISA has them: with Vectorized<float> (its loadu keeps
// a stack buffer for partial loads) GCC stores all 8 accumulators to the stack on every k
// iteration at 4 rows; with __m256 values they stay in registers.
#if defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
inline Reg load_x(const float* p) { return _mm256_loadu_ps(p); }
inline Reg fmadd(Reg x, Reg w, Reg acc) { return _mm256_fmadd_ps(x, w, acc); }
#else
using Reg = Vec;
inline Reg load_x(const float* p) { return Vec::loadu(p); }
inline Reg fmadd(const Reg& x, const Reg& w, const Reg& acc) { return at::vec::fmadd(x, w, acc); }
#endif

// kW weights as fp32 (exact for every weight type).
template <typename T>
inline Reg load_weight(const T* p) {
  if constexpr (std::is_same_v<T, int8_t>) {
#if defined(CPU_CAPABILITY_AVX2)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    float f[kW];
    for (int64_t i = 0; i < kW; ++i) f[i] = p[i];
    return Vec::loadu(f);
#endif
  } else {
    return load_float_vector(p);
  }
}

// Lane sum by a fixed shuffle tree, the same for every element.
inline float lane_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

constexpr int64_t kLineBytes = 64;
// Each thread prefetches two tiles of weight rows ahead: ~14 KiB at K = 576 in fp32, 36 KiB at 1536.
constexpr int64_t kPrefetchRowsAhead = 2 * kCols;

// Rows [m0, m0 + R) of x against the tile's weight rows w[c]: R x kCols dot products of length K.
// R is a compile-time constant so the accumulators live in registers. pf[c] are the weight rows
// to prefetch meanwhile, one line of each per line of w[c] consumed.
template <int R, typename T>
void dot_tile(const float* xf, int64_t K, const T* const (&w)[kCols], const char* const (&pf)[kCols],
              float (&sums)[kRows][kCols]) {
  constexpr int C = kCols;
  constexpr int64_t kLine = kLineBytes / sizeof(T);  // elements per cache line
  static_assert(kLine % kW == 0, "a cache line holds whole vectors");
  const int64_t k_vec = K - K % kW, k_lines = K - K % kLine;
  Reg acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  auto step = [&](int64_t k) {
    Reg wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_weight(w[c] + k);
    for (int r = 0; r < R; ++r) {
      const Reg xv = load_x(xf + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(xv, wv[c], acc[r][c]);
    }
  };
  int64_t k = 0;
  for (; k < k_lines; k += kLine) {
    for (int c = 0; c < C; ++c) __builtin_prefetch(pf[c] + k * sizeof(T), /*rw=*/0, /*locality: L2 and outward=*/1);
    for (int64_t j = 0; j < kLine; j += kW) step(k + j);
  }
  for (; k < k_vec; k += kW) step(k);
  for (int r = 0; r < R; ++r) {
    const float* xr = xf + r * K;
    for (int c = 0; c < C; ++c) {
      float sum = lane_sum(Vec(acc[r][c]));
      for (int64_t k = k_vec; k < K; ++k) sum += xr[k] * static_cast<float>(w[c][k]);
      sums[r][c] = sum;
    }
  }
}

// Rows in row tile t of `tiles` over M rows: as few tiles as the register tile allows, their rows
// balanced (5 rows in tiles of 4: 3 + 2, not 4 + 1): the tiles take turns on the weight rows in L1,
// and each is as slow as its latency-bound chains.
inline int64_t balanced_rows(int64_t M, int64_t tiles, int64_t t) { return M / tiles + (t < M % tiles ? 1 : 0); }

// Weight rows of column tile t (C rows from t * C; the last tile repeats row N - 1 where N is not
// a multiple of C: computed again, the same value stored again), and the rows `ahead` further on
// to prefetch meanwhile (near the end the last rows again, rather than reading past the weight).
template <int C, typename W>
inline void tile_columns(int64_t t, int64_t N, const W* w, int64_t ldw, int64_t ahead, int64_t (&n)[C],
                         const W* (&rows)[C], const char* (&pf)[C]) {
  for (int c = 0; c < C; ++c) {
    n[c] = std::min(t * C + c, N - 1);
    rows[c] = w + n[c] * ldw;
    pf[c] = reinterpret_cast<const char*>(w + std::min(t * C + ahead + c, N - 1) * ldw);
  }
}

// Stores a register tile's sums as out rows [m0, m0 + rows) x columns n[c], each sum times its
// weight row's scale when the weight is quantized (scale != null), plus the bias.
template <int C, int R, typename O>
inline void store_sums(const float (&sums)[R][C], int64_t m0, int64_t rows, const int64_t (&n)[C], const float* scale,
                       const O* bias, int64_t N, O* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = 0; c < C; ++c) {
      float sum = sums[r][c];
      if (scale != nullptr) sum *= scale[n[c]];
      if (bias != nullptr) sum += static_cast<float>(bias[n[c]]);
      out[(m0 + r) * N + n[c]] = static_cast<O>(sum);
    }
  }
}

// out rows [0, M) x the tile's columns n[c] (the last tile repeats column N - 1 where N is not a
// multiple of C: computed again, the same value stored again).
template <typename W, typename O>
void column_tile(const float* xf, int64_t M, int64_t K, const W* const (&w)[kCols], const char* const (&pf)[kCols],
                 const int64_t (&n)[kCols], const float* scale, const O* bias, int64_t N, O* out) {
  float sums[kRows][kCols];
  const int64_t tiles = (M + kRows - 1) / kRows;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t rows = balanced_rows(M, tiles, t);
    const float* xm = xf + m0 * K;
    switch (rows) {
      case 4: dot_tile<4>(xm, K, w, pf, sums); break;
      case 3: dot_tile<3>(xm, K, w, pf, sums); break;
      case 2: dot_tile<2>(xm, K, w, pf, sums); break;
      default: dot_tile<1>(xm, K, w, pf, sums); break;
    }
    store_sums(sums, m0, rows, n, scale, bias, N, out);
    m0 += rows;
  }
}

// All weight rows against all rows of x (fp32, xp): each thread streams a band of row tiles.
template <typename W, typename O>
void stream_weight(const float* xp, int64_t M, int64_t N, int64_t K, const W* w, int64_t ldw,
                   const float* scale, const O* bias, O* out) {
  constexpr int C = kCols;
  const int64_t tiles = (N + C - 1) / C;
  // ~64 KiB of weight per task at K = 576, fp32: long sequential streams, enough tasks to balance.
  at::parallel_for(0, tiles, 32 / C, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t n[C];
      const W* rows[C];
      const char* pf[C];
      tile_columns(t, N, w, ldw, kPrefetchRowsAhead, n, rows, pf);
      column_tile(xp, M, K, rows, pf, n, scale, bias, N, out);
    }
  });
}

#if SGLD_HAS_X86
// The AVX-512 path: 16 lanes, and with 32 registers 4 weight rows x 6 x rows of accumulators
// (24) + 4 weight vectors + an x vector. Each x vector now feeds 4 weight rows and each weight
// vector 6 x rows: 10 loads per 24 FMAs, where the AVX2 tile makes 7 per 12.
namespace wide {
constexpr int kCols = 4, kRows = 6;
constexpr int64_t kW = 16;
constexpr int64_t kPrefetchRowsAhead = 2 * kCols;

// 16 weights as fp32 (exact for every weight type).
template <typename T>
SGLD_AVX512 inline __m512 load_weight(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    static_assert(std::is_same_v<T, int8_t>, "float, half, bfloat16 or int8 weights");
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}

template <int R, typename T>
SGLD_AVX512 inline void fma_step(const float* xf, int64_t K, int64_t k, const T* const (&w)[kCols],
                                 __m512 (&acc)[R][kCols]) {
  __m512 wv[kCols];
  for (int c = 0; c < kCols; ++c) {
    wv[c] = load_weight(w[c] + k);
    // An empty asm that claims to change the vector: the compiler must hold it in a register.
    // Without it GCC folds the load into each FMA that uses it (a weight vector loaded once per
    // x row, an x vector once per weight row) in some tile shapes, 3 x rows among them, which
    // then ran slower than 4 (bound by loads); the arithmetic is the same either way. (On the
    // AVX2 path, with 16 registers, the same made GCC spill accumulators instead.)
    asm("" : "+v"(wv[c]));
  }
  for (int r = 0; r < R; ++r) {
    __m512 xv = _mm512_loadu_ps(xf + r * K + k);
    asm("" : "+v"(xv));  // in a register, as wv
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
  }
}

// dot_tile above, on 16 lanes.
template <int R, typename T>
SGLD_AVX512 void dot_tile(const float* xf, int64_t K, const T* const (&w)[kCols], const char* const (&pf)[kCols],
                          float (&sums)[kRows][kCols]) {
  constexpr int64_t kLine = kLineBytes / sizeof(T);
  static_assert(kLine % kW == 0, "a cache line holds whole vectors");
  const int64_t k_vec = K - K % kW, k_lines = K - K % kLine;
  __m512 acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < k_lines; k += kLine) {
    for (int c = 0; c < kCols; ++c) _mm_prefetch(pf[c] + k * sizeof(T), _MM_HINT_T1);  // into L2
    for (int64_t j = 0; j < kLine; j += kW) fma_step<R>(xf, K, k + j, w, acc);
  }
  for (; k < k_vec; k += kW) fma_step<R>(xf, K, k, w, acc);
  for (int r = 0; r < R; ++r) {
    const float* xr = xf + r * K;
    for (int c = 0; c < kCols; ++c) {
      float sum = _mm512_reduce_add_ps(acc[r][c]);  // a fixed shuffle tree
      for (int64_t t = k_vec; t < K; ++t) sum += xr[t] * static_cast<float>(w[c][t]);
      sums[r][c] = sum;
    }
  }
}

// Weight-row tiles [begin, end) against all M rows of x, as stream_weight's tasks above.
template <typename W, typename O>
SGLD_AVX512 void column_tiles(const float* xf, int64_t M, int64_t N, int64_t K, const W* w, int64_t ldw,
                              const float* scale, const O* bias, O* out, int64_t begin, int64_t end) {
  float sums[kRows][kCols];
  const int64_t row_tiles = (M + kRows - 1) / kRows;
  for (int64_t t = begin; t < end; ++t) {
    int64_t n[kCols];
    const W* rows[kCols];
    const char* pf[kCols];
    tile_columns(t, N, w, ldw, kPrefetchRowsAhead, n, rows, pf);
    for (int64_t i = 0, m0 = 0; i < row_tiles; ++i) {
      const int64_t r = balanced_rows(M, row_tiles, i);
      const float* xm = xf + m0 * K;
      switch (r) {
        case 6: dot_tile<6>(xm, K, rows, pf, sums); break;
        case 5: dot_tile<5>(xm, K, rows, pf, sums); break;
        case 4: dot_tile<4>(xm, K, rows, pf, sums); break;
        case 3: dot_tile<3>(xm, K, rows, pf, sums); break;
        case 2: dot_tile<2>(xm, K, rows, pf, sums); break;
        default: dot_tile<1>(xm, K, rows, pf, sums); break;
      }
      store_sums(sums, m0, r, n, scale, bias, N, out);
      m0 += r;
    }
  }
}

template <typename W, typename O>
void stream_weight(const float* xp, int64_t M, int64_t N, int64_t K, const W* w, int64_t ldw,
                   const float* scale, const O* bias, O* out) {
  at::parallel_for(0, (N + kCols - 1) / kCols, 32 / kCols, [&](int64_t begin, int64_t end) {
    column_tiles(xp, M, N, K, w, ldw, scale, bias, out, begin, end);
  });
}
}  // namespace wide
#endif  // SGLD_HAS_X86

// All weight rows against all rows of x, on the widest path this CPU has.
template <typename W, typename O>
void stream_weight_dispatch(const float* xp, int64_t M, int64_t N, int64_t K, const W* w, int64_t ldw,
                            const float* scale, const O* bias, O* out) {
#if SGLD_HAS_X86
  if (avx512_wanted()) return wide::stream_weight(xp, M, N, K, w, ldw, scale, bias, out);
#endif
  stream_weight(xp, M, N, K, w, ldw, scale, bias, out);
}

}  // namespace

bool avx512_wanted() {
#if SGLD_HAS_X86 && defined(CPU_CAPABILITY_AVX2)
  static const bool wanted = [] {
    __builtin_cpu_init();
    return !env_flag("SGLANG_DFLASH_NO_AVX512", false) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return wanted;
#else
  return false;
#endif
}

std::string float_dot_isa() {
#if defined(CPU_CAPABILITY_AVX2)
  return avx512_wanted() ? "avx512" : "avx2";
#else
  return "portable";
#endif
}

std::string bf16_dot_isa() { return amx_bf16_wanted() ? "amx_bf16" : float_dot_isa(); }

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& weight_scale) {
  const auto shape = check_skinny_linear_args(x, weight, bias, weight_scale);
  const int64_t M = shape.rows, N = shape.out, K = shape.in;
  at::Tensor out = empty_linear_output(x, N);
  if (M == 0 || N == 0) return out;
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t ldw = weight.stride(0);
  if (x.scalar_type() == at::kBFloat16 && !weight_scale.has_value() && amx_bf16_wanted()) {
    // bf16 x and (checked) weight: on AMX tiles, in bf16 (skinny_linear_amx.cpp).
    const at::Tensor xc = x.reshape({M, K}).contiguous();
    amx_bf16_linear(xc.const_data_ptr<at::BFloat16>(), M, N, K, weight.const_data_ptr<at::BFloat16>(), ldw,
                    b.defined() ? b.const_data_ptr<at::BFloat16>() : nullptr, out.mutable_data_ptr<at::BFloat16>());
    return out;
  }
  SGLD_DISPATCH_FLOAT_TYPES(x.scalar_type(), "skinny_linear", [&] {
    // x in fp32, converted into a per-thread buffer where it is contiguous bf16 / fp16: a draft
    // step makes ~20 of these calls, and a separate conversion op (allocation, dispatch) was
    // ~10 % of each.
    at::Tensor xf;
    const float* xp = nullptr;
    if (x.is_contiguous() && x.scalar_type() == at::kFloat) {
      xp = x.const_data_ptr<float>();
    } else if (x.is_contiguous()) {
      thread_local std::vector<float> converted;
      converted.resize(M * K);
      to_float(x.const_data_ptr<scalar_t>(), converted.data(), M * K);
      xp = converted.data();
    } else {
      xf = x.reshape({M, K}).to(at::kFloat).contiguous();
      xp = xf.const_data_ptr<float>();
    }
    const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    if (weight_scale.has_value()) {  // int8 weight (checked)
      const at::Tensor scale = weight_scale->contiguous();
      stream_weight_dispatch(xp, M, N, K, weight.const_data_ptr<int8_t>(), ldw, scale.const_data_ptr<float>(),
                             bp, o);
    } else {
      stream_weight_dispatch(xp, M, N, K, weight.const_data_ptr<scalar_t>(), ldw,
                             static_cast<const float*>(nullptr), bp, o);
    }
  });
  return out;
}

}  // namespace sglang_dflash::cpu
