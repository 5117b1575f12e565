#include "sglang_dflash/checks.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "sglang_dflash/accept.h"
#include "sglang_dflash/index_errors.h"

namespace sglang_dflash {
namespace {

#define SGLD_CHECK(cond, op, ...) TORCH_CHECK_VALUE(cond, "sglang_dflash.", op, ": ", __VA_ARGS__)

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

bool is_index_type(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank,
                const char* layout) {
  SGLD_CHECK(t.dim() == rank, op, name, " must be ", rank, "-D ", layout, ", got shape ",
             shape_of(t));
}

void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                int64_t expected, const char* meaning) {
  SGLD_CHECK(t.size(dim) == expected, op, name, ".shape[", dim, "] must be ", meaning, " = ",
             expected, ", got shape ", shape_of(t));
}

void check_index_tensor(const char* op, const char* name, const at::Tensor& t) {
  SGLD_CHECK(is_index_type(t.scalar_type()), op, name, " must be int32 or int64, got ",
             t.scalar_type());
}

void check_same_device(const char* op, const at::Tensor& ref, const char* name,
                       const at::Tensor& t) {
  SGLD_CHECK(t.device() == ref.device(), op, name, " is on ", t.device(), " but the other inputs are on ",
             ref.device());
}

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  SGLD_CHECK(t.scalar_type() == dtype, op, name, " must be ", dtype, ", got ", t.scalar_type());
}

// The kernels address rows through strides but read each head vector as one contiguous run.
void check_rows_of_vectors(const char* op, const char* name, const at::Tensor& t) {
  SGLD_CHECK(t.stride(-1) == 1, op, name, " must have a contiguous last dimension (stride 1), got strides ",
             t.strides());
}

// (min, max) of an index tensor's values in one pass; the tensor must be non-empty. CPU tensors are
// scanned in place: these checks run on every op call (once per attention layer in a served step),
// where aminmax's dispatch and two item() reads cost more than the scan itself.
std::pair<int64_t, int64_t> value_range(const at::Tensor& t) {
  if (!t.is_cpu()) {
    const auto [lo, hi] = at::aminmax(t);
    return {lo.item<int64_t>(), hi.item<int64_t>()};
  }
  const auto c = t.contiguous();
  return AT_DISPATCH_INDEX_TYPES(c.scalar_type(), "value_range", [&] {
    const index_t* p = c.const_data_ptr<index_t>();
    const auto [lo, hi] = std::minmax_element(p, p + c.numel());
    return std::pair<int64_t, int64_t>{*lo, *hi};
  });
}

struct Element {
  int64_t index;  // flat, in row-major order
  int64_t value;
};

// The first element of index tensor t outside [lo, hi), if any: one min / max scan when all are in
// range, the search for the culprit (named in the error) only when one is not.
std::optional<Element> first_outside(const at::Tensor& t, int64_t lo, int64_t hi) {
  if (t.numel() == 0) return std::nullopt;
  const auto [min, max] = value_range(t);
  if (min >= lo && max < hi) return std::nullopt;
  const auto flat = t.to(at::kLong).contiguous();
  const int64_t* p = flat.const_data_ptr<int64_t>();
  const int64_t* bad = std::find_if(p, p + flat.numel(), [&](int64_t v) { return v < lo || v >= hi; });
  return Element{bad - p, *bad};
}

[[noreturn]] void fail_index(IndexCheck check, int64_t i, int64_t j, int64_t value, int64_t bound) {
  TORCH_CHECK_VALUE(false, describe({static_cast<int32_t>(check), 0, i, j, value, bound}));
}

// Every token of ids [bs, B] in [0, vocab); the first that is not fails `check` at its [b, i].
void check_ids_in_vocab(IndexCheck check, const at::Tensor& ids, int64_t vocab) {
  if (const auto bad = first_outside(ids, 0, vocab)) {
    const int64_t cols = ids.size(1);
    fail_index(check, bad->index / cols, bad->index % cols, bad->value, vocab);
  }
}

