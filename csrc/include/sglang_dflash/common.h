// Shared by the C++ (CPU) and CUDA kernels: the function qualifier used by all header math.
#pragma once

#if defined(__CUDACC__)
#define SGLD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SGLD_HOST_DEVICE inline
#endif
