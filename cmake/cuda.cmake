# CUDA part of jax_sgl._native: kernels compiled for JAX_SGL_CUDA_ARCHS, handlers registered for
# the "CUDA" platform. Included from the top-level CMakeLists only when nvcc was found.
# SASS for every arch, and PTX only for plain ones (80: JIT-compiled on GPUs newer than any
# listed arch). PTX of an arch-specific target (90a, 100a) runs only on that very arch, where the
# SASS already is: it would only make the binary larger.
set(JAX_SGL_CUDA_ARCHITECTURES)
foreach(_arch ${JAX_SGL_CUDA_ARCHS})
  if(_arch MATCHES "a$")
    list(APPEND JAX_SGL_CUDA_ARCHITECTURES "${_arch}-real")
  else()
    list(APPEND JAX_SGL_CUDA_ARCHITECTURES "${_arch}")
  endif()
endforeach()
set(CMAKE_CUDA_ARCHITECTURES ${JAX_SGL_CUDA_ARCHITECTURES})
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
message(STATUS "jax_sgl: CUDA enabled, archs ${JAX_SGL_CUDA_ARCHS}")
# The runtime, linked statically, from the compiler's own toolkit tree (system or PyPI wheels):
# not find_package(CUDAToolkit), which fails on the wheels' layout (no libcudart.so there) and
# could pick another toolkit than the compiler's. The host sources (handlers) include
# cuda_runtime.h from the same tree.
find_library(JAX_SGL_CUDART_STATIC cudart_static
             HINTS ${CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES} "${JAX_SGL_PIP_CUDA_ROOT}/lib"
             NO_DEFAULT_PATH REQUIRED)
add_library(jax_sgl_cudart INTERFACE)
target_include_directories(jax_sgl_cudart SYSTEM INTERFACE ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
target_link_libraries(jax_sgl_cudart INTERFACE "${JAX_SGL_CUDART_STATIC}" Threads::Threads
                      ${CMAKE_DL_LIBS} rt)

jax_sgl_sources(cuda JAX_SGL_CUDA_SOURCES)
jax_sgl_sources(cuda_copts JAX_SGL_CUDA_COPTS)
# Attention forward and backward (ffi/cuda/attention): one generated instantiation file per
# (kind, head dim, dtype), listed in ffi/cuda/attention/instantiations.json (the one list;
# generate_instantiations.py writes the files from it). JAX_SGL_ATTN_HEAD_DIMS trims the portable
# (sm80) family for dev builds; left-out head dims get their guard defined, so the dispatch
# compiles them out too and reports "not built" at run time.
set(JAX_SGL_ATTN_HEAD_DIMS "64;96;128;192;256" CACHE STRING "Attention head-dim kernels to build")
set(_jax_sgl_inst_file "${CMAKE_CURRENT_SOURCE_DIR}/ffi/cuda/attention/instantiations.json")
file(READ "${_jax_sgl_inst_file}" _jax_sgl_inst)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_jax_sgl_inst_file}")
# jax_sgl_instantiations(<family> <head dims> <dtypes> <out sources> <out guards>): the files of
# the family's kinds for the wanted (head dim, dtype) pairs, and the guard macros to define for
# the pairs left out (a guard several kinds share is left undefined while any of them is built).
function(jax_sgl_instantiations family want_dims want_dtypes out_sources out_guards)
  string(JSON _pattern GET "${_jax_sgl_inst}" families ${family} guard)
  string(JSON _ndtypes LENGTH "${_jax_sgl_inst}" dtypes)
  string(JSON _nkinds LENGTH "${_jax_sgl_inst}" families ${family} kinds)
  math(EXPR _ndtypes "${_ndtypes} - 1")
  math(EXPR _nkinds "${_nkinds} - 1")
  set(_sources)
  set(_built)
  set(_all)
  foreach(k RANGE ${_nkinds})
    string(JSON _kind MEMBER "${_jax_sgl_inst}" families ${family} kinds ${k})
    string(JSON _ndims LENGTH "${_jax_sgl_inst}" families ${family} kinds ${_kind})
    math(EXPR _ndims "${_ndims} - 1")
    foreach(j RANGE ${_ndims})
      string(JSON d GET "${_jax_sgl_inst}" families ${family} kinds ${_kind} ${j})
      # A kind may list its own dtypes (instantiations.json kind_dtypes).
      string(JSON _kdtypes ERROR_VARIABLE _no_kdtypes GET "${_jax_sgl_inst}" kind_dtypes ${_kind})
      if(_no_kdtypes)
        set(_dtypes_key dtypes)
        set(_kn ${_ndtypes})
      else()
        set(_dtypes_key kind_dtypes ${_kind})
        string(JSON _kn LENGTH "${_jax_sgl_inst}" kind_dtypes ${_kind})
        math(EXPR _kn "${_kn} - 1")
      endif()
      foreach(i RANGE ${_kn})
        string(JSON t GET "${_jax_sgl_inst}" ${_dtypes_key} ${i})
        string(TOUPPER "${t}" _t)
        string(REPLACE "{d}" "${d}" _g "${_pattern}")
        string(REPLACE "{DTYPE}" "${_t}" _g "${_g}")
        list(APPEND _all ${_g})
        if(d IN_LIST want_dims AND t IN_LIST want_dtypes)
          list(APPEND _sources ffi/cuda/attention/instantiations/${_kind}_hdim${d}_${t}.cu)
          list(APPEND _built ${_g})
        endif()
      endforeach()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES _all)
  if(_built)
    list(REMOVE_ITEM _all ${_built})
  endif()
  set(${out_sources} ${_sources} PARENT_SCOPE)
  set(${out_guards} ${_all} PARENT_SCOPE)