// No slot >= 0 twice in the index tensor `slots` (named `name`): two writes into one slot would
// leave it holding either, or a mix on CUDA. Rejected on the host, where it is cheap (few values).
void check_each_slot_once(const char* op, const char* name, const at::Tensor& slots) {
  const auto loc = slots.to(at::kLong).contiguous();
  const int64_t* slot = loc.const_data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> written;  // (slot, index)
  for (int64_t i = 0; i < loc.numel(); ++i) {
    if (slot[i] >= 0) written.emplace_back(slot[i], i);
  }
  std::sort(written.begin(), written.end());
  const auto twice = std::adjacent_find(written.begin(), written.end(),
                                        [](const auto& a, const auto& b) { return a.first == b.first; });
  SGLD_CHECK(twice == written.end(), op, name, "[", twice->second, "] and ", name, "[", (twice + 1)->second,
             "] are both slot ", twice->first, ": each slot may be written once per call");
}

// candidates [bs, B] int64 with B >= 1 (the anchor column); returns (bs, B).
std::pair<int64_t, int64_t> check_candidates(const char* op, const at::Tensor& candidates) {
  check_rank(op, "candidates", candidates, 2, "[bs, B]");
  check_dtype(op, "candidates", candidates, at::kLong);
  SGLD_CHECK(candidates.size(1) >= 1, op, "candidates must have at least one column (the anchor), got shape ",
             shape_of(candidates));
  return {candidates.size(0), candidates.size(1)};
}

}  // namespace

std::string describe(const IndexError& e) {
  char text[256];
  switch (static_cast<IndexCheck>(e.check)) {
#define SGLD_DESCRIBE(name, op, format, ...)                                               \
  case IndexCheck::name:                                                                    \
    std::snprintf(text, sizeof text, "sglang_dflash." op ": " format, __VA_ARGS__);         \
    break;
    SGLD_INDEX_CHECKS(SGLD_DESCRIBE)
#undef SGLD_DESCRIBE
    default:
      std::snprintf(text, sizeof text, "sglang_dflash: unknown index check %d", e.check);
  }
  return text;
}

BlockAttentionShape check_block_attention_args(const at::Tensor& q, const at::Tensor& k_block,
                                               const at::Tensor& v_block, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache,
                                               const at::Tensor& req_to_token,
                                               const at::Tensor& req_pool_indices,
                                               const at::Tensor& ctx_lens, int64_t block_size,
                                               int64_t window, bool causal_block,
                                               const std::optional<at::Tensor>& tree_parents) {
  const char* op = "block_attention";
  check_rank(op, "q", q, 3, "[N, Hq, D]");
  check_rank(op, "k_block", k_block, 3, "[N, Hkv, D]");
  check_rank(op, "v_block", v_block, 3, "[N, Hkv, D]");
  check_rank(op, "k_cache", k_cache, 3, "[S, Hkv, D]");
  check_rank(op, "v_cache", v_cache, 3, "[S, Hkv, D]");
  check_rank(op, "req_to_token", req_to_token, 2, "[R, M]");
  check_rank(op, "req_pool_indices", req_pool_indices, 1, "[bs]");
  check_rank(op, "ctx_lens", ctx_lens, 1, "[bs]");

  SGLD_CHECK(is_float_type(q.scalar_type()), op, "q must be float32, bfloat16 or float16, got ",
             q.scalar_type());
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"k_block", &k_block},
                         {"v_block", &v_block},
                         {"k_cache", &k_cache},
                         {"v_cache", &v_cache}}) {
    SGLD_CHECK(t->scalar_type() == q.scalar_type(), op, name, " must have q's dtype ",
               q.scalar_type(), ", got ", t->scalar_type());
    check_same_device(op, q, name, *t);
    check_rows_of_vectors(op, name, *t);
  }
  check_rows_of_vectors(op, "q", q);
  check_index_tensor(op, "req_to_token", req_to_token);
  check_index_tensor(op, "req_pool_indices", req_pool_indices);
  check_index_tensor(op, "ctx_lens", ctx_lens);
  check_same_device(op, q, "req_to_token", req_to_token);
  check_same_device(op, q, "req_pool_indices", req_pool_indices);
  check_same_device(op, q, "ctx_lens", ctx_lens);

  SGLD_CHECK(block_size >= 1, op, "block_size must be >= 1, got ", block_size);
  SGLD_CHECK(window != 0, op, "window must be >= 1 (sliding window) or negative (off), got 0");
  const int64_t n_rows = q.size(0), q_heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_block.size(1);
  SGLD_CHECK(n_rows % block_size == 0, op, "q.shape[0] = ", n_rows,
             " is not a multiple of block_size = ", block_size);
  const int64_t batch = n_rows / block_size;
  SGLD_CHECK(head_dim >= 1 && kv_heads >= 1, op, "head_dim and the number of kv heads must be >= 1, got k_block shape ",
             shape_of(k_block));
  SGLD_CHECK(q_heads % kv_heads == 0, op, "q heads (", q_heads,
             ") must be a multiple of kv heads (", kv_heads, ")");
  check_size(op, "k_block", k_block, 0, n_rows, "q.shape[0]");
  check_size(op, "v_block", v_block, 0, n_rows, "q.shape[0]");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"k_block", &k_block},
                         {"v_block", &v_block},
                         {"k_cache", &k_cache},
                         {"v_cache", &v_cache}}) {
    check_size(op, name, *t, 1, kv_heads, "kv heads");
    check_size(op, name, *t, 2, head_dim, "head_dim");
  }
  check_size(op, "v_cache", v_cache, 0, k_cache.size(0), "k_cache.shape[0]");
  check_size(op, "req_pool_indices", req_pool_indices, 0, batch, "bs = N / block_size");
  check_size(op, "ctx_lens", ctx_lens, 0, batch, "bs = N / block_size");
  if (tree_parents) {
    const at::Tensor& parents = *tree_parents;
    check_rank(op, "tree_parents", parents, 2, "[bs, B]");
    check_index_tensor(op, "tree_parents", parents);
    check_same_device(op, q, "tree_parents", parents);
    check_size(op, "tree_parents", parents, 0, batch, "bs = N / block_size");
    check_size(op, "tree_parents", parents, 1, block_size, "block_size");
    // A window or causal order over block rows has no meaning for tree nodes, whose positions are
    // their depths, not their rows.
    SGLD_CHECK(window < 0, op, "tree_parents cannot be combined with a sliding window (window = ", window, ")");
    SGLD_CHECK(!causal_block, op, "tree_parents cannot be combined with causal_block (a chain is the tree "
               "tree_parents[b, i] = i - 1)");
  }
  return {batch, block_size, q_heads, kv_heads, head_dim};
}

