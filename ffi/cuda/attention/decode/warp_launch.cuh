// Decode attention, warp-sliced CUDA-core variant (JAX_SGL_DECODE=warp): for calls whose packed
// rows (q length x GQA group) per (sequence, kv head) are at most kDecodeWarpMaxRows, the usual
// decode (GQA 4-8, one or two q rows). Learned from flash-decoding / FlashInfer's decode kernels.
//
// Why not the mma kernel (decode/block_kernel.cuh) here: with 4 valid rows of 16 its m16n8k16 work is
// 3/4 padding, each 16-key chunk is a dependent mma -> softmax -> mma chain, every stage ends in
// a block-wide barrier, and its copies put 4 threads on a 256-byte row in 16-byte pieces 64 bytes
// apart (half-used 32-byte sectors per instruction). Here:
//   - one CTA per (sequence x kv head, KV split), 4 warps; warp w takes every 4th stage of the
//     split's keys, with its OWN cp.async ring (warp-level wait + __syncwarp, no block barrier in
//     the loop) and its own online softmax; the warps merge (m, l, acc) once at the end;
//   - a stage is 4 KiB of K + V (8 keys at d = 128), so a 4-deep ring is 16 KiB per warp and
//     3-4 CTAs share an SM with 12-16 warps' loads in flight;
//   - copies are 16 bytes per lane with consecutive lanes on consecutive 16 bytes of a row (full
//     256-byte rows per half warp); lane j of the warp resolves the page-table entry of key j of
//     the stage one stage ahead and broadcasts the row with a shuffle;
//   - math on CUDA cores in float32: a group of kVecLanes lanes holds one key, each lane 8
//     contiguous dims (one 16-byte vector); every lane keeps all rows' q dims of its chunk in
//     registers, dot products reduce with xor shuffles inside the group; each lane group (32 /
//     kVecLanes of them per warp) keeps its own running (m, l, acc) over its keys, so the loop
//     has no cross-group reduction; one max/rescale per stage (4 keys per group at d = 128).
// Masks, layouts, outputs and split partials are those of decode/block_kernel.cuh.
#pragma once

#include "ffi/cuda/attention/decode/block_kernel.cuh"
#include "ffi/cuda/attention/decode/tma_kernel.cuh"
#include "ffi/cuda/attention/decode/cp_async_kernel.cuh"
#include "ffi/cuda/attention/decode/warp_steps.cuh"
#include "ffi/cuda/attention/common/unpack.cuh"

