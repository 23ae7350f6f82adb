// Portable flash attention forward (sm_80+): tensor-core mma.sync m16n8k16 on bf16/fp16 with float32
// accumulators, online softmax in the log2 domain, K/V tiles double-buffered in shared memory with
// cp.async. One kernel for dense, varlen and paged KV: every key row is gathered through
// AttentionParams (KeyRow), so a paged call costs one page-table read per key row and nothing else.
//
// fp8 operands (kFp8: e4m3 V, K and q as AttentionParams says; LaunchFlashFwdFp8) take the
// same ldmatrix / mma path in T = bf16 or fp16: their bytes land in a ring of their own and are
// widened into the 16-bit tiles before the tile's mma, and the descales join the score scale
// (q_descale * k_descale) and the output (v_descale) where the CPU kernel applies them.
//
// Parts, in the order the kernel uses them:
//   FlashConfig   tile sizes and the shared-memory plan (why each size: see the comments there)
//   LoadQ/LoadKV  global -> shared staging with zero fill (padding rows, features past d, masked keys)
//   LoadQFp8/LoadKVFp8/WidenTile  the same for fp8 operands: e4m3 bytes, widened into the tiles
//   (LoadQ and LoadQFp8 share the walk StageQ; LoadKV keeps its own loop, as a shared walk for
//   K/V changed the 16-bit kernels' SASS under -lineinfo)
//   the kernel    QK^T -> mask/softcap -> online softmax -> PV, then the epilogue that merges the
//                 warps' partial rows, normalizes and writes out + lse (or the split-KV partials).
// Included only by the generated instantiation files (instantiations/), one per dtype x head dim.
#pragma once

#include <cstdint>

#include "ffi/common/attention_seq.h"
#include "ffi/common/attention_sink.h"
#include "ffi/cuda/attention/common/e4m3.cuh"
#include "ffi/cuda/attention/common/mma.cuh"
#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/common/row_scores.cuh"
#include "ffi/cuda/attention/flash_fwd_launch.h"

namespace jax_sgl::cuda {
namespace flash {

template <int kD, bool kDecode, bool kFp8 = false>
struct FlashConfig {
  static_assert(kD % 32 == 0, "head-dim capacity must split into 4 x 16-byte chunks");
  static constexpr int kThreads = 128;
  // Prefill: 4 warps stacked along rows (64 packed rows) reuse each K/V tile 64 times. Decode has
  // at most 16 packed rows, so the 4 warps split the key block instead and all stay busy.
  static constexpr int kWarpsM = kDecode ? 1 : 4;
  static constexpr int kWarpsN = kDecode ? 4 : 1;
  static constexpr int kBlockM = 16 * kWarpsM;
  // Keys per warp: 64 keeps the S tile at 32 registers; head dims > 128 halve it so the float32
  // output accumulator (kD / 2 registers) still fits without spills. Decode warps take 16 keys
  // each (one k-step of the PV mma), 64 per tile.
  static constexpr int kWarpN = kDecode ? 16 : (kD <= 128 ? 64 : 32);
  static constexpr int kBlockN = kWarpN * kWarpsN;
  // Shared rows are padded by one 16-byte chunk: 8 consecutive rows then start in 8 different
  // bank groups, so ldmatrix is conflict-free without a swizzle (and kD = 96, 192 work too).
  static constexpr int kStride = kD + 8;
  static constexpr int kChunks = kD / 8;           // 16-byte chunks per row
  static constexpr int kChunksPerThread = kChunks / 4;  // 4 threads per row when staging
  static constexpr int kRowsPerPass = kThreads / 4;

