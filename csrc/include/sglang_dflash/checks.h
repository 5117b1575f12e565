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
                                               int64_t window);

// Index ranges of block_attention: reads the index tensors, so only for CPU tensors.
void check_block_attention_indices(const at::Tensor& k_cache, const at::Tensor& req_to_token,
                                   const at::Tensor& req_pool_indices, const at::Tensor& ctx_lens);

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

// skinny_linear: x [..., K] and weight [N, K] (and bias [N]) of one float dtype on one device
// (only CPU and Meta kernels exist; the Python API refuses other devices by name).
LinearShape check_skinny_linear_args(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias);

}  // namespace sglang_dflash
