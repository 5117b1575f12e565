// CUDA verification (docs/design.md §3.2), the same semantics as csrc/cpu/verify.cpp.
//
// Kernel 1 (one CTA per verify row) finds the target's token of the row:
//  - greedy (temperature <= 0): one pass, block argmax, lowest index on ties.
//  - temperature only: pass 1 gives max / argmax of x = logit * (1 / T) (fp32, as on the CPU);
//    pass 2 draws the Gumbel noise of sampling.h for the tokens that can still win (the
//    kMaxGumbelNoise bound, seeded with the argmax's score, then per token gumbel_upper_bound
//    before the exact noise's double logs) and reduces argmax(x + g), lowest index on ties.
//  - top-k / top-p: pass 1 also builds a histogram of the order-preserving keys of x (top 12
//    bits). From it we pick the lowest bin edge L whose suffix holds at most kCap tokens; pass 2
//    compacts the tokens with x >= L into shared memory (in vocabulary order, by a block scan, so
//    the result does not depend on scheduling). When that set holds the k-th largest value (top-k)
//    and enough mass for the top-p threshold, both thresholds are found by the CPU twin's exact
//    bisections over the shared-memory set and the Gumbel-max runs over it; otherwise the same
//    bisections run over the whole row in global memory (slower, same result).
// Kernel 2 (one thread per request) runs the accept scan of accept.h over the row tokens. The
// argmax-ids variant is kernel 2 alone.
//
// Against the CPU twin: greedy is bit-identical. The sampled token is identical as well, except
// when float rounding differs at a decision boundary: the top-p mass sums are added in a
// different order (and with CUDA's expf), and the Gumbel noise's double log may differ by an ulp.
// Each needs a tie within rounding, so it affects a vanishing fraction of rows. Every reduction
// here has a fixed order, so repeated runs (and CUDA-graph replays) are bit-identical.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cuda_fp16.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cmath>
#include <limits>
#include <type_traits>

#include "cuda_common.cuh"
#include "sglang_dflash/accept.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/sampling.h"
#include "sglang_dflash/variants.h"

namespace sglang_dflash::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBinShift = 20;               // histogram bin = key >> 20: 4096 bins
constexpr int kBins = 1 << (32 - kBinShift);
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kCap = 4096;                  // candidates kept in shared memory
constexpr size_t kSmemBytes = sizeof(int) * kBins + (sizeof(float) + sizeof(int)) * kCap;
static_assert(kBins % kThreads == 0, "bins per thread");

struct VerifyParams {
  const void* logits;
  int64_t row_stride;
  int64_t vocab;
  int block_size;
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const int64_t* offsets;
  uint64_t seed;
  int64_t* target;  // [bs * B] the target's token of every row
};

// ---------------------------------------------------------------------------------------------
// Block reductions with a fixed combination order (deterministic for a fixed block size).

struct Scratch {
  Best best[kWarps];
  float f[kWarps];
  int i[kWarps];
  int scan[kWarps];
  int value;
  uint32_t best_key;  // "fused": the best score any thread has reached, as a float_to_key key
};

// Block-wide sum in a fixed order (lanes by shuffle, then warps 0..kWarps-1), so results are
// bit-identical run to run; `slots` is kWarps entries of shared memory.
template <typename T>
__device__ T block_sum(T v, T* slots) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  T r = slots[0];
  for (int w = 1; w < kWarps; ++w) r += slots[w];
  __syncthreads();
  return r;
}

// Exclusive prefix sum over thread index; *total gets the block's sum.
__device__ int block_exclusive_scan(int v, int* total, Scratch& s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += up;
  }
  if (lane == 31) s.scan[warp] = incl;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    const int t = s.scan[w];
    before += w < warp ? t : 0;
    sum += t;
  }
  __syncthreads();
  *total = sum;
  return before + incl - v;
}

// ---------------------------------------------------------------------------------------------
// The two places a row's scaled logits x can come from: the whole row in global memory, or the
// compacted candidate set in shared memory. Each calls f(x, vocab id) for this thread's share.

