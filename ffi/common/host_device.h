// Lets the shared math headers compile unchanged as host C++ (CPU backend) and as CUDA device code.
#pragma once

#if defined(__CUDACC__)
#define JAX_SGL_HD __host__ __device__ __forceinline__
#else
#define JAX_SGL_HD inline
#endif
