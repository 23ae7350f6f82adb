// Portable flash attention backward (sm_80+), FlashAttention-2 style: tensor-core mma.sync
// m16n8k16 on bf16/fp16 with float32 accumulators; P is recomputed from q, k and the forward's lse
// (kept in the log2 domain by the preprocess kernel), never stored. Two kernels per
// (dtype, head-dim capacity), both with their tiles staged by cp.async, double-buffered:
//   FlashBwdDkDvKernel  CTA = 128 keys (8 warps x 16) of one (sequence, kv head). It streams the
//                       packed q rows (query row x q head of the group) that can see its keys in
//                       steps of kBlockM and computes per warp, with the keys as the M dimension:
//                         S^T = K Q^T,  dP^T = V dO^T,  P^T = exp2(S^T - lse),
//                         dS^T = P^T (dP^T - D) (x softcap'),  dV += P^T dO,  dK += dS^T Q.
//                       dK and dV stay in registers; each key row is written once (no atomics).
//   FlashBwdDqKernel    CTA = 64 packed q rows (4 warps x 16) of one (sequence, kv head): the
//                       forward's loop with dP = dO V^T beside S and dQ += dS K in place of PV.
// The S/dP accumulators of one mma are laid out exactly as the A operand of the next (as P is in
// the forward), so P^T and dS^T go from registers into the second product without shared memory.
// The warp primitives (mma, ldmatrix, cp.async) are common/mma.cuh; the staging of Q / K / V tiles is
// the forward's (prefill_sm80/kernel.cuh).
// Included only by the generated instantiation files (instantiations/bwd_sm80_*.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ffi/common/attention_bwd_params.h"
#include "ffi/common/attention_seq.h"
#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/flash_bwd_launch.h"
#include "ffi/cuda/attention/prefill_sm80/kernel.cuh"

namespace jax_sgl::cuda {
namespace flash_bwd {

using flash::CpAsync16;
using flash::CpAsyncCommit;
using flash::CpAsyncWaitAll;
using flash::Elem;
using flash::kLog2e;
using flash::Ldmatrix4;
using flash::Ldmatrix4Trans;
using flash::PackedRow;
using flash::Unpack;

template <int kD>
struct DkDvConfig {
  static_assert(kD % 32 == 0 && kD <= 128, "dK + dV accumulators: 16 keys x kD x 2 per warp");
  // 8 warps x 16 keys: every staged q/dO tile serves 128 keys. Per warp the float32 dK and dV
  // accumulators take kD registers per thread (128 at kD = 128), which is why a warp owns only 16.
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kWarps;
  // Packed q rows per step: the S^T and dP^T tiles take kBlockM / 2 registers each; 32 rows keep
  // kD = 128 under 255 registers with no spills, 64 rows fit beside the smaller kD = 64 accumulators.
  static constexpr int kBlockM = kD <= 64 ? 64 : 32;
  static constexpr int kStride = kD + 8;  // one 16-byte pad per row: conflict-free ldmatrix
  static constexpr int kChunks = kD / 8;
  static constexpr int kKBytes = kBlockN * kStride * 2;      // K, then V
  static constexpr int kQBytes = kBlockM * kStride * 2;      // Q, then dO, per stage
  static constexpr int kRowInfoBytes = kBlockM * 16;         // lse2, D, lo, hi per stage
  static constexpr int kStageBytes = 2 * kQBytes + kRowInfoBytes;
  static constexpr int kSmemBytes = 2 * kKBytes + 2 * kStageBytes;
};

template <int kD>
struct DqConfig {
  static_assert(kD % 32 == 0 && kD <= 128, "dQ kernel tile plan");
  // The forward's prefill layout: 4 warps x 16 packed rows against 64-key tiles; per warp the dQ
  // accumulator takes kD / 2 registers, S and dP 32 each.
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = 64;
  static constexpr int kStride = kD + 8;
  static constexpr int kChunks = kD / 8;
  static constexpr int kQBytes = kBlockM * kStride * 2;      // Q, then dO
  static constexpr int kTileBytes = kBlockN * kStride * 2;   // K, then V, per stage
  static constexpr int kSmemBytes = 2 * kQBytes + 4 * kTileBytes;
};

// Stages kRows rows of kChunks 16-byte chunks at dst (row stride kStride elements) with
// cp.async; src(r) is row r's first element or nullptr for a zero row, and chunks at or past
// `width` elements are zero too. Consecutive threads take consecutive chunks of a row.
template <int kRows, int kChunks, int kStride, int kThreads, typename T, typename Src>
__device__ __forceinline__ void StageRows(T* dst, const T* any, int width, Src src) {
#pragma unroll 4
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const T* row = src(r);
    const bool ok = row != nullptr && c * 8 < width;
    CpAsync16(dst + r * kStride + c * 8, ok ? row + c * 8 : any, ok ? 16 : 0);
  }
}

// Writes a [kRows][kStride] tile of T from shared memory to global rows dst(r) (nullptr: skip),
// `width` elements each, with 16-byte stores.
template <int kRows, int kChunks, int kStride, int kThreads, typename T, typename Dst>
__device__ __forceinline__ void StoreRows(const T* src, int width, Dst dst) {
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    T* row = dst(r);
    if (row == nullptr || c * 8 >= width) continue;
    *reinterpret_cast<uint4*>(row + c * 8) =
        *reinterpret_cast<const uint4*>(src + r * kStride + c * 8);
  }
}