void check_block_attention_indices(const at::Tensor& k_cache, const at::Tensor& req_to_token,
                                   const at::Tensor& req_pool_indices, const at::Tensor& ctx_lens,
                                   const std::optional<at::Tensor>& tree_parents) {
  const auto pools = req_pool_indices.to(at::kLong).contiguous();
  const auto lens = ctx_lens.to(at::kLong).contiguous();
  const int64_t n_reqs = req_to_token.size(0), width = req_to_token.size(1);
  const int64_t n_slots = k_cache.size(0);
  const int64_t* pool = pools.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < pools.numel(); ++b) {
    if (pool[b] < 0 || pool[b] >= n_reqs) fail_index(IndexCheck::kAttentionPool, b, 0, pool[b], n_reqs);
    if (len[b] < 0 || len[b] > width) fail_index(IndexCheck::kAttentionCtxLen, b, 0, len[b], width);
    // Only the entries in use: SGLang's table is [max requests, context length], far larger than
    // what one step reads, and this runs once per attention layer.
    if (const auto bad = first_outside(req_to_token[pool[b]].narrow(0, 0, len[b]), 0, n_slots)) {
      fail_index(IndexCheck::kAttentionSlot, pool[b], bad->index, bad->value, n_slots);
    }
  }
  if (tree_parents) {
    const auto parents = tree_parents->to(at::kLong).contiguous();
    const int64_t nodes = parents.size(1);
    const int64_t* parent = parents.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < parents.size(0); ++b)
      for (int64_t i = 0; i < nodes; ++i) {
        const int64_t p = parent[b * nodes + i];
        if (p < -1 || p >= i) fail_index(IndexCheck::kAttentionTreeParent, b, i, p, i);
      }
  }
}

VerifyShape check_verify_ids_args(const at::Tensor& candidates, const at::Tensor& target_ids) {
  const char* op = "verify_block";
  const auto [batch, block_size] = check_candidates(op, candidates);
  check_index_tensor(op, "target_ids", target_ids);
  check_same_device(op, candidates, "target_ids", target_ids);
  SGLD_CHECK(target_ids.numel() == batch * block_size &&
                 (target_ids.dim() == 1 || (target_ids.dim() == 2 && target_ids.size(0) == batch)),
             op, "target_ids must be [bs, B] or [bs * B] with bs, B = ", batch, ", ", block_size,
             " from candidates, got shape ", shape_of(target_ids));
  return {batch, block_size, 0};
}