// The 16 / sizeof(T) values of one 16-byte load, as floats, without a trip through local memory.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& u, float out[16 / sizeof(T)]) {
  const uint32_t words[4] = {u.x, u.y, u.z, u.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = __uint_as_float(words[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t bits = (words[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        out[j] = __uint_as_float(bits << 16);
      } else {
        out[j] = __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
      }
    }
  }
}

// lanes[lane] for a lane known only at run time, kept in registers.
__device__ __forceinline__ uint32_t pick4(const uint32_t lanes[4], int lane) {
  return lane == 0 ? lanes[0] : lane == 1 ? lanes[1] : lane == 2 ? lanes[2] : lanes[3];
}

template <typename T>
struct GlobalRow {
  const T* raw;
  int64_t vocab;
  float inv_t;  // 1 / temperature; x = raw * inv_t rounded once, as on the CPU

  __device__ __forceinline__ float x(int64_t v) const {
    return __fmul_rn(static_cast<float>(raw[v]), inv_t);
  }

  template <typename F>
  __device__ __forceinline__ void for_each(F f) const {
    constexpr int kVec = 16 / sizeof(T);
    int64_t tail = 0;
    if (reinterpret_cast<uintptr_t>(raw) % 16 == 0) {
      const int64_t n_vec = vocab / kVec;
      const uint4* src = reinterpret_cast<const uint4*>(raw);
#pragma unroll 2
      for (int64_t c = threadIdx.x; c < n_vec; c += kThreads) {
        float vals[kVec];
        unpack16<T>(src[c], vals);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f(__fmul_rn(vals[j], inv_t), static_cast<int>(c * kVec + j));
      }
      tail = n_vec * kVec;
    }
#pragma unroll 4
    for (int64_t v = tail + threadIdx.x; v < vocab; v += kThreads) f(x(v), static_cast<int>(v));
  }

  // As for_each, but every lane of a warp runs the same iterations (f(x, id, valid), valid false
  // past the row's end), so f may use warp-wide instructions. Order per lane: as for_each.
  template <typename F>
  __device__ __forceinline__ void for_each_warp_uniform(F f) const {
    constexpr int kVec = 16 / sizeof(T);
    const int lane = threadIdx.x % 32, warp_base = threadIdx.x - lane;
    int64_t tail = 0;
    if (reinterpret_cast<uintptr_t>(raw) % 16 == 0) {
      const int64_t n_vec = vocab / kVec;
      const uint4* src = reinterpret_cast<const uint4*>(raw);
      for (int64_t c0 = warp_base; c0 < n_vec; c0 += kThreads) {
        const int64_t c = c0 + lane;
        float vals[kVec];
        unpack16<T>(c < n_vec ? src[c] : make_uint4(0, 0, 0, 0), vals);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f(__fmul_rn(vals[j], inv_t), static_cast<int>(c * kVec + j), c < n_vec);
      }
      tail = n_vec * kVec;
    }
    for (int64_t v0 = tail + warp_base; v0 < vocab; v0 += kThreads) {
      const int64_t v = v0 + lane;
      f(v < vocab ? x(v) : 0.0f, static_cast<int>(v), v < vocab);
    }
  }
};

struct SmemSet {
  const float* x;
  const int* id;
  int n;

  template <typename F>
  __device__ __forceinline__ void for_each(F f) const {
    for (int j = threadIdx.x; j < n; j += kThreads) f(x[j], id[j]);
  }
};

template <typename Src>
__device__ int count_at_least(const Src& src, float t, Scratch& s) {
  int c = 0;
  src.for_each([&](float x, int) { c += x >= t; });
  return block_sum(c, s.i);
}

// Sum of exp(x - max) over the tokens with x > t and x >= floor.
template <typename Src>
__device__ float sum_above(const Src& src, float t, float floor, float max, Scratch& s) {
  float sum = 0.0f;
  src.for_each([&](float x, int) {
    if (x > t && x >= floor) sum += expf(x - max);
  });
  return block_sum(sum, s.f);
}

// The CPU twin's kth_largest: the largest key t in [lo, hi] with count(x >= t) >= k.
template <typename Src>
__device__ float kth_largest(const Src& src, int64_t k, uint64_t lo, uint64_t hi, Scratch& s) {
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo + 1) / 2;
    if (count_at_least(src, key_to_float(static_cast<uint32_t>(mid)), s) >= k) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return key_to_float(static_cast<uint32_t>(lo));
}