endfunction()
# The portable family is built for both dtypes always; only its head dims are trimmed.
jax_sgl_instantiations(sm80 "${JAX_SGL_ATTN_HEAD_DIMS}" "bf16;fp16" _sources _guards)
list(APPEND JAX_SGL_CUDA_SOURCES ${_sources})
foreach(g ${_guards})
  target_compile_definitions(_native PRIVATE ${g}=1)
endforeach()
target_sources(_native PRIVATE ${JAX_SGL_CUDA_SOURCES})
# _native exists before CUDA is enabled, so it did not pick up CMAKE_CUDA_ARCHITECTURES.
set_target_properties(_native PROPERTIES CUDA_ARCHITECTURES "${JAX_SGL_CUDA_ARCHITECTURES}")
target_compile_definitions(_native PRIVATE JAX_SGL_HAVE_CUDA=1)
target_link_libraries(_native PRIVATE jax_sgl_cudart)
target_compile_options(_native PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${JAX_SGL_CUDA_COPTS}>)

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
endif()

# An arch-specific kernel family (sm90, sm100): its own object library for that arch only (other
# archs never see its instructions), one file per (kind, head dim, dtype) of instantiations.json's
# family for the given head dims x dtypes, the guards of the pairs left out defined for the
# dispatch's list (instantiations/<family>_kernels.inc), and its host dispatch files
# (ffi/sources.json's <family> list) in _native with JAX_SGL_HAVE_<FAMILY>.
function(jax_sgl_arch_family family arch head_dims dtypes note)
  jax_sgl_instantiations(${family} "${head_dims}" "${dtypes}" _sources _guards)
  foreach(g ${_guards})
    target_compile_definitions(_native PRIVATE ${g}=1)
  endforeach()
  add_library(jax_sgl_${family} OBJECT ${_sources})
  set_target_properties(jax_sgl_${family} PROPERTIES CUDA_ARCHITECTURES "${arch}-real"
                                                     POSITION_INDEPENDENT_CODE ON)
  target_include_directories(jax_sgl_${family} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(jax_sgl_${family} PRIVATE jax_sgl_cutlass jax_sgl_cudart)
  target_compile_options(jax_sgl_${family} PRIVATE ${JAX_SGL_CUDA_COPTS})
  jax_sgl_sources(${family} _dispatch)
  target_sources(_native PRIVATE ${_dispatch} $<TARGET_OBJECTS:jax_sgl_${family}>)
  string(TOUPPER "${family}" _upper)
  target_compile_definitions(_native PRIVATE JAX_SGL_HAVE_${_upper}=1)
  list(LENGTH _sources _n)
  message(STATUS "jax_sgl: ${family} attention: head dims ${head_dims}, dtypes ${dtypes}: "
                 "${_n} files${note}")
endfunction()

# Hopper flash forward and backward (ffi/cuda/attention/sm90, CuTe wgmma + TMA): built when 90a is
# among the archs and CuTe is found. At run time JAX_SGL_DISABLE=sm90 turns the forward off and
# JAX_SGL_DISABLE=sm90_bwd the backward.
set(JAX_SGL_SM90_HEAD_DIMS "64;96;128;192;256" CACHE STRING "sm90 attention head dims to build")
set(JAX_SGL_SM90_DTYPES "bf16;fp16;e4m3" CACHE STRING "sm90 attention dtypes to build (e4m3: the forward only)")
if("90a" IN_LIST JAX_SGL_CUDA_ARCHS AND TARGET jax_sgl_cutlass AND JAX_SGL_SM90_HEAD_DIMS)
  jax_sgl_arch_family(sm90 90a "${JAX_SGL_SM90_HEAD_DIMS}" "${JAX_SGL_SM90_DTYPES}" "")
  # sm90_defines: wgmma N other than 2^k (hd256's 80-key tiles) is behind
  # CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED in CuTe's MMA selectors; without it they silently pick
  # N = 16.
  jax_sgl_sources(sm90_defines _jax_sgl_sm90_defines)
  target_compile_definitions(jax_sgl_sm90 PRIVATE ${_jax_sgl_sm90_defines})
endif()

# The FMHA collectives of CUTLASS's Blackwell example (77_blackwell_fmha: collective/, kernel/,
# device/, common/), from the same wheel (cutlass_library/source/examples), included from there as
# a published interface, never copied: the sm100 family builds on them.
set(JAX_SGL_FMHA_SM100_INCLUDE_DIR "" CACHE PATH
    "CUTLASS 77_blackwell_fmha example dir (default: from nvidia-cutlass)")
if(NOT JAX_SGL_FMHA_SM100_INCLUDE_DIR AND JAX_SGL_CUTLASS_INCLUDE_DIR)
  get_filename_component(_jax_sgl_fmha_dir
    "${JAX_SGL_CUTLASS_INCLUDE_DIR}/../examples/77_blackwell_fmha" ABSOLUTE)
  if(EXISTS "${_jax_sgl_fmha_dir}/collective/sm100_fmha_fwd_mainloop_tma_warpspecialized.hpp")
    set(JAX_SGL_FMHA_SM100_INCLUDE_DIR "${_jax_sgl_fmha_dir}" CACHE PATH "" FORCE)
  endif()
endif()

# Blackwell attention (ffi/cuda/attention/sm100, tcgen05 MMA + TMEM + TMA on the FMHA
# collectives): built when 100a is among the archs and CuTe and the collectives are found. At run
# time JAX_SGL_DISABLE=sm100 / sm100_bwd turn the forward / backward off.
set(JAX_SGL_SM100_HEAD_DIMS "64;128" CACHE STRING "sm100 attention head dims to build")
set(JAX_SGL_SM100_DTYPES "bf16;fp16" CACHE STRING "sm100 attention dtypes to build")
if("100a" IN_LIST JAX_SGL_CUDA_ARCHS AND TARGET jax_sgl_cutlass AND JAX_SGL_FMHA_SM100_INCLUDE_DIR
   AND JAX_SGL_SM100_HEAD_DIMS)
  jax_sgl_arch_family(sm100 100a "${JAX_SGL_SM100_HEAD_DIMS}" "${JAX_SGL_SM100_DTYPES}"
                      " (collectives: ${JAX_SGL_FMHA_SM100_INCLUDE_DIR})")
  target_include_directories(jax_sgl_sm100 SYSTEM PRIVATE "${JAX_SGL_FMHA_SM100_INCLUDE_DIR}")
endif()

# A build for sm_90a without CuTe would fall back to the portable kernels at a third of the speed:
# say so in one loud line, and let the module report it (attention_backend_info(), and a
# one-time warning at the first call on a Hopper GPU).
string(REPLACE ";" "," _jax_sgl_archs_csv "${JAX_SGL_CUDA_ARCHS}")
target_compile_definitions(_native PRIVATE "JAX_SGL_CUDA_ARCHS_BUILT=\"${_jax_sgl_archs_csv}\"")
if("90a" IN_LIST JAX_SGL_CUDA_ARCHS AND NOT TARGET jax_sgl_cutlass)
  message(WARNING "jax_sgl: *** Hopper (sm90) attention kernels NOT built: no CuTe headers "
                  "(nvidia-cutlass) in the build environment; install with nvcc on PATH (the "
                  "build then pulls nvidia-cutlass) or set JAX_SGL_CUTLASS_INCLUDE_DIR ***")
  target_compile_definitions(_native PRIVATE JAX_SGL_SM90_NO_CUTE=1)
endif()
