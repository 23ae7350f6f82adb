// Makes Metal Shading Language kernel sources compile as C++17 on Linux, so that the CPU grid
// emulator (metal/emulator) can run the very source the Metal compiler sees. It provides what
// jax_sgl's kernels use and nothing more:
//   - address-space qualifiers (device, constant, threadgroup, thread) as empty macros;
//   - half and bfloat as storage structs with explicit float conversions (the kernels convert
//     explicitly, as they must for bit-exact agreement with the CPU backend anyway);
//   - uint / ulong scalars, uint3 / ulong2 vectors;
//   - threadgroup_barrier / simdgroup_barrier, simd_sum / simd_max / simd_shuffle_xor, all
//     synchronizing through the emulator's fibers;
//   - simdgroup_matrix 8x8 with load / store / multiply(_accumulate). Each lane holds the whole
//     matrix (Metal spreads it over the lanes), which is observably the same as long as kernels
//     touch matrices only through these functions (never thread_elements()); stores run in
//     lockstep so a lane cannot read memory another lane of its simdgroup rewrote.
//   - JAX_SGL_THREADGROUP_ARRAY (metal/kernels/utils.h) allocates from the emulator's per-
//     threadgroup arena, which checks Metal's 32 KB limit.
// Include this before any kernel header and after every standard header: the qualifier macros
// would break identifiers such as std::thread.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ffi/common/numeric.h"
#include "metal/emulator/runtime.h"

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;

// bfloat16 / float16 storage: conversions round to nearest even, as Metal's do.
struct half {
  uint16_t bits;
  half() = default;
  explicit half(float f) : bits(jax_sgl::FromFloatF16(f).bits) {}
  explicit operator float() const { return jax_sgl::ToFloat(jax_sgl::f16_t{bits}); }
};
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) : bits(jax_sgl::FromFloatBf16(f).bits) {}
  explicit operator float() const { return jax_sgl::ToFloat(jax_sgl::bf16_t{bits}); }
};
static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2, "storage types must be 2 bytes");

struct uint3 {
  uint x, y, z;
};
struct ulong2 {
  ulong x, y;
  ulong2(ulong a = 0, ulong b = 0) : x(a), y(b) {}
};

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

inline void threadgroup_barrier(mem_flags) { jax_sgl::metal_emu::ThreadgroupBarrier(); }
inline void simdgroup_barrier(mem_flags) { jax_sgl::metal_emu::SimdgroupBarrier(); }

inline float simd_sum(float v) {
  int n;
  const float* all = jax_sgl::metal_emu::SimdExchange(v, &n);
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += all[i];
  return s;
}
inline float simd_max(float v) {
  int n;
  const float* all = jax_sgl::metal_emu::SimdExchange(v, &n);
  float m = all[0];
  for (int i = 1; i < n; ++i) m = std::max(m, all[i]);
  return m;
}
inline float simd_shuffle_xor(float v, ushort mask) {
  int n;
  const float* all = jax_sgl::metal_emu::SimdExchange(v, &n);
  const uint src = jax_sgl::metal_emu::CurrentSimdLane() ^ mask;
  return src < uint(n) ? all[src] : v;
}

using std::exp;
using std::exp2;
using std::log;
using std::max;
using std::min;
using std::tanh;
namespace precise {
using std::cos;
using std::sin;
}  // namespace precise

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  T e[Rows][Cols];
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <typename T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) m.e[r][c] = value;
  return m;
}

// element (r, c) at src[(origin.y + r) * elements_per_row + origin.x + c]; transposed loads read
// (r, c) from the source's (c, r).
template <typename T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                    ulong2 origin = ulong2(0, 0), bool transpose_matrix = false) {
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) {
      const ulong row = transpose_matrix ? c : r, col = transpose_matrix ? r : c;
      d.e[r][c] = src[(origin.y + row) * elements_per_row + origin.x + col];
    }
}

template <typename T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, T* dst, ulong elements_per_row = Cols,
                     ulong2 origin = ulong2(0, 0), bool transpose_matrix = false) {
  jax_sgl::metal_emu::SimdgroupBarrier();
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) {
      const ulong row = transpose_matrix ? c : r, col = transpose_matrix ? r : c;
      dst[(origin.y + row) * elements_per_row + origin.x + col] = a.e[r][c];
    }
  jax_sgl::metal_emu::SimdgroupBarrier();
}

// d = a * b + c
template <typename T, int N>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, N, N>& d, const simdgroup_matrix<T, N, N>& a,
                                   const simdgroup_matrix<T, N, N>& b,
                                   const simdgroup_matrix<T, N, N>& c) {
  simdgroup_matrix<T, N, N> r;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) {
      T s = c.e[i][j];
      for (int k = 0; k < N; ++k) s += a.e[i][k] * b.e[k][j];
      r.e[i][j] = s;
    }
  d = r;
}

// d = a * b
template <typename T, int N>
void simdgroup_multiply(simdgroup_matrix<T, N, N>& d, const simdgroup_matrix<T, N, N>& a,
                        const simdgroup_matrix<T, N, N>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, N, N>(T(0)));
}

}  // namespace metal

#define device
#define constant
#define threadgroup
#define thread