// The CPU twin's top_p_threshold search: the smallest key t in [lo, hi] whose mass strictly
// above it is < target.
template <typename Src>
__device__ float top_p_search(const Src& src, uint64_t lo, uint64_t hi, float floor, float max,
                              float target, Scratch& s) {
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (sum_above(src, key_to_float(static_cast<uint32_t>(mid)), floor, max, s) < target) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return key_to_float(static_cast<uint32_t>(lo));
}

struct RowRng {
  uint64_t seed, offset;
  uint32_t row;
  // The Philox lanes of vocab ids 4 * group .. 4 * group + 3 (sampling.h).
  __device__ __forceinline__ void lanes4(uint32_t group, uint32_t out[4]) const {
    philox_lanes4(seed, offset, row, group, out);
  }
  // The Philox lane of vocab id v.
  __device__ __forceinline__ uint32_t bits(int v) const {
    uint32_t lanes[4];
    lanes4(static_cast<uint32_t>(v / 4), lanes);
    return pick4(lanes, v % 4);
  }
};

// Adds token v with scaled logit x and noise lane `bits` to a thread's running Gumbel-max. The
// exact noise (two double logs) is drawn only when the cheap bound of sampling.h can still reach
// the thread's best: otherwise the token scores strictly below a score that exists, so it cannot
// be the row's winner.
__device__ __forceinline__ void consider_noisy(Best& best, float x, uint32_t bits, int v) {
  if (x + gumbel_upper_bound(bits) < best.value) return;
  consider(best, __fadd_rn(x, gumbel_from_bits(bits)), v);
}

// Gumbel-max over the row in global memory, tokens with x >= floor; one Philox block per group of
// four ids, skipped when none of the four can beat the best score so far (kMaxGumbelNoise bound).
template <typename T>
__device__ Best gumbel_global(const GlobalRow<T>& row, float floor, Best seed_best,
                              const RowRng& rng, Scratch& s) {
  Best best = seed_best;
  const int64_t groups = (row.vocab + 3) / 4;
  for (int64_t g = threadIdx.x; g < groups; g += kThreads) {
    float x[4];
    bool any = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t v = g * 4 + j;
      x[j] = v < row.vocab ? row.x(v) : -INFINITY;
      // Against this thread's running best (>= seed_best): a skipped token scores strictly below
      // a score that exists, so it cannot be the row's winner.
      any |= v < row.vocab && x[j] >= floor && x[j] + kMaxGumbelNoise >= best.value;
    }
    if (!any) continue;
    uint32_t lanes[4];
    rng.lanes4(static_cast<uint32_t>(g), lanes);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t v = g * 4 + j;
      if (v < row.vocab && x[j] >= floor) consider_noisy(best, x[j], lanes[j], static_cast<int>(v));
    }
  }
  return block_best<kWarps>(best, s.best);
}

// Gumbel-max over the shared-memory candidates with x >= floor.
__device__ Best gumbel_smem(const SmemSet& set, float floor, Best seed_best, const RowRng& rng,
                            Scratch& s) {
  Best best = seed_best;
  set.for_each([&](float x, int v) {
    if (x >= floor && x + kMaxGumbelNoise >= best.value) consider_noisy(best, x, rng.bits(v), v);
  });
  return block_best<kWarps>(best, s.best);
}

// ---------------------------------------------------------------------------------------------
// The "fused" variant's paths.

