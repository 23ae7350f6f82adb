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
// v % 2 at A column 4 c + v; TransposeV gives V^T columns 4 c + {0..3} keys 2 c + {0, 1, 8, 9}.
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

// Four floats -> four e4m3 bytes (IEEE round to nearest, saturating at +-448), x0 lowest. One
// asm block, the halves joined by mov.b32 (ptxas: two F2FP, the second merging into the first):
// two 16-bit outputs joined in C++ compiled to byte extracts and shifts (~8 instructions a word).
__device__ __forceinline__ uint32_t PackE4m3x4(float x0, float x1, float x2, float x3) {
  uint32_t word;
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}"
      : "=r"(word)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return word;
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

// The V transpose of the producer warpgroup (TransposeV): V^T(d, k, stage) = V(Fp8KeyOfColumn(k),
// d, stage), one block of 16 keys x 32 head-dim bytes per step of a warp, in three instructions
// of shared-memory traffic per lane and block:
// - ldmatrix.x4.trans (b16) reads the block as four matrices of 8 keys x 16 bytes (matrix m:
//   keys + 8 (m & 1), bytes + 16 (m >> 1)); lane (r, c) = (lane / 4, lane % 4) receives of each
//   the b16 pairs of keys 2c and 2c + 1 at dims 2r, 2r + 1 (bytes: key 2c dim 2r, key 2c dim
//   2r + 1, key 2c + 1 dim 2r, key 2c + 1 dim 2r + 1);
// - byte permutes of the key +0 / +8 matrices' registers (0x6420 / 0x7531) give, for dim 2r and
//   for dim 2r + 1, the keys 2c + {0, 1, 8, 9}: V^T columns 4c + {0..3} in Fp8KeyOfColumn's
//   order, so P (AccToAFp8) needs no lane exchange;
// - stmatrix.x4 writes those words as 16-byte V^T rows, lane l naming row l % 8 of matrix
//   l / 8. Lanes 16-31 (r >= 4) swap their dim 2r / 2r + 1 words (the permute selectors are
//   per lane), so each matrix's 8 rows are dims of 8 distinct residues mod 8: under the 128- and
//   64-byte swizzles that puts them in 8 distinct 16-byte bank groups (dims of one parity met
//   2-way conflicts). ldmatrix's 8 rows are 8 consecutive keys: conflict-free likewise.
// Block `it` of warp w is key block 4 (it % kKeySteps) + w and dim block it / kKeySteps, so
// the lane's coordinates and the block's occupy distinct bits of each coordinate; both layouts
// are linear over those bits (swizzles are XORs of offset bits), so each address is the lane's
// base offset XOR a constant of `it`: one LOP3 once the loop is unrolled. __host__ too:
// tools/check_fp8_transpose.cu replays it (with models of the two instructions) against the
// layouts and counts the banks of every matrix access.
// LayoutV: the staging ring's layout, SmemLayoutKV or, where paged TMA boxes fill it by whole
// rows, SmemLayoutKVRows (linear over the same bits: tiles of swizzle atoms in another order).
template <typename Cfg, typename LayoutV_ = typename Cfg::SmemLayoutKV>
struct Fp8TransposeMap {
  using LayoutV = LayoutV_;                        // [keys, head dim, stage], bytes
  using LayoutVt = typename Cfg::SmemLayoutVtFp8;  // [head dim, keys, stage], bytes
  static constexpr int kKeyBlocks = Cfg::kBlockN / 16, kDimBlocks = Cfg::kHeadDim / 32;
  static_assert(kKeyBlocks % 4 == 0 && Cfg::kHeadDim % 32 == 0, "whole blocks per warp");
  static constexpr int kKeySteps = kKeyBlocks / 4;
  static constexpr int kPerThread = kKeySteps * kDimBlocks;  // blocks per warp
  __host__ __device__ static constexpr int Key0(int it) { return 64 * (it % kKeySteps); }
  __host__ __device__ static constexpr int Dim0(int it) { return 32 * (it / kKeySteps); }
  // ldmatrix / stmatrix row l % 8 of matrix l / 8 of this lane: V's key and byte, V^T's dim.
  __host__ __device__ static constexpr int LoadKey(int lane, int warp) {
    return 16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1);
  }
  __host__ __device__ static constexpr int LoadDim(int lane) { return 16 * (lane >> 4); }
  __host__ __device__ static constexpr int StoreDim(int lane) {
    const int m = lane >> 3, row = lane & 7;
    return 16 * (m >> 1) + 2 * row + ((m & 1) ^ (row >> 2));
  }

  uint32_t load_base, store_base;  // offsets in the rings' stage 0
  uint32_t sel_even, sel_odd;      // byte_perm selectors of the stmatrix registers 0, 2 / 1, 3

  __host__ __device__ explicit Fp8TransposeMap(int t) {
    const int lane = t % 32, warp = t / 32;
    load_base = uint32_t(LayoutV{}(LoadKey(lane, warp), LoadDim(lane), 0));
    store_base = uint32_t(LayoutVt{}(StoreDim(lane), 16 * warp, 0));
    sel_even = lane < 16 ? 0x6420u : 0x7531u;  // dim 2r, or 2r + 1 swapped
    sel_odd = lane < 16 ? 0x7531u : 0x6420u;
  }
  __host__ __device__ static constexpr uint32_t LoadConstant(int it) {
    return uint32_t(LayoutV{}(Key0(it), Dim0(it), 0));
  }
  __host__ __device__ static constexpr uint32_t StoreConstant(int it) {
    return uint32_t(LayoutVt{}(Dim0(it), Key0(it), 0));
  }
  __host__ __device__ uint32_t Load(int it) const { return load_base ^ LoadConstant(it); }
  __host__ __device__ uint32_t Store(int it) const { return store_base ^ StoreConstant(it); }
  // The stage offsets, added to the rings' addresses once (a stage is the layouts' last mode).
  __host__ __device__ static uint32_t LoadStage(int stage) {
    return uint32_t(LayoutV{}(0, 0, stage));
  }
  __host__ __device__ static uint32_t StoreStage(int stage) {
    return uint32_t(LayoutVt{}(0, 0, stage));
  }
};

