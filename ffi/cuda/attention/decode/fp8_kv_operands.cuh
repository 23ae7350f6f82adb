// The fp8 KV cache's operands in the warp-sliced decode kernels: K and V tiles of e4m3 bytes in
// shared memory (half the bytes of a 16-bit tile, which is the point: decode is bandwidth bound),
// turned into q's 16-bit type in registers right before each m16n8k16 mma. e4m3 -> f16 is exact
// (every e4m3 value, subnormals included, is a normal f16) and so is f16 -> f32 -> bf16; the
// descales stay out of the tiles: k_descale[b, kv head] joins the score scale and
// v_descale[b, kv head] the output's 1 / l (warp_steps.cuh), the CPU kernel's placement.
//
// Why permuted feature orders: ldmatrix moves 16-bit elements, so a byte tile cannot feed it. The
// mma's fragments are instead read with plain shared loads, and the feature (d) order of each
// fragment is chosen so that a lane's bytes are contiguous in a K or V row:
//   - S = Q K^T sums over d, so any permutation of d applied to both q and K leaves S unchanged.
//     Lane (g = lane / 4, c = lane % 4) reads the kD / 4 bytes [c kD/4, (c + 1) kD/4) of key rows
//     g and g + 8; k step s takes their bytes 4s .. 4s + 3 as its fragment positions 2c, 2c + 1,
//     2c + 8, 2c + 9. q is written into shared memory in the same order (QColumn).
//   - O = P V: P's key order is fixed by the score fragments, but V's columns are free: n tile j,
//     column n holds feature n kD/8 + j (OutFeature), so lane g reads the kD / 8 bytes
//     [g kD/8, (g + 1) kD/8) of key rows 2c, 2c + 1, 2c + 8, 2c + 9 and byte-permutes the pairs.
// A stage costs a lane 2 x kD / 64 + 4 shared loads (16-byte at kD = 128) and one cvt per two
// elements, instead of ldmatrix's kD / 8 + kD / 16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ffi/cuda/attention/common/e4m3.cuh"
#include "ffi/cuda/attention/common/mma.cuh"
#include "ffi/cuda/attention/decode/stage_softmax.cuh"

namespace jax_sgl::cuda::decode_fp8kv {

// The widening every fp8 operand of the CUDA kernels shares (common/e4m3.cuh).
using flash::E4m3x2To;

// Column of q's shared-memory tile that holds feature d (the K fragment order above).
template <int kD>
__host__ __device__ constexpr int QColumn(int d) {
  const int c = d / (kD / 4), rem = d % (kD / 4), s = rem / 4, r = rem % 4;
  return s * 16 + 2 * c + (r & 1) + (r >= 2 ? 8 : 0);
}

// Feature of output n tile t, column n (the V order above).
template <int kD>
__host__ __device__ constexpr int OutFeature(int t, int n) { return n * (kD / 8) + t; }

// Loads `kBytes` bytes (8 or 16) at shared address `addr` into words w[0 .. kBytes / 4).
template <int kBytes>
__device__ __forceinline__ void LoadShared(uint32_t addr, uint32_t* w) {
  static_assert(kBytes == 8 || kBytes == 16, "one 8- or 16-byte load");
  if constexpr (kBytes == 16) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(addr));
  } else {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
  }
}

// The stage's 16 x 16 raw scores sc (two n8 tiles of keys) from q's A fragments qa (QColumn
// order) and the K byte tile; at(row, byte): shared address of K byte (row, byte), whose 16-byte
// chunks are contiguous (a padded or a swizzled tile).
template <typename T, int kD, typename At>
__device__ __forceinline__ void Scores(const uint32_t (&qa)[kD / 16][4], At at, int lane,
                                       float (&sc)[2][4]) {
  constexpr int kLaneBytes = kD / 4;
  constexpr int kLoad = kLaneBytes < 16 ? kLaneBytes : 16;
  const int g = lane / 4, c = lane % 4;
  uint32_t w[2][kD / 16];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int b = 0; b < kLaneBytes; b += kLoad)
      LoadShared<kLoad>(at(g + 8 * t, c * kLaneBytes + b), &w[t][b / 4]);
#pragma unroll
  for (int s = 0; s < kD / 16; ++s) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint32_t bk[2] = {E4m3x2To<T>(w[t][s] & 0xffffu), E4m3x2To<T>(w[t][s] >> 16)};
      flash::Elem<T>::Mma(sc[t], qa[s], bk);
    }
  }
}

// SoftmaxStep and o += P V over the V byte tile (at as Scores'); o's n tile t, column n is
// feature OutFeature(t, n).
template <typename T, int kD, typename At>
__device__ __forceinline__ void SoftmaxPv(float (&sc)[2][4], const float (&blk_max)[2],
                                          float (&m_run)[2], float (&l_run)[2],
                                          float (&o)[kD / 8][4], At at, int lane) {
  constexpr int kLaneBytes = kD / 8;
  uint32_t pa[4];
  decode::SoftmaxStep<T, kD, true>(sc, blk_max, m_run, l_run, o, pa);
  const int g = lane / 4, c = lane % 4;
  // Key rows 2c, 2c + 1, 2c + 8, 2c + 9: the B fragment's k positions of this lane.
  uint32_t w[4][kLaneBytes / 4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
    LoadShared<kLaneBytes>(at(2 * c + (r & 1) + (r >> 1) * 8, g * kLaneBytes), w[r]);
#pragma unroll
  for (int t = 0; t < kD / 8; ++t) {
    const uint32_t sel = uint32_t(t % 4) | (uint32_t(4 + t % 4) << 4);
    const uint32_t bv[2] = {E4m3x2To<T>(__byte_perm(w[0][t / 4], w[1][t / 4], sel)),
                            E4m3x2To<T>(__byte_perm(w[2][t / 4], w[3][t / 4], sel))};
    flash::Elem<T>::Mma(o[t], pa, bv);
  }
}

}  // namespace jax_sgl::cuda::decode_fp8kv
