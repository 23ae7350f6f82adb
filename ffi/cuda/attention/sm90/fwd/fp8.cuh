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

// First key of V^T's 4-column block kb (Fp8KeyOfColumn(4 kb)); its +1, +8, +9 follow. A bit
// placement (kb bits 0, 1 -> key bits 1, 2; kb bits 2.. -> key bits 4..), so it commutes with
// XOR: Fp8KeyOfBlock(a ^ b) == Fp8KeyOfBlock(a) ^ Fp8KeyOfBlock(b).
__host__ __device__ constexpr uint32_t Fp8KeyOfBlock(uint32_t kb) {
  return 16 * (kb >> 2) + 2 * (kb & 3);
}

// TransposeV's share of thread t (of the 128 producer threads): block `it` (< kPerThread) is
// the 4 x 4 bytes V(Fp8KeyOfBlock(kb) + {0, 1, 8, 9}, 4 db + {0..3}) -> V^T(4 db + {0..3},
// 4 kb + {0..3}), as byte offsets into the `v` / `vt` rings (their CuTe layouts). Load i reads
// V row key + KeyStep(i ^ LoadSwap()), store j writes V^T row 4 db + (j ^ Swap()).
// __host__ too: tools/check_fp8_transpose.cu replays the map on the host against the layouts
// and counts the smem banks of every warp access.
// Three shapes have a lane -> block map under which a warp's 32 loads, and its 32 stores, each
// fall in 32 distinct banks (bank bits from the swizzles: 128-byte, 16-byte chunk ^= row % 8;
// 64-byte, chunk ^= (row / 2) % 4; r: the row a lane's access hits):
// - hd128, 128 keys (V and V^T rows of 128 bytes): load (db0, db1, db2 ^ r0, db3 ^ kb0,
//   db4 ^ kb1), store (kb0, kb1, kb2 ^ r0, kb3 ^ r1, kb4 ^ db0), one-to-one in the lane under
//   db = (l0, l1, l2, l3 ^ l2, l4 ^ l3), kb = (l2, l3, l4, l0, l1 ^ l0).
// - hd128, 192 keys (V^T rows of 192 bytes, 64-byte atoms): store (kb0, kb1, kb2 ^ r1,
//   kb3 ^ db0, r0), row bit 0 a bank bit: db = lane, kb = (l1, l2, l3, l0 ^ l4), Swap() = l0.
// - hd64, 128 keys (V rows of 64 bytes, 64-byte atoms): load (db0, db1, db2 ^ kb0, db3 ^ kb1,
//   r0), row bit 0 a bank bit: db = lane % 16, kb = (l0, l1, l2, l3, l4 ^ l0), LoadSwap() = l4.
// Each lane's db is fixed, and its key blocks kb_t ^ c run over all 32 (192 keys: and 32 + the
// 16 of (kb_t mod 16) ^ c') as c = kLow warp + it (c' = 4 warp + it - 8) over the warps and
// steps (hd64: the two lanes of a db split them by kb bit 4). Both layouts are XOR-linear in
// the (row, column) bits a step changes (powers of two under a swizzle), so each offset is the
// thread's base offset (one for the first 32 key blocks, one for the rest) XOR a constant of
// `it` and i / j: one LOP3 an address once the loop is unrolled, where evaluating the swizzled
// layout per access cost ~10. Other shapes go in plain order, their offsets from the layouts.
template <typename Cfg>
struct Fp8TransposeMap {
  using LayoutV = typename Cfg::SmemLayoutKV;      // [keys, head dim, stage], bytes
  using LayoutVt = typename Cfg::SmemLayoutVtFp8;  // [head dim, keys, stage], bytes
  static constexpr int kKeyBlocks = Cfg::kBlockN / 4, kDimBlocks = Cfg::kHeadDim / 4;
  static constexpr int kPerThread = kKeyBlocks * kDimBlocks / 128;
  static_assert(kKeyBlocks * kDimBlocks % 128 == 0 && Cfg::kBlockN % 16 == 0);
  static constexpr bool kWide = kDimBlocks == 32 && kKeyBlocks == 48;   // hd128, 192 keys
  static constexpr bool kNarrow = kDimBlocks == 16 && kKeyBlocks == 32;  // hd64, 128 keys
  static constexpr bool kMapped = (kDimBlocks == 32 && kKeyBlocks == 32) || kWide || kNarrow;
  static constexpr int kLow = kNarrow ? 4 : 8;  // mapped: steps over the first 32 key blocks
  // Row of load i past the block's first key: 0, 1, 8, 9.
  __host__ __device__ static constexpr uint32_t KeyStep(int i) { return (i & 1) | (i & 2) << 2; }

