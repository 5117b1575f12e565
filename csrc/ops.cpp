// Op schemas of the sglang_dflash namespace and their CPU implementations. CUDA implementations
// register themselves from csrc/cuda/ when the extension is built with CUDA, and the Meta
// (shape-only) implementations from meta.cpp.
#include <Python.h>
#include <torch/library.h>

#include "cpu/cpu_kernels.h"

TORCH_LIBRARY(sglang_dflash, m) {
  m.def(
      "block_attention(Tensor q, Tensor k_block, Tensor v_block, Tensor k_cache, Tensor v_cache, "
      "Tensor req_to_token, Tensor req_pool_indices, Tensor ctx_lens, int block_size, "
      "float sm_scale, int window=-1, bool causal_block=False, Tensor? tree_parents=None) -> Tensor");
  m.def(
      "verify_block(Tensor candidates, Tensor logits, Tensor temperature, Tensor top_k, "
      "Tensor top_p, int seed, Tensor offsets) -> (Tensor accept_len, Tensor bonus, "
      "Tensor out_tokens)");
  m.def(
      "verify_block_from_ids(Tensor candidates, Tensor target_ids) -> (Tensor accept_len, "
      "Tensor bonus, Tensor out_tokens)");
  m.def(
      "verify_tree_from_ids(Tensor tokens, Tensor parents, Tensor depths, Tensor target_ids) -> "
      "(Tensor accept_len, Tensor path, Tensor out_tokens)");
  m.def(
      "verify_tree(Tensor tokens, Tensor parents, Tensor depths, Tensor logits, Tensor temperature, Tensor top_k, "
      "Tensor top_p, int seed, Tensor offsets) -> (Tensor accept_len, Tensor path, Tensor out_tokens)");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? weight_scale=None) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias=None) -> Tensor");
  m.def("int8_dot_isa() -> str", &sglang_dflash::cpu::int8_dot_isa);
  m.def("float_dot_isa() -> str", &sglang_dflash::cpu::float_dot_isa);
  m.def("bf16_dot_isa() -> str", &sglang_dflash::cpu::bf16_dot_isa);
  m.def("gumbel_argmax(Tensor scores, Tensor? ids, int seed, Tensor offsets, Tensor rows) -> Tensor");
  m.def(
      "materialize_context_kv(Tensor ctx, Tensor[] kv_weights, Tensor[]? kv_biases, Tensor[] k_norm_weights, "
      "float eps, Tensor cos_sin_cache, bool is_neox, Tensor positions, Tensor out_loc, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, float v_scale=1.0) -> ()");
  m.def(
      "rms_norm_rope(Tensor x, Tensor weight, float eps, Tensor? cos_sin_cache=None, Tensor? positions=None, "
      "bool is_neox=True) -> Tensor");
  m.def("move_slots(Tensor(a!)[] buffers, Tensor src, Tensor dst) -> ()");
  m.def("top_k_logprobs(Tensor logits, int k) -> (Tensor values, Tensor indices)");
}

TORCH_LIBRARY_IMPL(sglang_dflash, CPU, m) {
  m.impl("block_attention", &sglang_dflash::cpu::block_attention);
  m.impl("verify_block", &sglang_dflash::cpu::verify_block);
  m.impl("verify_block_from_ids", &sglang_dflash::cpu::verify_block_from_ids);
  m.impl("verify_tree_from_ids", &sglang_dflash::cpu::verify_tree_from_ids);
  m.impl("verify_tree", &sglang_dflash::cpu::verify_tree);
  m.impl("skinny_linear", &sglang_dflash::cpu::skinny_linear);
  m.impl("w8a8_linear", &sglang_dflash::cpu::w8a8_linear);
  m.impl("gumbel_argmax", &sglang_dflash::cpu::gumbel_argmax);
  m.impl("materialize_context_kv", &sglang_dflash::cpu::materialize_context_kv);
  m.impl("rms_norm_rope", &sglang_dflash::cpu::rms_norm_rope);
  m.impl("move_slots", &sglang_dflash::cpu::move_slots);
  m.impl("top_k_logprobs", &sglang_dflash::cpu::top_k_logprobs);
}

// Importing sglang_dflash._C runs the registrations above; the module itself has no members.
static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module_def); }