  static constexpr int kQBytes = kBlockM * kStride * 2;
  static constexpr int kTileBytes = kBlockN * kStride * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K then V
  // The fp8 form's plan (kFp8; 84 KiB at kD = 128 against 85 for 16 bits, so two CTAs per SM
  // stay resident and sm_86 / sm_89's 99 KiB per block holds every capacity): V, always e4m3, is
  // widened into one 16-bit tile, as is an e4m3 K (into K tile 0), since a tile's widening
  // follows the barrier after the previous tile's mma; a 16-bit K (v_dequant) is cp.async'd
  // into both K tiles as in the 16-bit kernel. e4m3 bytes land in rings of kBlockN x kD bytes
  // (unpadded: WidenTile reads them with 8-byte loads, consecutive threads consecutive chunks):
  // K's two stages inside K tile 1, V's two behind the key flags.
  static constexpr int kKStageBytes = kFp8 ? kTileBytes : kStageBytes;  // K tile st to st + 1
  static constexpr int kVStageBytes = kFp8 ? 0 : kStageBytes;       // V tile st to st + 1
  static constexpr int kVTileOffset = kFp8 ? 2 * kTileBytes : kTileBytes;  // past stage st's start
  static constexpr int kFlagsOffset =
      kFp8 ? kQBytes + 3 * kTileBytes : kQBytes + 2 * kStageBytes;
  static constexpr int kRawTileBytes = kFp8 ? kBlockN * kD : 0;
  static constexpr int kRawKOffset = kQBytes + kTileBytes;
  static constexpr int kRawVOffset = kFlagsOffset + 2 * kBlockN;  // + key-valid flags per stage
  static constexpr int kMainBytes = kRawVOffset + 2 * kRawTileBytes;
  static_assert(2 * kRawTileBytes <= kTileBytes, "K's byte ring must fit in one 16-bit tile");
  // Epilogue (reuses the same memory): float32 rows per warp column + per-row m, l, lse.
  static constexpr int kOStride = kD + 4;
  static constexpr int kOBytes = kWarpsN * kBlockM * kOStride * 4;
  static constexpr int kEpiBytes = kOBytes + (2 * kWarpsN + 1) * kBlockM * 4;
  static constexpr int kSmemBytes = kMainBytes > kEpiBytes ? kMainBytes : kEpiBytes;
  static_assert(kBlockN % kRowsPerPass == 0, "key tile must be a whole number of staging passes");
};

// Walks the CTA's packed q rows [m0, m0 + kBlockM) as the staging threads share them (4 per row,
// 8-element chunks tc, tc + 4, ...): copy(dst, src, ok) for each chunk, src a chunk of q (of
// element type Src) or, where !ok (rows past `rows`, features past d: zeros), q itself.
template <typename Src, typename T, typename Cfg, typename Copy>
__device__ __forceinline__ void StageQ(const AttentionParams& p, const SeqBounds& s, int kv_head,
                                       int group, int m0, int rows, T* sq, Copy copy) {
  const Src* q = static_cast<const Src*>(p.q);
  const int tr = threadIdx.x / 4, tc = threadIdx.x % 4;
  for (int r = tr; r < Cfg::kBlockM; r += Cfg::kRowsPerPass) {
    const bool row_ok = m0 + r < rows;
    const Src* src = q;
    if (row_ok) {
      const PackedRow pr = Unpack(s, kv_head, group, m0 + r);
      src = q + (pr.q_row * p.num_heads + pr.head) * p.head_dim;
    }
#pragma unroll
    for (int i = 0; i < Cfg::kChunksPerThread; ++i) {
      const int c = tc + 4 * i;
      const bool ok = row_ok && c * 8 < p.head_dim;
      copy(sq + r * Cfg::kStride + c * 8, ok ? src + c * 8 : q, ok);
    }
  }
}

// Stages the CTA's packed q rows; rows past `rows` and features past d are 0.
template <typename T, typename Cfg>
__device__ __forceinline__ void LoadQ(const AttentionParams& p, const SeqBounds& s, int kv_head,
                                      int group, int m0, int rows, T* sq) {
  StageQ<T, T, Cfg>(p, s, kv_head, group, m0, rows, sq, [](T* dst, const T* src, bool ok) {
    CpAsync16(dst, src, ok ? 16 : 0);
  });
}

// Stages keys [n0, n0 + kBlockN) of the K and V tiles; keys at or past n_end and keys whose page
// entry is out of range are zero rows with flag 0 (the mask reads the flags).
template <typename T, typename Cfg>
__device__ __forceinline__ void LoadKV(const AttentionParams& p, int b, const SeqBounds& s,
                                       int kv_head, int n0, int n_end, T* sk, T* sv,
                                       uint8_t* flags) {
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  // This kv head's column of K and V; rows follow at the params' row strides (attention_params.h).
  const T* k_head = k + kv_head * p.k_head_stride;
  const T* v_head = v + kv_head * p.v_head_stride;
  const int tr = threadIdx.x / 4, tc = threadIdx.x % 4;
#pragma unroll
  for (int r = tr; r < Cfg::kBlockN; r += Cfg::kRowsPerPass) {
    const int j = n0 + r;
    const int64_t row = j < n_end ? KeyRow(p, b, s, j) : -1;
    const bool ok = row >= 0;
    const T* ksrc = ok ? k_head + row * p.k_row_stride : k;
    const T* vsrc = ok ? v_head + row * p.v_row_stride : v;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksPerThread; ++i) {
      const int c = tc + 4 * i;
      const bool kok = ok && c * 8 < p.head_dim, vok = ok && c * 8 < p.head_dim_v;
      CpAsync16(sk + r * Cfg::kStride + c * 8, kok ? ksrc + c * 8 : k, kok ? 16 : 0);
      CpAsync16(sv + r * Cfg::kStride + c * 8, vok ? vsrc + c * 8 : v, vok ? 16 : 0);
    }
    if (tc == 0) flags[r] = ok;
  }
}

// LoadQ for e4m3 q: 8 bytes per chunk, widened to T on the way into shared memory (once per CTA,
// so plain loads; the zero chunks need no load).
template <typename T, typename Cfg>
__device__ __forceinline__ void LoadQFp8(const AttentionParams& p, const SeqBounds& s, int kv_head,
                                         int group, int m0, int rows, T* sq) {
  StageQ<uint8_t, T, Cfg>(p, s, kv_head, group, m0, rows, sq,
                          [](T* dst, const uint8_t* src, bool ok) {
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (ok) w = E4m3x8To<T>(*reinterpret_cast<const uint2*>(src));
    *reinterpret_cast<uint4*>(dst) = w;
  });
}

// LoadKV for an e4m3 V and a K that is e4m3 (k_fp8: into the byte ring rk, widened later) or T
// (straight into sk, as LoadKV): 8-byte copies of the bytes, so K/V row and head strides of 8
// elements do (fwd_dispatch.cc CheckPortableFp8).
template <typename T, typename Cfg>
__device__ __forceinline__ void LoadKVFp8(const AttentionParams& p, int b, const SeqBounds& s,
                                          int kv_head, int n0, int n_end, bool k_fp8, T* sk,
                                          uint8_t* rk, uint8_t* rv, uint8_t* flags) {
  const int k_elem = k_fp8 ? 1 : int(sizeof(T));
  const char* k = static_cast<const char*>(p.k);
  const uint8_t* v = static_cast<const uint8_t*>(p.v);
  const char* k_head = k + kv_head * p.k_head_stride * k_elem;
  const uint8_t* v_head = v + kv_head * p.v_head_stride;
  const int tr = threadIdx.x / 4, tc = threadIdx.x % 4;
#pragma unroll
  for (int r = tr; r < Cfg::kBlockN; r += Cfg::kRowsPerPass) {
    const int j = n0 + r;
    const int64_t row = j < n_end ? KeyRow(p, b, s, j) : -1;
    const bool ok = row >= 0;
    const char* ksrc = ok ? k_head + row * p.k_row_stride * k_elem : k;
    const uint8_t* vsrc = ok ? v_head + row * p.v_row_stride : v;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksPerThread; ++i) {
      const int c = tc + 4 * i;
      const bool kok = ok && c * 8 < p.head_dim, vok = ok && c * 8 < p.head_dim_v;
      if (k_fp8)
        CpAsync8(rk + r * (Cfg::kChunks * 8) + c * 8, kok ? ksrc + c * 8 : k, kok ? 8 : 0);
      else
        CpAsync16(sk + r * Cfg::kStride + c * 8, kok ? ksrc + c * 16 : k, kok ? 16 : 0);
      CpAsync8(rv + r * (Cfg::kChunks * 8) + c * 8, vok ? vsrc + c * 8 : v, vok ? 8 : 0);
    }
    if (tc == 0) flags[r] = ok;
  }
}