namespace jax_sgl::cuda {
namespace decode_warp {

using flash::Elem;
using flash::kLn2;
using flash::kLog2e;
using decode::CpAsync16;
using decode::CpAsyncCommit;
using decode::CpAsyncWaitPending;
using decode::KeySourceRow;
using flash::Ldmatrix4;
using flash::Ldmatrix4Trans;
using flash::QuadMax;
using flash::QuadSum;

template <int kD, int kRows>
struct WarpConfig {
  static constexpr int kThreads = kDecodeWarpThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kChunks = kD / 8;  // 16-byte vectors per row
  static constexpr int kVecLanes = DecodeWarpVecLanes(kD);
  static constexpr int kKeysPerStep = 32 / kVecLanes;
  static constexpr int kStageKeys = DecodeWarpStageKeys(kD);
  static constexpr int kSteps = kStageKeys / kKeysPerStep;  // keys per lane group per stage
  static constexpr int kCopies = kStageKeys * kChunks / 32;  // 16-byte copies per lane, K or V
  static constexpr int kTileElems = kStageKeys * kD;
  static_assert(kStageKeys % kKeysPerStep == 0 && kStageKeys * kChunks % 32 == 0, "stage shape");
  static_assert(kStageKeys <= 32, "one lane per key resolves the page table");
};

// CTAs per SM the register budget is held to (65536 / (128 x this) registers a thread): 3 at
// d <= 128 with 4 rows (168 registers; 4 CTAs = 128 registers spills two values in the loop),
// else what the registers allow anyway (the ring fits 3 CTAs of 4 stages in shared memory).
constexpr int DecodeWarpMinCtas(int d, int rows) { return d <= 128 && rows <= 4 ? 3 : 1; }

// grid: x = batch * num_kv_heads, y = KV splits; kDecodeWarpThreads threads. Shared memory: per
// warp `stages` x (K tile, V tile), then per warp `stages` key-valid masks; the epilogue reuses
// the front for the warps' (acc, m, l).
template <typename T, int kD, int kRows>
__global__ void __launch_bounds__(kDecodeWarpThreads, DecodeWarpMinCtas(kD, kRows))
    FlashDecodeWarpKernel(const FlashDecodeArgs args) {
  using Cfg = WarpConfig<kD, kRows>;
  extern __shared__ __align__(16) uint8_t smem[];
  const AttentionParams& p = args.fwd.p;
  const int group = args.fwd.group;
  const int num_splits = args.fwd.num_splits;
  const int stages = args.stages;
  const int b = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const SeqBounds s = GetSeqBounds(p, b);
  const int rows_here = min(kRows, s.q_len * group);  // the host checked the bound
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv = lane / Cfg::kVecLanes;   // key of the step this lane's group holds
  const int cl = lane % Cfg::kVecLanes;   // this lane's 16-byte chunk of the row
  const bool chunk_ok = cl < Cfg::kChunks;  // false only for d = 96 / 192 (padded groups)

  // Keys any row may see, split into whole stages; this split's stages [t_begin, t_end), warp w
  // takes t_begin + w, + 4, ...
  int n_lo = 0, n_hi = 0, unused;
  if (rows_here > 0) {
    KeyRange(p, s, 0, &n_lo, &unused);
    KeyRange(p, s, (rows_here - 1) / group, &unused, &n_hi);
  }
  const int n_tiles = n_hi > n_lo ? (n_hi - n_lo + Cfg::kStageKeys - 1) / Cfg::kStageKeys : 0;
  const int t_begin = int(int64_t(n_tiles) * blockIdx.y / num_splits);
  const int t_end = int(int64_t(n_tiles) * (blockIdx.y + 1) / num_splits);
  const int my_tiles = t_end - t_begin > warp ? (t_end - t_begin - warp + Cfg::kWarps - 1) / Cfg::kWarps : 0;

  T* ring = reinterpret_cast<T*>(smem) + warp * stages * 2 * Cfg::kTileElems;
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + DecodeWarpRingBytes(kD, stages)) +
                    warp * kDecodeMaxStages;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  // Source row of key `key` of this warp's i-th stage (-1: past the range or a bad page entry).
  auto source_row = [&](int i, int key) -> int64_t {
    if (i >= my_tiles || key >= Cfg::kStageKeys) return -1;
    const int j = n_lo + (t_begin + warp + i * Cfg::kWarps) * Cfg::kStageKeys + key;
    return KeySourceRow(p, b, s, j, n_hi);
  };
  // Copies a stage into ring slot st; lane lane0 + j holds the source row of its key j.
  auto issue = [&](int64_t my_row, int lane0, int st) {
    T* sk = ring + st * 2 * Cfg::kTileElems;
    T* sv = sk + Cfg::kTileElems;
#pragma unroll
    for (int i = 0; i < Cfg::kCopies; ++i) {
      const int idx = i * 32 + lane;
      const int key = idx / Cfg::kChunks, c = (idx % Cfg::kChunks) * 8;
      const int64_t row = __shfl_sync(0xffffffffu, my_row, lane0 + key);
      const bool ok = row >= 0;
      const int64_t head_row = row * p.num_kv_heads + kv_head;
      const bool kok = ok && c < p.head_dim, vok = ok && c < p.head_dim_v;
      CpAsync16<kD * 2>(sk + key * kD + c, kok ? k + head_row * p.head_dim + c : k, kok ? 16 : 0);
      CpAsync16<kD * 2>(sv + key * kD + c, vok ? v + head_row * p.head_dim_v + c : v, vok ? 16 : 0);
    }
    const uint32_t valid = __ballot_sync(0xffffffffu, my_row >= 0) >> lane0;
    if (lane == 0) masks[st] = valid & ((1u << Cfg::kStageKeys) - 1);
  };