// Row r of the block of keys from key0 (row key0 + r of this sequence and kv head) in a
// [rows, num_kv_heads, width] tensor (k, v, dk, dv), or nullptr at or past key_end.
template <typename T>
__device__ __forceinline__ T* KeyRow(T* base, const AttentionParams& p, const SeqBounds& s,
                                     int kv_head, int width, int key0, int key_end, int r) {
  return key0 + r < key_end ? base + ((s.k_row0 + key0 + r) * p.num_kv_heads + kv_head) * width
                            : nullptr;
}

// Packed row m0 + r (query row x q head of kv_head's group) in a [rows, num_heads, width] tensor
// (q, dout, dq), or nullptr at or past m_end.
template <typename T>
__device__ __forceinline__ T* QRow(T* base, const AttentionParams& p, const SeqBounds& s,
                                   int kv_head, int group, int width, int m0, int m_end, int r) {
  if (m0 + r >= m_end) return nullptr;
  const PackedRow pr = Unpack(s, kv_head, group, m0 + r);
  return base + (pr.q_row * p.num_heads + pr.head) * width;
}

// acc[t] (16 x 8 tiles, t < kNT) += A B^T over kD features: A is 16 rows at sa, B is 8 * kNT rows
// at sb, both row-major in shared memory with row stride kStride.
template <typename T, int kNT, int kD, int kStride>
__device__ __forceinline__ void MmaABt(float (*acc)[4], const T* sa, const T* sb, int lane) {
#pragma unroll
  for (int k0 = 0; k0 < kD; k0 += 16) {
    uint32_t a[4];
    Ldmatrix4(a, sa + (lane % 16) * kStride + k0 + (lane / 16) * 8);
#pragma unroll
    for (int t = 0; t < kNT; t += 2) {
      uint32_t b[4];
      Ldmatrix4(b, sb + (t * 8 + lane % 8 + (lane / 16) * 8) * kStride + k0 + ((lane / 8) % 2) * 8);
      Elem<T>::Mma(acc[t], a, b);
      Elem<T>::Mma(acc[t + 1], a, b + 2);
    }
  }
}

// acc[dt] (16 x kD) += X B where X (16 x 8 * kNT) is held as mma accumulators x[t] (the layout
// of A fragments, two n8 tiles per k16 step) and B is 8 * kNT rows x kD at sb (row-major).
template <typename T, int kNT, int kD, int kStride>
__device__ __forceinline__ void MmaRegB(float (*acc)[4], const float (*x)[4], const T* sb,
                                        int lane) {
#pragma unroll
  for (int t = 0; t < kNT / 2; ++t) {
    const uint32_t a[4] = {Elem<T>::Pack(x[2 * t][0], x[2 * t][1]),
                           Elem<T>::Pack(x[2 * t][2], x[2 * t][3]),
                           Elem<T>::Pack(x[2 * t + 1][0], x[2 * t + 1][1]),
                           Elem<T>::Pack(x[2 * t + 1][2], x[2 * t + 1][3])};
#pragma unroll
    for (int dt = 0; dt < kD / 8; dt += 2) {
      uint32_t b[4];
      Ldmatrix4Trans(b, sb + (t * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dt * 8 +
                            (lane / 16) * 8);
      Elem<T>::Mma(acc[dt], a, b);
      Elem<T>::Mma(acc[dt + 1], a, b + 2);
    }
  }
}

// A warp's 16 x kD float accumulator (mma layout; tile rows warp * 16 + ...) as T into a shared
// tile of row stride kStride, each element times `scale` when kScaled.
template <typename T, int kD, int kStride, bool kScaled>
__device__ __forceinline__ void AccToTile(const float (*acc)[4], float scale, T* tile, int warp,
                                          int lane) {
#pragma unroll
  for (int t = 0; t < kD / 8; ++t) {
    const int c = t * 8 + (lane % 4) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + lane / 4 + 8 * h;
      const float x0 = acc[t][2 * h], x1 = acc[t][2 * h + 1];
      *reinterpret_cast<uint32_t*>(tile + r * kStride + c) =
          kScaled ? Elem<T>::Pack(x0 * scale, x1 * scale) : Elem<T>::Pack(x0, x1);
    }
  }
}

