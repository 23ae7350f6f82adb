# Picks the CUDA compiler, or none, from JAX_SGL_CUDA and JAX_SGL_CUDA_ARCHS:
#   auto  a system toolkit: CUDACXX, nvcc on PATH, $CUDA_HOME / $CUDA_PATH, /usr/local/cuda
#         (the same order as tools/build_backend/jax_sgl_build.py, which adds the build
#         requirements of a CUDA build); none found: a CPU-only build;
#   pip   nvcc, its headers, CCCL and the static cudart from the nvidia-* wheels of the build's
#         Python (cuda-toolkit[nvcc,...], pulled in by the build backend): no system toolkit;
#   off   a CPU-only build (as JAX_SGL_CUDA_ARCHS=OFF).
# Sets CMAKE_CUDA_COMPILER when CUDA is to be built.
set(JAX_SGL_CUDA "auto" CACHE STRING "Where nvcc comes from: auto, pip or off")
string(TOLOWER "${JAX_SGL_CUDA}" _jax_sgl_cuda)

if(JAX_SGL_CUDA_ARCHS STREQUAL "OFF" OR _jax_sgl_cuda STREQUAL "off")
  unset(CMAKE_CUDA_COMPILER)
elseif(_jax_sgl_cuda STREQUAL "pip")
  # The wheels unpack a toolkit tree under site-packages/nvidia/cu13 (bin/nvcc, nvvm/, include/,
  # include/cccl, lib/libcudart_static.a) whose nvcc.profile already points at its own parts.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util, os; s = importlib.util.find_spec('nvidia'); print(next(os.path.join(d, 'cu13', 'bin', 'nvcc') for d in s.submodule_search_locations if os.path.exists(os.path.join(d, 'cu13', 'bin', 'nvcc'))))"
    OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE _jax_sgl_pip_nvcc ERROR_QUIET
    RESULT_VARIABLE _jax_sgl_pip_rc)
  if(NOT _jax_sgl_pip_rc EQUAL 0)
    message(FATAL_ERROR "jax_sgl: JAX_SGL_CUDA=pip, but the build's Python has no nvcc from PyPI "
                        "(pip install 'cuda-toolkit[nvcc,nvvm,crt,cudart,cccl]==13.0.2'; an "
                        "isolated pip build installs it itself)")
  endif()
  set(CMAKE_CUDA_COMPILER "${_jax_sgl_pip_nvcc}" CACHE FILEPATH "" FORCE)
  # The nvcc wheel's profile links from lib64/, the cudart wheel installs into lib/: show nvcc
  # lib/ for CMake's compiler check, and cuda.cmake looks for the static cudart there.
  get_filename_component(JAX_SGL_PIP_CUDA_ROOT "${_jax_sgl_pip_nvcc}/../.." ABSOLUTE)
  set(ENV{NVCC_APPEND_FLAGS} "$ENV{NVCC_APPEND_FLAGS} -L${JAX_SGL_PIP_CUDA_ROOT}/lib")
  message(STATUS "jax_sgl: nvcc from PyPI: ${CMAKE_CUDA_COMPILER}")
elseif(_jax_sgl_cuda STREQUAL "auto")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(_jax_sgl_nvcc nvcc
                 PATHS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin" /usr/local/cuda/bin)
    if(_jax_sgl_nvcc)
      set(CMAKE_CUDA_COMPILER "${_jax_sgl_nvcc}" CACHE FILEPATH "")
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
else()
  message(FATAL_ERROR "jax_sgl: JAX_SGL_CUDA must be auto, pip or off, got '${JAX_SGL_CUDA}'")
endif()