// Temperature only, in one pass over the row (16-byte loads): each thread keeps its running
// Gumbel-max and skips a group of four ids without drawing its Philox block when none can reach
// the threshold, and a token without its double logs when its bound cannot. The threshold is the
// larger of the thread's best score and the block's (s.best_key, raised by atomicMax as threads
// improve): always a score some token reached, so a token skipped against it scores strictly
// below an existing score and cannot be the row's winner (nor tie it). The winner is therefore the
// exact argmax, lowest id on ties, whatever the threads' timing.
template <typename T>
__device__ Best gumbel_one_pass(const GlobalRow<T>& row, const RowRng& rng, Scratch& s) {
  if (threadIdx.x == 0) s.best_key = float_to_key(-INFINITY);
  __syncthreads();
  volatile uint32_t* shared_best = &s.best_key;
  Best best{-INFINITY, INT_MAX};
  // Ids 4g .. 4g + n - 1 with scaled logits x.
  auto group = [&](uint32_t g, const float (&x)[4], int n) {
    const float threshold = fmaxf(best.value, key_to_float(*shared_best));
    bool any = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) any |= j < n && x[j] + kMaxGumbelNoise >= threshold;
    if (!any) return;
    uint32_t lanes[4];
    rng.lanes4(g, lanes);
    const float before = best.value;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < n && x[j] + gumbel_upper_bound(lanes[j]) >= threshold) {
        consider(best, __fadd_rn(x[j], gumbel_from_bits(lanes[j])), static_cast<int>(4 * g + j));
      }
    }
    if (best.value > before) atomicMax(&s.best_key, float_to_key(best.value));
  };
  constexpr int kVec = 16 / sizeof(T);
  int64_t tail = 0;
  if (reinterpret_cast<uintptr_t>(row.raw) % 16 == 0) {
    const int64_t n_vec = row.vocab / kVec;
    const uint4* src = reinterpret_cast<const uint4*>(row.raw);
    for (int64_t c = threadIdx.x; c < n_vec; c += kThreads) {
      float vals[kVec];
      unpack16<T>(src[c], vals);
#pragma unroll
      for (int q = 0; q < kVec / 4; ++q) {  // a vector holds whole Philox groups (kVec is 4 or 8)
        const float x[4] = {__fmul_rn(vals[4 * q], row.inv_t), __fmul_rn(vals[4 * q + 1], row.inv_t),
                            __fmul_rn(vals[4 * q + 2], row.inv_t), __fmul_rn(vals[4 * q + 3], row.inv_t)};
        group(static_cast<uint32_t>(c * (kVec / 4) + q), x, 4);
      }
    }
    tail = n_vec * kVec;  // a multiple of 4: the tail starts at a group boundary
  }
  for (int64_t g = tail / 4 + threadIdx.x; 4 * g < row.vocab; g += kThreads) {
    const int n = static_cast<int>(min(int64_t{4}, row.vocab - 4 * g));
    const float x[4] = {row.x(4 * g), n > 1 ? row.x(4 * g + 1) : 0.0f, n > 2 ? row.x(4 * g + 2) : 0.0f,
                        n > 3 ? row.x(4 * g + 3) : 0.0f};
    group(static_cast<uint32_t>(g), x, n);
  }
  best = block_best<kWarps>(best, s.best);
  if (best.index == INT_MAX) best.index = 0;  // a row of NaNs: id 0, as the default variant
  return best;
}

constexpr int kSegment = kCap / kWarps;  // "fused": candidates each warp may keep

// Compacts the tokens with x >= edge into per-warp segments of kSegment entries: each warp appends
// what it reads, in its own (fixed) order, by ballot and popcount, with no block-wide step; unused
// entries become NaN, which no count, sum or comparison takes. Returns the candidates, or -1 when
// some warp found more than kSegment (the caller then searches the whole row). Also adds
// exp(x - max) of every token to *total when need_total.
template <typename T>
__device__ int compact_by_warps(const GlobalRow<T>& row, float edge, bool need_total, float max, float* total,
                                float* cand_x, int* cand_id, Scratch& s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned lower = (1u << lane) - 1u;  // lanes below this one
  float* seg_x = cand_x + warp * kSegment;
  int* seg_id = cand_id + warp * kSegment;
  int count = 0;  // warp-uniform
  float mass = 0.0f;
  row.for_each_warp_uniform([&](float x, int v, bool valid) {
    const bool take = valid && x >= edge;
    if (need_total && valid) mass += expf(x - max);
    const unsigned taken = __ballot_sync(0xffffffffu, take);
    const int pos = count + __popc(taken & lower);
    if (take && pos < kSegment) {
      seg_x[pos] = x;
      seg_id[pos] = v;
    }
    count += __popc(taken);
  });
  for (int j = count + lane; j < kSegment; j += 32) seg_x[j] = __int_as_float(0x7fc00000);  // NaN
  if (lane == 0) s.i[warp] = count;
  *total = mass;
  __syncthreads();
  int n = 0;
  bool overflow = false;
  for (int w = 0; w < kWarps; ++w) {
    n += s.i[w];
    overflow |= s.i[w] > kSegment;
  }
  __syncthreads();
  return overflow ? -1 : n;
}

