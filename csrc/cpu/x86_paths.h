// The x86 instruction paths the CPU kernels choose between at run time. The extension is compiled
// for AVX2 (setup.py); AVX-512 code lives in functions marked SGLD_AVX512 and runs only where
// avx512_wanted() says so, decided once per process so that every call of a process sums in the
// same order.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#define SGLD_HAS_X86 1
#define SGLD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#endif

namespace sglang_dflash::cpu {

// Whether this process runs the AVX-512 paths: the CPU has AVX-512 F/BW/VL/DQ and
// SGLANG_DFLASH_NO_AVX512 is not set (tests run both paths).
bool avx512_wanted();

}  // namespace sglang_dflash::cpu
