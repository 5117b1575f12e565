// Rows of fp32 / fp16 / bf16 values converted to fp32, a vector at a time (F16C for fp16, a
// shift for bf16 on AVX2): the CPU kernels stage K/V and hidden rows in fp32 before their FMAs,
// and a scalar conversion of an fp16 pool costs more than the attention arithmetic itself.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstring>
#include <type_traits>

namespace sglang_dflash::cpu {

// One vector of fp32 / fp16 / bf16 values as fp32.
template <typename T>
inline at::vec::Vectorized<float> load_float_vector(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return at::vec::Vectorized<float>::loadu(src);
  } else {
    at::vec::Vectorized<float> v;
    at::vec::load_to_float(src, v);
    return v;
  }
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using Vec = at::vec::Vectorized<float>;
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) load_float_vector(src + i).store(dst + i);
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

}  // namespace sglang_dflash::cpu