  uint32_t kb0, db0;       // mapped: step 0's block of this thread; plain: kb0 is the thread
  uint32_t load0, store0;  // mapped: step 0's offsets (load 0, store 0)
  uint32_t load8, store8;  // mapped, 192 keys: step 8's (the first past the 32 key blocks)
  uint32_t swap;           // mapped, 192 keys: lane bit 0
  uint32_t load_swap;      // mapped, hd64: lane bit 4
  int stage;

  __host__ __device__ Fp8TransposeMap(int t, int stage_) : stage(stage_) {
    if constexpr (kMapped) {
      const uint32_t l = uint32_t(t) % 32, warp = uint32_t(t) / 32;
      const uint32_t l0 = l & 1, l1 = (l >> 1) & 1, l2 = (l >> 2) & 1, l3 = (l >> 3) & 1,
                     l4 = l >> 4;
      uint32_t kb_lane;
      load_swap = 0;
      if constexpr (kWide) {
        db0 = l;
        kb_lane = l1 | l2 << 1 | l3 << 2 | (l0 ^ l4) << 3;
        swap = l0;
      } else if constexpr (kNarrow) {
        db0 = l % 16;
        kb_lane = l % 16 | (l4 ^ l0) << 4;
        swap = 0;
        load_swap = l4;
      } else {
        db0 = l0 | l1 << 1 | l2 << 2 | (l3 ^ l2) << 3 | (l4 ^ l3) << 4;
        kb_lane = l2 | l3 << 1 | l4 << 2 | l0 << 3 | (l1 ^ l0) << 4;
        swap = 0;
      }
      kb0 = kb_lane ^ (warp * kLow);
      load0 = uint32_t(LayoutV{}(int(Fp8KeyOfBlock(kb0) ^ KeyStep(int(load_swap))),
                                 int(4 * db0), stage));
      store0 = uint32_t(LayoutVt{}(int(4 * db0 + swap), int(4 * kb0), stage));
      const uint32_t kb8 = 32 + ((kb_lane % 16) ^ (warp * 4));
      load8 = kWide ? uint32_t(LayoutV{}(int(Fp8KeyOfBlock(kb8)), int(4 * db0), stage)) : 0;
      store8 = kWide ? uint32_t(LayoutVt{}(int(4 * db0 + swap), int(4 * kb8), stage)) : 0;
    } else {
      kb0 = uint32_t(t);
      db0 = load0 = store0 = load8 = store8 = swap = load_swap = 0;
    }
  }
  __host__ __device__ uint32_t Swap() const { return swap; }
  __host__ __device__ uint32_t LoadSwap() const { return load_swap; }
  __host__ __device__ uint32_t Load(int it, int i) const {
    if constexpr (kMapped) {
      const uint32_t c = uint32_t(it < kLow ? it : it - kLow);
      return (it < kLow ? load0 : load8) ^
             uint32_t(LayoutV{}(int(Fp8KeyOfBlock(c) ^ KeyStep(i)), 0, 0));
    } else {
      const uint32_t b = kb0 + 128 * uint32_t(it), kb = b % kKeyBlocks, db = b / kKeyBlocks;
      return uint32_t(LayoutV{}(int(Fp8KeyOfBlock(kb) + KeyStep(i)), int(4 * db), stage));
    }
  }
  __host__ __device__ uint32_t Store(int it, int j) const {
    if constexpr (kMapped) {
      const uint32_t c = uint32_t(it < kLow ? it : it - kLow);
      return (it < kLow ? store0 : store8) ^ uint32_t(LayoutVt{}(j, int(4 * c), 0));
    } else {
      const uint32_t b = kb0 + 128 * uint32_t(it), kb = b % kKeyBlocks, db = b / kKeyBlocks;
      return uint32_t(LayoutVt{}(int(4 * db) + j, int(4 * kb), stage));
    }
  }
};

