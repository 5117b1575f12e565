// The accept scans of verification: the longest draft prefix (block) or root path (tree) that
// agrees with the target.
#pragma once

#include <cstdint>

#include "sglang_dflash/common.h"
#include "sglang_dflash/index_errors.h"

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

// Node i of one request's draft tree against the tree's rules (docs/design.md §3.3): parent(j) is
// parents[b, j], depths its row of depths. Returns the broken rule as the error of request b, or
// check kNone. Reads nodes i and parent(i) only, so the whole tree costs O(N).
template <typename ParentAt>
SGLD_HOST_DEVICE IndexError check_tree_node(ParentAt parent, const int64_t* depths, int64_t b, int64_t i) {
  const auto error = [&](IndexCheck check, int64_t value, int64_t bound) {
    return IndexError{static_cast<int32_t>(check), 0, b, i, value, bound};
  };
  const int64_t p = parent(i);
  if (i == 0 && p != -1) return error(IndexCheck::kTreeRoot, p, 0);
  if (p < -1 || p >= i) return error(IndexCheck::kTreeParent, p, i);
  // A node under an unused one can never be reached: a bug of the tree's builder, not padding.
  if (p > 0 && parent(p) == -1) return error(IndexCheck::kTreeOrphan, p, 0);
  if (p >= 0 && depths[i] != depths[p] + 1) return error(IndexCheck::kTreeDepth, depths[i], depths[p] + 1);
  if (p < 0 && depths[i] != 0) return error(IndexCheck::kTreeZeroDepth, depths[i], 0);
  return error(IndexCheck::kNone, 0, 0);
}

// The walk of tree verification (docs/design.md §3.3) over one request's N nodes: from the root (node
// 0), while a child of the current node (parent(c) == it) holds target(current), the target's
// token after it, move to that child, the lowest-index one if several do. Writes path[0..N-1] = 0,
// the accepted nodes, then -1, and out_tokens[0..N-1] = the accepted tokens, the bonus (the
// target's token after the last node reached), then -1; returns the number of accepted nodes.
// Every step moves to a later node, so nothing outside the N nodes is read or written even for a
// tree that breaks check_tree_node's rules.
template <typename ParentAt, typename TargetAt>
SGLD_HOST_DEVICE int32_t accept_tree(const int64_t* tokens, ParentAt parent, int64_t n_nodes,
                                     TargetAt target, int64_t* path, int64_t* out_tokens) {
  int64_t n = 0, cur = 0;
  path[0] = 0;
  while (true) {
    const int64_t t = target(cur);
    out_tokens[n] = t;
    int64_t c = cur + 1;
    while (c < n_nodes && !(parent(c) == cur && tokens[c] == t)) ++c;
    if (c == n_nodes) break;
    path[++n] = cur = c;
  }
  for (int64_t i = n + 1; i < n_nodes; ++i) path[i] = out_tokens[i] = -1;
  return static_cast<int32_t>(n);
}

}  // namespace sglang_dflash
