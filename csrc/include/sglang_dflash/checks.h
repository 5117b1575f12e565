// Host-side argument validation shared by the CPU and CUDA implementations of every op. Each
// failure raises one ValueError that names the op, the argument and what was wrong with it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace sglang_dflash {

struct BlockAttentionShape {
  int64_t batch;       // bs
  int64_t block_size;  // B
  int64_t q_heads;     // Hq
  int64_t kv_heads;    // Hkv
  int64_t head_dim;    // D
};

// Shapes, dtypes, devices and scalar arguments of block_attention (no reads of tensor data).
BlockAttentionShape check_block_attention_args(const at::Tensor& q, const at::Tensor& k_block,
                                               const at::Tensor& v_block, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache,
                                               const at::Tensor& req_to_token,
                                               const at::Tensor& req_pool_indices,
                                               const at::Tensor& ctx_lens, int64_t block_size,
                                               int64_t window, bool causal_block,
                                               const std::optional<at::Tensor>& tree_parents);

// Index ranges of block_attention (tree_parents[b, i] in [-1, i) in tree mode): reads the index
// tensors, so only for CPU tensors.
void check_block_attention_indices(const at::Tensor& k_cache, const at::Tensor& req_to_token,
                                   const at::Tensor& req_pool_indices, const at::Tensor& ctx_lens,
                                   const std::optional<at::Tensor>& tree_parents);

struct VerifyShape {
  int64_t batch;       // bs
  int64_t block_size;  // B
  int64_t vocab;       // V (0 for the ids variant)
};

VerifyShape check_verify_args(const at::Tensor& candidates, const at::Tensor& logits,
                              const at::Tensor& temperature, const at::Tensor& top_k,
                              const at::Tensor& top_p, const at::Tensor& offsets);

VerifyShape check_verify_ids_args(const at::Tensor& candidates, const at::Tensor& target_ids);

// Value ranges of verify: candidates in [0, V) (when V > 0). CPU tensors only.
void check_verify_values(const at::Tensor& candidates, int64_t vocab);

struct TreeShape {
  int64_t batch;  // bs
  int64_t nodes;  // N
};

// verify_tree_from_ids: tokens [bs, N] int64 (N >= 1: the root), parents [bs, N] int32 or int64,
// depths [bs, N] int64, target_ids [bs, N] or [bs * N] int32 or int64, on one device.
TreeShape check_verify_tree_args(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depths,
                                 const at::Tensor& target_ids);

// verify_tree: the tree as verify_tree_from_ids takes it, logits [bs * N, V] float, and the sampling
// arguments [bs] as verify_block takes them, on one device.
TreeShape check_verify_tree_sampling_args(const at::Tensor& tokens, const at::Tensor& parents,
                                          const at::Tensor& depths, const at::Tensor& logits,
                                          const at::Tensor& temperature, const at::Tensor& top_k,
                                          const at::Tensor& top_p, const at::Tensor& offsets);

// Every token of verify_tree's trees (padding included) in [0, V). CPU tensors only.
void check_verify_tree_tokens(const at::Tensor& tokens, int64_t vocab);

// The tree rules of every node (accept.h, check_tree_node). Reads the tensors, so CPU tensors only.
void check_verify_tree_values(const at::Tensor& parents, const at::Tensor& depths);

struct GumbelArgmaxShape {
  int64_t rows, cols;
};

// scores [R, n] float, ids [n] int64 (optional), offsets [R] int64, rows [R] int64.
GumbelArgmaxShape check_gumbel_argmax_args(const at::Tensor& scores, const std::optional<at::Tensor>& ids,
                                           const at::Tensor& offsets, const at::Tensor& rows);

// Reads the index tensors (host memory): ids within [0, 2^34), rows within [0, 2^32).
void check_gumbel_argmax_values(const std::optional<at::Tensor>& ids, const at::Tensor& rows);

struct LinearShape {
  int64_t rows;  // M: x's leading dimensions flattened
  int64_t out;   // N = weight.size(0)
  int64_t in;    // K = weight.size(1) = x.size(-1)
};