// Radix select: the key of the k-th largest value of the set (k <= its size; NaN entries are not
// in it), with the CPU twin's kth_largest's tie rule: that bisection returns the largest key t
// with count(x >= t) >= k, which is the k-th largest value's key, except that -0 counts as +0
// there (x >= +0 holds for -0), so a -0 answer becomes +0. Three passes of 12, 12 and 8 bits, each
// a shared histogram of the entries that match the key bits found so far (integer atomics: the
// same counts whatever their order) and one scan from the top bin.
__device__ float kth_largest_radix(const SmemSet& set, int k, int* hist, Scratch& s) {
  uint32_t prefix = 0, known = 0;  // key bits found so far, and which
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 20 : level == 1 ? 8 : 0;
    const int bins = level == 2 ? 256 : 4096;
    for (int j = threadIdx.x; j < bins; j += kThreads) hist[j] = 0;
    __syncthreads();
    set.for_each([&](float x, int) {
      const uint32_t key = float_to_key(x);
      if (x == x && (key & known) == prefix) atomicAdd(&hist[(key >> shift) & (bins - 1)], 1);
    });
    __syncthreads();
    // Thread t owns the `per` bins from bins - 1 - t * per down (none past bin 0); the prefix sum
    // over threads counts the entries in higher bins.
    const int per = (bins + kThreads - 1) / kThreads;
    int own = 0;
    for (int j = 0; j < per; ++j) {
      const int bin = bins - 1 - static_cast<int>(threadIdx.x) * per - j;
      if (bin >= 0) own += hist[bin];
    }
    int all;
    int above = block_exclusive_scan(own, &all, s);
    for (int j = 0; j < per; ++j) {
      const int bin = bins - 1 - static_cast<int>(threadIdx.x) * per - j;
      if (bin < 0) break;
      if (above < k && above + hist[bin] >= k) {  // the k-th largest is in this bin
        s.value = bin;
        s.i[0] = above;
      }
      above += hist[bin];
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s.value) << shift;
    known |= static_cast<uint32_t>(bins - 1) << shift;
    k -= s.i[0];
    __syncthreads();
  }
  const float t = key_to_float(prefix);
  return t == 0.0f ? 0.0f : t;
}

