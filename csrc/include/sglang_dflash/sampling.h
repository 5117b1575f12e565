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

// Gumbel(0, 1) noise for vocab ids 4*group .. 4*group+3 of verify row `row` of the request whose
// sampling offset is `offset`: one Philox4x32-10 block at counter (group, row, offset) under key
// `seed`, lane j for id 4*group + j. u = (2m + 1) / 2^24 with m the lane's 23 high bits is exact
// in fp32 and never 0 or 1; -log(-log(u)) runs in double and is rounded once, so every backend
// produces the same fp32 noise.
SGLD_HOST_DEVICE void gumbel_noise4(uint64_t seed, uint64_t offset, uint32_t row, uint32_t group,
                                    float noise[4]) {
  at::philox_engine engine(seed, /*subsequence=*/offset,
                           /*offset=*/(static_cast<uint64_t>(row) << 32) | group);
  for (int lane = 0; lane < 4; ++lane) {
    const uint32_t bits = engine();
    const double u = static_cast<double>(((bits >> 9) << 1) | 1u) * (1.0 / 16777216.0);
    noise[lane] = static_cast<float>(-log(-log(u)));
  }
}

// Upper bound of any value gumbel_noise4 returns: -log(-log(1 - 2^-24)) = 16.6355. A token whose
// scaled logit is more than this below the best score found so far cannot win the Gumbel-max, so
// its noise need not be drawn; skipping it leaves the result exactly the same.
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
