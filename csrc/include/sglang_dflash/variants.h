// Kernel variants: several compiled configurations of one op's kernel (tile sizes, pipeline depth,
// split policy), selectable per calling thread, so one build can time and test all of them
// (sglang_dflash/ops/variants.py). Every op with variants has "default" first: the configuration
// its calls get when nothing else is selected.
#pragma once

#include <string>
#include <vector>

namespace sglang_dflash {

enum class VariantOp : int { kBlockAttention = 0, kVerifyBlock, kCount };

// Called once per op, at load time, by the file that compiles the op's variants (the CUDA kernels):
// `names` in the order of the indices selected_kernel_variant returns, "default" first. Builds
// without those kernels list "default" alone. Returns true (for a namespace-scope initializer).
bool register_kernel_variants(VariantOp op, std::vector<std::string> names);

// The variant the calling thread selected for `op` (torch.ops.sglang_dflash.select_kernel_variant):
// an index into the registered names, 0 ("default") when none is selected.
int selected_kernel_variant(VariantOp op);

}  // namespace sglang_dflash
