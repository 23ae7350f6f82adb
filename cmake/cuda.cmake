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
# Attention forward and backward (ffi/cuda/attention): one generated instantiation file per dtype x head-dim
# capacity. JAX_SGL_ATTN_HEAD_DIMS trims the set for dev builds; left-out head dims are compiled
# out of the dispatch too and report "not built" at run time.
set(JAX_SGL_ATTN_HEAD_DIMS "64;96;128;192;256" CACHE STRING "Attention head-dim kernels to build")
list(APPEND JAX_SGL_CUDA_SOURCES
  ffi/cuda/attention/attention_handler.cc
  ffi/cuda/attention/fwd_dispatch.cc
  ffi/cuda/attention/common/split_combine.cu
  ffi/cuda/attention/attention_bwd_handler.cc
  ffi/cuda/attention/bwd_dispatch.cc
  ffi/cuda/attention/bwd_sm80/preprocess.cu
)
foreach(d 64 96 128 192 256)
  if(d IN_LIST JAX_SGL_ATTN_HEAD_DIMS)
    list(APPEND JAX_SGL_CUDA_SOURCES
      ffi/cuda/attention/instantiations/flash_fwd_sm80_hdim${d}_bf16.cu
      ffi/cuda/attention/instantiations/flash_fwd_sm80_hdim${d}_fp16.cu
      ffi/cuda/attention/instantiations/flash_decode_hdim${d}_bf16.cu
      ffi/cuda/attention/instantiations/flash_decode_hdim${d}_fp16.cu)
    # The backward (bwd_sm80/kernel.cuh) has capacities up to 128 only.
    if(d LESS_EQUAL 128)
      list(APPEND JAX_SGL_CUDA_SOURCES
        ffi/cuda/attention/instantiations/flash_bwd_sm80_hdim${d}_bf16.cu
        ffi/cuda/attention/instantiations/flash_bwd_sm80_hdim${d}_fp16.cu)
    endif()
  else()
    target_compile_definitions(_native PRIVATE JAX_SGL_ATTN_DISABLE_HDIM${d}=1)
  endif()
endforeach()
target_sources(_native PRIVATE ${JAX_SGL_CUDA_SOURCES})
# _native exists before CUDA is enabled, so it did not pick up CMAKE_CUDA_ARCHITECTURES.
set_target_properties(_native PROPERTIES CUDA_ARCHITECTURES "${JAX_SGL_CUDA_ARCHS}")
target_compile_definitions(_native PRIVATE JAX_SGL_HAVE_CUDA=1)
target_link_libraries(_native PRIVATE CUDA::cudart_static)
target_compile_options(_native PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)

# CuTe/CUTLASS headers for the matrix kernels, from the nvidia-cutlass wheel
# (cutlass_library/source/include). Optional: kernels that need them add the interface target
# jax_sgl_cutlass; the rest of the CUDA build works without it. find_spec locates the package
# without importing it (its __init__ pulls in cuda-python and friends).
set(JAX_SGL_CUTLASS_INCLUDE_DIR "" CACHE PATH "CuTe/CUTLASS include dir (default: from nvidia-cutlass)")
if(NOT JAX_SGL_CUTLASS_INCLUDE_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(s.submodule_search_locations[0], 'source', 'include'))"
    OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE _jax_sgl_cutlass_dir ERROR_QUIET
    RESULT_VARIABLE _jax_sgl_cutlass_rc)
  if(_jax_sgl_cutlass_rc EQUAL 0 AND EXISTS "${_jax_sgl_cutlass_dir}/cute/tensor.hpp")
    set(JAX_SGL_CUTLASS_INCLUDE_DIR "${_jax_sgl_cutlass_dir}" CACHE PATH "" FORCE)
  endif()
endif()
if(JAX_SGL_CUTLASS_INCLUDE_DIR)
  add_library(jax_sgl_cutlass INTERFACE)
  target_include_directories(jax_sgl_cutlass SYSTEM INTERFACE "${JAX_SGL_CUTLASS_INCLUDE_DIR}")
  message(STATUS "jax_sgl: CuTe/CUTLASS headers: ${JAX_SGL_CUTLASS_INCLUDE_DIR}")
