// See simd_kernels.h. MultiplyRows keeps a 4 x 16 tile of out in registers: each element of B
// loaded serves four rows, and out is read and written once per tile, not once per step.
#include "ffi/cpu/simd_kernels.h"

#include <cstring>

// Clones by ISA level (x86-64-v4: AVX-512; v3: AVX2+FMA), which the resolver tests as CPU
// features. Not "arch=skylake-avx512"/"arch=haswell": for those GCC's resolver compares the CPU
// model, so every AMD and every newer Intel CPU got the SSE baseline. ISA levels in
// target_clones need GCC 12.
#if defined(__GNUC__) && __GNUC__ >= 12 && defined(__x86_64__) && !defined(__APPLE__) && \
    !defined(__clang__)
#define JAX_SGL_ISA_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAX_SGL_ISA_CLONES
#endif

namespace jax_sgl::cpu {

namespace {

// Eight floats as one GCC vector: 256 bits, so an AVX2 clone keeps a 4 x 16 tile of accumulators
// (8 vectors) plus its operands in 16 registers; the baseline clone splits each into two SSE ops.
typedef float Vec8 __attribute__((vector_size(32)));
constexpr int kTileRows = 4;
constexpr int kTileCols = 16;

inline Vec8 LoadVec(const float* p) {
  Vec8 x;
  std::memcpy(&x, p, sizeof x);  // unaligned
  return x;
}

inline void StoreVec(float* p, Vec8 x) { std::memcpy(p, &x, sizeof x); }

// out rows [0, R), columns [0, kTileCols) += A B: the accumulators stay in registers over len.
// Always inlined, so that each clone of MultiplyRows compiles it for its own ISA.
template <int R>
__attribute__((always_inline)) inline void MultiplyTile(const float* a, int lda, const float* b,
                                                        int ldb, int len, float* out, int ldo) {
  Vec8 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = LoadVec(out + size_t(r) * ldo);
    acc[r][1] = LoadVec(out + size_t(r) * ldo + 8);
  }
  for (int e = 0; e < len; ++e) {
    const Vec8 b0 = LoadVec(b + size_t(e) * ldb);
    const Vec8 b1 = LoadVec(b + size_t(e) * ldb + 8);
    for (int r = 0; r < R; ++r) {
      const float x = a[size_t(r) * lda + e];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    StoreVec(out + size_t(r) * ldo, acc[r][0]);
    StoreVec(out + size_t(r) * ldo + 8, acc[r][1]);
  }
}

}  // namespace

JAX_SGL_ISA_CLONES
void MultiplyRows(const float* a, int lda, int m, const float* b, int ldb, int len, int n,
                  float* out, int ldo) {
  const int n_tiled = n - n % kTileCols;
  for (int c = 0; c < n_tiled; c += kTileCols) {
    int i = 0;
    for (; i + kTileRows <= m; i += kTileRows)
      MultiplyTile<kTileRows>(a + size_t(i) * lda, lda, b + c, ldb, len,
                              out + size_t(i) * ldo + c, ldo);
    for (; i < m; ++i)
      MultiplyTile<1>(a + size_t(i) * lda, lda, b + c, ldb, len, out + size_t(i) * ldo + c, ldo);
  }
  for (int i = 0; i < m; ++i)  // columns past the last full tile
    for (int c = n_tiled; c < n; ++c) {
      float s = out[size_t(i) * ldo + c];
      for (int e = 0; e < len; ++e) s += a[size_t(i) * lda + e] * b[size_t(e) * ldb + c];
      out[size_t(i) * ldo + c] = s;
    }
}

}  // namespace jax_sgl::cpu
