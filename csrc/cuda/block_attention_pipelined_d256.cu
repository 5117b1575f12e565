// The pipelined block-attention kernels for head_dim 256 (block_attention_pipelined.cuh), one file per
// head_dim so that the build compiles them in parallel.
#include "block_attention_pipelined.cuh"

namespace sglang_dflash::cuda::attention {

template KernelLaunch pipelined_kernel<256>(int config, bool bf16);

}  // namespace sglang_dflash::cuda::attention