namespace {

// logits [rows, V] (one row per candidate / node of `drafts`, the tensor named `source`) and the
// per-request sampling arguments [bs] of verify_block and verify_tree.
void check_logits_and_sampling(const char* op, const char* source, const at::Tensor& drafts, int64_t batch,
                               int64_t rows, const char* rows_meaning, const at::Tensor& logits,
                               const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                               const at::Tensor& offsets) {
  const std::string bs_meaning = std::string("bs from ") + source;
  check_rank(op, "logits", logits, 2, rows_meaning);
  SGLD_CHECK(is_float_type(logits.scalar_type()), op,
             "logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  check_size(op, "logits", logits, 0, rows, rows_meaning);
  SGLD_CHECK(logits.size(1) >= 1, op, "logits must have a vocabulary of at least 1, got shape ",
             shape_of(logits));
  check_rows_of_vectors(op, "logits", logits);
  check_same_device(op, drafts, "logits", logits);
  for (auto [name, t, dtype] :
       {std::tuple<const char*, const at::Tensor*, at::ScalarType>{"temperature", &temperature, at::kFloat},
        {"top_k", &top_k, at::kInt},
        {"top_p", &top_p, at::kFloat},
        {"offsets", &offsets, at::kLong}}) {
    check_rank(op, name, *t, 1, "[bs]");
    check_size(op, name, *t, 0, batch, bs_meaning.c_str());
    check_dtype(op, name, *t, dtype);
    check_same_device(op, drafts, name, *t);
  }
}

// tokens [bs, N] int64 (N >= 1: the root), parents [bs, N] int32 or int64, depths [bs, N] int64.
TreeShape check_tree(const char* op, const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depths) {
  check_rank(op, "tokens", tokens, 2, "[bs, N]");
  check_dtype(op, "tokens", tokens, at::kLong);
  SGLD_CHECK(tokens.size(1) >= 1, op, "tokens must have at least one column (the root), got shape ",
             shape_of(tokens));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"parents", &parents}, {"depths", &depths}}) {
    SGLD_CHECK(t->sizes() == tokens.sizes(), op, name, " must have tokens' shape [bs, N] = ", shape_of(tokens),
               ", got shape ", shape_of(*t));
    check_same_device(op, tokens, name, *t);
  }
  check_index_tensor(op, "parents", parents);
  check_dtype(op, "depths", depths, at::kLong);
  return {tokens.size(0), tokens.size(1)};
}

}  // namespace

VerifyShape check_verify_args(const at::Tensor& candidates, const at::Tensor& logits,
                              const at::Tensor& temperature, const at::Tensor& top_k,
                              const at::Tensor& top_p, const at::Tensor& offsets) {
  const char* op = "verify_block";
  const auto [batch, block_size] = check_candidates(op, candidates);
  check_logits_and_sampling(op, "candidates", candidates, batch, batch * block_size, "bs * B from candidates", logits,
                            temperature, top_k, top_p, offsets);
  return {batch, block_size, logits.size(1)};
}

TreeShape check_verify_tree_sampling_args(const at::Tensor& tokens, const at::Tensor& parents,
                                          const at::Tensor& depths, const at::Tensor& logits,
                                          const at::Tensor& temperature, const at::Tensor& top_k,
                                          const at::Tensor& top_p, const at::Tensor& offsets) {
  const char* op = "verify_tree";
  const auto shape = check_tree(op, tokens, parents, depths);
  check_logits_and_sampling(op, "tokens", tokens, shape.batch, shape.batch * shape.nodes, "bs * N from tokens",
                            logits, temperature, top_k, top_p, offsets);
  return shape;
}

void check_verify_values(const at::Tensor& candidates, int64_t vocab) {
  check_ids_in_vocab(IndexCheck::kVerifyCandidate, candidates, vocab);
}

void check_verify_tree_tokens(const at::Tensor& tokens, int64_t vocab) {
  check_ids_in_vocab(IndexCheck::kTreeToken, tokens, vocab);
}

TreeShape check_verify_tree_args(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depths,
                                 const at::Tensor& target_ids) {
  const char* op = "verify_tree_from_ids";
  const auto [batch, nodes] = check_tree(op, tokens, parents, depths);
  check_index_tensor(op, "target_ids", target_ids);
  check_same_device(op, tokens, "target_ids", target_ids);
  SGLD_CHECK(target_ids.numel() == batch * nodes &&
                 (target_ids.dim() == 1 || (target_ids.dim() == 2 && target_ids.size(0) == batch)),
             op, "target_ids must be [bs, N] or [bs * N] with bs, N = ", batch, ", ", nodes, " from tokens, got shape ",
             shape_of(target_ids));
  return {batch, nodes};
}