// skinny_linear: x [..., K] and weight [N, K] (and bias [N]) of one float dtype on one device, or
// an int8 weight with weight_scale float32 [N] (only CPU and Meta kernels exist; the Python API
// refuses other devices by name).
LinearShape check_skinny_linear_args(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& weight_scale);

// The (uninitialized) output of a linear op on x [..., K]: [..., n], x's dtype and device.
at::Tensor empty_linear_output(const at::Tensor& x, int64_t n);

// w8a8_linear: x [..., K] of a float dtype, weight int8 [N, K] (contiguous last dimension),
// weight_scale float32 [N], bias [N] of x's dtype (optional), one device; K <= kW8a8MaxK, so that
// a sum of K products of int8 values (|q|, |w| <= 127) fits in int32.
constexpr int64_t kW8a8MaxK = 131072;
LinearShape check_w8a8_linear_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                                   const std::optional<at::Tensor>& bias);

struct ContextKvShape {
  int64_t rows;           // N
  int64_t layers;         // L
  int64_t kv_heads;       // Hkv (from the pools)
  int64_t head_dim;       // D (from the pools)
  int64_t rotary_dim;     // cos_sin_cache.shape[1]
  int64_t max_positions;  // P = cos_sin_cache.shape[0]
  int64_t slots;          // S (from the pools)
};

// materialize_context_kv: ctx [N, H] and per layer kv_weights [2*Hkv*D, H], kv_biases [2*Hkv*D]
// (optional), k_norm_weights [D], all of ctx's float dtype; cos_sin_cache [P, rotary_dim] any float
// dtype; positions / out_loc [N] int32 or int64; k_caches / v_caches [S, Hkv, D] of one float dtype.
// Everything on ctx's device (no reads of tensor data).
ContextKvShape check_materialize_context_kv_args(const at::Tensor& ctx, at::TensorList kv_weights,
                                                 const std::optional<at::TensorList>& kv_biases,
                                                 at::TensorList k_norm_weights, const at::Tensor& cos_sin_cache,
                                                 const at::Tensor& positions, const at::Tensor& out_loc,
                                                 at::TensorList k_caches, at::TensorList v_caches);

// Index values of materialize_context_kv: positions in [0, P), out_loc in [-1, S) with no slot
// twice. Reads the index tensors, so only for CPU tensors.
void check_materialize_context_kv_indices(const at::Tensor& positions, const at::Tensor& out_loc,
                                          const ContextKvShape& shape);

// rms_norm_rope: x [..., D] float with a contiguous last dimension, weight [D] of x's dtype; with RoPE
// (cos_sin_cache given) x is [N, heads, D], cos_sin_cache [P, rotary_dim] any float dtype with
// rotary_dim even in [2, D], positions [N] int32 or int64; positions without cos_sin_cache is an
// error. All on x's device (no reads of tensor data).
void check_rms_norm_rope_args(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& cos_sin_cache,
                              const std::optional<at::Tensor>& positions);

// positions in [0, P) when RoPE is applied. Reads the positions, so only for CPU tensors.
void check_rms_norm_rope_positions(const std::optional<at::Tensor>& cos_sin_cache,
                                   const std::optional<at::Tensor>& positions);

// move_slots: at least one buffer, each with a slot dimension (dim >= 1) and a contiguous last
// dimension, all on one device; src and dst 1-D int32 or int64 of one length on that device.
void check_move_slots_args(at::TensorList buffers, const at::Tensor& src, const at::Tensor& dst);

// Index values of move_slots: src and dst within every buffer's slots, no slot in dst twice. Reads
// the index tensors, so only for CPU tensors.
void check_move_slots_indices(at::TensorList buffers, const at::Tensor& src, const at::Tensor& dst);

// top_k_logprobs: logits [..., V] float (fp32, bf16, fp16) with V >= 1, k in [1, V].
void check_top_k_logprobs_args(const at::Tensor& logits, int64_t k);

}  // namespace sglang_dflash
