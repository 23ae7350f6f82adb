// Warp-level building blocks of the mma.sync kernels (the portable prefill and backward, the
// decode kernels): the m16n8k16 tensor-core mma and float-pair packing per 16-bit type, ldmatrix,
// 16- and 8-byte cp.async, quad reductions over the four threads that share an accumulator row, and
// where a packed row (query row x q head of a GQA group) lives in q / out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/common/attention_seq.h"
#include "ffi/common/numeric.h"

namespace jax_sgl::cuda {
namespace flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// bf16 / fp16 specifics: the mma instruction and float pair packing.
template <typename T>
struct Elem {
  static_assert(std::is_same_v<T, bf16_t> || std::is_same_v<T, f16_t>, "a 16-bit float type");
  static constexpr bool kBf16 = std::is_same_v<T, bf16_t>;
  using Pair = std::conditional_t<kBf16, __nv_bfloat162, __half2>;

  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) {
    Pair h;
    if constexpr (kBf16) h = __floats2bfloat162_rn(lo, hi);
    else h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  // c += a b with the asm's operand type spelled per T (PTX names it in the instruction).
  static __device__ __forceinline__ void Mma(float* c, const uint32_t* a, const uint32_t* b) {
#define JAX_SGL_MMA_M16N8K16(AB)                                                         \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0,%1,%2,%3}, " \
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
    if constexpr (kBf16) JAX_SGL_MMA_M16N8K16("bf16");
    else JAX_SGL_MMA_M16N8K16("f16");
#undef JAX_SGL_MMA_M16N8K16
  }
};

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void Ldmatrix4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}

__device__ __forceinline__ void Ldmatrix4Trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}

// 16-byte async copy; src_bytes == 0 writes zeros and reads nothing.
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)), "l"(src),
               "r"(src_bytes));
}
// 8-byte async copy (an fp8 row's chunk of 8 elements); src_bytes == 0 writes zeros.
__device__ __forceinline__ void CpAsync8(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(SmemAddr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n"); }

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Where packed row r of (sequence, kv head) lives in q/out: query row r / group, head r % group.
struct PackedRow {
  int64_t q_row;  // global row of q / out
  int head;
};
__device__ __forceinline__ PackedRow Unpack(const SeqBounds& s, int kv_head, int group, int r) {
  return {s.q_row0 + r / group, kv_head * group + r % group};
}

}  // namespace flash
}  // namespace jax_sgl::cuda