// A landed byte tile [kBlockN][kD] of e4m3 widened into the 16-bit tile dst (kStride rows).
template <typename T, typename Cfg>
__device__ __forceinline__ void WidenTile(const uint8_t* raw, T* dst) {
  constexpr int kD = Cfg::kChunks * 8;
#pragma unroll
  for (int idx = threadIdx.x; idx < Cfg::kBlockN * Cfg::kChunks; idx += Cfg::kThreads) {
    const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
    const uint2 w = *reinterpret_cast<const uint2*>(raw + r * kD + c * 8);
    *reinterpret_cast<uint4*>(dst + r * Cfg::kStride + c * 8) = E4m3x8To<T>(w);
  }
}

// grid: x = packed-row blocks, y = KV splits, z = batch * num_kv_heads. 128 threads.
template <typename T, int kD, bool kDecode, bool kFp8 = false>
__global__ void __launch_bounds__(128) FlashFwdKernel(const FlashFwdArgs args) {
  using Cfg = FlashConfig<kD, kDecode, kFp8>;
  constexpr int kNT = Cfg::kWarpN / 8;  // n8 tiles of S per warp
  constexpr int kDT = kD / 8;           // n8 tiles of the output per warp
  extern __shared__ __align__(16) uint8_t smem[];
  const AttentionParams& p = args.p;
  const int group = args.group;
  const int b = blockIdx.z / p.num_kv_heads, kv_head = blockIdx.z % p.num_kv_heads;
  const SeqBounds s = GetSeqBounds(p, b);
  const int rows = s.q_len * group;
  const int m0 = blockIdx.x * Cfg::kBlockM;
  if (m0 >= rows) return;

  // Keys this CTA may need: rows' ranges are monotone in the query row, so the union runs from
  // the first row's start to the last row's end. This split takes an even share of its blocks.
  int n_lo, n_hi, unused;
  KeyRange(p, s, m0 / group, &n_lo, &unused);
  KeyRange(p, s, (min(m0 + Cfg::kBlockM, rows) - 1) / group, &unused, &n_hi);
  const int n_blocks = n_hi > n_lo ? (n_hi - n_lo + Cfg::kBlockN - 1) / Cfg::kBlockN : 0;
  const int per_split = (n_blocks + args.num_splits - 1) / args.num_splits;
  const int blk_begin = min(n_blocks, int(blockIdx.y) * per_split);
  const int blk_end = min(n_blocks, blk_begin + per_split);

  T* sq = reinterpret_cast<T*>(smem);
  // kFp8: whether K is e4m3 too (fp8 q/k/v, the fp8 KV cache) or T (v_dequant).
  const bool k_fp8 = kFp8 && p.k_type == DType::kF8E4M3;
  auto stage_k = [&](int st) {
    return reinterpret_cast<T*>(smem + Cfg::kQBytes + (k_fp8 ? 0 : st) * Cfg::kKStageBytes);
  };
  auto stage_v = [&](int st) {
    return reinterpret_cast<T*>(smem + Cfg::kQBytes + st * Cfg::kVStageBytes + Cfg::kVTileOffset);
  };
  auto stage_flags = [&](int st) { return smem + Cfg::kFlagsOffset + st * Cfg::kBlockN; };
  auto raw_k = [&](int st) { return smem + Cfg::kRawKOffset + st * Cfg::kRawTileBytes; };
  auto raw_v = [&](int st) { return smem + Cfg::kRawVOffset + st * Cfg::kRawTileBytes; };
  auto load_kv = [&](int n0, int st) {
    if constexpr (kFp8)
      LoadKVFp8<T, Cfg>(p, b, s, kv_head, n0, n_hi, k_fp8, stage_k(st), raw_k(st), raw_v(st),
                        stage_flags(st));
    else
      LoadKV<T, Cfg>(p, b, s, kv_head, n0, n_hi, stage_k(st), stage_v(st), stage_flags(st));
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % Cfg::kWarpsM, wn = warp / Cfg::kWarpsM;
  // Warps whose 16 rows are all padding only help with the loads.
  const bool warp_active = m0 + wm * 16 < rows;

  // This thread's two rows (lane / 4 and lane / 4 + 8 of the warp's 16) and their key ranges.
  RowScores scoring(p, s, group, m0 + wm * 16, rows, 0, lane);
  if constexpr (kFp8)
    scoring.ScaleBy(p.q_descale.At(b, kv_head) * p.k_descale.At(b, kv_head));

  float o[kDT][4];
#pragma unroll
  for (int t = 0; t < kDT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  if (kFp8 && p.q_type == DType::kF8E4M3)
    LoadQFp8<T, Cfg>(p, s, kv_head, group, m0, rows, sq);
  else
    LoadQ<T, Cfg>(p, s, kv_head, group, m0, rows, sq);
  if (blk_begin < blk_end) load_kv(n_lo + blk_begin * Cfg::kBlockN, 0);
  CpAsyncCommit();

  for (int blk = blk_begin; blk < blk_end; ++blk) {
    const int st = (blk - blk_begin) & 1;
    const int n0 = n_lo + blk * Cfg::kBlockN;
    // Tile blk has landed, and every warp is done with the other stage: refill it.
    CpAsyncWaitAll();
    __syncthreads();
    if (blk + 1 < blk_end) load_kv(n0 + Cfg::kBlockN, st ^ 1);
    CpAsyncCommit();
    if constexpr (kFp8) {
      // Tile blk's bytes into the 16-bit tiles (free: their last reader, tile blk - 1's mma,
      // finished before the barrier above).
      if (k_fp8) WidenTile<T, Cfg>(raw_k(st), stage_k(st));
      WidenTile<T, Cfg>(raw_v(st), stage_v(st));
      __syncthreads();
    }
    if (!warp_active) continue;

    const T* sk = stage_k(st) + wn * Cfg::kWarpN * Cfg::kStride;
    const T* sv = stage_v(st) + wn * Cfg::kWarpN * Cfg::kStride;
    const uint8_t* flags = stage_flags(st) + wn * Cfg::kWarpN;

    // S = Q K^T for the warp's 16 rows x kWarpN keys.
    float sc[kNT][4];
#pragma unroll
    for (int t = 0; t < kNT; ++t) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < kD; k0 += 16) {
      uint32_t a[4];
      Ldmatrix4(a, sq + (wm * 16 + lane % 16) * Cfg::kStride + k0 + (lane / 16) * 8);
#pragma unroll
      for (int t = 0; t < kNT; t += 2) {
        uint32_t bk[4];
        Ldmatrix4(bk, sk + (t * 8 + lane % 8 + (lane / 16) * 8) * Cfg::kStride + k0 +
                          ((lane / 8) % 2) * 8);
        Elem<T>::Mma(sc[t], a, bk);
        Elem<T>::Mma(sc[t + 1], a, bk + 2);
      }
    }

    // Scale (+ softcap) into the log2 domain, mask, and the online-softmax update.
    const int key0 = n0 + wn * Cfg::kWarpN;
    float blk_max[2];
    scoring.MaskAndMax(sc, key0, lane, [flags](int c) -> bool { return flags[c]; }, blk_max);
    float corr[2], m_use[2];
    UpdateRowMax(m_run, blk_max, m_use, corr);
    float row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(sc[t][e] - m_use[e / 2]);
        sc[t][e] = pe;
        row_sum[e / 2] += pe;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * corr[h] + row_sum[h];
    ScaleAccRows(o, corr);

    // O += P V: the S accumulators are already the A fragments of P (two n8 tiles per k16 step).
#pragma unroll
    for (int t = 0; t < kNT / 2; ++t) {
      uint32_t pa[4] = {Elem<T>::Pack(sc[2 * t][0], sc[2 * t][1]),
                        Elem<T>::Pack(sc[2 * t][2], sc[2 * t][3]),
                        Elem<T>::Pack(sc[2 * t + 1][0], sc[2 * t + 1][1]),
                        Elem<T>::Pack(sc[2 * t + 1][2], sc[2 * t + 1][3])};
#pragma unroll
      for (int dt = 0; dt < kDT; dt += 2) {
        uint32_t bv[4];
        Ldmatrix4Trans(bv, sv + (t * 16 + lane % 8 + ((lane / 8) % 2) * 8) * Cfg::kStride +
                               dt * 8 + (lane / 16) * 8);
        Elem<T>::Mma(o[dt], pa, bv);
        Elem<T>::Mma(o[dt + 1], pa, bv + 2);
      }
    }
  }
  CpAsyncWaitAll();

  // Epilogue. Each warp column holds (m, l, o) of its rows over its keys; merge them through
  // shared memory (a no-op merge when kWarpsN == 1), normalize, then write with 16-byte stores.
  __syncthreads();  // every warp is done with the K/V tiles the epilogue memory reuses
  float* so = reinterpret_cast<float*>(smem);
  float* sm = reinterpret_cast<float*>(smem + Cfg::kOBytes);  // [kWarpsN][kBlockM]
  float* sl = sm + Cfg::kWarpsN * Cfg::kBlockM;               // [kWarpsN][kBlockM]
  float* slse = sl + Cfg::kWarpsN * Cfg::kBlockM;             // [kBlockM]
  int r_loc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    r_loc[h] = wm * 16 + lane / 4 + 8 * h;
    l_run[h] = QuadSum(l_run[h]);
    if (lane % 4 == 0) {
      sm[wn * Cfg::kBlockM + r_loc[h]] = m_run[h];
      sl[wn * Cfg::kBlockM + r_loc[h]] = l_run[h];
    }
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < Cfg::kWarpsN; ++w) m_all = fmaxf(m_all, sm[w * Cfg::kBlockM + r_loc[h]]);
    float l_all = 0.f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < Cfg::kWarpsN; ++w)
        l_all += sl[w * Cfg::kBlockM + r_loc[h]] * exp2f(sm[w * Cfg::kBlockM + r_loc[h]] - m_all);
    }
    // Fully masked rows: out 0, lse -inf (the sink's logit with sinks). A split's partial leaves
    // the sink to the combine.
    const SinkedRow fin =
        ApplySinkOf(args.num_splits > 1 ? nullptr : p.sinks,
                    Unpack(s, kv_head, group, m0 + r_loc[h]).head,
                    l_all > 0.f ? (m_all + log2f(l_all)) * kLn2 : -INFINITY);
    f[h] = l_all > 0.f ? fin.scale * exp2f(m_run[h] - m_all) / l_all : 0.f;
    // v_descale is linear in the output, so each split's partial takes it before the combine.
    if constexpr (kFp8) f[h] *= p.v_descale.At(b, kv_head);
    if (wn == 0 && lane % 4 == 0) slse[r_loc[h]] = fin.lse;
  }
