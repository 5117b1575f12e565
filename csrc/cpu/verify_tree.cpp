// CPU tree verification from the target's token ids (docs/design.md §3.3): the tree's rules are checked
// first (checks.cpp), then every request's walk (accept.h, accept_tree) runs as its own task.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu_kernels.h"
#include "sglang_dflash/accept.h"
#include "sglang_dflash/checks.h"

namespace sglang_dflash::cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_from_ids(const at::Tensor& tokens_in,
                                                                    const at::Tensor& parents_in,
                                                                    const at::Tensor& depths,
                                                                    const at::Tensor& target_ids) {
  const auto shape = check_verify_tree_args(tokens_in, parents_in, depths, target_ids);
  const auto parents = parents_in.to(at::kLong).contiguous();
  check_verify_tree_values(parents, depths);
  const auto tokens = tokens_in.contiguous();
  const auto ids = target_ids.to(at::kLong).contiguous();
  const auto opts = tokens.options();
  auto accept_len = at::empty({shape.batch}, opts.dtype(at::kInt));
  auto path = at::empty({shape.batch, shape.nodes}, opts);
  auto out_tokens = at::empty({shape.batch, shape.nodes}, opts);

  const int64_t n = shape.nodes;
  // A walk reads a few nodes per accepted token: cheaper than waking a thread unless there are
  // thousands of nodes to a task.
  constexpr int64_t kNodesPerTask = 4096;
  at::parallel_for(0, shape.batch, std::max<int64_t>(1, kNodesPerTask / n), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* parent = parents.const_data_ptr<int64_t>() + b * n;
      const int64_t* id = ids.const_data_ptr<int64_t>() + b * n;
      accept_len.data_ptr<int32_t>()[b] = accept_tree(
          tokens.const_data_ptr<int64_t>() + b * n, [parent](int64_t i) { return parent[i]; }, n,
          [id](int64_t i) { return id[i]; }, path.data_ptr<int64_t>() + b * n, out_tokens.data_ptr<int64_t>() + b * n);
    }
  });
  return {accept_len, path, out_tokens};
}

}  // namespace sglang_dflash::cpu
