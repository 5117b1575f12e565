// The index values the ops check against their ranges, shared by the host checks (checks.cpp, which
// the CPU kernels run) and the CUDA kernels' device error record (csrc/cuda/device_errors.cu), so a
// bad index gets the same text on either device.
#pragma once

#include <cstdint>
#include <string>

namespace sglang_dflash {

// X(name, op, printf format, its arguments from an IndexError `e`): one entry per checked index.
// The formats serve both the host (describe) and, in a debug build, the device's printf.
#define SGLD_INDEX_CHECKS(X)                                                                       \
  X(kAttentionPool, "block_attention",                                                            \
    "req_pool_indices[%lld] = %lld is out of range for req_to_token with %lld rows", e.i, e.value, \
    e.bound)                                                                                       \
  X(kAttentionCtxLen, "block_attention",                                                          \
    "ctx_lens[%lld] = %lld is out of range [0, %lld] (req_to_token width)", e.i, e.value, e.bound) \
  X(kAttentionSlot, "block_attention",                                                            \
    "req_to_token[%lld, %lld] = %lld is outside the KV cache's slots [0, %lld)", e.i, e.j, e.value, \
    e.bound)                                                                                       \
  X(kAttentionTreeParent, "block_attention",                                                      \
    "tree_parents[%lld, %lld] = %lld is not a node before %lld (or -1)", e.i, e.j, e.value, e.bound) \
  X(kVerifyCandidate, "verify_block",                                                             \
    "candidates[%lld, %lld] = %lld is outside the vocabulary [0, %lld) of logits", e.i, e.j,       \
    e.value, e.bound)                                                                              \
  X(kGumbelId, "gumbel_argmax",                                                                   \
    "ids[%lld] = %lld is outside the token ids [0, 2^34) the noise is defined for", e.i, e.value)  \
  X(kGumbelRow, "gumbel_argmax", "rows[%lld] = %lld is outside the verify rows [0, 2^32)", e.i,   \
    e.value)                                                                                       \
  X(kContextPosition, "materialize_context_kv",                                                   \
    "positions[%lld] = %lld is outside the rows [0, %lld) of cos_sin_cache", e.i, e.value, e.bound) \
  X(kContextOutLoc, "materialize_context_kv",                                                     \
    "out_loc[%lld] = %lld is outside [-1, %lld) (-1: row not written; else a slot of the KV pools)", \
    e.i, e.value, e.bound)                                                                         \
  X(kNormRopePosition, "rms_norm_rope",                                                           \
    "positions[%lld] = %lld is outside the rows [0, %lld) of cos_sin_cache", e.i, e.value, e.bound) \
  X(kTreeToken, "verify_tree",                                                                     \
    "tokens[%lld, %lld] = %lld is outside the vocabulary [0, %lld) of logits", e.i, e.j, e.value,   \
    e.bound)                                                                                       \
  X(kTreeRoot, "verify_tree_from_ids", "parents[%lld, 0] = %lld must be -1 (node 0 is the root)",  \
    e.i, e.value)                                                                                  \
  X(kTreeParent, "verify_tree_from_ids",                                                           \
    "parents[%lld, %lld] = %lld is not a node before %lld (or -1)", e.i, e.j, e.value, e.j)        \
  X(kTreeOrphan, "verify_tree_from_ids",                                                           \
    "parents[%lld, %lld] = %lld is an unused node (its own parent is -1)", e.i, e.j, e.value)      \
  X(kTreeDepth, "verify_tree_from_ids",                                                            \
    "depths[%lld, %lld] = %lld is not its parent's depth + 1 = %lld", e.i, e.j, e.value, e.bound)  \
  X(kTreeZeroDepth, "verify_tree_from_ids",                                                        \
    "depths[%lld, %lld] = %lld must be 0 (the root's and the unused nodes' depth)", e.i, e.j,      \
    e.value)

enum class IndexCheck : int32_t {
  kNone = 0,
#define SGLD_INDEX_CHECK_NAME(name, ...) name,
  SGLD_INDEX_CHECKS(SGLD_INDEX_CHECK_NAME)
#undef SGLD_INDEX_CHECK_NAME
};

// One failed check: element [i] (or [i, j]) of an index tensor holds `value`, outside its range
// (`bound` where the message names one). long long: what the formats' %lld reads.
struct IndexError {
  int32_t check;  // an IndexCheck; kNone: no failure
  int32_t unused;
  long long i, j, value, bound;
};

// "sglang_dflash.<op>: <what was out of range>", the text the error raises with.
std::string describe(const IndexError& e);

}  // namespace sglang_dflash
