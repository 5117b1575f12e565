// The Gumbel-max search shared by verify_block's sampler and gumbel_argmax on the CPU: the lowest
// index of the largest fp32 score x + g over one row, with g the noise of sampling.h.
//
// It is exact: a token is skipped only when its score, rounded, is provably below the best score
// already found, so it could neither win nor tie. Tokens go in chunks of 128 (32 Philox blocks):
//  1. no Philox at all when the chunk's largest x plus the largest possible noise
//     (kMaxGumbelNoise) cannot reach the best score: with real LLM logits most chunks stop here;
//  2. else its 32 Philox blocks are drawn at once (AVX-512 / AVX2), and it stops when its largest
//     x plus gumbel_coarse_bound of its largest lane cannot reach the best score. Logits of small
//     spread (e.g. randn) keep every token within 16.7 of the max, so step 1 never skips, but the
//     best score soon sits ~log(vocab) above a typical x, and few chunks hold a lane with noise
//     that large;
//  3. the same test per Philox block, then per token; only tokens that pass pay the exact noise's
//     two double logs (a handful per row).
// Steps 2 and 3 are exact because gumbel_coarse_bound(b) >= gumbel_from_bits(b) for every lane b
// and is nondecreasing in b: a token with x <= xmax and lane <= top scores
// fl(x + g) <= fl(xmax + bound(top)), fp32 rounding being monotone.
#pragma once

#include <ATen/Version.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "sglang_dflash/sampling.h"

namespace sglang_dflash::cpu {

constexpr int kPhiloxBatch = 32;  // Philox blocks drawn at once

// The noise key of one verify row (sampling.h): key seed, counter (group, 0, offset + row).
struct NoiseKey {
  uint64_t seed, offset;
  uint32_t row;
};

// Philox4x32-10 as ATen's philox_engine computes it (philox_lanes4), one block per 32-bit lane of
// a vector, several vectors interleaved to hide the multiplies' latency; ~6x (AVX2) and ~8x
// (AVX-512) faster per block than philox_lanes4 here. x86 has no 32-bit high multiply: the even
// and odd lanes' 64-bit products come from two mul_epu32. Both return the largest lane.
#if defined(__AVX2__)
inline uint32_t philox_lanes4_avx2(const NoiseKey& key, const uint32_t group[kPhiloxBatch],
                                   uint32_t lanes[4][kPhiloxBatch]) {
  constexpr int V = kPhiloxBatch / 8;
  auto mulhi = [](__m256i a, __m256i m) {
    const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  };
  const uint64_t sub = key.offset + key.row;
  const __m256i m0 = _mm256_set1_epi32(static_cast<int32_t>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int32_t>(0xCD9E8D57u));
  __m256i c0[V], c1[V], c2[V], c3[V];
  for (int h = 0; h < V; ++h) {
    c0[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 8 * h));
    c1[h] = _mm256_setzero_si256();
    c2[h] = _mm256_set1_epi32(static_cast<int32_t>(sub));
    c3[h] = _mm256_set1_epi32(static_cast<int32_t>(sub >> 32));
  }
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i vk0 = _mm256_set1_epi32(static_cast<int32_t>(k0));
    const __m256i vk1 = _mm256_set1_epi32(static_cast<int32_t>(k1));
    for (int h = 0; h < V; ++h) {
      const __m256i hi0 = mulhi(c0[h], m0), lo0 = _mm256_mullo_epi32(c0[h], m0);
      const __m256i hi1 = mulhi(c2[h], m1), lo1 = _mm256_mullo_epi32(c2[h], m1);
      c0[h] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[h]), vk0);
      c2[h] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[h]), vk1);
      c1[h] = lo1;
      c3[h] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  __m256i top = _mm256_setzero_si256();
  for (int h = 0; h < V; ++h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes[0] + 8 * h), c0[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes[1] + 8 * h), c1[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes[2] + 8 * h), c2[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes[3] + 8 * h), c3[h]);
    top = _mm256_max_epu32(top, _mm256_max_epu32(c0[h], c1[h]));
    top = _mm256_max_epu32(top, _mm256_max_epu32(c2[h], c3[h]));
  }
  uint32_t tops[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tops), top);
  return *std::max_element(tops, tops + 8);
}

