// CPU implementations of the ops registered in ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace sglang_dflash::cpu {

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k_block,
                           const at::Tensor& v_block, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& req_to_token,
                           const at::Tensor& req_pool_indices, const at::Tensor& ctx_lens,
                           int64_t block_size, double sm_scale, int64_t window, bool causal_block,
                           const std::optional<at::Tensor>& tree_parents);

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block(
    const at::Tensor& candidates, const at::Tensor& logits, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, int64_t seed, const at::Tensor& offsets);

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_block_from_ids(const at::Tensor& candidates,
                                                                     const at::Tensor& target_ids);

// The walk of each request's draft tree along the target's token ids (docs/design.md §3.3; the contract
// is in sglang_dflash/ops/__init__.py): accept_len i32 [bs], path i64 [bs, N], out_tokens i64 [bs, N].
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_from_ids(const at::Tensor& tokens,
                                                                    const at::Tensor& parents,
                                                                    const at::Tensor& depths,
                                                                    const at::Tensor& target_ids);

// Tree verification with the target's tokens sampled lazily from its logits, only for the nodes
// the walk reaches (the contract is ops.verify_tree's): accept_len i32 [bs], path and out_tokens
// i64 [bs, N], equal to verify_block on every node then verify_tree_from_ids.
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree(const at::Tensor& tokens, const at::Tensor& parents,
                                                        const at::Tensor& depths, const at::Tensor& logits,
                                                        const at::Tensor& temperature, const at::Tensor& top_k,
                                                        const at::Tensor& top_p, int64_t seed,
                                                        const at::Tensor& offsets);

// out [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]), fp32 accumulation, for few rows; an
// int8 weight's sums are multiplied by weight_scale [N] (one scale per weight row) before the bias.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& weight_scale);

// Which fp32 FMA path skinny_linear runs on this CPU: "avx512", "avx2" or "portable".
std::string float_dot_isa();

// Which path skinny_linear runs bf16 x bf16 on: "amx_bf16", else float_dot_isa()'s.
std::string bf16_dot_isa();

// skinny_linear's bf16 path on AMX tiles (skinny_linear_amx.cpp): whether this process runs it
// (the CPU has AMX-BF16, Linux granted the tile state, SGLANG_DFLASH_NO_AMX unset; decided once),
// and out [M, N] = x [M, K] (contiguous) @ w [N, K]^T (row stride ldw) + bias, fp32 sums.
bool amx_bf16_wanted();
void amx_bf16_linear(const c10::BFloat16* x, int64_t M, int64_t N, int64_t K, const c10::BFloat16* w, int64_t ldw,
                     const c10::BFloat16* bias, c10::BFloat16* out);

// out [..., N] = x [..., K] quantized to int8 per row @ weight int8 [N, K]^T, exact int32 sums
// times the row's scale and weight_scale [N] (+ bias [N]); AVX512-VNNI where the CPU has it.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& bias);

// Which int8 dot product w8a8_linear runs on this CPU: "avx512_vnni" or "portable".
std::string int8_dot_isa();

// Per row r: the column j maximizing scores[r, j] + the Gumbel noise verify_block draws for token
// ids[j] (j when ids is None) in verify row rows[r] under (seed, offsets[r]); lowest j on ties.
at::Tensor gumbel_argmax(const at::Tensor& scores, const std::optional<at::Tensor>& ids, int64_t seed,
                         const at::Tensor& offsets, const at::Tensor& rows);

// Every draft layer's context K/V for N tokens, written into the layers' KV pools at out_loc
// (docs/design.md §3.4; sglang_dflash/ops/__init__.py has the contract).
void materialize_context_kv(const at::Tensor& ctx, at::TensorList kv_weights,
                            std::optional<at::TensorList> kv_biases, at::TensorList k_norm_weights,
                            double eps, const at::Tensor& cos_sin_cache, bool is_neox,
                            const at::Tensor& positions, const at::Tensor& out_loc, at::TensorList k_caches,
                            at::TensorList v_caches, double v_scale);

// Per head vector of x: RMSNorm over D (times weight), then RoPE at positions[row] when
// cos_sin_cache is given; fp32 inside, one rounding to x's dtype (sglang_dflash/ops/__init__.py).
at::Tensor rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, double eps,
                         const std::optional<at::Tensor>& cos_sin_cache, const std::optional<at::Tensor>& positions,
                         bool is_neox);

// In every buffer [S, ...] (last dimension contiguous), slot dst[i] takes what slot src[i] held,
// all sources read first (sglang_dflash/ops/__init__.py has the contract).
void move_slots(at::TensorList buffers, const at::Tensor& src, const at::Tensor& dst);

// Per row of logits [..., V]: the k largest, best first (lower index first among equals), as
// (log-probabilities float32 [..., k], indices int64 [..., k]) (sglang_dflash/ops/__init__.py).
std::tuple<at::Tensor, at::Tensor> top_k_logprobs(const at::Tensor& logits, int64_t k);

}  // namespace sglang_dflash::cpu