  // Prologue: the page-table reads of the first stages - 1 stages all at once (lane l resolves
  // key l % kStageKeys of stage l / kStageKeys of each batch of kPerReg stages), then the copies.
  constexpr int kPerReg = 32 / Cfg::kStageKeys;
  constexpr int kRegs = (kDecodeMaxStages - 2 + kPerReg) / kPerReg;
  int64_t first_rows[kRegs];
#pragma unroll
  for (int g = 0; g < kRegs; ++g) {
    const int i = g * kPerReg + lane / Cfg::kStageKeys;
    first_rows[g] = i < stages - 1 ? source_row(i, lane % Cfg::kStageKeys) : -1;
  }
  int64_t next_row = source_row(stages - 1, lane);
#pragma unroll
  for (int i = 0; i < kDecodeMaxStages - 1; ++i) {
    if (i < stages - 1) {
      if (i < my_tiles) issue(first_rows[i / kPerReg], (i % kPerReg) * Cfg::kStageKeys, i);
      CpAsyncCommit();
    }
  }

  // q: this lane's 8 dims of every row (zero past the rows and past head_dim), float32.
  float q[kRows][8];
  int row_lo[kRows], row_hi[kRows];
  {
    const T* qp = static_cast<const T*>(p.q);
    const int c = cl * 8;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      uint4 u = make_uint4(0, 0, 0, 0);
      row_lo[r] = row_hi[r] = 0;
      if (r < rows_here) {
        KeyRange(p, s, r / group, &row_lo[r], &row_hi[r]);
        if (chunk_ok && c < p.head_dim) {
          const int64_t row_head = (s.q_row0 + r / group) * p.num_heads + kv_head * group + r % group;
          u = *reinterpret_cast<const uint4*>(qp + row_head * p.head_dim + c);
        }
      }
      Unpack8<T>(u, q[r]);
    }
  }
  const bool use_softcap = p.softcap > 0.f;
  const float score_scale = use_softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  const float cap_log2 = p.softcap * kLog2e;

  float acc[kRows][8];
  float m_run[kRows], l_run[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m_run[r] = -INFINITY;
    l_run[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }

  int st_read = 0, st_write = stages - 1;
  for (int it = 0; it < my_tiles; ++it) {
    // This lane's copies of stage it have landed; __syncwarp makes every lane's visible, and
    // every lane is done with the slot read last iteration: refill it with stage it + stages - 1.
    CpAsyncWaitPending(stages - 2);
    __syncwarp();
    if (it + stages - 1 < my_tiles) issue(next_row, 0, st_write);
    CpAsyncCommit();
    next_row = source_row(it + stages, lane);
    st_write = st_write + 1 == stages ? 0 : st_write + 1;

    const T* sk = ring + st_read * 2 * Cfg::kTileElems;
    const T* sv = sk + Cfg::kTileElems;
    const uint32_t valid = masks[st_read];
    st_read = st_read + 1 == stages ? 0 : st_read + 1;
    const int key0 = n_lo + (t_begin + warp + it * Cfg::kWarps) * Cfg::kStageKeys;

    // Scores of this group's kSteps keys (key kv + step * kKeysPerStep of the stage).
    float sc[Cfg::kSteps][kRows];
#pragma unroll
    for (int st = 0; st < Cfg::kSteps; ++st) {
      const int key = st * Cfg::kKeysPerStep + kv;
      float kf[8];
      uint4 u = make_uint4(0, 0, 0, 0);
      if (chunk_ok) u = *reinterpret_cast<const uint4*>(sk + key * kD + cl * 8);
      Unpack8<T>(u, kf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float x = q[r][0] * kf[0];
#pragma unroll
        for (int e = 1; e < 8; ++e) x = fmaf(q[r][e], kf[e], x);
        sc[st][r] = x;
      }
#pragma unroll
      for (int off = Cfg::kVecLanes / 2; off > 0; off /= 2) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) sc[st][r] += __shfl_xor_sync(0xffffffffu, sc[st][r], off);
      }
      const int j = key0 + key;
      const bool key_ok = (valid >> key) & 1u;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float x = sc[st][r] * score_scale;
        if (use_softcap) x = cap_log2 * tanhf(x);
        sc[st][r] = key_ok && j >= row_lo[r] && j < row_hi[r] ? x : -INFINITY;
      }
    }

    // Online softmax, once per stage per row (log2 domain).
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = m_run[r];
#pragma unroll
      for (int st = 0; st < Cfg::kSteps; ++st) mx = fmaxf(mx, sc[st][r]);
      // A row with no visible key yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
      const float m_use = mx == -INFINITY ? 0.f : mx;
      const float corr = exp2f(m_run[r] - m_use);
      m_run[r] = mx;
      float l = l_run[r] * corr;