// The 4 x 4 byte transpose of one block: r[i] holds V row key + Fp8TransposeMap::KeyStep(i ^
// load_swap) (4 head-dim bytes); word j of the result is V^T row 4 db + (j ^ swap) (4 key bytes,
// in Fp8KeyOfColumn's order). BytePerm: __byte_perm, spelled out for the host replay.
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
__host__ __device__ inline void TransposeBlock4x4(const uint32_t (&r)[4], uint32_t load_swap,
                                                  uint32_t swap, uint32_t (&w)[4]) {
  // r[i] holds key + KeyStep(i ^ load_swap): with load_swap the operands of each pair come
  // swapped, and so do the selectors' operand halves (nibble ^ 4).
  const uint32_t lo = load_swap ? 0x1504 : 0x5140, hi = load_swap ? 0x3726 : 0x7362;
  // 0x5410 takes the low halves of the (lo, hi) pairs (rows 4 db + 0 and + 2), 0x7632 the high
  // halves (rows + 1 and + 3); swap exchanges them.
  const uint32_t even = swap ? 0x7632 : 0x5410, odd = swap ? 0x5410 : 0x7632;
  const uint32_t lo01 = BytePerm(r[0], r[1], lo), lo23 = BytePerm(r[2], r[3], lo);
  const uint32_t hi01 = BytePerm(r[0], r[1], hi), hi23 = BytePerm(r[2], r[3], hi);
  w[0] = BytePerm(lo01, lo23, even);
  w[1] = BytePerm(lo01, lo23, odd);
  w[2] = BytePerm(hi01, hi23, even);
  w[3] = BytePerm(hi01, hi23, odd);
}

// V^T of one staged V tile: Vt(d, k, stage) = V(Fp8KeyOfColumn(k), d, stage), by the 128
// threads of the producer warpgroup (Fp8TransposeMap's blocks: four 32-bit loads, eight byte
// permutes, four 32-bit stores each); the caller fences and signals. v_smem / vt_smem: the `v`
// and `vt` rings as shared-window addresses, so that the accesses are LDS / STS on 32-bit
// offsets: through CuTe's swizzled smem pointers they compiled to generic LD.E / ST.E with the
// swizzle applied to 64-bit addresses (107 instructions a block against 32 now, SASS).
template <typename Cfg>
__device__ __forceinline__ void TransposeV(uint32_t v_smem, uint32_t vt_smem, int stage, int t) {
  using Map = Fp8TransposeMap<Cfg>;
  const Map map(t, stage);
  // Unrolled, the mapped offsets are constants; the plain form (hd256) stays rolled: its
  // offsets come from the layouts per access either way, and unrolled (hd64's before its map)
  // it spilled the producer.
#pragma unroll(Map::kMapped ? Map::kPerThread : 1)
  for (int it = 0; it < Map::kPerThread; ++it) {
    uint32_t r[4], w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r[i]) : "r"(v_smem + map.Load(it, i)));
    TransposeBlock4x4(r, map.LoadSwap(), map.Swap(), w);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(vt_smem + map.Store(it, j)), "r"(w[j]));
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