// The score math shared by both kernels, for one (packed q row, key) element: from the raw q.k
// and dO.v it gives P (written back into s) and dS without softmax_scale (written into dp):
//   x = scale s (softcapped: cap tanh(scale s / cap)), P = exp(x - lse), dS = P (dP - D) x'(s).
struct ScoreMath {
  float score_scale;  // log2(e) scale, or scale / cap under softcap
  float cap_log2;     // cap * log2(e)
  bool softcap;
  __device__ __forceinline__ void operator()(float& s, float& dp, bool visible, float lse2,
                                             float d) const {
    float x, deriv = 1.f;
    if (softcap) {
      const float t = tanhf(s * score_scale);
      x = cap_log2 * t;
      deriv = 1.f - t * t;
    } else {
      x = s * score_scale;
    }
    const float pr = visible ? exp2f(x - lse2) : 0.f;
    s = pr;
    dp = pr * (dp - d) * deriv;
  }
};

__device__ __forceinline__ ScoreMath MakeScoreMath(const AttentionParams& p) {
  ScoreMath m;
  m.softcap = p.softcap > 0.f;
  m.score_scale = m.softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  m.cap_log2 = p.softcap * kLog2e;
  return m;
}

// First query row i in [0, q_len) for which pred(i) holds; pred is monotone (false, then true).
template <typename Pred>
__device__ __forceinline__ int FirstRow(int q_len, Pred pred) {
  int lo = 0, hi = q_len;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (pred(mid)) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// grid: x = 128-key blocks, y = kv head, z = sequence. 256 threads.
template <typename T, int kD>
__global__ void __launch_bounds__(256, 1) FlashBwdDkDvKernel(const FlashBwdArgs args) {
  using Cfg = DkDvConfig<kD>;
  constexpr int kMT = Cfg::kBlockM / 8;  // n8 tiles of S^T per warp (q rows)
  constexpr int kDT = kD / 8;            // n8 tiles of dK / dV per warp
  extern __shared__ __align__(16) uint8_t smem[];
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  const int group = args.group;
  const int b = blockIdx.z, kv_head = blockIdx.y;
  const SeqBounds s = GetSeqBounds(p, b);
  const int n0 = blockIdx.x * Cfg::kBlockN;
  if (n0 >= s.k_len) return;
  const int n_end = min(n0 + Cfg::kBlockN, s.k_len);

  // Query rows that may see a key of [n0, n_end): both ends of a row's key range grow with the
  // row, so they lie between the first row whose range ends past n0 and the last one starting
  // before n_end (rows in between that see none of these keys are masked like any other).
  const int i_begin = FirstRow(s.q_len, [&](int i) {
    int lo, hi;
    KeyRange(p, s, i, &lo, &hi);
    return hi > n0;
  });
  const int i_end = FirstRow(s.q_len, [&](int i) {
    int lo, hi;
    KeyRange(p, s, i, &lo, &hi);
    return lo >= n_end;
  });
  const int m_begin = i_begin * group;
  const int m_end = max(m_begin, i_end * group);
  const int steps = (m_end - m_begin + Cfg::kBlockM - 1) / Cfg::kBlockM;

  T* sk = reinterpret_cast<T*>(smem);
  T* sv = reinterpret_cast<T*>(smem + Cfg::kKBytes);
  uint8_t* stages = smem + 2 * Cfg::kKBytes;
  auto stage_q = [&](int st) { return reinterpret_cast<T*>(stages + st * Cfg::kStageBytes); };
  auto stage_do = [&](int st) {
    return reinterpret_cast<T*>(stages + st * Cfg::kStageBytes + Cfg::kQBytes);
  };
  // Per packed row of a step: lse2 (float), D (float), key range lo, hi (int).
  auto stage_info = [&](int st) {
    return reinterpret_cast<float*>(stages + st * Cfg::kStageBytes + 2 * Cfg::kQBytes);
  };

  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(bp.dout);
  StageRows<Cfg::kBlockN, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
      sk, k, p.head_dim,
      [&](int r) { return KeyRow(k, p, s, kv_head, p.head_dim, n0, n_end, r); });
  StageRows<Cfg::kBlockN, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
      sv, v, p.head_dim_v,
      [&](int r) { return KeyRow(v, p, s, kv_head, p.head_dim_v, n0, n_end, r); });

  // Stages step `step`'s q and dO rows (cp.async) and their row info (plain stores).
  auto load_step = [&](int step, int st) {
    const int m0 = m_begin + step * Cfg::kBlockM;
    auto q_row = [&](int r) { return QRow(q, p, s, kv_head, group, p.head_dim, m0, m_end, r); };
    auto do_row = [&](int r) {
      return QRow(dout, p, s, kv_head, group, p.head_dim_v, m0, m_end, r);
    };
    StageRows<Cfg::kBlockM, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(stage_q(st), q,
                                                                        p.head_dim, q_row);
    StageRows<Cfg::kBlockM, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(stage_do(st), dout,
                                                                        p.head_dim_v, do_row);
    float* info = stage_info(st);
    for (int r = threadIdx.x; r < Cfg::kBlockM; r += Cfg::kThreads) {
      float lse2 = INFINITY, d = 0.f;
      int lo = 0, hi = 0;
      if (m0 + r < m_end) {
        const int i = (m0 + r) / group, h = kv_head * group + (m0 + r) % group;
        const int64_t idx = WsIndex(args, s, b, h, i);
        lse2 = args.lse_log2[idx];
        d = bp.softmax_d[idx];
        KeyRange(p, s, i, &lo, &hi);
      }
      info[r] = lse2;
      info[Cfg::kBlockM + r] = d;
      reinterpret_cast<int*>(info)[2 * Cfg::kBlockM + r] = lo;
      reinterpret_cast<int*>(info)[3 * Cfg::kBlockM + r] = hi;
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const ScoreMath math = MakeScoreMath(p);
  // This thread's two keys (rows lane / 4 and lane / 4 + 8 of the warp's 16).
  int key[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) key[h] = n0 + warp * 16 + lane / 4 + 8 * h;

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int t = 0; t < kDT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[t][e] = dv[t][e] = 0.f;

  if (steps > 0) load_step(0, 0);
  CpAsyncCommit();
  for (int step = 0; step < steps; ++step) {
    const int st = step & 1;
    // Step `step` has landed and every warp is done with the other stage: refill it.
    CpAsyncWaitAll();
    __syncthreads();
    if (step + 1 < steps) load_step(step + 1, st ^ 1);
    CpAsyncCommit();

    const T* sq = stage_q(st);
    const T* sdo = stage_do(st);
    const float* info = stage_info(st);
    const int* row_lo = reinterpret_cast<const int*>(info) + 2 * Cfg::kBlockM;
    const int* row_hi = reinterpret_cast<const int*>(info) + 3 * Cfg::kBlockM;

    float sc[kMT][4], dp[kMT][4];
#pragma unroll
    for (int t = 0; t < kMT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[t][e] = dp[t][e] = 0.f;
    MmaABt<T, kMT, kD, Cfg::kStride>(sc, sk + warp * 16 * Cfg::kStride, sq, lane);
    MmaABt<T, kMT, kD, Cfg::kStride>(dp, sv + warp * 16 * Cfg::kStride, sdo, lane);
#pragma unroll
    for (int t = 0; t < kMT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = t * 8 + (lane % 4) * 2 + (e % 2);  // packed q row of the step
        const int j = key[e / 2];
        math(sc[t][e], dp[t][e], j >= row_lo[c] && j < row_hi[c], info[c],
             info[Cfg::kBlockM + c]);
      }
    }
    MmaRegB<T, kMT, kD, Cfg::kStride>(dv, sc, sdo, lane);
    MmaRegB<T, kMT, kD, Cfg::kStride>(dk, dp, sq, lane);
  }
  CpAsyncWaitAll();

  // Epilogue: dK (times softmax_scale, the chain factor of the scaled scores) and dV as T into
  // the K and V tiles, then 16-byte stores of the rows this CTA owns.
  __syncthreads();
  AccToTile<T, kD, Cfg::kStride, true>(dk, p.softmax_scale, sk, warp, lane);
  AccToTile<T, kD, Cfg::kStride, false>(dv, 1.f, sv, warp, lane);
  __syncthreads();
  T* dk_out = static_cast<T*>(bp.dk);
  T* dv_out = static_cast<T*>(bp.dv);
  StoreRows<Cfg::kBlockN, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
      sk, p.head_dim,
      [&](int r) { return KeyRow(dk_out, p, s, kv_head, p.head_dim, n0, n_end, r); });
  StoreRows<Cfg::kBlockN, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
      sv, p.head_dim_v,
      [&](int r) { return KeyRow(dv_out, p, s, kv_head, p.head_dim_v, n0, n_end, r); });
}