#pragma unroll
      for (int st = 0; st < Cfg::kSteps; ++st) {
        sc[st][r] = exp2f(sc[st][r] - m_use);
        l += sc[st][r];
      }
      l_run[r] = l;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= corr;
    }

    // acc += p V over the group's keys.
#pragma unroll
    for (int st = 0; st < Cfg::kSteps; ++st) {
      const int key = st * Cfg::kKeysPerStep + kv;
      float vf[8];
      uint4 u = make_uint4(0, 0, 0, 0);
      if (chunk_ok) u = *reinterpret_cast<const uint4*>(sv + key * kD + cl * 8);
      Unpack8<T>(u, vf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(sc[st][r], vf[e], acc[r][e]);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  // Merge the warp's lane groups (xor shuffles across groups), then the warps through shared
  // memory (reused: every warp is past its last copy and read after the barrier).
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float m_all = m_run[r];
#pragma unroll
    for (int off = Cfg::kVecLanes; off < 32; off *= 2)
      m_all = fmaxf(m_all, __shfl_xor_sync(0xffffffffu, m_all, off));
    const float f = m_run[r] == -INFINITY ? 0.f : exp2f(m_run[r] - m_all);
    float l = l_run[r] * f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] *= f;
#pragma unroll
    for (int off = Cfg::kVecLanes; off < 32; off *= 2) {
      l += __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], off);
    }
    m_run[r] = m_all;
    l_run[r] = l;
  }
  __syncthreads();
  float* so = reinterpret_cast<float*>(smem);        // [warps][kRows][kD]
  float* sm = so + Cfg::kWarps * kRows * kD;          // [warps][kRows]
  float* sl = sm + Cfg::kWarps * kRows;               // [warps][kRows]
  if (lane < Cfg::kVecLanes && chunk_ok) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float4* dst = reinterpret_cast<float4*>(so + (warp * kRows + r) * kD + cl * 8);
      dst[0] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      dst[1] = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      sm[warp * kRows + r] = m_run[r];
      sl[warp * kRows + r] = l_run[r];
    }
  }
  __syncthreads();

  const bool split = num_splits > 1;
  const int dv = p.head_dim_v;
  for (int idx = threadIdx.x; idx < rows_here * Cfg::kChunks; idx += Cfg::kThreads) {
    const int r = idx / Cfg::kChunks, c = (idx % Cfg::kChunks) * 8;
    if (c >= dv) continue;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) m_all = fmaxf(m_all, sm[w * kRows + r]);
    float l_all = 0.f;
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < Cfg::kWarps; ++w) {
        const float f = exp2f(sm[w * kRows + r] - m_all);
        l_all += sl[w * kRows + r] * f;
        const float4* src = reinterpret_cast<const float4*>(so + (w * kRows + r) * kD + c);
        const float4 x0 = src[0], x1 = src[1];
        o[0] += x0.x * f; o[1] += x0.y * f; o[2] += x0.z * f; o[3] += x0.w * f;
        o[4] += x1.x * f; o[5] += x1.y * f; o[6] += x1.z * f; o[7] += x1.w * f;
      }
    }
    // Fully masked rows (and a split with no keys): out 0, lse -inf.
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    const int i = r / group, head = kv_head * group + r % group;
    const int64_t row_head = (s.q_row0 + i) * p.num_heads + head;
    const float lse = l_all > 0.f ? (m_all + log2f(l_all)) * kLn2 : -INFINITY;
    if (split) {
      float4* dst = reinterpret_cast<float4*>(
          args.fwd.o_partial + (int64_t(blockIdx.y) * p.total_q * p.num_heads + row_head) * dv + c);
      dst[0] = make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
      dst[1] = make_float4(o[4] * inv, o[5] * inv, o[6] * inv, o[7] * inv);
      if (c == 0)
        args.fwd.lse_partial[int64_t(blockIdx.y) * p.total_q * p.num_heads + row_head] = lse;
    } else {
      uint4 packed;
      packed.x = Elem<T>::Pack(o[0] * inv, o[1] * inv);
      packed.y = Elem<T>::Pack(o[2] * inv, o[3] * inv);
      packed.z = Elem<T>::Pack(o[4] * inv, o[5] * inv);
      packed.w = Elem<T>::Pack(o[6] * inv, o[7] * inv);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row_head * dv + c) = packed;
      if (c == 0) {
        const int64_t li = p.cu_seqlens_q ? int64_t(head) * p.total_q + s.lse_row0 + i
                                          : (int64_t(b) * p.num_heads + head) * p.seqlen_q + i;
        p.lse[li] = lse;
      }
    }
  }
}