template <typename T, bool kFused>
__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const VerifyParams p) {
  extern __shared__ __align__(16) int smem[];
  int* hist = smem;                                        // [kBins]
  float* cand_x = reinterpret_cast<float*>(hist + kBins);  // [kCap]
  int* cand_id = reinterpret_cast<int*>(cand_x + kCap);    // [kCap]
  __shared__ Scratch s;

  const int64_t row = blockIdx.x;
  const int64_t b = row / p.block_size;
  const uint32_t i = static_cast<uint32_t>(row % p.block_size);
  const T* raw = static_cast<const T*>(p.logits) + row * p.row_stride;
  const float temperature = p.temperature[b];

  if (temperature <= 0.0f) {  // greedy: argmax of the logits themselves
    Best best{-INFINITY, INT_MAX};
    const GlobalRow<T> src{raw, p.vocab, 1.0f};
    src.for_each([&](float x, int v) { consider(best, x, v); });
    best = block_best<kWarps>(best, s.best);
    if (threadIdx.x == 0) p.target[row] = best.index == INT_MAX ? 0 : best.index;
    return;
  }

  const GlobalRow<T> src{raw, p.vocab, 1.0f / temperature};
  const int64_t top_k = p.top_k[b];
  const float top_p = p.top_p[b];
  const bool use_k = top_k > 0 && top_k < p.vocab;
  const bool use_p = top_p < 1.0f;
  const bool filtered = use_k || use_p;
  const RowRng rng{p.seed, static_cast<uint64_t>(p.offsets[b]), i};
  if constexpr (kFused) {
    if (!filtered) {
      const Best best = gumbel_one_pass(src, rng, s);
      if (threadIdx.x == 0) p.target[row] = best.index;
      return;
    }
  }

  // Pass 1: max / first argmax of x, and (filters on) the key histogram.
  if (filtered) {
    for (int j = threadIdx.x; j < kBins; j += kThreads) hist[j] = 0;
    __syncthreads();
  }
  Best top{-INFINITY, INT_MAX};
  src.for_each([&](float x, int v) {
    consider(top, x, v);
    if (filtered) {
      // Logits cluster in few bins: one atomic per distinct bin of the warp, not per lane.
      const unsigned bin = float_to_key(x) >> kBinShift;
      const unsigned peers = __match_any_sync(__activemask(), bin);
      if ((threadIdx.x % 32) == static_cast<unsigned>(__ffs(peers) - 1)) {
        atomicAdd(&hist[bin], __popc(peers));
      }
    }
  });
  top = block_best<kWarps>(top, s.best);  // its barriers also publish the histogram
  if (top.index == INT_MAX) top.index = 0;  // NaN-only row: any id (the CPU twin's is undefined too)
  const float max = top.value;
  const Best seed_best{__fadd_rn(max, gumbel_from_bits(rng.bits(top.index))), top.index};

  if (!filtered) {
    const Best best = gumbel_global(src, -INFINITY, seed_best, rng, s);
    if (threadIdx.x == 0) p.target[row] = best.index;
    return;
  }

  // Lowest histogram bin b* whose suffix (bins >= b*) holds at most kCap tokens ("fused": half of
  // that, so that each warp's segment of kCap / kWarps is rarely outrun).
  // Thread t owns bins kBins-1-t*kBinsPerThread downwards, so a prefix scan over threads counts
  // higher bins.
  constexpr int kBudget = kFused ? kCap / 2 : kCap;
  int own[kBinsPerThread];
  int own_sum = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    own[j] = hist[kBins - 1 - threadIdx.x * kBinsPerThread - j];
    own_sum += own[j];
  }
  int all_tokens;
  int above = block_exclusive_scan(own_sum, &all_tokens, s);
  int too_big = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    above += own[j];  // tokens in bins >= this one
    too_big += above > kBudget;
  }
  const int b_star = block_sum(too_big, s.i);  // bins [0, b_star) have suffixes over kBudget
  // Bins below 8 hold only -inf and NaN keys (their edges are NaNs as floats): take -inf there.
  // Bin 8's edge is -FLT_MAX.
  const float edge = b_star < 8 ? -INFINITY : key_to_float(static_cast<uint32_t>(b_star) << kBinShift);
  bool in_smem = b_star < kBins;

  // Pass 2: compact the tokens with x >= edge, in vocabulary order; the total mass on the way
  // when top-p runs over the whole vocabulary.
  const bool need_total = use_p && !use_k;
  float total_part = 0.0f;
  int n_cand = 0;
  if constexpr (kFused) {
    if (in_smem) {
      n_cand = compact_by_warps(src, edge, need_total, max, &total_part, cand_x, cand_id, s);
      in_smem = n_cand >= 0 && (!use_k || n_cand >= top_k);
    }
  } else if (in_smem) {
    constexpr int kPer = 4;
    for (int64_t c0 = 0; c0 < p.vocab; c0 += int64_t{kThreads} * kPer) {
      const int64_t v0 = c0 + threadIdx.x * kPer;
      float x[kPer];
      int count = 0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        x[j] = v0 + j < p.vocab ? src.x(v0 + j) : -INFINITY;
        const bool take = v0 + j < p.vocab && x[j] >= edge;
        count += take;
        if (need_total && v0 + j < p.vocab) total_part += expf(x[j] - max);
      }
      int chunk_total;
      int pos = n_cand + block_exclusive_scan(count, &chunk_total, s);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (v0 + j < p.vocab && x[j] >= edge) {
          if (pos < kCap) {
            cand_x[pos] = x[j];
            cand_id[pos] = static_cast<int>(v0 + j);
          }
          ++pos;
        }
      }
      n_cand += chunk_total;
    }
    __syncthreads();
    in_smem = n_cand <= kCap && (!use_k || n_cand >= top_k);
  }

  // "fused": the whole array, NaN-padded segments included.
  const SmemSet set{cand_x, cand_id, kFused ? kCap : min(n_cand, kCap)};
  const uint64_t max_key = float_to_key(max);
  float floor = -INFINITY;
  if (in_smem) {
    // Every token with x >= edge is in the set, and (checked) the answers lie at or above edge.
    if (use_k) {
      floor = kFused ? kth_largest_radix(set, static_cast<int>(top_k), hist, s)
                     : kth_largest(set, top_k, float_to_key(edge), max_key, s);
    }
    if (use_p) {
      const float total = use_k ? sum_above(set, -INFINITY, floor, max, s)
                                : block_sum(total_part, s.f);
      const float target = top_p * total;
      uint64_t lo = float_to_key(floor);
      if (!use_k) {
        // The CPU searches from -inf; the answer is >= edge when the set's mass reaches target.
        in_smem = sum_above(set, -INFINITY, floor, max, s) >= target;
        lo = float_to_key(edge);
      }
      if (in_smem) floor = top_p_search(set, lo, max_key, floor, max, target, s);
    }
  }
  Best best;
  if (in_smem) {
    best = gumbel_smem(set, floor, seed_best, rng, s);
  } else {  // the exact searches over the whole row
    floor = -INFINITY;
    if (use_k) floor = kth_largest(src, top_k, float_to_key(-INFINITY), max_key, s);
    if (use_p) {
      const float target = top_p * sum_above(src, -INFINITY, floor, max, s);
      floor = top_p_search(src, float_to_key(floor), max_key, floor, max, target, s);
    }
    best = gumbel_global(src, floor, seed_best, rng, s);
  }
  if (threadIdx.x == 0) p.target[row] = best.index;
}