// grid: x = 64-row blocks of packed q rows, y = kv head, z = sequence. 128 threads.
template <typename T, int kD>
__global__ void __launch_bounds__(128) FlashBwdDqKernel(const FlashBwdArgs args) {
  using Cfg = DqConfig<kD>;
  constexpr int kNT = Cfg::kBlockN / 8;  // n8 tiles of S per warp (keys)
  constexpr int kDT = kD / 8;            // n8 tiles of dQ per warp
  extern __shared__ __align__(16) uint8_t smem[];
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  const int group = args.group;
  const int b = blockIdx.z, kv_head = blockIdx.y;
  const SeqBounds s = GetSeqBounds(p, b);
  const int rows = s.q_len * group;
  const int m0 = blockIdx.x * Cfg::kBlockM;
  if (m0 >= rows) return;

  // Keys of the block's rows: from the first row's start to the last row's end (monotone).
  int n_lo, n_hi, unused;
  KeyRange(p, s, m0 / group, &n_lo, &unused);
  KeyRange(p, s, (min(m0 + Cfg::kBlockM, rows) - 1) / group, &unused, &n_hi);
  const int tiles = n_hi > n_lo ? (n_hi - n_lo + Cfg::kBlockN - 1) / Cfg::kBlockN : 0;

  T* sq = reinterpret_cast<T*>(smem);
  T* sdo = reinterpret_cast<T*>(smem + Cfg::kQBytes);
  auto stage_k = [&](int st) {
    return reinterpret_cast<T*>(smem + 2 * Cfg::kQBytes + 2 * st * Cfg::kTileBytes);
  };
  auto stage_v = [&](int st) {
    return reinterpret_cast<T*>(smem + 2 * Cfg::kQBytes + (2 * st + 1) * Cfg::kTileBytes);
  };

  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(bp.dout);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  StageRows<Cfg::kBlockM, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
      sq, q, p.head_dim,
      [&](int r) { return QRow(q, p, s, kv_head, group, p.head_dim, m0, rows, r); });
  StageRows<Cfg::kBlockM, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
      sdo, dout, p.head_dim_v,
      [&](int r) { return QRow(dout, p, s, kv_head, group, p.head_dim_v, m0, rows, r); });
  auto load_tile = [&](int tile, int st) {
    const int t0 = n_lo + tile * Cfg::kBlockN;
    StageRows<Cfg::kBlockN, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
        stage_k(st), k, p.head_dim,
        [&](int r) { return KeyRow(k, p, s, kv_head, p.head_dim, t0, n_hi, r); });
    StageRows<Cfg::kBlockN, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
        stage_v(st), v, p.head_dim_v,
        [&](int r) { return KeyRow(v, p, s, kv_head, p.head_dim_v, t0, n_hi, r); });
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const ScoreMath math = MakeScoreMath(p);
  // This thread's two packed rows (lane / 4 and lane / 4 + 8 of the warp's 16): lse, D, keys.
  float lse2[2], dd[2];
  int row_lo[2], row_hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = m0 + warp * 16 + lane / 4 + 8 * h;
    lse2[h] = INFINITY;
    dd[h] = 0.f;
    row_lo[h] = row_hi[h] = 0;
    if (r < rows) {
      const int i = r / group, head = kv_head * group + r % group;
      const int64_t idx = WsIndex(args, s, b, head, i);
      lse2[h] = args.lse_log2[idx];
      dd[h] = bp.softmax_d[idx];
      KeyRange(p, s, i, &row_lo[h], &row_hi[h]);
    }
  }

  float dq[kDT][4];