template <typename T, int kD, int kRows>
cudaError_t Launch(const FlashDecodeArgs& args, cudaStream_t stream) {
  auto kernel = FlashDecodeWarpKernel<T, kD, kRows>;
  const int smem = DecodeWarpSmemBytes(kD, args.stages, kRows);
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const AttentionParams& p = args.fwd.p;
  const dim3 grid(unsigned(int64_t(p.batch) * p.num_kv_heads), unsigned(args.fwd.num_splits));
  kernel<<<grid, kDecodeWarpThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

template <typename T, int kD, int kRows>
int CtasPerSm(int stages) {
  auto kernel = FlashDecodeWarpKernel<T, kD, kRows>;
  const int smem = DecodeWarpSmemBytes(kD, stages, kRows);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kDecodeWarpThreads, smem) !=
      cudaSuccess)
    return 1;
  return n > 0 ? n : 1;
}

// The mma form (JAX_SGL_DECODE=warpmma): per-warp rings and copies as above, but a stage is 16
// keys in ldmatrix-padded rows and the warp runs the m16n8k16 chunk of decode/block_kernel.cuh on it
// (one m16 tile of packed rows: ~12 instructions per key instead of ~75 on CUDA cores), with its
// own online softmax; the warps merge at the end as the mma kernel's warps do. 2 CTAs per SM at
// d = 128 and 3 stages (8.5 KiB each per warp).
template <typename T, int kD>
__global__ void __launch_bounds__(kDecodeWarpThreads, kD <= 128 ? 2 : 1)
    FlashDecodeWarpMmaKernel(const FlashDecodeArgs args) {
  constexpr int kStride = DecodeStride(kD);
  constexpr int kKeys = 16;
  constexpr int kChunks = kD / 8;
  constexpr int kCopies = kKeys * kChunks / 32;
  constexpr int kTileElems = kKeys * kStride;
  constexpr int kDT = kD / 8;  // n8 tiles of the output
  static_assert(kKeys * kChunks % 32 == 0, "whole copies per lane");
  extern __shared__ __align__(16) uint8_t smem[];
  const AttentionParams& p = args.fwd.p;
  const int group = args.fwd.group;
  const int num_splits = args.fwd.num_splits;
  const int stages = args.stages;
  const int b = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const SeqBounds s = GetSeqBounds(p, b);
  const int rows_here = min(kDecodeWarpMmaMaxRows, s.q_len * group);  // the host checked the bound
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const decode_warp_mma::WarpStages<kKeys> stages_of(p, s, group, rows_here, num_splits, warp);
  const int n_hi = stages_of.n_hi, my_tiles = stages_of.my_tiles;

  T* sq = reinterpret_cast<T*>(smem);
  T* ring = sq + 16 * kStride + warp * stages * 2 * kTileElems;
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + 16 * kStride * 2 +
                                                DecodeWarpMmaRingBytes(kD, stages)) +
                    warp * kDecodeMaxStages;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  auto source_row = [&](int i, int key) -> int64_t {
    if (i >= my_tiles || key >= kKeys) return -1;
    const int j = stages_of.Key0(i) + key;
    return KeySourceRow(p, b, s, j, n_hi);
  };
  auto issue = [&](int64_t my_row, int lane0, int st) {
    T* sk = ring + st * 2 * kTileElems;
    T* sv = sk + kTileElems;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int idx = i * 32 + lane;
      const int key = idx / kChunks, c = (idx % kChunks) * 8;
      const int64_t row = __shfl_sync(0xffffffffu, my_row, lane0 + key);
      const bool ok = row >= 0;
      const int64_t head_row = row * p.num_kv_heads + kv_head;
      const bool kok = ok && c < p.head_dim, vok = ok && c < p.head_dim_v;
      CpAsync16<kD * 2>(sk + key * kStride + c, kok ? k + head_row * p.head_dim + c : k,
                        kok ? 16 : 0);
      CpAsync16<kD * 2>(sv + key * kStride + c, vok ? v + head_row * p.head_dim_v + c : v,
                        vok ? 16 : 0);
    }
    const uint32_t valid = __ballot_sync(0xffffffffu, my_row >= 0) >> lane0;
    if (lane == 0) masks[st] = valid & 0xffffu;
  };

  // Prologue: two stages' page-table entries per lane register (lane l: key l % 16 of stage
  // l / 16), the first stages - 1 stages' copies, then q (plain loads: one barrier, once).
  constexpr int kRegs = (kDecodeMaxStages - 1 + 1) / 2;
  int64_t first_rows[kRegs];
