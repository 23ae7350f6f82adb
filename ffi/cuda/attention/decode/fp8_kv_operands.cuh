// The fp8 KV cache's operands in the warp-sliced decode kernels: K and V tiles of e4m3 bytes in
// shared memory (half the bytes of a 16-bit tile, which is the point: decode is bandwidth bound),
// turned into f16 in registers right before each m16n8k16 mma, one cvt per two bytes (e4m3 -> f16
// is exact: every e4m3 value, subnormals included, is a normal f16). The descales stay out of the
// tiles: k_descale[b, kv head] joins the score scale and v_descale[b, kv head] the output's 1 / l
// (warp_steps.cuh), the CPU kernel's placement.
//
// Why f16 mmas under bf16 q too: a bf16 operand costs three more instructions per two bytes
// (f16 -> f32 twice and a bf16 pack: 192 of the 545 a warp issued per 16-key stage at kD = 128,
// 128 of them conversions), and the bf16-q form ran at 59-69% of copy bandwidth on the H200: bound
// by per-key instruction work, not by bytes. f16 holds bf16 q exactly once each q row is brought
// near f16's top by a power of two (QRowExponent: row max |q| in [2^14, 2^15); f16 keeps 11
// significant bits to bf16's 8, so every element within 2^-31 of the row max is exact and smaller
// ones round by at most 2^-25 in scaled units, 2^-39 of the row max), and the power of two leaves
// through the row's score scale (StageScoring::ScaleRows). P in [0, 1] is then packed as f16, as
// the f16-q kernels always did: below bf16's rounding error for every P >= 2^-16, and at most
// 2^-25 (of l >= 1) under it.
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
//     [g kD/8, (g + 1) kD/8) of key rows 2c, 2c + 1, 2c + 8, 2c + 9 and byte-permutes the pairs,
//     one permute for the pairs of two n tiles (the cvt reads either half of a register).
// A stage costs a lane 2 x kD / 64 + 4 shared loads (16-byte at kD = 128), one cvt per two
// elements and one permute per four V elements, instead of ldmatrix's kD / 8 + kD / 16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ffi/cuda/attention/common/e4m3.cuh"
#include "ffi/cuda/attention/common/mma.cuh"
#include "ffi/cuda/attention/decode/stage_softmax.cuh"

namespace jax_sgl::cuda::decode_fp8kv {

// Half kHalf (0: bits 0..15, 1: bits 16..31) of w, two e4m3 values (low byte first), as f16x2,
// low half first: the sm_89+ conversion instruction, which reads either half of its register
// (no shift or mask), else (sm_80's cp.async form) the exact decode of the bits.
template <int kHalf>
__device__ __forceinline__ uint32_t E4m3x2ToF16(uint32_t w) {
  static_assert(kHalf == 0 || kHalf == 1, "a register has two halves");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  const uint32_t two = w >> (16 * kHalf);
  return flash::Elem<f16_t>::Pack(ToFloat(f8e4m3_t{uint8_t(two & 0xffu)}),
                                  ToFloat(f8e4m3_t{uint8_t((two >> 8) & 0xffu)}));
#else
  uint32_t h;
  if constexpr (kHalf == 0) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
        : "=r"(h)
        : "r"(w));
  } else {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
        : "=r"(h)
        : "r"(w));
  }
  return h;
#endif
}

// The power of two e that brings a bf16 q row of max |x| `amax` to [2^14, 2^15) (the top binade
// f16 holds with room: bf16's largest significand times 2^14 is below 2^15 <= 65504), from the
// float's exponent field: a zero or subnormal max clamps to 2^126 (2^e and 2^-e stay normal
// floats), an inf or NaN max gives 2^-114 (the row's scores are inf or NaN either way).
__device__ __forceinline__ int QRowExponent(float amax) {
  const int biased = int((__float_as_uint(amax) >> 23) & 0xffu);
  return min(141 - biased, 126);  // 14 - (biased - 127)
}

// 2^e as a float, for e in [-126, 127].
__device__ __forceinline__ float Pow2(int e) { return __uint_as_float(uint32_t(127 + e) << 23); }

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

// The stage's 16 x 16 raw scores sc (two n8 tiles of keys) from q's f16 A fragments qa (QColumn
// order) and the K byte tile; at(row, byte): shared address of K byte (row, byte), whose 16-byte
// chunks are contiguous (a padded or a swizzled tile).
template <int kD, typename At>
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
      const uint32_t bk[2] = {E4m3x2ToF16<0>(w[t][s]), E4m3x2ToF16<1>(w[t][s])};
      flash::Elem<f16_t>::Mma(sc[t], qa[s], bk);
    }
  }
}

// SoftmaxStep (P by Exp2Ftz, packed as f16) and o += P V over the V byte tile (at as Scores');
// o's n tile t, column n is feature OutFeature(t, n).
template <int kD, typename At>
__device__ __forceinline__ void SoftmaxPv(float (&sc)[2][4], const float (&blk_max)[2],
                                          float (&m_run)[2], float (&l_run)[2],
                                          float (&o)[kD / 8][4], At at, int lane) {
  constexpr int kLaneBytes = kD / 8;
  uint32_t pa[4];
  decode::SoftmaxStep<f16_t, kD, true, true>(sc, blk_max, m_run, l_run, o, pa);
  const int g = lane / 4, c = lane % 4;
  // Key rows 2c, 2c + 1, 2c + 8, 2c + 9: the B fragment's k positions of this lane.
  uint32_t w[4][kLaneBytes / 4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
    LoadShared<kLaneBytes>(at(2 * c + (r & 1) + (r >> 1) * 8, g * kLaneBytes), w[r]);
  // n tiles t and t + 1 (t even) take bytes t % 4 and t % 4 + 1 of the lane's word t / 4 of each
  // key row: one permute puts tile t's (row 2c, row 2c + 1) pair in the low half, tile t + 1's in
  // the high half (likewise rows 2c + 8, 2c + 9).
#pragma unroll
  for (int t = 0; t < kD / 8; t += 2) {
    const uint32_t b0 = uint32_t(t % 4);
    const uint32_t sel = b0 | ((4 + b0) << 4) | ((b0 + 1) << 8) | ((5 + b0) << 12);
    const uint32_t r01 = __byte_perm(w[0][t / 4], w[1][t / 4], sel);
    const uint32_t r23 = __byte_perm(w[2][t / 4], w[3][t / 4], sel);
    const uint32_t bv0[2] = {E4m3x2ToF16<0>(r01), E4m3x2ToF16<0>(r23)};
    const uint32_t bv1[2] = {E4m3x2ToF16<1>(r01), E4m3x2ToF16<1>(r23)};
    flash::Elem<f16_t>::Mma(o[t], pa, bv0);
    flash::Elem<f16_t>::Mma(o[t + 1], pa, bv1);
  }
}

}  // namespace jax_sgl::cuda::decode_fp8kv
