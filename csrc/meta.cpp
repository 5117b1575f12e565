// Meta implementations: shape inference for FakeTensor / torch.compile, running the same
// argument validation as the real kernels (no tensor data is read).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "sglang_dflash/checks.h"

namespace sglang_dflash {
namespace {

at::Tensor block_attention_meta(const at::Tensor& q, const at::Tensor& k_block,
                                const at::Tensor& v_block, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& req_to_token,
                                const at::Tensor& req_pool_indices, const at::Tensor& ctx_lens,
                                int64_t block_size, double /*sm_scale*/, int64_t window,
                                bool causal_block, const std::optional<at::Tensor>& tree_parents) {
  const auto shape = check_block_attention_args(q, k_block, v_block, k_cache, v_cache,
                                                req_to_token, req_pool_indices, ctx_lens,
                                                block_size, window, causal_block, tree_parents);
  return at::empty({q.size(0), shape.q_heads, shape.head_dim}, q.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_results(const VerifyShape& shape,
                                                              const at::Tensor& candidates) {
  const auto opts = candidates.options();
  return {at::empty({shape.batch}, opts.dtype(at::kInt)),
          at::empty({shape.batch}, opts.dtype(at::kLong)),
          at::empty({shape.batch, shape.block_size}, opts.dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block_meta(
    const at::Tensor& candidates, const at::Tensor& logits, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, int64_t /*seed*/, const at::Tensor& offsets) {
  return verify_results(check_verify_args(candidates, logits, temperature, top_k, top_p, offsets),
                        candidates);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block_from_ids_meta(
    const at::Tensor& candidates, const at::Tensor& target_ids) {
  return verify_results(check_verify_ids_args(candidates, target_ids), candidates);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_results(const TreeShape& shape, const at::Tensor& tokens) {
  const auto opts = tokens.options();
  return {at::empty({shape.batch}, opts.dtype(at::kInt)), at::empty({shape.batch, shape.nodes}, opts),
          at::empty({shape.batch, shape.nodes}, opts)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_from_ids_meta(const at::Tensor& tokens,
                                                                         const at::Tensor& parents,
                                                                         const at::Tensor& depths,
                                                                         const at::Tensor& target_ids) {
  return tree_results(check_verify_tree_args(tokens, parents, depths, target_ids), tokens);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_meta(const at::Tensor& tokens, const at::Tensor& parents,
                                                                const at::Tensor& depths, const at::Tensor& logits,
                                                                const at::Tensor& temperature, const at::Tensor& top_k,
                                                                const at::Tensor& top_p, int64_t /*seed*/,
                                                                const at::Tensor& offsets) {
  return tree_results(
      check_verify_tree_sampling_args(tokens, parents, depths, logits, temperature, top_k, top_p, offsets), tokens);
}

at::Tensor skinny_linear_meta(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& weight_scale) {
  return empty_linear_output(x, check_skinny_linear_args(x, weight, bias, weight_scale).out);
}

at::Tensor w8a8_linear_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                            const std::optional<at::Tensor>& bias) {
  return empty_linear_output(x, check_w8a8_linear_args(x, weight, weight_scale, bias).out);
}

at::Tensor gumbel_argmax_meta(const at::Tensor& scores, const std::optional<at::Tensor>& ids, int64_t /*seed*/,
                              const at::Tensor& offsets, const at::Tensor& rows) {
  const auto shape = check_gumbel_argmax_args(scores, ids, offsets, rows);
  return at::empty({shape.rows}, scores.options().dtype(at::kLong));
}

// Nothing to infer (the op only writes its pools): FakeTensor runs the argument checks.
void materialize_context_kv_meta(const at::Tensor& ctx, at::TensorList kv_weights,
                                 std::optional<at::TensorList> kv_biases, at::TensorList k_norm_weights,
                                 double /*eps*/, const at::Tensor& cos_sin_cache, bool /*is_neox*/,
                                 const at::Tensor& positions, const at::Tensor& out_loc, at::TensorList k_caches,
                                 at::TensorList v_caches, double /*v_scale*/) {
  check_materialize_context_kv_args(ctx, kv_weights, kv_biases, k_norm_weights, cos_sin_cache, positions, out_loc,
                                    k_caches, v_caches);
}

at::Tensor rms_norm_rope_meta(const at::Tensor& x, const at::Tensor& weight, double /*eps*/,
                              const std::optional<at::Tensor>& cos_sin_cache,
                              const std::optional<at::Tensor>& positions, bool /*is_neox*/) {
  check_rms_norm_rope_args(x, weight, cos_sin_cache, positions);
  return at::empty(x.sizes(), x.options());
}

// Nothing to infer (the op only moves slots in place): FakeTensor runs the argument checks.
void move_slots_meta(at::TensorList buffers, const at::Tensor& src, const at::Tensor& dst) {
  check_move_slots_args(buffers, src, dst);
}

std::tuple<at::Tensor, at::Tensor> top_k_logprobs_meta(const at::Tensor& logits, int64_t k) {
  check_top_k_logprobs_args(logits, k);
  auto shape = logits.sizes().vec();
  shape.back() = k;
  return {at::empty(shape, logits.options().dtype(at::kFloat)), at::empty(shape, logits.options().dtype(at::kLong))};
}

}  // namespace
}  // namespace sglang_dflash

TORCH_LIBRARY_IMPL(sglang_dflash, Meta, m) {
  m.impl("block_attention", &sglang_dflash::block_attention_meta);
  m.impl("verify_block", &sglang_dflash::verify_block_meta);
  m.impl("verify_block_from_ids", &sglang_dflash::verify_block_from_ids_meta);
  m.impl("verify_tree_from_ids", &sglang_dflash::verify_tree_from_ids_meta);
  m.impl("verify_tree", &sglang_dflash::verify_tree_meta);
  m.impl("skinny_linear", &sglang_dflash::skinny_linear_meta);
  m.impl("w8a8_linear", &sglang_dflash::w8a8_linear_meta);
  m.impl("gumbel_argmax", &sglang_dflash::gumbel_argmax_meta);
  m.impl("materialize_context_kv", &sglang_dflash::materialize_context_kv_meta);
  m.impl("rms_norm_rope", &sglang_dflash::rms_norm_rope_meta);
  m.impl("move_slots", &sglang_dflash::move_slots_meta);
  m.impl("top_k_logprobs", &sglang_dflash::top_k_logprobs_meta);
}