#pragma unroll
  for (int t = 0; t < kDT; ++t) {
    const int c = t * 8 + (lane % 4) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* dst = so + (wn * Cfg::kBlockM + r_loc[h]) * Cfg::kOStride + c;
      dst[0] = o[t][2 * h] * f[h];
      dst[1] = o[t][2 * h + 1] * f[h];
    }
  }
  __syncthreads();

  const bool split = args.num_splits > 1;
  const int dv = p.head_dim_v;
  for (int idx = threadIdx.x; idx < Cfg::kBlockM * Cfg::kChunks; idx += Cfg::kThreads) {
    const int r = idx / Cfg::kChunks, c = (idx % Cfg::kChunks) * 8;
    if (m0 + r >= rows || c >= dv) continue;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
    for (int w = 0; w < Cfg::kWarpsN; ++w) {
      const float4* src = reinterpret_cast<const float4*>(so + (w * Cfg::kBlockM + r) * Cfg::kOStride + c);
      const float4 x0 = src[0], x1 = src[1];
      acc[0] += x0.x; acc[1] += x0.y; acc[2] += x0.z; acc[3] += x0.w;
      acc[4] += x1.x; acc[5] += x1.y; acc[6] += x1.z; acc[7] += x1.w;
    }
    const PackedRow pr = Unpack(s, kv_head, group, m0 + r);
    const int64_t row_head = pr.q_row * p.num_heads + pr.head;
    if (split) {
      float4* dst = reinterpret_cast<float4*>(
          args.o_partial + ((int64_t(blockIdx.y) * p.total_q * p.num_heads) + row_head) * dv + c);
      dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
      uint4 packed;
      packed.x = Elem<T>::Pack(acc[0], acc[1]);
      packed.y = Elem<T>::Pack(acc[2], acc[3]);
      packed.z = Elem<T>::Pack(acc[4], acc[5]);
      packed.w = Elem<T>::Pack(acc[6], acc[7]);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row_head * dv + c) = packed;
    }
  }
  for (int r = threadIdx.x; r < Cfg::kBlockM; r += Cfg::kThreads) {
    if (m0 + r >= rows) continue;
    const PackedRow pr = Unpack(s, kv_head, group, m0 + r);
    if (split) {
      args.lse_partial[int64_t(blockIdx.y) * p.total_q * p.num_heads + pr.q_row * p.num_heads +
                       pr.head] = slse[r];
    } else {
      const int i = int(pr.q_row - s.q_row0);
      const int64_t idx = p.cu_seqlens_q ? int64_t(pr.head) * p.total_q + s.lse_row0 + i
                                         : (int64_t(b) * p.num_heads + pr.head) * p.seqlen_q + i;
      p.lse[idx] = slse[r];
    }
  }
}

}  // namespace flash