// Accept scan, one thread per request. `vocab` > 0 checks the candidates against it: no memory is
// addressed by a candidate, so one out of range is recorded (raised by check_device_errors) and
// simply never matches.
__global__ void accept_kernel(const int64_t* candidates, const void* target, bool target64,
                              int64_t vocab, int64_t batch, int block_size, int32_t* accept_len,
                              int64_t* bonus, int64_t* out_tokens, IndexError* errors) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int64_t* cand = candidates + b * block_size;
  if (vocab > 0) {
    for (int i = 0; i < block_size; ++i) {
      index_ok(cand[i] >= 0 && cand[i] < vocab, errors, IndexCheck::kVerifyCandidate, b, i, cand[i], vocab);
    }
  }
  bonus[b] = accept_block(
      cand, block_size, [&](int i) { return read_index(target, target64, b * block_size + i); },
      out_tokens + b * block_size, accept_len + b);
}

[[maybe_unused]] const bool variants_registered =
    register_kernel_variants(VariantOp::kVerifyBlock, {"default", "fused"});

std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_results(const at::Tensor& candidates) {
  const int64_t batch = candidates.size(0), block = candidates.size(1);
  auto opts = candidates.options();
  return {at::empty({batch}, opts.dtype(at::kInt)), at::empty({batch}, opts.dtype(at::kLong)),
          at::empty({batch, block}, opts.dtype(at::kLong))};
}

