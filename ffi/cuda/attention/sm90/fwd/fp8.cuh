// The e4m3 operands of the sm_90a forward's P V (FlashConfig::kFp8) and its descales.
//
// 8-bit wgmma wants both operands K-major: P (A, registers) and V^T (B, smem, keys contiguous).
// P comes from the S accumulator, whose 32-bit layout puts columns 8j + 2c + {0, 1} of each row
// in a thread (c = lane % 4), where the 8-bit A fragment wants columns 16h + 4c + {0..3}. Rather
// than move bytes between the lanes of a quad, P V runs over the keys in a permuted order: A
// column k of each 16-key group holds key Fp8KeyOfColumn(k), which is where the accumulator
// already has it, so P is a per-thread regrouping (AccToAFp8), and the producer writes V^T's
// column k from V's row Fp8KeyOfColumn(k) as it transposes the tile anyway (TransposeV). A sum
// over keys does not care about their order.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "ffi/cuda/attention/sm90/fwd/kernel_params.h"
#include "ffi/cuda/attention/sm90/wgmma.cuh"

namespace jax_sgl::cuda::sm90 {

using namespace cute;

// Key of A column k (within its 16-key group): the column's bits (k0, k1, k2, k3) are the
// fragment's (value bit 0, value bit 1, lane % 4 bit 0, lane % 4 bit 1), whose accumulator column
// is 8 * (value bit 1) + 2 * (lane % 4) + value bit 0.
__host__ __device__ constexpr int Fp8KeyOfColumn(int k) {
  return (k & ~15) | (k & 1) | ((k >> 2) & 1) << 1 | ((k >> 3) & 1) << 2 | ((k >> 1) & 1) << 3;
}

// The two users of the order agree with it: AccToAFp8 puts accumulator column 8 (v / 2) + 2 c +
// v % 2 at A column 4 c + v; TransposeV reads keys 2 kb + {0, 1, 8, 9} for V^T columns 4 kb + i.
constexpr bool Fp8KeyOrderConsistent() {
  for (int k = 0; k < 16; ++k) {
    const int c = k / 4, v = k % 4;
    if (Fp8KeyOfColumn(k) != 8 * (v / 2) + 2 * c + v % 2) return false;
    if (Fp8KeyOfColumn(k) != 2 * c + (v & 1) + 8 * (v >> 1)) return false;
    if (Fp8KeyOfColumn(k + 16) != 16 + Fp8KeyOfColumn(k)) return false;
  }
  return true;
}
static_assert(Fp8KeyOrderConsistent());

// Four floats -> four e4m3 bytes (IEEE round to nearest, saturating at +-448), x0 lowest.
__device__ __forceinline__ uint32_t PackE4m3x4(float x0, float x1, float x2, float x3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(x0), "f"(x1));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(x2), "f"(x3));
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// The 64 x kN S accumulator ((2, 2, kN / 8): column bit, row half, 8-column block) as the e4m3 A
// operand of P V ((4, 2, 2): 4 columns, row half, 16-column half; 1; kN / 32 K blocks), in the
// key order of Fp8KeyOfColumn: A values (v, r, h) of K block b are the accumulator's (v % 2, r,
// 4 b + 2 h + v / 2).
template <int kN, typename Acc>
__device__ __forceinline__ auto AccToAFp8(Acc const& acc) {
  static_assert(kN % 32 == 0, "8-bit wgmma K blocks are 32 keys");
  Tensor a = make_tensor<cutlass::float_e4m3_t>(Layout<Shape<Shape<_4, _2, _2>, _1, Int<kN / 32>>>{});
  Tensor words = recast<uint32_t>(a);  // word (r + 2 h + 4 b): values (0..3, r, h) of block b
#pragma unroll
  for (int b = 0; b < kN / 32; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = 4 * b + 2 * h;  // the accumulator's 8-column block of v / 2 = 0
        words(r + 2 * h + 4 * b) = PackE4m3x4(acc(2 * r + 4 * j), acc(1 + 2 * r + 4 * j),
                                              acc(2 * r + 4 * (j + 1)), acc(1 + 2 * r + 4 * (j + 1)));
      }
  return a;
}

