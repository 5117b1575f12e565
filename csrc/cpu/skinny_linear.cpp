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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <vector>

#include "cpu_kernels.h"
#include "to_float.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"

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

// out rows [0, M) x the tile's columns n[c] (the last tile repeats column N - 1 where N is not a
// multiple of C: computed again, the same value stored again); each sum times its weight row's
// scale when the weight is quantized (scale != null).
template <typename W, typename O>
void column_tile(const float* xf, int64_t M, int64_t K, const W* const (&w)[kCols], const char* const (&pf)[kCols],
                 const int64_t (&n)[kCols], const float* scale, const O* bias, int64_t N, O* out) {
  float sums[kRows][kCols];
  // As few row tiles as kRows allows, their rows balanced (5 rows: 3 + 2, not 4 + 1): the tiles
  // take turns on the weight rows in L1, and each is as slow as its latency-bound chains.
  const int64_t tiles = (M + kRows - 1) / kRows;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t rows = M / tiles + (t < M % tiles ? 1 : 0);
    const float* xm = xf + m0 * K;
    switch (rows) {
      case 4: dot_tile<4>(xm, K, w, pf, sums); break;
      case 3: dot_tile<3>(xm, K, w, pf, sums); break;
      case 2: dot_tile<2>(xm, K, w, pf, sums); break;
      default: dot_tile<1>(xm, K, w, pf, sums); break;
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < kCols; ++c) {
        float sum = sums[r][c];
        if (scale != nullptr) sum *= scale[n[c]];
        if (bias != nullptr) sum += static_cast<float>(bias[n[c]]);
        out[(m0 + r) * N + n[c]] = static_cast<O>(sum);
      }
    }
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
      for (int c = 0; c < C; ++c) {
        n[c] = std::min(t * C + c, N - 1);
        rows[c] = w + n[c] * ldw;
        // Near the end the prefetch re-touches the last rows rather than reading past the weight.
        pf[c] = reinterpret_cast<const char*>(w + std::min(t * C + kPrefetchRowsAhead + c, N - 1) * ldw);
      }
      column_tile(xp, M, K, rows, pf, n, scale, bias, N, out);
    }
  });
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& weight_scale) {
  const auto shape = check_skinny_linear_args(x, weight, bias, weight_scale);
  const int64_t M = shape.rows, N = shape.out, K = shape.in;
  at::Tensor out = empty_linear_output(x, N);
  if (M == 0 || N == 0) return out;
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t ldw = weight.stride(0);
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
      stream_weight(xp, M, N, K, weight.const_data_ptr<int8_t>(), ldw, scale.const_data_ptr<float>(), bp, o);
    } else {
      stream_weight(xp, M, N, K, weight.const_data_ptr<scalar_t>(), ldw, static_cast<const float*>(nullptr),
                    bp, o);
    }
  });
  return out;
}

}  // namespace sglang_dflash::cpu