void check_verify_tree_values(const at::Tensor& parents, const at::Tensor& depths) {
  const auto par = parents.to(at::kLong).contiguous();
  const auto dep = depths.contiguous();
  const int64_t nodes = par.size(1);
  for (int64_t b = 0; b < par.size(0); ++b) {
    const int64_t* parent = par.const_data_ptr<int64_t>() + b * nodes;
    for (int64_t i = 0; i < nodes; ++i) {
      const IndexError e = check_tree_node([parent](int64_t j) { return parent[j]; },
                                           dep.const_data_ptr<int64_t>() + b * nodes, b, i);
      TORCH_CHECK_VALUE(e.check == static_cast<int32_t>(IndexCheck::kNone), describe(e));
    }
  }
}

namespace {

LinearShape check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& weight_scale) {
  check_rank(op, "weight", weight, 2, "[N, K]");
  SGLD_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension [..., K], got a scalar");
  SGLD_CHECK(x.size(-1) == weight.size(1), op, "x.shape[-1] must be K = weight.shape[1] = ",
             weight.size(1), ", got x shape ", shape_of(x));
  if (weight_scale.has_value()) {
    SGLD_CHECK(is_float_type(x.scalar_type()), op, "x must be float32, bfloat16 or float16, got ", x.scalar_type());
    SGLD_CHECK(weight.scalar_type() == at::kChar, op,
               "weight_scale is given, so weight must be int8 (quantized), got ", weight.scalar_type());
    check_rank(op, "weight_scale", *weight_scale, 1, "[N]");
    check_size(op, "weight_scale", *weight_scale, 0, weight.size(0), "N = weight.shape[0]");
    check_dtype(op, "weight_scale", *weight_scale, at::kFloat);
    check_same_device(op, x, "weight_scale", *weight_scale);
  } else {
    SGLD_CHECK(weight.scalar_type() != at::kChar, op,
               "an int8 weight needs weight_scale (float32 [N], one scale per weight row)");
    SGLD_CHECK(is_float_type(weight.scalar_type()), op,
               "weight must be float32, bfloat16 or float16 (or int8 with weight_scale), got ", weight.scalar_type());
    check_dtype(op, "x", x, weight.scalar_type());
  }
  SGLD_CHECK(weight.size(1) == 0 || weight.stride(1) == 1, op,
             "weight must have a contiguous last dimension (stride 1), got strides ", weight.strides());
  check_same_device(op, x, "weight", weight);
  if (bias.has_value()) {
    check_rank(op, "bias", *bias, 1, "[N]");
    check_size(op, "bias", *bias, 0, weight.size(0), "N = weight.shape[0]");
    check_dtype(op, "bias", *bias, x.scalar_type());
    check_same_device(op, x, "bias", *bias);
  }
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return {rows, weight.size(0), weight.size(1)};
}

}  // namespace

at::Tensor empty_linear_output(const at::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return at::empty(sizes, x.options());
}

LinearShape check_skinny_linear_args(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& weight_scale) {
  return check_linear_args("skinny_linear", x, weight, bias, weight_scale);
}

LinearShape check_w8a8_linear_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                                   const std::optional<at::Tensor>& bias) {
  const char* op = "w8a8_linear";
  SGLD_CHECK(weight.scalar_type() == at::kChar, op, "weight must be int8 (quantize_rows), got ", weight.scalar_type());
  const auto shape = check_linear_args(op, x, weight, bias, weight_scale);
  SGLD_CHECK(shape.in <= kW8a8MaxK, op, "K = weight.shape[1] must be <= ", kW8a8MaxK,
             " (the int32 sums of K products of two int8 values), got ", shape.in);
  return shape;
}