#pragma unroll
  for (int t = 0; t < kDT; ++t) dq[t][0] = dq[t][1] = dq[t][2] = dq[t][3] = 0.f;

  if (tiles > 0) load_tile(0, 0);
  CpAsyncCommit();
  for (int tile = 0; tile < tiles; ++tile) {
    const int st = tile & 1;
    const int t0 = n_lo + tile * Cfg::kBlockN;
    CpAsyncWaitAll();
    __syncthreads();
    if (tile + 1 < tiles) load_tile(tile + 1, st ^ 1);
    CpAsyncCommit();

    float sc[kNT][4], dp[kNT][4];
#pragma unroll
    for (int t = 0; t < kNT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[t][e] = dp[t][e] = 0.f;
    MmaABt<T, kNT, kD, Cfg::kStride>(sc, sq + warp * 16 * Cfg::kStride, stage_k(st), lane);
    MmaABt<T, kNT, kD, Cfg::kStride>(dp, sdo + warp * 16 * Cfg::kStride, stage_v(st), lane);
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        const int j = t0 + t * 8 + (lane % 4) * 2 + (e % 2);
        math(sc[t][e], dp[t][e], j >= row_lo[h] && j < row_hi[h], lse2[h], dd[h]);
      }
    }
    MmaRegB<T, kNT, kD, Cfg::kStride>(dq, dp, stage_k(st), lane);
  }
  CpAsyncWaitAll();

  // Epilogue: dQ times softmax_scale as T into the Q tile (each warp rewrites only the 16 rows
  // it alone read; the barrier covers a loop of zero tiles, where other threads' copies of those
  // rows may still be landing), then 16-byte stores.
  __syncthreads();
  AccToTile<T, kD, Cfg::kStride, true>(dq, p.softmax_scale, sq, warp, lane);
  __syncthreads();
  T* dq_out = static_cast<T*>(bp.dq);
  StoreRows<Cfg::kBlockM, Cfg::kChunks, Cfg::kStride, Cfg::kThreads>(
      sq, p.head_dim,
      [&](int r) { return QRow(dq_out, p, s, kv_head, group, p.head_dim, m0, rows, r); });
}

}  // namespace flash_bwd

