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
# Attention forward (ffi/cuda/attention): one generated instantiation file per dtype x head-dim
# capacity. JAX_SGL_ATTN_HEAD_DIMS trims the set for dev builds; left-out head dims are compiled
# out of the dispatch too and report "not built" at run time.
set(JAX_SGL_ATTN_HEAD_DIMS "64;96;128;192;256" CACHE STRING "Attention head-dim kernels to build")
list(APPEND JAX_SGL_CUDA_SOURCES
  ffi/cuda/attention/attention_handler.cc
  ffi/cuda/attention/flash_dispatch.cc
  ffi/cuda/attention/flash_split_combine.cu
)
foreach(d 64 96 128 192 256)
  if(d IN_LIST JAX_SGL_ATTN_HEAD_DIMS)
    list(APPEND JAX_SGL_CUDA_SOURCES
      ffi/cuda/attention/instantiations/flash_fwd_sm80_hdim${d}_bf16.cu
      ffi/cuda/attention/instantiations/flash_fwd_sm80_hdim${d}_fp16.cu)
  else()
    target_compile_definitions(_native PRIVATE JAX_SGL_ATTN_DISABLE_HDIM${d}=1)
  endif()
endforeach()
target_sources(_native PRIVATE ${JAX_SGL_CUDA_SOURCES})
target_compile_definitions(_native PRIVATE JAX_SGL_HAVE_CUDA=1)
target_link_libraries(_native PRIVATE CUDA::cudart_static)
target_compile_options(_native PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