#pragma unroll
  for (int g = 0; g < kRegs; ++g) {
    const int i = g * 2 + lane / kKeys;
    first_rows[g] = i < stages - 1 ? source_row(i, lane % kKeys) : -1;
  }
  int64_t next_row = source_row(stages - 1, lane);
#pragma unroll
  for (int i = 0; i < kDecodeMaxStages - 1; ++i) {
    if (i < stages - 1) {
      if (i < my_tiles) issue(first_rows[i / 2], (i % 2) * kKeys, i);
      CpAsyncCommit();
    }
  }
  decode_warp_mma::LoadQRows<T, kD>(p, s, group, kv_head, rows_here, sq);
  __syncthreads();

  int row_lo[2], row_hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = lane / 4 + 8 * h;
    row_lo[h] = row_hi[h] = 0;
    if (r < rows_here) KeyRange(p, s, r / group, &row_lo[h], &row_hi[h]);
  }
  const bool use_softcap = p.softcap > 0.f;
  const float score_scale = use_softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  const float cap_log2 = p.softcap * kLog2e;

  // q's A fragments stay in registers for the whole loop (kD / 16 x 4 registers).
  uint32_t qa[kD / 16][4];
  decode_warp_mma::LoadQFragments<T, kD>(sq, lane, qa);

  float o[kDT][4];
