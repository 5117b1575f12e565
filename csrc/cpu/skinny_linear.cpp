// CPU linear layer for few rows (decode and verify steps): out = x @ weight^T + bias.
//
// With a handful of rows the product is bound by reading the weight once from memory, and BLAS
// GEMMs waste that: they pack (copy) the weight, and for 2-16 rows MKL's fp32 path runs 2-4x
// slower than one pass over the weight (bench/bench_ops.py). Here every
// thread streams a contiguous band of weight rows exactly once; while a pair of rows sits in L1 it
// is multiplied by all rows of x (fp32, converted once, small enough for L1/L2). Each thread also
// prefetches its weight stream two pairs ahead into L2, one cache line per line consumed, from
// inside the FMA loop: the hardware prefetchers alone leave the FMAs of a pair and the arrival of
// the next bytes serialized, and a burst of prefetches per pair did not fix that (likely: the burst
// stalls the loads behind it once the miss buffers fill). Standalone A/B on SmolLM2's shapes, 2
// threads, 4 rows: 6.9 -> 5.0 ms per 60 MLP-sized matrices; 1 row unchanged or better; 1 row with
// no prefetching at all: 1.6x slower.
//
// Each output element is one fixed sequence of fp32 FMAs over k plus a fixed lane reduction, so it
// depends only on its own x row and weight row: the result for a row is bitwise the same whatever
// the other rows are or how many there are. A verify pass over B tokens therefore computes exactly
// the values plain decoding computes one token at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "cpu_kernels.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"

namespace sglang_dflash::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kRowTile = 4;  // x rows per register tile: 4 x 2 accumulators + 2 weight vectors

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

template <typename T>
inline Vec load_weight(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

// Lane sum by a fixed shuffle tree, the same for every element.
inline float lane_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

constexpr int64_t kLineBytes = 64;
constexpr int64_t kPrefetchRowsAhead = 4;  // two pairs: ~9 KiB ahead at K = 576 fp32, 24 KiB at 1536

// Rows [m0, m0 + R) of x against weight rows w0, w1: R x 2 dot products of length K. R is a
// compile-time constant so the accumulators live in registers. pf0/pf1 are the weight rows to
// prefetch meanwhile, one line of each per line of w0/w1 consumed.
template <int R, typename T>
void dot_tile(const float* xf, int64_t K, const T* w0, const T* w1, const char* pf0, const char* pf1,
              float (&sums)[kRowTile][2]) {
  constexpr int64_t kLine = kLineBytes / sizeof(T);  // elements per cache line
  static_assert(kLine % kW == 0, "a cache line holds whole vectors");
  const int64_t k_vec = K - K % kW, k_lines = K - K % kLine;
  Reg acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
  auto step = [&](int64_t k) {
    const Reg a = load_weight(w0 + k), b = load_weight(w1 + k);
    for (int r = 0; r < R; ++r) {
      const Reg xv = load_x(xf + r * K + k);
      acc[r][0] = fmadd(xv, a, acc[r][0]);
      acc[r][1] = fmadd(xv, b, acc[r][1]);
    }
  };
  int64_t k = 0;
  for (; k < k_lines; k += kLine) {
    __builtin_prefetch(pf0 + k * sizeof(T), /*rw=*/0, /*locality: L2 and outward=*/1);
    __builtin_prefetch(pf1 + k * sizeof(T), 0, 1);
    for (int64_t j = 0; j < kLine; j += kW) step(k + j);
  }
  for (; k < k_vec; k += kW) step(k);
  for (int r = 0; r < R; ++r) {
    const float* xr = xf + r * K;
    float s0 = lane_sum(Vec(acc[r][0])), s1 = lane_sum(Vec(acc[r][1]));
    for (int64_t k = k_vec; k < K; ++k) {
      s0 += xr[k] * static_cast<float>(w0[k]);
      s1 += xr[k] * static_cast<float>(w1[k]);
    }
    sums[r][0] = s0;
    sums[r][1] = s1;
  }
}

// out rows [0, M) x columns {n0, n1} (n1 == n0 for an odd last column: computed, stored once).
template <typename T>
void column_pair(const float* xf, int64_t M, int64_t K, const T* w0, const T* w1, const char* pf0,
                 const char* pf1, const T* bias, int64_t n0, int64_t n1, int64_t N, T* out) {
  float sums[kRowTile][2];
  for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, M - m0);
    const float* xm = xf + m0 * K;
    switch (rows) {
      case 4: dot_tile<4>(xm, K, w0, w1, pf0, pf1, sums); break;
      case 3: dot_tile<3>(xm, K, w0, w1, pf0, pf1, sums); break;
      case 2: dot_tile<2>(xm, K, w0, w1, pf0, pf1, sums); break;
      default: dot_tile<1>(xm, K, w0, w1, pf0, pf1, sums); break;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float s0 = sums[r][0], s1 = sums[r][1];
      if (bias != nullptr) {
        s0 += static_cast<float>(bias[n0]);
        s1 += static_cast<float>(bias[n1]);
      }
      out[(m0 + r) * N + n0] = static_cast<T>(s0);
      out[(m0 + r) * N + n1] = static_cast<T>(s1);
    }
  }
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  const auto shape = check_skinny_linear_args(x, weight, bias);
  const int64_t M = shape.rows, N = shape.out, K = shape.in;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor out = at::empty(out_sizes, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t ldw = weight.stride(0);
  SGLD_DISPATCH_FLOAT_TYPES(weight.scalar_type(), "skinny_linear", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const float* xp = xf.const_data_ptr<float>();
    const int64_t pairs = (N + 1) / 2;
    // ~64 KiB of weight per task at K = 576, fp32: long sequential streams, enough tasks to balance.
    at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = 2 * p, n1 = std::min(n0 + 1, N - 1);
        // Near the end the prefetch re-touches the last rows rather than reading past the weight.
        const int64_t pf_row = std::min(n0 + kPrefetchRowsAhead, N - 1);
        const char* pf0 = reinterpret_cast<const char*>(w + pf_row * ldw);
        const char* pf1 = reinterpret_cast<const char*>(w + std::min(pf_row + 1, N - 1) * ldw);
        column_pair(xp, M, K, w + n0 * ldw, w + n1 * ldw, pf0, pf1, bp, n0, n1, N, o);
      }
    });
  });
  return out;
}

}  // namespace sglang_dflash::cpu