GumbelArgmaxShape check_gumbel_argmax_args(const at::Tensor& scores, const std::optional<at::Tensor>& ids,
                                           const at::Tensor& offsets, const at::Tensor& rows) {
  const char* op = "gumbel_argmax";
  check_rank(op, "scores", scores, 2, "[R, n]");
  SGLD_CHECK(is_float_type(scores.scalar_type()), op,
             "scores must be float32, bfloat16 or float16, got ", scores.scalar_type());
  SGLD_CHECK(scores.size(1) >= 1, op, "scores must have at least one column, got shape ", shape_of(scores));
  check_rows_of_vectors(op, "scores", scores);
  if (ids.has_value()) {
    check_rank(op, "ids", *ids, 1, "[n]");
    check_dtype(op, "ids", *ids, at::kLong);
    check_size(op, "ids", *ids, 0, scores.size(1), "n = scores.shape[1]");
    check_same_device(op, scores, "ids", *ids);
  }
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"offsets", &offsets}, {"rows", &rows}}) {
    check_rank(op, name, *t, 1, "[R]");
    check_dtype(op, name, *t, at::kLong);
    check_size(op, name, *t, 0, scores.size(0), "R = scores.shape[0]");
    check_same_device(op, scores, name, *t);
  }
  return {scores.size(0), scores.size(1)};
}

void check_gumbel_argmax_values(const std::optional<at::Tensor>& ids, const at::Tensor& rows) {
  if (const auto bad = ids.has_value() ? first_outside(*ids, 0, int64_t{1} << 34) : std::nullopt) {
    fail_index(IndexCheck::kGumbelId, bad->index, 0, bad->value, 0);
  }
  if (const auto bad = first_outside(rows, 0, int64_t{1} << 32)) {
    fail_index(IndexCheck::kGumbelRow, bad->index, 0, bad->value, 0);
  }
}

ContextKvShape check_materialize_context_kv_args(const at::Tensor& ctx, at::TensorList kv_weights,
                                                 const std::optional<at::TensorList>& kv_biases,
                                                 at::TensorList k_norm_weights, const at::Tensor& cos_sin_cache,
                                                 const at::Tensor& positions, const at::Tensor& out_loc,
                                                 at::TensorList k_caches, at::TensorList v_caches) {
  const char* op = "materialize_context_kv";
  const auto item = [](const char* list, int64_t l) { return std::string(list) + "[" + std::to_string(l) + "]"; };
  check_rank(op, "ctx", ctx, 2, "[N, H]");
  SGLD_CHECK(is_float_type(ctx.scalar_type()), op, "ctx must be float32, bfloat16 or float16, got ",
             ctx.scalar_type());
  const int64_t layers = static_cast<int64_t>(kv_weights.size());
  SGLD_CHECK(layers >= 1, op, "kv_weights must hold at least one layer's weight, got an empty list");
  for (auto [name, count] : {std::pair<const char*, size_t>{"k_norm_weights", k_norm_weights.size()},
                             {"k_caches", k_caches.size()},
                             {"v_caches", v_caches.size()},
                             {"kv_biases", kv_biases.has_value() ? kv_biases->size() : kv_weights.size()}}) {
    SGLD_CHECK(static_cast<int64_t>(count) == layers, op, name, " must hold one tensor per layer (L = ", layers,
               " from kv_weights), got ", count);
  }

  // Hkv, D and S come from the first pool; every other pool must match it.
  const at::Tensor& pool0 = k_caches[0];
  check_rank(op, "k_caches[0]", pool0, 3, "[S, Hkv, D]");
  SGLD_CHECK(is_float_type(pool0.scalar_type()), op, "k_caches[0] must be float32, bfloat16 or float16, got ",
             pool0.scalar_type());
  const int64_t slots = pool0.size(0), kv_heads = pool0.size(1), head_dim = pool0.size(2);
  SGLD_CHECK(kv_heads >= 1 && head_dim >= 1, op, "k_caches[0] must have kv heads and head_dim >= 1, got shape ",
             shape_of(pool0));
  const int64_t kv_rows = 2 * kv_heads * head_dim;
  for (int64_t l = 0; l < layers; ++l) {
    for (auto [list, pools] : {std::pair<const char*, at::TensorList>{"k_caches", k_caches}, {"v_caches", v_caches}}) {
      const std::string name = item(list, l);
      const at::Tensor& pool = pools[l];
      check_rank(op, name.c_str(), pool, 3, "[S, Hkv, D]");
      check_size(op, name.c_str(), pool, 0, slots, "S = k_caches[0].shape[0]");
      check_size(op, name.c_str(), pool, 1, kv_heads, "Hkv = k_caches[0].shape[1]");
      check_size(op, name.c_str(), pool, 2, head_dim, "D = k_caches[0].shape[2]");
      SGLD_CHECK(pool.scalar_type() == pool0.scalar_type(), op, name, " must have k_caches[0]'s dtype ",
                 pool0.scalar_type(), ", got ", pool.scalar_type());
      check_same_device(op, ctx, name.c_str(), pool);
      check_rows_of_vectors(op, name.c_str(), pool);
    }
    const std::string w = item("kv_weights", l), n = item("k_norm_weights", l);
    check_rank(op, w.c_str(), kv_weights[l], 2, "[2 * Hkv * D, H]");
    check_size(op, w.c_str(), kv_weights[l], 0, kv_rows, "2 * Hkv * D from the KV pools");
    check_size(op, w.c_str(), kv_weights[l], 1, ctx.size(1), "H = ctx.shape[1]");
    check_rows_of_vectors(op, w.c_str(), kv_weights[l]);
    check_rank(op, n.c_str(), k_norm_weights[l], 1, "[D]");
    check_size(op, n.c_str(), k_norm_weights[l], 0, head_dim, "D from the KV pools");
    std::vector<std::pair<std::string, const at::Tensor*>> same_dtype{{w, &kv_weights[l]}, {n, &k_norm_weights[l]}};
    if (kv_biases.has_value()) {
      const std::string b = item("kv_biases", l);
      check_rank(op, b.c_str(), (*kv_biases)[l], 1, "[2 * Hkv * D]");
      check_size(op, b.c_str(), (*kv_biases)[l], 0, kv_rows, "2 * Hkv * D from the KV pools");
      same_dtype.emplace_back(b, &(*kv_biases)[l]);
    }
    for (const auto& [name, t] : same_dtype) {
      SGLD_CHECK(t->scalar_type() == ctx.scalar_type(), op, name, " must have ctx's dtype ", ctx.scalar_type(),
                 ", got ", t->scalar_type());
      check_same_device(op, ctx, name.c_str(), *t);
    }
  }

  check_rank(op, "cos_sin_cache", cos_sin_cache, 2, "[P, rotary_dim]");
  SGLD_CHECK(is_float_type(cos_sin_cache.scalar_type()), op,
             "cos_sin_cache must be float32, bfloat16 or float16, got ", cos_sin_cache.scalar_type());
  const int64_t rotary_dim = cos_sin_cache.size(1);
  SGLD_CHECK(rotary_dim % 2 == 0 && rotary_dim >= 2 && rotary_dim <= head_dim, op,
             "cos_sin_cache.shape[1] (rotary_dim: cos then sin halves) must be even, in [2, D = ", head_dim,
             "], got shape ", shape_of(cos_sin_cache));
  check_rows_of_vectors(op, "cos_sin_cache", cos_sin_cache);
  check_same_device(op, ctx, "cos_sin_cache", cos_sin_cache);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"positions", &positions}, {"out_loc", &out_loc}}) {
    check_rank(op, name, *t, 1, "[N]");
    check_size(op, name, *t, 0, ctx.size(0), "N = ctx.shape[0]");
    check_index_tensor(op, name, *t);
    check_same_device(op, ctx, name, *t);
  }
  return {ctx.size(0), layers, kv_heads, head_dim, rotary_dim, cos_sin_cache.size(0), slots};
}