template <typename T, int kHeadDim, bool kDecode>
cudaError_t LaunchFlashFwd(const FlashFwdArgs& args, int m_blocks, cudaStream_t stream) {
  using Cfg = flash::FlashConfig<kHeadDim, kDecode>;
  const dim3 grid(m_blocks, args.num_splits, args.p.batch * args.p.num_kv_heads);
  return LaunchWithSmem(flash::FlashFwdKernel<T, kHeadDim, kDecode>, grid, Cfg::kThreads,
                        Cfg::kSmemBytes, stream, args);
}

// fp8 operands run the prefill warp layout only, whatever the rows: one instantiation per
// (T, head dim) keeps this general path's build small; decode-shaped fp8-KV calls have the
// fp8-KV decode kernels (fwd_dispatch.cc).
template <typename T, int kHeadDim>
cudaError_t LaunchFlashFwdFp8(const FlashFwdArgs& args, int m_blocks, cudaStream_t stream) {
  using Cfg = flash::FlashConfig<kHeadDim, false, true>;
  const dim3 grid(m_blocks, args.num_splits, args.p.batch * args.p.num_kv_heads);
  return LaunchWithSmem(flash::FlashFwdKernel<T, kHeadDim, false, true>, grid, Cfg::kThreads,
                        Cfg::kSmemBytes, stream, args);
}

template <typename T, int kHeadDim>
int FlashFwdFp8SmemBytes() {
  return flash::FlashConfig<kHeadDim, false, true>::kSmemBytes;
}

}  // namespace jax_sgl::cuda

// Instantiates one (storage type T, head dim D) of the launchers above (instantiations/).
#define JAX_SGL_INSTANTIATE_PREFILL_SM80(T, D)                                              \
  namespace jax_sgl::cuda {                                                                 \
  template cudaError_t LaunchFlashFwd<T, D, false>(const FlashFwdArgs&, int, cudaStream_t); \
  template cudaError_t LaunchFlashFwd<T, D, true>(const FlashFwdArgs&, int, cudaStream_t);  \
  }
#define JAX_SGL_INSTANTIATE_PREFILL_SM80_FP8(T, D)                                      \
  namespace jax_sgl::cuda {                                                             \
  template cudaError_t LaunchFlashFwdFp8<T, D>(const FlashFwdArgs&, int, cudaStream_t); \
  template int FlashFwdFp8SmemBytes<T, D>();                                            \
  }