void launch_accept(const at::Tensor& candidates, const at::Tensor& target, int64_t vocab,
                   at::Tensor& accept_len, at::Tensor& bonus, at::Tensor& out_tokens,
                   cudaStream_t stream) {
  const int64_t batch = candidates.size(0);
  constexpr int kAcceptThreads = 128;
  const auto blocks = static_cast<unsigned>(ceil_div(batch, kAcceptThreads));
  accept_kernel<<<blocks, kAcceptThreads, 0, stream>>>(
      candidates.data_ptr<int64_t>(), target.data_ptr(), target.scalar_type() == at::kLong, vocab,
      batch, static_cast<int>(candidates.size(1)), accept_len.data_ptr<int32_t>(),
      bonus.data_ptr<int64_t>(), out_tokens.data_ptr<int64_t>(),
      device_error_record(candidates.get_device()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block(
    const at::Tensor& candidates_in, const at::Tensor& logits, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, int64_t seed, const at::Tensor& offsets) {
  const auto shape = check_verify_args(candidates_in, logits, temperature, top_k, top_p, offsets);
  TORCH_CHECK_VALUE(shape.vocab <= std::numeric_limits<int32_t>::max(),
                    "sglang_dflash.verify_block: the CUDA kernel supports a vocabulary below 2^31, got ",
                    shape.vocab);
  const c10::cuda::CUDAGuard guard(candidates_in.device());
  const auto candidates = candidates_in.contiguous();
  auto [accept_len, bonus, out_tokens] = empty_results(candidates);
  if (shape.batch == 0) return {accept_len, bonus, out_tokens};
  const auto temp = temperature.contiguous();
  const auto topk = top_k.contiguous();
  const auto topp = top_p.contiguous();
  const auto offs = offsets.contiguous();
  auto target = at::empty({shape.batch * shape.block_size}, candidates.options());
  const auto stream = at::cuda::getCurrentCUDAStream();

  VerifyParams p{};
  p.logits = logits.data_ptr();
  p.row_stride = logits.stride(0);
  p.vocab = shape.vocab;
  p.block_size = static_cast<int>(shape.block_size);
  p.temperature = temp.data_ptr<float>();
  p.top_k = topk.data_ptr<int32_t>();
  p.top_p = topp.data_ptr<float>();
  p.offsets = offs.data_ptr<int64_t>();
  p.seed = static_cast<uint64_t>(seed);
  p.target = target.data_ptr<int64_t>();
  const auto rows = static_cast<unsigned>(shape.batch * shape.block_size);
  // Kernel variants (variants.h): "default", or "fused" (one pass for temperature-only rows;
  // warp-ballot compaction and a radix top-k select for filtered rows).
  const bool fused = selected_kernel_variant(VariantOp::kVerifyBlock) == 1;
  SGLD_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "verify_block", [&] {
    auto kernel = fused ? sample_rows_kernel<scalar_t, true> : sample_rows_kernel<scalar_t, false>;
    // 48 KiB of dynamic shared memory plus the static scratch: above the default limit.
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmemBytes);
    kernel<<<rows, kThreads, kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  launch_accept(candidates, target, shape.vocab, accept_len, bonus, out_tokens, stream);
  return {accept_len, bonus, out_tokens};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block_from_ids(const at::Tensor& candidates_in,
                                                                     const at::Tensor& target_ids) {
  check_verify_ids_args(candidates_in, target_ids);
  const c10::cuda::CUDAGuard guard(candidates_in.device());
  const auto candidates = candidates_in.contiguous();
  const auto ids = target_ids.contiguous();
  auto [accept_len, bonus, out_tokens] = empty_results(candidates);
  if (candidates.size(0) == 0) return {accept_len, bonus, out_tokens};
  launch_accept(candidates, ids, 0, accept_len, bonus, out_tokens,
                at::cuda::getCurrentCUDAStream());
  return {accept_len, bonus, out_tokens};
}

}  // namespace sglang_dflash::cuda

TORCH_LIBRARY_IMPL(sglang_dflash, CUDA, m) {
  m.impl("verify_block", &sglang_dflash::cuda::verify_block);
  m.impl("verify_block_from_ids", &sglang_dflash::cuda::verify_block_from_ids);
}
