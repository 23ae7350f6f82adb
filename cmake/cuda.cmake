# CUDA part of jax_sgl._native: kernels compiled for JAX_SGL_CUDA_ARCHS, handlers registered for
# the "CUDA" platform. Included from the top-level CMakeLists only when nvcc was found.
set(CMAKE_CUDA_ARCHITECTURES ${JAX_SGL_CUDA_ARCHS})
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
message(STATUS "jax_sgl: CUDA enabled, archs ${JAX_SGL_CUDA_ARCHS}")

set(JAX_SGL_CUDA_SOURCES
  ffi/cuda/rope_pool/rope_pool.cu
  ffi/cuda/rope_pool/rope_pool_handler.cc
)
target_sources(_native PRIVATE ${JAX_SGL_CUDA_SOURCES})
target_compile_definitions(_native PRIVATE JAX_SGL_HAVE_CUDA=1)
target_link_libraries(_native PRIVATE CUDA::cudart_static)
target_compile_options(_native PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
