// Online softmax state (running max and running sum of exponentials) and the merge of two
// partial states. The CPU kernel merges context tiles this way; the CUDA kernel also merges the
// partial results of context splits handled by different CTAs (flash-decoding).
#pragma once

#include <cmath>

#include "sglang_dflash/common.h"

namespace sglang_dflash {

struct SoftmaxState {
  float max;  // running max of the scores seen so far (-inf before any)
  float sum;  // sum of exp(score - max) over the scores seen so far
};

// Rescale factor for accumulators built against `old_max` when the max becomes `new_max`.
// Written so that an empty state (-inf max) contributes nothing instead of NaN.
SGLD_HOST_DEVICE float rescale_factor(float old_max, float new_max) {
  return old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
}

// Merges partial state `b` into `a`; the accumulators of a and b must be scaled by the two
// returned factors and added.
SGLD_HOST_DEVICE void merge_softmax(SoftmaxState& a, const SoftmaxState& b, float& scale_a,
                                    float& scale_b) {
  const float m = fmaxf(a.max, b.max);
  scale_a = rescale_factor(a.max, m);
  scale_b = rescale_factor(b.max, m);
  a.sum = a.sum * scale_a + b.sum * scale_b;
  a.max = m;
}

}  // namespace sglang_dflash