else()
  message(STATUS "jax_sgl: nvidia-cutlass not found (pip install nvidia-cutlass); kernels that "
                 "need CuTe are skipped")
endif()

# Hopper flash forward and backward (ffi/cuda/attention/sm90, CuTe wgmma + TMA): built when 90a is
# among the archs and CuTe is found, for sm_90a only (its own object library, so other archs never see
# wgmma). One file per (head dim, dtype, variant): the head dims and dtypes of
# JAX_SGL_SM90_HEAD_DIMS x JAX_SGL_SM90_DTYPES, each in the variants its defaults need plus the
# extra A/B variants of JAX_SGL_SM90_VARIANTS. The list goes to the dispatch as X-macros in a
# generated header (sm90_kernels.inc). At run time JAX_SGL_SM90 turns the kernel off. The backward
# (head dims 64 and 128) defines JAX_SGL_SM90_BWD_HAVE_HDIM<D>_<DTYPE>; JAX_SGL_SM90_BWD picks it
# at run time (sm90/bwd/dispatch.cc).
set(JAX_SGL_SM90_HEAD_DIMS "64;128;256" CACHE STRING "sm90 attention head dims to build")
set(JAX_SGL_SM90_DTYPES "bf16;fp16" CACHE STRING "sm90 attention dtypes to build")
# The variant (sm90/fwd/tile_size.h) a call runs when JAX_SGL_SM90_VARIANT is unset, per head dim:
# "<head dim>:<non-causal>:<causal>", the best measured on an H200 (benchmarks/NOTES_sm90.md).
set(JAX_SGL_SM90_DEFAULT_VARIANTS "64:6:6;128:4:4;256:7:7" CACHE STRING
    "sm90 attention default variant per head dim: <head dim>:<non-causal>:<causal>[:<short>], \
short: calls of at most 2048 rows and keys")
# Extra variants for A/B runs (picked at run time by JAX_SGL_SM90_VARIANT): each costs one more
# nvcc run per (head dim, dtype), so the default build has none.
set(JAX_SGL_SM90_VARIANTS "" CACHE STRING "extra sm90 attention kernel variants to build (A/B)")
# Extra sm90 backward performance variants (sm90/bwd/config.h bit sets, 1-15 without both 2 and
# 8; picked at run time by JAX_SGL_SM90_BWD_VARIANT) for A/B runs; the default build has none
# (variant 0 only).
set(JAX_SGL_SM90_BWD_VARIANTS "" CACHE STRING "extra sm90 backward kernel variants to build (A/B)")
if("90a" IN_LIST JAX_SGL_CUDA_ARCHS AND TARGET jax_sgl_cutlass AND JAX_SGL_SM90_HEAD_DIMS)
  set(_jax_sgl_sm90_sources)
  set(_jax_sgl_sm90_inc "// Generated by cmake/cuda.cmake: the sm90 kernels of this build.\n")
  set(_jax_sgl_sm90_bwd_inc "// Generated by cmake/cuda.cmake: extra sm90 backward variants.\n")
  foreach(d ${JAX_SGL_SM90_HEAD_DIMS})
    set(_defaults)
    foreach(entry ${JAX_SGL_SM90_DEFAULT_VARIANTS})
      string(REPLACE ":" ";" entry "${entry}")
      list(GET entry 0 _d)
      if(_d STREQUAL d)
        list(GET entry 1 _non_causal)
        list(GET entry 2 _causal)
        set(_short -1)
        list(LENGTH entry _fields)
        if(_fields GREATER 3)
          list(GET entry 3 _short)
        endif()
        set(_defaults ${_non_causal} ${_causal})
        if(NOT _short EQUAL -1)
          list(APPEND _defaults ${_short})
        endif()
      endif()
    endforeach()
    if(NOT _defaults)
      message(FATAL_ERROR "jax_sgl: JAX_SGL_SM90_DEFAULT_VARIANTS has no entry for head dim ${d}")
    endif()
    string(APPEND _jax_sgl_sm90_inc
      "JAX_SGL_SM90_DEFAULT(${d}, ${_non_causal}, ${_causal}, ${_short})\n")
    set(_variants ${_defaults} ${JAX_SGL_SM90_VARIANTS})
    list(REMOVE_DUPLICATES _variants)
    list(SORT _variants)
    foreach(t ${JAX_SGL_SM90_DTYPES})
      foreach(v ${_variants})
        if(v STREQUAL "0")
          set(_suffix "")
        else()
          set(_suffix "_variant${v}")
        endif()
        list(APPEND _jax_sgl_sm90_sources
          ffi/cuda/attention/instantiations/flash_fwd_sm90_hdim${d}_${t}${_suffix}.cu)
        string(APPEND _jax_sgl_sm90_inc "JAX_SGL_SM90_KERNEL(${d}, ${t}, ${v})\n")
      endforeach()
      string(TOUPPER "${t}" _t)
      # The backward (sm90/bwd_*) exists for head dims 64 and 128.
      if(d EQUAL 64 OR d EQUAL 128)
        list(APPEND _jax_sgl_sm90_sources
          ffi/cuda/attention/instantiations/flash_bwd_sm90_hdim${d}_${t}.cu)
        target_compile_definitions(_native PRIVATE JAX_SGL_SM90_BWD_HAVE_HDIM${d}_${_t}=1)
        foreach(v ${JAX_SGL_SM90_BWD_VARIANTS})
          if(NOT v STREQUAL "0")
            list(APPEND _jax_sgl_sm90_sources
              ffi/cuda/attention/instantiations/flash_bwd_sm90_hdim${d}_${t}_variant${v}.cu)
            string(APPEND _jax_sgl_sm90_bwd_inc "JAX_SGL_SM90_BWD_VARIANT(${d}, ${t}, ${v})\n")
          endif()
        endforeach()
      endif()
    endforeach()
  endforeach()
  set(_jax_sgl_sm90_gen "${CMAKE_CURRENT_BINARY_DIR}/jax_sgl_sm90_generated")
  # Rewritten only when the list changes, so a reconfigure does not rebuild the dispatch.
  file(CONFIGURE OUTPUT "${_jax_sgl_sm90_gen}/sm90_kernels.inc" CONTENT "${_jax_sgl_sm90_inc}"
       @ONLY)
  file(CONFIGURE OUTPUT "${_jax_sgl_sm90_gen}/sm90_bwd_variants.inc"
       CONTENT "${_jax_sgl_sm90_bwd_inc}" @ONLY)
  target_include_directories(_native PRIVATE "${_jax_sgl_sm90_gen}")
  add_library(jax_sgl_sm90 OBJECT ${_jax_sgl_sm90_sources})
  set_target_properties(jax_sgl_sm90 PROPERTIES CUDA_ARCHITECTURES "90a"
                                                POSITION_INDEPENDENT_CODE ON)
  target_include_directories(jax_sgl_sm90 PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(jax_sgl_sm90 PRIVATE jax_sgl_cutlass CUDA::cudart_static)
  target_compile_options(jax_sgl_sm90 PRIVATE --expt-relaxed-constexpr -lineinfo)
  # wgmma N other than 2^k (the wide variants' 176 / 80 key tiles) is behind this switch in
  # CuTe's MMA selectors; without it they silently pick N = 16.
  target_compile_definitions(jax_sgl_sm90 PRIVATE CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED=1)
  target_sources(_native PRIVATE ffi/cuda/attention/sm90/fwd/dispatch.cc
                                 ffi/cuda/attention/sm90/bwd/dispatch.cc
                                 $<TARGET_OBJECTS:jax_sgl_sm90>)
  target_compile_definitions(_native PRIVATE JAX_SGL_HAVE_SM90=1)
  list(LENGTH _jax_sgl_sm90_sources _n)
  message(STATUS "jax_sgl: sm90 attention: head dims ${JAX_SGL_SM90_HEAD_DIMS}, "
                 "dtypes ${JAX_SGL_SM90_DTYPES}, defaults ${JAX_SGL_SM90_DEFAULT_VARIANTS}, "
                 "extra variants '${JAX_SGL_SM90_VARIANTS}', extra backward variants "
                 "'${JAX_SGL_SM90_BWD_VARIANTS}': ${_n} files")
endif()
