// CPU versions of the three sgl-kernel index / KV-copy ops that SGLang 0.5.23's speculative path
// calls on CPU (`torch.ops.sgl_kernel.<name>`). Only a CPU build of sgl-kernel has them; the PyPI
// wheel is a CUDA build without them, so any speculative CPU server (NGRAM, DFLASH) on a stock
// `pip install sglang` dies at start-up. They are registered here under sglang_dflash::sgl_kernel_*;
// the plugin (sglang_dflash/serving/sgl_kernel_ops.py) exposes each under SGLang's name only when
// torch.ops.sgl_kernel lacks it. Semantics follow the arguments SGLang passes (see that module).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

// One ValueError naming SGLang's op and the argument (these ops carry sgl_kernel's names).
#define COMPAT_CHECK(cond, op, ...) TORCH_CHECK_VALUE(cond, op, ": ", __VA_ARGS__)

namespace sglang_dflash::cpu {
namespace {

constexpr const char* kCopyOp = "sgl_kernel.copy_all_layer_kv_cache_cpu";
constexpr const char* kAssignOp = "sgl_kernel.assign_req_to_token_pool_cpu";
constexpr const char* kExtendOp = "sgl_kernel.assign_extend_cache_locs_cpu";

void check_cpu_index(const char* op, const char* name, const at::Tensor& t) {
  COMPAT_CHECK(t.device().is_cpu(), op, name, " must be a CPU tensor, got ", t.device());
  COMPAT_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, name,
             " must be int32 or int64, got ", t.scalar_type());
  COMPAT_CHECK(t.dim() == 1, op, name, " must be 1-D, got ", t.dim(), " dims");
}

std::vector<int64_t> as_int64(const at::Tensor& t) {
  const auto c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

// For every buffer i (data_ptrs[i] its base address, strides[i] its bytes per slot row): row
// src_loc[j] -> row tgt_loc[j]. Every source row of a buffer is read before any target row of it
// is written, so overlapping locations move as a gather then a scatter would.
void copy_all_layer_kv_cache(const at::Tensor& data_ptrs, const at::Tensor& strides, const at::Tensor& tgt_loc,
                             const at::Tensor& src_loc) {
  COMPAT_CHECK(data_ptrs.device().is_cpu() && data_ptrs.dim() == 1 &&
                 (data_ptrs.scalar_type() == at::kUInt64 || data_ptrs.scalar_type() == at::kLong),
             kCopyOp, "data_ptrs must be a 1-D CPU uint64/int64 tensor of buffer addresses");
  COMPAT_CHECK(strides.device().is_cpu() && strides.dim() == 1 && strides.scalar_type() == at::kLong &&
                 strides.numel() == data_ptrs.numel(),
             kCopyOp, "strides must be a 1-D CPU int64 tensor with one row stride (bytes) per buffer");
  check_cpu_index(kCopyOp, "tgt_loc", tgt_loc);
  check_cpu_index(kCopyOp, "src_loc", src_loc);
  COMPAT_CHECK(tgt_loc.numel() == src_loc.numel(), kCopyOp, "tgt_loc has ", tgt_loc.numel(),
             " entries but src_loc has ", src_loc.numel());
  const auto tgt = as_int64(tgt_loc), src = as_int64(src_loc);
  for (size_t j = 0; j < tgt.size(); ++j)
    COMPAT_CHECK(tgt[j] >= 0 && src[j] >= 0, kCopyOp, "locations must be >= 0, got tgt_loc[", j, "] = ", tgt[j],
               ", src_loc[", j, "] = ", src[j]);
  const auto ptrs = data_ptrs.contiguous();
  const auto bytes = strides.contiguous();
  const int64_t n_bufs = ptrs.numel(), n = static_cast<int64_t>(tgt.size());
  std::vector<char> staged;
  for (int64_t i = 0; i < n_bufs; ++i) {
    char* base = reinterpret_cast<char*>(static_cast<uintptr_t>(
        data_ptrs.scalar_type() == at::kLong ? ptrs.data_ptr<int64_t>()[i]
                                             : static_cast<int64_t>(ptrs.data_ptr<uint64_t>()[i])));
    const int64_t row = bytes.data_ptr<int64_t>()[i];
    COMPAT_CHECK(row > 0, kCopyOp, "strides[", i, "] = ", row, " must be positive");
    staged.resize(static_cast<size_t>(n * row));
    for (int64_t j = 0; j < n; ++j) std::memcpy(staged.data() + j * row, base + src[j] * row, row);
    for (int64_t j = 0; j < n; ++j) std::memcpy(base + tgt[j] * row, staged.data() + j * row, row);
  }
}

// Request b's range [start[b], end[b]) of its req_to_token row against the b-th packed segment of
// out_cache_loc: written into the table (`into_table`) or read out of it.
void move_ranges(const char* op, const at::Tensor& req_pool_indices, const at::Tensor& req_to_token,
                 const at::Tensor& start_offset, const at::Tensor& end_offset, const at::Tensor& out_cache_loc,
                 bool into_table) {
  check_cpu_index(op, "req_pool_indices", req_pool_indices);
  check_cpu_index(op, "start_offset", start_offset);
  check_cpu_index(op, "end_offset", end_offset);
  check_cpu_index(op, "out_cache_loc", out_cache_loc);
  COMPAT_CHECK(req_to_token.device().is_cpu() && req_to_token.dim() == 2 &&
                 (req_to_token.scalar_type() == at::kInt || req_to_token.scalar_type() == at::kLong),
             op, "req_to_token must be a 2-D CPU int32/int64 tensor");
  const int64_t bs = req_pool_indices.numel();
  COMPAT_CHECK(start_offset.numel() == bs && end_offset.numel() == bs, op,
             "start_offset and end_offset need one entry per request (", bs, ")");
  const auto reqs = as_int64(req_pool_indices), starts = as_int64(start_offset), ends = as_int64(end_offset);
  int64_t total = 0;
  for (int64_t b = 0; b < bs; ++b) {
    COMPAT_CHECK(reqs[b] >= 0 && reqs[b] < req_to_token.size(0), op, "req_pool_indices[", b, "] = ", reqs[b],
               " is outside req_to_token's ", req_to_token.size(0), " rows");
    COMPAT_CHECK(starts[b] >= 0 && ends[b] <= req_to_token.size(1), op, "request ", b, "'s range [", starts[b],
               ", ", ends[b], ") is outside req_to_token's ", req_to_token.size(1), " columns");
    total += std::max<int64_t>(ends[b] - starts[b], 0);
  }
  COMPAT_CHECK(out_cache_loc.numel() >= total, op, "out_cache_loc has ", out_cache_loc.numel(),
             " entries, the ranges need ", total);
  AT_DISPATCH_INDEX_TYPES(req_to_token.scalar_type(), "move_ranges", [&] {
    using table_t = index_t;
    AT_DISPATCH_INDEX_TYPES(out_cache_loc.scalar_type(), "move_ranges", [&] {
      index_t* loc = out_cache_loc.data_ptr<index_t>();
      const int64_t loc_step = out_cache_loc.stride(0);
      table_t* table = req_to_token.data_ptr<table_t>();
      int64_t packed = 0;
      for (int64_t b = 0; b < bs; ++b) {
        table_t* row = table + reqs[b] * req_to_token.stride(0);
        for (int64_t j = starts[b]; j < ends[b]; ++j, ++packed) {
          table_t& cell = row[j * req_to_token.stride(1)];
          index_t& slot = loc[packed * loc_step];
          if (into_table) {
            cell = static_cast<table_t>(slot);
          } else {
            slot = static_cast<index_t>(cell);
          }
        }
      }
    });
  });
}

void assign_req_to_token_pool(const at::Tensor& req_pool_indices, const at::Tensor& req_to_token,
                              const at::Tensor& start_offset, const at::Tensor& end_offset,
                              const at::Tensor& out_cache_loc, int64_t /*pool_len: req_to_token's width*/) {
  move_ranges(kAssignOp, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, true);
}

void assign_extend_cache_locs(const at::Tensor& req_pool_indices, const at::Tensor& req_to_token,
                              const at::Tensor& start_offset, const at::Tensor& end_offset,
                              const at::Tensor& out_cache_loc, int64_t /*pool_len*/) {
  move_ranges(kExtendOp, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, false);
}

}  // namespace
}  // namespace sglang_dflash::cpu

// A fragment of our namespace, separate from ops.cpp's product ops: these only stand in for
// sgl-kernel's, with its argument lists.
TORCH_LIBRARY_FRAGMENT(sglang_dflash, m) {
  m.def("sgl_kernel_copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()");
  m.def(
      "sgl_kernel_assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, "
      "Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()");
  m.def(
      "sgl_kernel_assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, "
      "Tensor start_offset, Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()");
}

TORCH_LIBRARY_IMPL(sglang_dflash, CPU, m) {
  m.impl("sgl_kernel_copy_all_layer_kv_cache_cpu", &sglang_dflash::cpu::copy_all_layer_kv_cache);
  m.impl("sgl_kernel_assign_req_to_token_pool_cpu", &sglang_dflash::cpu::assign_req_to_token_pool);
  m.impl("sgl_kernel_assign_extend_cache_locs_cpu", &sglang_dflash::cpu::assign_extend_cache_locs);
}