void check_materialize_context_kv_indices(const at::Tensor& positions, const at::Tensor& out_loc,
                                          const ContextKvShape& shape) {
  const char* op = "materialize_context_kv";
  if (shape.rows == 0) return;
  if (const auto bad = first_outside(positions, 0, shape.max_positions)) {
    fail_index(IndexCheck::kContextPosition, bad->index, 0, bad->value, shape.max_positions);
  }
  if (const auto bad = first_outside(out_loc, -1, shape.slots)) {
    fail_index(IndexCheck::kContextOutLoc, bad->index, 0, bad->value, shape.slots);
  }
  check_each_slot_once(op, "out_loc", out_loc);
}

void check_rms_norm_rope_args(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& cos_sin_cache,
                              const std::optional<at::Tensor>& positions) {
  const char* op = "rms_norm_rope";
  SGLD_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension [..., D], got a scalar");
  SGLD_CHECK(is_float_type(x.scalar_type()), op, "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  check_rows_of_vectors(op, "x", x);
  const int64_t head_dim = x.size(-1);
  check_rank(op, "weight", weight, 1, "[D]");
  check_size(op, "weight", weight, 0, head_dim, "D = x.shape[-1]");
  check_dtype(op, "weight", weight, x.scalar_type());
  check_same_device(op, x, "weight", weight);
  SGLD_CHECK(cos_sin_cache.has_value() == positions.has_value(), op,
             "cos_sin_cache and positions go together (RoPE needs both), got only ",
             cos_sin_cache.has_value() ? "cos_sin_cache" : "positions");
  if (!cos_sin_cache.has_value()) return;
  check_rank(op, "x", x, 3, "[N, heads, D] (with RoPE)");
  check_rank(op, "cos_sin_cache", *cos_sin_cache, 2, "[P, rotary_dim]");
  SGLD_CHECK(is_float_type(cos_sin_cache->scalar_type()), op,
             "cos_sin_cache must be float32, bfloat16 or float16, got ", cos_sin_cache->scalar_type());
  const int64_t rotary_dim = cos_sin_cache->size(1);
  SGLD_CHECK(rotary_dim % 2 == 0 && rotary_dim >= 2 && rotary_dim <= head_dim, op,
             "cos_sin_cache.shape[1] (rotary_dim: cos then sin halves) must be even, in [2, D = ", head_dim,
             "], got shape ", shape_of(*cos_sin_cache));
  check_rows_of_vectors(op, "cos_sin_cache", *cos_sin_cache);
  check_same_device(op, x, "cos_sin_cache", *cos_sin_cache);
  check_rank(op, "positions", *positions, 1, "[N]");
  check_size(op, "positions", *positions, 0, x.size(0), "N = x.shape[0]");
  check_index_tensor(op, "positions", *positions);
  check_same_device(op, x, "positions", *positions);
}

void check_rms_norm_rope_positions(const std::optional<at::Tensor>& cos_sin_cache,
                                   const std::optional<at::Tensor>& positions) {
  if (!positions.has_value() || positions->numel() == 0) return;
  const int64_t rows = cos_sin_cache->size(0);
  if (const auto bad = first_outside(*positions, 0, rows)) {
    fail_index(IndexCheck::kNormRopePosition, bad->index, 0, bad->value, rows);
  }
}

void check_move_slots_args(at::TensorList buffers, const at::Tensor& src, const at::Tensor& dst) {
  const char* op = "move_slots";
  SGLD_CHECK(!buffers.empty(), op, "buffers must hold at least one tensor, got none");
  check_rank(op, "src", src, 1, "[n]");
  check_rank(op, "dst", dst, 1, "[n]");
  check_index_tensor(op, "src", src);
  check_index_tensor(op, "dst", dst);
  SGLD_CHECK(src.size(0) == dst.size(0), op, "src and dst must have one length, got shapes ", shape_of(src),
             " and ", shape_of(dst));
  for (size_t b = 0; b < buffers.size(); ++b) {
    const std::string name = "buffers[" + std::to_string(b) + "]";
    const at::Tensor& t = buffers[b];
    SGLD_CHECK(t.dim() >= 1, op, name, " must have a slot dimension [S, ...], got a scalar");
    if (t.dim() > 1) check_rows_of_vectors(op, name.c_str(), t);
    check_same_device(op, buffers[0], name.c_str(), t);
  }
  check_same_device(op, buffers[0], "src", src);
  check_same_device(op, buffers[0], "dst", dst);
}

void check_move_slots_indices(at::TensorList buffers, const at::Tensor& src, const at::Tensor& dst) {
  const char* op = "move_slots";
  if (src.numel() == 0) return;
  int64_t slots = buffers[0].size(0);
  for (const auto& t : buffers) slots = std::min(slots, t.size(0));
  for (const auto& [name, index] : {std::pair<const char*, const at::Tensor&>{"src", src}, {"dst", dst}}) {
    if (const auto bad = first_outside(index, 0, slots)) {
      SGLD_CHECK(false, op, name, "[", bad->index, "] = ", bad->value, " is outside the slots [0, ", slots,
                 ") of every buffer");
    }
  }
  check_each_slot_once(op, "dst", dst);
}

void check_top_k_logprobs_args(const at::Tensor& logits, int64_t k) {
  const char* op = "top_k_logprobs";
  SGLD_CHECK(logits.dim() >= 1, op, "logits must have at least 1 dimension [..., V], got a scalar");
  SGLD_CHECK(is_float_type(logits.scalar_type()), op, "logits must be float32, bfloat16 or float16, got ",
             logits.scalar_type());
  const int64_t vocab = logits.size(-1);
  SGLD_CHECK(1 <= k && k <= vocab, op, "k must be in [1, V = ", vocab, "] (logits shape ", shape_of(logits),
             "), got ", k);
}

}  // namespace sglang_dflash
