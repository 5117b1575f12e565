// CPU move_slots (the contract is in sglang_dflash/ops/__init__.py): in every buffer, slot dst[i]
// takes what slot src[i] held, every source read before any slot is written. A tree step moves its
// accepted path's K/V into consecutive cache slots with it: a few slots of 2 x layers buffers, where
// a torch index copy per buffer (60 for SmolLM2) cost more than all the bytes moved.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "sglang_dflash/checks.h"

namespace sglang_dflash::cpu {
namespace {

// One buffer's slot (its dimensions after the first) as runs of contiguous bytes: the last
// dimension is contiguous (checked), the ones before it are walked through their strides.
class SlotRuns {
 public:
  explicit SlotRuns(const at::Tensor& t)
      : base_(static_cast<char*>(t.data_ptr())), elem_(t.element_size()), slot_stride_(t.stride(0) * elem_),
        run_bytes_(t.dim() > 1 ? t.size(-1) * elem_ : elem_) {
    for (int64_t d = 1; d + 1 < t.dim(); ++d) {
      sizes_.push_back(t.size(d));
      strides_.push_back(t.stride(d) * elem_);
    }
    runs_ = 1;
    for (int64_t s : sizes_) runs_ *= s;
  }
  int64_t slot_bytes() const { return runs_ * run_bytes_; }

  // fn(address of run r of `slot`, r) for every run, in row-major order.
  template <typename Fn>
  void for_each_run(int64_t slot, Fn fn) const {
    char* origin = base_ + slot * slot_stride_;
    std::vector<int64_t> at(sizes_.size(), 0);
    for (int64_t r = 0; r < runs_; ++r) {
      int64_t offset = 0;
      for (size_t d = 0; d < at.size(); ++d) offset += at[d] * strides_[d];
      fn(origin + offset, r);
      for (size_t d = at.size(); d-- > 0;) {  // odometer over the dimensions between
        if (++at[d] < sizes_[d]) break;
        at[d] = 0;
      }
    }
  }
  int64_t run_bytes() const { return run_bytes_; }

 private:
  char* base_;
  int64_t elem_, slot_stride_, run_bytes_, runs_;
  std::vector<int64_t> sizes_, strides_;
};

void move_buffer(const at::Tensor& buffer, const std::vector<int64_t>& src, const std::vector<int64_t>& dst) {
  const SlotRuns runs(buffer);
  const int64_t n = static_cast<int64_t>(src.size()), bytes = runs.run_bytes();
  std::vector<char> staged(n * runs.slot_bytes());
  for (int64_t i = 0; i < n; ++i) {
    char* out = staged.data() + i * runs.slot_bytes();
    runs.for_each_run(src[i], [&](const char* from, int64_t r) { std::memcpy(out + r * bytes, from, bytes); });
  }
  for (int64_t i = 0; i < n; ++i) {
    const char* in = staged.data() + i * runs.slot_bytes();
    runs.for_each_run(dst[i], [&](char* to, int64_t r) { std::memcpy(to, in + r * bytes, bytes); });
  }
}

std::vector<int64_t> to_vector(const at::Tensor& index) {
  const auto flat = index.to(at::kLong).contiguous();
  const int64_t* p = flat.const_data_ptr<int64_t>();
  return {p, p + flat.numel()};
}

}  // namespace

void move_slots(at::TensorList buffers, const at::Tensor& src, const at::Tensor& dst) {
  check_move_slots_args(buffers, src, dst);
  check_move_slots_indices(buffers, src, dst);
  if (src.numel() == 0) return;
  const auto from = to_vector(src), to = to_vector(dst);
  // Buffers are independent; a tree step moves ~10 KB in all, so only big moves take the pool.
  const int64_t bytes = src.numel() * SlotRuns(buffers[0]).slot_bytes();
  at::parallel_for(0, static_cast<int64_t>(buffers.size()), std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(bytes, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t b = begin; b < end; ++b) move_buffer(buffers[b], from, to);
                   });
}

}  // namespace sglang_dflash::cpu