template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwd(const FlashBwdArgs& args, cudaStream_t stream) {
  using KvCfg = flash_bwd::DkDvConfig<kHeadDim>;
  using QCfg = flash_bwd::DqConfig<kHeadDim>;
  const AttentionParams& p = args.bp.fwd;
  // Grid bounds: dense sequences have seqlen_q / seqlen_k rows; a varlen one at most the whole
  // buffer (CTAs past their sequence's end return at once).
  const int64_t q_bound = p.cu_seqlens_q ? p.total_q : p.seqlen_q;
  const int64_t k_bound = p.kv_layout == KvLayout::kVarlen ? p.total_k : p.seqlen_k;
  const int64_t rows = q_bound * args.group;
  const unsigned kv_blocks = unsigned((k_bound + KvCfg::kBlockN - 1) / KvCfg::kBlockN);
  const unsigned q_blocks = unsigned((rows + QCfg::kBlockM - 1) / QCfg::kBlockM);

  if (kv_blocks > 0 && !args.skip_dkdv) {
    if (cudaError_t err = LaunchWithSmem(flash_bwd::FlashBwdDkDvKernel<T, kHeadDim>,
                                         dim3(kv_blocks, p.num_kv_heads, p.batch),
                                         KvCfg::kThreads, KvCfg::kSmemBytes, stream, args);
        err != cudaSuccess)
      return err;
  }
  if (q_blocks == 0) return cudaSuccess;
  return LaunchWithSmem(flash_bwd::FlashBwdDqKernel<T, kHeadDim>,
                        dim3(q_blocks, p.num_kv_heads, p.batch), QCfg::kThreads,
                        QCfg::kSmemBytes, stream, args);
}

}  // namespace jax_sgl::cuda

// Instantiates one (storage type T, head dim D) of the launchers above (instantiations/).
#define JAX_SGL_INSTANTIATE_BWD_SM80(T, D)                                      \
  namespace jax_sgl::cuda {                                                     \
  template cudaError_t LaunchFlashBwd<T, D>(const FlashBwdArgs&, cudaStream_t); \
  }