// The stmatrix registers of one block from its four ldmatrix registers (matrices: keys +0 / +8
// x bytes +0 / +16). BytePerm: __byte_perm, spelled out for the host replay.
__host__ __device__ inline uint32_t BytePerm(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, s);
#else
  const uint64_t x = uint64_t(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t(x >> (8 * ((s >> (4 * i)) & 7)) & 0xff) << (8 * i);
  return r;
#endif
}
__host__ __device__ inline void TransposeBlock(const uint32_t (&d)[4], uint32_t sel_even,
                                               uint32_t sel_odd, uint32_t (&w)[4]) {
  w[0] = BytePerm(d[0], d[1], sel_even);
  w[1] = BytePerm(d[0], d[1], sel_odd);
  w[2] = BytePerm(d[2], d[3], sel_even);
  w[3] = BytePerm(d[2], d[3], sel_odd);
}

// V^T of one staged V tile by the 128 threads of the producer warpgroup (Fp8TransposeMap); the
// caller fences and signals. v_smem / vt_smem: the `v` and `vt` rings as shared-window addresses.
template <typename Cfg, typename LayoutV = typename Cfg::SmemLayoutKV>
__device__ __forceinline__ void TransposeV(uint32_t v_smem, uint32_t vt_smem, int stage, int t) {
  using Map = Fp8TransposeMap<Cfg, LayoutV>;
  const Map map(t);
  const uint32_t v_stage = v_smem + Map::LoadStage(stage);
  const uint32_t vt_stage = vt_smem + Map::StoreStage(stage);
  // Each address is the ring stage's address + (the lane's offset XOR the block's constant),
  // formed inside the asm: the compiler would otherwise hoist all 2 x kPerThread of them out of
  // the producer's tile loop and spill. The XOR applies to the offset within the stage only: on
  // the whole address it flips bits of the ring's own address (the first GPU run of this
  // transpose, XORing v_smem + offset, read and wrote other bytes: every fp8 test failed).
#pragma unroll
  for (int it = 0; it < Map::kPerThread; ++it) {
    uint32_t d[4], w[4];
    asm volatile(
        "{\n .reg .b32 a;\n xor.b32 a, %4, %5;\n add.u32 a, a, %6;\n"
        " ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [a];\n}\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(map.load_base), "r"(Map::LoadConstant(it)), "r"(v_stage));
    TransposeBlock(d, map.sel_even, map.sel_odd, w);
    asm volatile(
        "{\n .reg .b32 a;\n xor.b32 a, %0, %1;\n add.u32 a, a, %2;\n"
        " stmatrix.sync.aligned.m8n8.x4.shared.b16 [a], {%3, %4, %5, %6};\n}\n"
        ::"r"(map.store_base), "r"(Map::StoreConstant(it)), "r"(vt_stage), "r"(w[0]), "r"(w[1]),
        "r"(w[2]), "r"(w[3]));
  }
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