#pragma unroll
  for (int t = 0; t < kDT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  int st_read = 0, st_write = stages - 1;
  for (int it = 0; it < my_tiles; ++it) {
    CpAsyncWaitPending(stages - 2);
    __syncwarp();
    if (it + stages - 1 < my_tiles) issue(next_row, 0, st_write);
    CpAsyncCommit();
    next_row = source_row(it + stages, lane);
    st_write = st_write + 1 == stages ? 0 : st_write + 1;

    const T* sk = ring + st_read * 2 * kTileElems;
    const T* sv = sk + kTileElems;
    const uint32_t valid = masks[st_read];
    st_read = st_read + 1 == stages ? 0 : st_read + 1;
    const int key0 = stages_of.Key0(it);

    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int k0 = 0; k0 < kD; k0 += 16) {
      uint32_t bk[4];
      Ldmatrix4(bk, sk + (lane % 8 + (lane / 16) * 8) * kStride + k0 + ((lane / 8) % 2) * 8);
      Elem<T>::Mma(sc[0], qa[k0 / 16], bk);
      Elem<T>::Mma(sc[1], qa[k0 / 16], bk + 2);
    }
    float blk_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        const int c = t * 8 + (lane % 4) * 2 + (e % 2);
        const int j = key0 + c;
        float x = sc[t][e] * score_scale;
        if (use_softcap) x = cap_log2 * tanhf(x);
        const bool ok = j >= row_lo[h] && j < row_hi[h] && ((valid >> c) & 1u);
        x = ok ? x : -INFINITY;
        sc[t][e] = x;
        blk_max[h] = fmaxf(blk_max[h], x);
      }
    }
    decode_warp_mma::SoftmaxPv<T, kD, false>(sc, blk_max, m_run, l_run, o, sv, lane);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  decode_warp_mma::MergeWarpsAndStore<T, kD>(args, s, b, kv_head, rows_here, smem, m_run, l_run,
                                             o);
}

template <typename T, int kD>
cudaError_t LaunchMma(const FlashDecodeArgs& args, cudaStream_t stream) {
  return decode_warp_mma::Launch<kD>(FlashDecodeWarpMmaKernel<T, kD>, args, stream);
}

template <typename T, int kD>
int CtasPerSmMma(int stages) {
  return decode_warp_mma::CtasPerSm<kD>(FlashDecodeWarpMmaKernel<T, kD>, stages);
}

}  // namespace decode_warp

// args.m_tiles carries the row capacity here: 4 or 8 (CUDA-core kernel), 16 (mma kernel, the
// warpmma, warpmma2 or TMA form by args.warp_variant; the TMA form at head-dim capacity 64 and
// 128 only, which the dispatch ensures).
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecodeWarp(const FlashDecodeArgs& args, cudaStream_t stream) {
  if (args.m_tiles > kDecodeWarpMaxRows) {
    if (args.warp_variant == kDecodeWarpTma) {
      if constexpr (kHeadDim == 64 || kHeadDim == 128)
        return decode_tma::Launch<T, kHeadDim>(args, stream);
      return cudaErrorInvalidValue;
    }
    return args.warp_variant == kDecodeWarpMma2 ? decode_warp2::Launch<T, kHeadDim>(args, stream)
                                                : decode_warp::LaunchMma<T, kHeadDim>(args, stream);
  }
  return args.m_tiles <= 4 ? decode_warp::Launch<T, kHeadDim, 4>(args, stream)
                           : decode_warp::Launch<T, kHeadDim, 8>(args, stream);
}

template <typename T, int kHeadDim>
int FlashDecodeWarpCtasPerSm(int stages, int rows_cap, int variant) {
  if (rows_cap > kDecodeWarpMaxRows) {
    if (variant == kDecodeWarpTma) {
      if constexpr (kHeadDim == 64 || kHeadDim == 128)
        return decode_tma::CtasPerSm<T, kHeadDim>(stages);
      return 1;
    }
    return variant == kDecodeWarpMma2 ? decode_warp2::CtasPerSm<T, kHeadDim>(stages)
                                      : decode_warp::CtasPerSmMma<T, kHeadDim>(stages);
  }
  return rows_cap <= 4 ? decode_warp::CtasPerSm<T, kHeadDim, 4>(stages)
                       : decode_warp::CtasPerSm<T, kHeadDim, 8>(stages);
}

}  // namespace jax_sgl::cuda