// V^T of one staged V tile: sVt(d, k, stage) = sV(Fp8KeyOfColumn(k), d, slot), by the 128
// threads of the producer warpgroup, each moving 4 x 4 byte blocks (four 32-bit loads, eight
// byte permutes, four 32-bit stores); the caller fences and signals. Block (kb, db): keys
// 4 kb.. of V^T rows 4 db... hd128 with 128-key tiles (both rings 128-byte rows under the
// 128-byte swizzle: 16-byte chunk ^= row % 8) uses a lane -> block map under which a warp's 32
// loads, and its 32 stores, each fall in 32 distinct banks: load bank bits (db0, db1, db2 ^ i,
// db3 ^ kb0, db4 ^ kb1), store bank bits (kb0, kb1, kb2 ^ j0, kb3 ^ j1, kb4 ^ db0) for load i and
// store j, both one-to-one in the lane under the map below. Other shapes go in plain order.
template <typename Cfg, typename SV, typename SVt>
__device__ __forceinline__ void TransposeV(SV const& sV, SVt& sVt, int slot, int stage, int t) {
  constexpr int kKeyBlocks = Cfg::kBlockN / 4, kDimBlocks = Cfg::kHeadDim / 4;
  constexpr int kPerThread = kKeyBlocks * kDimBlocks / 128;
  static_assert(kKeyBlocks * kDimBlocks % 128 == 0 && Cfg::kBlockN % 16 == 0);
  constexpr bool kMapped = kKeyBlocks == 32 && kDimBlocks == 32;
  const int l = t % 32;
  const int l0 = l & 1, l1 = (l >> 1) & 1, l2 = (l >> 2) & 1, l3 = (l >> 3) & 1, l4 = l >> 4;
  const int db_lane = l0 | l1 << 1 | l2 << 2 | (l3 ^ l2) << 3 | (l4 ^ l3) << 4;
  const int kb_lane = l2 | l3 << 1 | l4 << 2 | l0 << 3 | (l1 ^ l0) << 4;
  // Rolled: the producer has 24 registers (unrolled, the blocks' addresses spilled).
#pragma unroll 1
  for (int it = 0; it < kPerThread; ++it) {
    int kb, db;
    if constexpr (kMapped) {
      kb = kb_lane ^ ((t / 32) * kPerThread + it);
      db = db_lane;
    } else {
      const int b = t + 128 * it;
      kb = b % kKeyBlocks;
      db = b / kKeyBlocks;
    }
    const int key = 16 * (kb >> 2) + 2 * (kb & 3);  // Fp8KeyOfColumn(4 kb); +1, +8, +9 follow
    const uint32_t r0 = *reinterpret_cast<uint32_t const*>(&sV(key, 4 * db, slot));
    const uint32_t r1 = *reinterpret_cast<uint32_t const*>(&sV(key + 1, 4 * db, slot));
    const uint32_t r2 = *reinterpret_cast<uint32_t const*>(&sV(key + 8, 4 * db, slot));
    const uint32_t r3 = *reinterpret_cast<uint32_t const*>(&sV(key + 9, 4 * db, slot));
    const uint32_t lo01 = __byte_perm(r0, r1, 0x5140), lo23 = __byte_perm(r2, r3, 0x5140);
    const uint32_t hi01 = __byte_perm(r0, r1, 0x7362), hi23 = __byte_perm(r2, r3, 0x7362);
    *reinterpret_cast<uint32_t*>(&sVt(4 * db + 0, 4 * kb, stage)) = __byte_perm(lo01, lo23, 0x5410);
    *reinterpret_cast<uint32_t*>(&sVt(4 * db + 1, 4 * kb, stage)) = __byte_perm(lo01, lo23, 0x7632);
    *reinterpret_cast<uint32_t*>(&sVt(4 * db + 2, 4 * kb, stage)) = __byte_perm(hi01, hi23, 0x5410);
    *reinterpret_cast<uint32_t*>(&sVt(4 * db + 3, 4 * kb, stage)) = __byte_perm(hi01, hi23, 0x7632);
  }
}

// The descales of work tile w's (batch, kv head) (AttentionParams: [batch, num_kv_heads] or
// nullptr for 1).
template <typename Cfg>
__device__ __forceinline__ float Fp8Descale(KernelParams<Cfg> const& params, const float* d,
                                            int batch, int kv_head) {
  return d != nullptr ? d[int64_t(batch) * params.num_kv_heads + kv_head] : 1.f;
}

// The smem the consumers read V^T from (16-bit: the V ring itself) and stage O in.
template <typename Cfg>
__device__ __forceinline__ auto VtData(typename Cfg::SharedStorage& shared) {
  if constexpr (Cfg::kFp8) return shared.vt.data();
  else return shared.v.data();
}
template <typename Cfg>
__device__ __forceinline__ auto OData(typename Cfg::SharedStorage& shared) {
  if constexpr (Cfg::kSeparateO) return shared.o.data();
  else return shared.q.data();
}

// The S accumulator as the A operand of P V: e4m3 in the permuted key order, else Element.
template <typename Cfg, typename Acc>
__device__ __forceinline__ auto ToA(Acc const& acc) {
  if constexpr (Cfg::kFp8) return AccToAFp8<Cfg::kBlockN>(acc);
  else return AccToA<typename Cfg::Element, Cfg::kBlockN>(acc);
}

}  // namespace jax_sgl::cuda::sm90
