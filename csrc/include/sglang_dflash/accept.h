// The accept scan of verification: the longest draft prefix that agrees with the target.
#pragma once

#include <cstdint>

#include "sglang_dflash/common.h"

namespace sglang_dflash {

// candidates[0] is the anchor, candidates[1..B-1] the drafts; target(i) is the target's token
// after candidates[i]. Returns n = the largest n with candidates[1..n] == target(0..n-1), writes
// out_tokens[0..B-1] = accepted drafts, the bonus target(n), then -1, and returns the bonus.
// target(i) is called once for each i in 0..n (it may sample a whole row of logits).
template <typename TargetAt>
SGLD_HOST_DEVICE int64_t accept_block(const int64_t* candidates, int block_size, TargetAt target,
                                      int64_t* out_tokens, int32_t* accept_len) {
  int n = 0;
  int64_t bonus = target(0);
  while (n + 1 < block_size && candidates[n + 1] == bonus) {
    out_tokens[n] = bonus;
    bonus = target(++n);
  }
  out_tokens[n] = bonus;
  for (int i = n + 1; i < block_size; ++i) out_tokens[i] = -1;
  *accept_len = n;
  return bonus;
}

}  // namespace sglang_dflash
