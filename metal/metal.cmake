# macOS only (included from CMakeLists.txt under if(APPLE)): compiles metal/kernels/*.metal into
# jax_sgl_kernels.metallib with the Xcode toolchain, ships it beside _native, and adds the Metal
# "cpu" handlers (metal/host) to _native. Needs Xcode (xcrun metal / metallib), macOS 14+ at run
# time (MSL 3.1 for bfloat); without the Metal toolchain the CPU-only build is kept.
find_program(JAX_SGL_XCRUN xcrun)
if(JAX_SGL_XCRUN)
  execute_process(COMMAND ${JAX_SGL_XCRUN} -sdk macosx --find metal
                  OUTPUT_VARIABLE JAX_SGL_METAL_COMPILER OUTPUT_STRIP_TRAILING_WHITESPACE
                  ERROR_QUIET RESULT_VARIABLE JAX_SGL_METAL_FOUND)
endif()
if(NOT JAX_SGL_XCRUN OR NOT JAX_SGL_METAL_FOUND EQUAL 0)
  message(STATUS "jax_sgl: Metal toolchain not found (install Xcode); Metal backend disabled")
  return()
endif()

enable_language(OBJCXX)

set(JAX_SGL_METAL_KERNELS rope_pool attention)
# Every header a kernel may include: a change to any rebuilds the metallib.
file(GLOB JAX_SGL_METAL_HEADERS ${CMAKE_CURRENT_SOURCE_DIR}/metal/kernels/*.h)
list(APPEND JAX_SGL_METAL_HEADERS
  ${CMAKE_CURRENT_SOURCE_DIR}/ffi/common/attention_geometry.h
  ${CMAKE_CURRENT_SOURCE_DIR}/ffi/common/attention_sink.h
  ${CMAKE_CURRENT_SOURCE_DIR}/ffi/common/rope_math.h)

set(JAX_SGL_METAL_AIR)
foreach(kernel ${JAX_SGL_METAL_KERNELS})
  set(src ${CMAKE_CURRENT_SOURCE_DIR}/metal/kernels/${kernel}.metal)
  set(air ${CMAKE_CURRENT_BINARY_DIR}/metal/${kernel}.air)
  # -fno-fast-math: Metal defaults to fast math; the kernels want IEEE exp/log/tanh so they agree
  # with the CPU backend (and the -inf LSE of fully masked rows stays -inf).
  add_custom_command(
    OUTPUT ${air}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_BINARY_DIR}/metal
    COMMAND ${JAX_SGL_XCRUN} -sdk macosx metal -std=metal3.1 -fno-fast-math -Wall
            -I ${CMAKE_CURRENT_SOURCE_DIR} -c ${src} -o ${air}
    DEPENDS ${src} ${JAX_SGL_METAL_HEADERS}
    COMMENT "Metal: ${kernel}.metal")
  list(APPEND JAX_SGL_METAL_AIR ${air})
endforeach()

set(JAX_SGL_METALLIB ${CMAKE_CURRENT_BINARY_DIR}/jax_sgl_kernels.metallib)
add_custom_command(
  OUTPUT ${JAX_SGL_METALLIB}
  COMMAND ${JAX_SGL_XCRUN} -sdk macosx metallib ${JAX_SGL_METAL_AIR} -o ${JAX_SGL_METALLIB}
  DEPENDS ${JAX_SGL_METAL_AIR}
  COMMENT "Metal: jax_sgl_kernels.metallib")
add_custom_target(jax_sgl_metallib ALL DEPENDS ${JAX_SGL_METALLIB})
add_dependencies(_native jax_sgl_metallib)

target_sources(_native PRIVATE
  metal/host/context.mm
  metal/host/rope_pool.cc
  metal/host/attention_fwd.cc)
set_source_files_properties(metal/host/context.mm PROPERTIES COMPILE_OPTIONS "-fobjc-arc")
target_compile_definitions(_native PRIVATE JAX_SGL_HAVE_METAL)
target_link_libraries(_native PRIVATE "-framework Metal" "-framework Foundation")
install(FILES ${JAX_SGL_METALLIB} DESTINATION jax_sgl)
