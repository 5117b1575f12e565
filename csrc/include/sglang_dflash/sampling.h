// Counter-based Gumbel noise and order-preserving float keys: the math that makes stochastic
// verification a single pass over the logits and bit-identical across CPU and CUDA.
// The pure-PyTorch spec is sglang_dflash/ops/reference.py (gumbel_noise, sampling_mask).
#pragma once

#include <ATen/core/PhiloxRNGEngine.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "sglang_dflash/common.h"

namespace sglang_dflash {

// The Philox4x32-10 block behind vocab ids 4*group .. 4*group+3 of verify row `row` of the
// request whose sampling offset is `offset`: counter (group, 0, offset + row) under key `seed`;
// lane j belongs to id 4*group + j. Row r at offset o draws what row 0 at offset o + r draws, so a
// caller whose offset is the position of row 0's token keys every sample by the position it
// fills: speculative steps then emit exactly the tokens one-row steps with the same seed emit.
SGLD_HOST_DEVICE void philox_lanes4(uint64_t seed, uint64_t offset, uint32_t row, uint32_t group,
                                    uint32_t lanes[4]) {
  at::philox_engine engine(seed, /*subsequence=*/offset + row, /*offset=*/group);
  for (int lane = 0; lane < 4; ++lane) lanes[lane] = engine();
}

// u = (2m + 1) / 2^24 with m the lane's 23 high bits: exact in fp32, never 0 or 1.
SGLD_HOST_DEVICE float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(((bits >> 9) << 1) | 1u) * (1.0f / 16777216.0f);
}

// Gumbel(0, 1) noise -log(-log(u)), evaluated in double and rounded once, so every backend
// produces the same fp32 value.
SGLD_HOST_DEVICE float gumbel_from_bits(uint32_t bits) {
  const double u = uniform_from_bits(bits);
  return static_cast<float>(-log(-log(u)));
}

// A cheap upper bound of gumbel_from_bits(bits), for skipping tokens that cannot win: with
// w = 1 - u (exact), -log(u) = w + w^2/2 + w^3/3 + ... >= w + w^2/2, so the noise is at most
// -log(w + w^2/2); 1e-3 covers the fp32 rounding of this bound and of the exact noise.
SGLD_HOST_DEVICE float gumbel_upper_bound(uint32_t bits) {
  const float w = 1.0f - uniform_from_bits(bits);
  return -logf(w + 0.5f * w * w) + 1e-3f;
}

// Upper bound of any value gumbel_from_bits returns: -log(-log(1 - 2^-24)) = 16.6355. A token
// whose scaled logit is more than this below the best score found so far cannot win the
// Gumbel-max, so its noise need not be drawn; skipping it leaves the result exactly the same.
constexpr float kMaxGumbelNoise = 16.7f;

// Maps floats to unsigned keys with the same order (-inf < ... < -0 < +0 < ... < +inf), so a
// threshold can be found by bisection over the key range.
SGLD_HOST_DEVICE uint32_t float_to_key(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

SGLD_HOST_DEVICE float key_to_float(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace sglang_dflash