// The same with 16 lanes a vector. The extension is compiled for AVX2, so these two functions are
// compiled for AVX-512 and called only where the CPU has it. (GCC 12 wrongly reports the
// _mm512_undefined_epi32() inside its AVX-512 intrinsics as used uninitialized.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
__attribute__((target("avx512f"))) inline __m512i mulhi_avx512(__m512i a, __m512i m) {
  const __m512i even = _mm512_mul_epu32(a, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

__attribute__((target("avx512f"))) inline uint32_t philox_lanes4_avx512(
    const NoiseKey& key, const uint32_t group[kPhiloxBatch], uint32_t lanes[4][kPhiloxBatch]) {
  constexpr int V = kPhiloxBatch / 16;
  const uint64_t sub = key.offset + key.row;
  const __m512i m0 = _mm512_set1_epi32(static_cast<int32_t>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int32_t>(0xCD9E8D57u));
  __m512i c0[V], c1[V], c2[V], c3[V];
  for (int h = 0; h < V; ++h) {
    c0[h] = _mm512_loadu_si512(group + 16 * h);
    c1[h] = _mm512_setzero_si512();
    c2[h] = _mm512_set1_epi32(static_cast<int32_t>(sub));
    c3[h] = _mm512_set1_epi32(static_cast<int32_t>(sub >> 32));
  }
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m512i vk0 = _mm512_set1_epi32(static_cast<int32_t>(k0));
    const __m512i vk1 = _mm512_set1_epi32(static_cast<int32_t>(k1));
    for (int h = 0; h < V; ++h) {
      const __m512i hi0 = mulhi_avx512(c0[h], m0), lo0 = _mm512_mullo_epi32(c0[h], m0);
      const __m512i hi1 = mulhi_avx512(c2[h], m1), lo1 = _mm512_mullo_epi32(c2[h], m1);
      c0[h] = _mm512_ternarylogic_epi32(hi1, c1[h], vk0, 0x96);  // three-way xor
      c2[h] = _mm512_ternarylogic_epi32(hi0, c3[h], vk1, 0x96);
      c1[h] = lo1;
      c3[h] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  __m512i top = _mm512_setzero_si512();
  for (int h = 0; h < V; ++h) {
    _mm512_storeu_si512(lanes[0] + 16 * h, c0[h]);
    _mm512_storeu_si512(lanes[1] + 16 * h, c1[h]);
    _mm512_storeu_si512(lanes[2] + 16 * h, c2[h]);
    _mm512_storeu_si512(lanes[3] + 16 * h, c3[h]);
    top = _mm512_max_epu32(top, _mm512_max_epu32(c0[h], c1[h]));
    top = _mm512_max_epu32(top, _mm512_max_epu32(c2[h], c3[h]));
  }
  return _mm512_reduce_max_epu32(top);
}
#pragma GCC diagnostic pop
#endif

// lanes[j][i] = lane j of the Philox block of group[i] (philox_lanes4, many blocks at once);
// returns the largest lane. ATen's CPU capability ("AVX512", "AVX2" or "DEFAULT", which
// ATEN_CPU_CAPABILITY can lower) picks the code. ATen reports what that variable names even on a
// CPU without the instructions, so the AVX-512 path also asks the CPU itself.
inline uint32_t philox_lanes4_batch(const NoiseKey& key, const uint32_t group[kPhiloxBatch],
                                    uint32_t lanes[4][kPhiloxBatch]) {
#if defined(__AVX2__)
  static const bool avx512 = at::get_cpu_capability() == "AVX512" && __builtin_cpu_supports("avx512f");
  static const bool avx2 = at::get_cpu_capability() == "AVX2";
  if (avx512) return philox_lanes4_avx512(key, group, lanes);
  if (avx2) return philox_lanes4_avx2(key, group, lanes);
#endif
  uint32_t top = 0;
  for (int i = 0; i < kPhiloxBatch; ++i) {
    uint32_t block[4];
    philox_lanes4(key.seed, key.offset, key.row, group[i], block);
    for (int j = 0; j < 4; ++j) top = std::max(top, lanes[j][i] = block[j]);
  }
  return top;
}

// Largest of src[t] * scale over t in [0, count) ignoring NaNs (-inf if none). Lanes past count
// read as 0, which can only raise it: it stays an upper bound for the pruning tests.
inline float max_ignoring_nan(const float* src, float scale, int64_t count) {
  using Vec = at::vec::Vectorized<float>;
  const Vec vscale(scale);
  Vec m(-INFINITY);
  for (int64_t t = 0; t < count; t += Vec::size()) {
    const Vec v = Vec::loadu(src + t, std::min<int64_t>(count - t, Vec::size())) * vscale;
    m = Vec::blendv(m, v, v > m);  // a NaN compares false: never taken
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
}

// An upper bound of gumbel_from_bits(bits) from integer ops alone (gumbel_upper_bound needs a
// log): with w = 1 - u = k / 2^24 (k odd, 1 <= k < 2^24), -log(u) >= w, so the noise
// -log(-log(u)) <= -log(w) = ln 2 * (24 - log2(k)) <= ln 2 * (24 - floor(log2(k)))
// = ln 2 * (clz(k) - 7); 1e-3 covers the fp32 rounding of this bound and of the exact noise (the
// margin is >= 0.000999 over all 2^23 values of u). Nondecreasing in bits.
inline float gumbel_coarse_bound(uint32_t bits) {
  const uint32_t k = ((~bits >> 9) << 1) | 1u;
  return 0.6931472f * static_cast<float>(std::countl_zero(k) - 7) + 1e-3f;
}

// The running search: the best score so far and its index, over tokens with x >= floor.
struct GumbelMax {
  float floor, best;
  int64_t best_id;

  // Whether a token with x <= xmax and noise <= bound can reach the best score (false for NaNs).
  bool reachable(float xmax, float bound) const { return xmax >= floor && xmax + bound >= best; }

  void consider(float x, uint32_t bits, int64_t id) {
    if (!reachable(x, gumbel_coarse_bound(bits))) return;
    const float score = x + gumbel_from_bits(bits);
    if (score > best || (score == best && id < best_id)) {
      best = score;
      best_id = id;
    }
  }

  // Tokens v in [0, n) with scores x = src[v] * scale in fp32 (scale 1 reads src as is) and the
  // noise of vocab id v.
  void run(const float* src, float scale, int64_t n, const NoiseKey& key) {
    constexpr int64_t kChunk = 4 * kPhiloxBatch;
    for (int64_t v0 = 0; v0 < n; v0 += kChunk) {
      const int64_t count = std::min(kChunk, n - v0);
      const float xmax = max_ignoring_nan(src + v0, scale, count);
      if (!reachable(xmax, kMaxGumbelNoise)) continue;
      uint32_t group[kPhiloxBatch], lanes[4][kPhiloxBatch];
      for (int i = 0; i < kPhiloxBatch; ++i) group[i] = static_cast<uint32_t>(v0 / 4 + i);
      if (!reachable(xmax, gumbel_coarse_bound(philox_lanes4_batch(key, group, lanes)))) continue;
      for (int64_t i = 0; 4 * i < count; ++i) {
        const uint32_t top = std::max({lanes[0][i], lanes[1][i], lanes[2][i], lanes[3][i]});
        if (!reachable(xmax, gumbel_coarse_bound(top))) continue;
        for (int64_t v = v0 + 4 * i; v < std::min(n, v0 + 4 * i + 4); ++v) {
          consider(src[v] * scale, lanes[v % 4][i], v);
        }
      }
    }
  }

  // Columns j in [0, n) with scores x[j] and the noise of vocab id ids[j] (< 2^34): one Philox
  // block per column.
  void run(const float* x, const int64_t* ids, int64_t n, const NoiseKey& key) {
    for (int64_t j0 = 0; j0 < n; j0 += kPhiloxBatch) {
      const int64_t count = std::min<int64_t>(kPhiloxBatch, n - j0);
      const float xmax = max_ignoring_nan(x + j0, 1.0f, count);
      if (!reachable(xmax, kMaxGumbelNoise)) continue;
      uint32_t group[kPhiloxBatch] = {}, lanes[4][kPhiloxBatch], bits[kPhiloxBatch];
      for (int64_t i = 0; i < count; ++i) group[i] = static_cast<uint32_t>(ids[j0 + i] / 4);
      philox_lanes4_batch(key, group, lanes);
      for (int64_t i = 0; i < count; ++i) bits[i] = lanes[ids[j0 + i] % 4][i];
      if (!reachable(xmax, gumbel_coarse_bound(*std::max_element(bits, bits + count)))) continue;
      for (int64_t i = 0; i < count; ++i) consider(x[j0 + i], bits[i], j0 + i);
    }
  }
};

}  // namespace sglang_dflash::cpu
