// Decode attention (sm_80+): at most kDecodeMaxQLen query rows per sequence against a long KV,
// dense, varlen or paged. Decode is bound by reading K/V once from HBM, so the kernel is built
// around keeping enough loads in flight rather than around the math:
//   - one CTA per (q-row block, KV split, sequence x kv head): the q heads sharing a kv head and
//     the q rows of the step are packed into up to 64 rows (row r = query r / group, head
//     r % group), so each K/V byte is read once per CTA;
//   - a ring of `stages` shared-memory stages filled by cp.async (16-byte copies, L2 prefetch
//     hint); while a CTA computes one stage, stages - 1 are in flight (48 KiB at 4 stages, d = 128),
//     and several CTAs share an SM;
//   - every thread stages one key row per stage, and reads that row's page-table entry one
//     iteration ahead of its copy, so the gather adds no latency to the loop; entries outside
//     [0, num_pages) are zero-filled keys masked by a per-stage flag (never read);
//   - the dot products are mma.sync m16n8k16 on 16-key chunks: warp w owns m16 tile w % m_tiles of
//     the packed rows and every (4 / m_tiles)-th chunk, with its own online softmax (log2
//     domain); the warps sharing a tile merge through shared memory at the end, then the CTA
//     writes out + lse, or its split's float32 partials for the combine kernel.
// Causal and windows are bottom-right aligned per query row, as everywhere in jax_sgl.
// Included only by the generated instantiation files (instantiations/decode_*.cu).
#pragma once

#include "ffi/common/attention_sink.h"
#include "ffi/cuda/attention/decode/launch.h"
#include "ffi/cuda/attention/decode/stage_softmax.cuh"
#include "ffi/cuda/attention/common/mma.cuh"
#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/common/row_scores.cuh"

namespace jax_sgl::cuda {
namespace decode {

using flash::Elem;
using flash::kLn2;
using flash::Ldmatrix4;
using flash::QuadSum;
using flash::SmemAddr;

template <int kD>
struct DecodeConfig {
  static_assert(kD % 32 == 0, "head-dim capacity must be a multiple of 32");
  static constexpr int kThreads = kDecodeThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kBlockN = DecodeBlockN(kD);
  static constexpr int kChunksPerTile = kBlockN / 16;  // 16-key mma chunks per stage
  static constexpr int kStride = DecodeStride(kD);
  static constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  // Staging: kThreadsPerRow threads share one key row, kChunksPerThread chunks each, interleaved
  // so that consecutive threads copy consecutive 16 bytes.
  static constexpr int kThreadsPerRow = kThreads / kBlockN;
  static constexpr int kChunksPerThread = kChunks / kThreadsPerRow;
  static constexpr int kTileBytes = DecodeTileBytes(kD);
  static constexpr int kStageBytes = DecodeStageBytes(kD);
  static constexpr int kOStride = kD + 4;  // epilogue float rows
  static_assert(kThreads % kBlockN == 0 && kChunks % kThreadsPerRow == 0,
                "one key row per thread group");
  static_assert(kBlockN % 16 == 0, "stage = whole 16-key chunks");
};

// 16-byte async copy with an L2 prefetch of the surrounding 128 or 256 bytes (a K/V row of one
// head is 128 B at d = 64, 256 B at d >= 128); src_bytes == 0 writes zeros and reads nothing.
template <int kRowBytes>
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, int src_bytes) {
  if constexpr (kRowBytes >= 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)),
                 "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)),
                 "l"(src), "r"(src_bytes));
  }
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }

// cp.async.wait_group takes an immediate: one case per ring depth.
__device__ __forceinline__ void CpAsyncWaitPending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
  }
}

// Where this thread's key row of a tile comes from: the row of the k/v buffers holding key j, or
// -1 for a key past the range or behind an out-of-range page-table entry (zero-filled, masked).
__device__ __forceinline__ int64_t KeySourceRow(const AttentionParams& p, int b, const SeqBounds& s,
                                                int j, int n_end) {
  if (j >= n_end) return -1;
  return KeyRow(p, b, s, j);
}

// The CTA's view of one call: which rows and keys it owns and where its stages live.
template <typename T, int kD>
struct DecodeCta {
  using Cfg = DecodeConfig<kD>;
  const AttentionParams& p;
  int b, kv_head;
  SeqBounds s;
  int n_lo, n_hi;  // keys any of the CTA's rows may see
  uint8_t* smem;
  int q_bytes;

  __device__ T* StageK(int st) const {
    return reinterpret_cast<T*>(smem + q_bytes + st * Cfg::kStageBytes);
  }
  __device__ T* StageV(int st) const {
    return reinterpret_cast<T*>(smem + q_bytes + st * Cfg::kStageBytes + Cfg::kTileBytes);
  }
  __device__ uint8_t* StageFlags(int st) const {
    return smem + q_bytes + st * Cfg::kStageBytes + 2 * Cfg::kTileBytes;
  }

  // This thread's key row of tile t (absolute tile index from n_lo).
  __device__ int64_t SourceRow(int t) const {
    const int j = n_lo + t * Cfg::kBlockN + threadIdx.x / Cfg::kThreadsPerRow;
    return KeySourceRow(p, b, s, j, n_hi);
  }

  // Copies this thread's share of key row `row` into stage st (K and V), and its valid flag.
  __device__ void IssueRow(int64_t row, int st) const {
    constexpr int kRowBytes = kD * 2;
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
    const int r = threadIdx.x / Cfg::kThreadsPerRow, c0 = threadIdx.x % Cfg::kThreadsPerRow;
    const bool ok = row >= 0;
    const T* ksrc = ok ? k + row * p.k_row_stride + kv_head * p.k_head_stride : k;
    const T* vsrc = ok ? v + row * p.v_row_stride + kv_head * p.v_head_stride : v;
    T* sk = StageK(st) + r * Cfg::kStride;
    T* sv = StageV(st) + r * Cfg::kStride;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksPerThread; ++i) {
      const int c = (c0 + i * Cfg::kThreadsPerRow) * 8;
      const bool kok = ok && c < p.head_dim, vok = ok && c < p.head_dim_v;
      CpAsync16<kRowBytes>(sk + c, kok ? ksrc + c : k, kok ? 16 : 0);
      CpAsync16<kRowBytes>(sv + c, vok ? vsrc + c : v, vok ? 16 : 0);
    }
    if (c0 == 0) StageFlags(st)[r] = ok;
  }
};

// grid: x = q-row blocks x (batch * num_kv_heads) (row block fastest, so the CTAs of one kv head
// that share K/V run together and meet in L2), y = KV splits. 128 threads.
template <typename T, int kD>
__global__ void __launch_bounds__(kDecodeThreads) FlashDecodeKernel(const FlashDecodeArgs args) {
  using Cfg = DecodeConfig<kD>;
  constexpr int kDT = kD / 8;  // n8 tiles of the output per warp
  extern __shared__ __align__(16) uint8_t smem[];
  const AttentionParams& p = args.fwd.p;
  const int group = args.fwd.group;
  const int num_splits = args.fwd.num_splits;
  const int stages = args.stages;
  const int mb = blockIdx.x % args.m_blocks;
  const int bh = blockIdx.x / args.m_blocks;
  const int b = bh / p.num_kv_heads, kv_head = bh % p.num_kv_heads;
  const SeqBounds s = GetSeqBounds(p, b);
  const int rows = s.q_len * group;
  const int m0 = mb * kDecodeMaxRows;
  if (m0 >= rows) return;  // the combine kernel reads no partial of these rows either
  // The host sized shared memory for args.m_tiles m16 tiles from the rows bound; never exceed it.
  const int rows_here = min(min(kDecodeMaxRows, args.m_tiles * 16), rows - m0);
  // m16 tiles this CTA fills (1, 2 or 4) and key chunks interleaved over the warps of a tile.
  const int m_tiles = rows_here > 32 ? 4 : (rows_here > 16 ? 2 : 1);
  const int warps_n = Cfg::kWarps / m_tiles;

  // Keys the CTA's rows may see (row ranges are monotone in the query row), as whole tiles from
  // n_lo; this split takes tiles [t_begin, t_end), an even share.
  int n_lo, n_hi, unused;
  KeyRange(p, s, m0 / group, &n_lo, &unused);
  KeyRange(p, s, (m0 + rows_here - 1) / group, &unused, &n_hi);
  const int n_tiles = n_hi > n_lo ? (n_hi - n_lo + Cfg::kBlockN - 1) / Cfg::kBlockN : 0;
  const int t_begin = int(int64_t(n_tiles) * blockIdx.y / num_splits);
  const int t_end = int(int64_t(n_tiles) * (blockIdx.y + 1) / num_splits);
  const int num_t = t_end - t_begin;

  const int q_bytes = args.m_tiles * 16 * Cfg::kStride * 2;
  const DecodeCta<T, kD> cta{p, b, kv_head, s, n_lo, n_hi, smem, q_bytes};
  T* sq = reinterpret_cast<T*>(smem);

  // Prologue: q rows (zero past rows_here and past head_dim), then the first stages - 1 tiles.
  // The page-table reads of the first `stages` tiles are issued together, before any copy.
  {
    const T* q = static_cast<const T*>(p.q);
    for (int idx = threadIdx.x; idx < m_tiles * 16 * Cfg::kChunks; idx += Cfg::kThreads) {
      const int r = idx / Cfg::kChunks, c = (idx % Cfg::kChunks) * 8;
      const T* src = q;
      bool ok = r < rows_here && c < p.head_dim;
      if (ok) {
        const int pr = m0 + r;
        src = q + ((s.q_row0 + pr / group) * p.num_heads + kv_head * group + pr % group) *
                      p.head_dim + c;
      }
      CpAsync16<128>(sq + r * Cfg::kStride + c, src, ok ? 16 : 0);
    }
  }
  // Source rows of tiles 0 .. stages - 2 (issued now) and stages - 1 (issued by the first loop
  // iteration): independent loads, all in flight together. Every index into first_rows is a
  // compile-time constant after unrolling, so the array stays in registers.
  int64_t first_rows[kDecodeMaxStages - 1];
#pragma unroll
  for (int t = 0; t < kDecodeMaxStages - 1; ++t)
    first_rows[t] = t < stages - 1 && t < num_t ? cta.SourceRow(t_begin + t) : -1;
  int64_t next_row = stages - 1 < num_t ? cta.SourceRow(t_begin + stages - 1) : -1;
#pragma unroll
  for (int t = 0; t < kDecodeMaxStages - 1; ++t) {
    if (t < stages - 1) {
      if (t < num_t) cta.IssueRow(first_rows[t], t);
      CpAsyncCommit();
    }
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % m_tiles, wn = warp / m_tiles;

  // This thread's two packed rows (lane / 4 and lane / 4 + 8 of its warp's m16 tile).
  const flash::RowScores scoring(p, s, group, wm * 16, rows_here, m0, lane);

  float o[kDT][4];
#pragma unroll
  for (int t = 0; t < kDT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  int st_read = 0, st_write = stages - 1;
  for (int it = 0; it < num_t; ++it) {
    // Tile it has landed (stages - 2 later groups may still be in flight), and every warp is
    // done with the stage computed last iteration: refill it with tile it + stages - 1.
    CpAsyncWaitPending(stages - 2);
    __syncthreads();
    if (it + stages - 1 < num_t) cta.IssueRow(next_row, st_write);
    CpAsyncCommit();
    next_row = it + stages < num_t ? cta.SourceRow(t_begin + it + stages) : -1;
    st_write = st_write + 1 == stages ? 0 : st_write + 1;

    const int tile = t_begin + it;
    const T* sk = cta.StageK(st_read);
    const T* sv = cta.StageV(st_read);
    const uint8_t* flags = cta.StageFlags(st_read);
    st_read = st_read + 1 == stages ? 0 : st_read + 1;
#pragma unroll
    for (int ci = 0; ci < Cfg::kChunksPerTile; ++ci) {
      if (((tile * Cfg::kChunksPerTile + ci) & (warps_n - 1)) != wn) continue;
      const int key0 = n_lo + tile * Cfg::kBlockN + ci * 16;

      // S = Q K^T: the warp's 16 rows x 16 keys (two n8 tiles).
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int k0 = 0; k0 < kD; k0 += 16) {
        uint32_t a[4], bk[4];
        Ldmatrix4(a, sq + (wm * 16 + lane % 16) * Cfg::kStride + k0 + (lane / 16) * 8);
        Ldmatrix4(bk, sk + (ci * 16 + lane % 8 + (lane / 16) * 8) * Cfg::kStride + k0 +
                          ((lane / 8) % 2) * 8);
        Elem<T>::Mma(sc[0], a, bk);
        Elem<T>::Mma(sc[1], a, bk + 2);
      }

      // Scale (+ softcap) into the log2 domain, mask, online-softmax update.
      float blk_max[2];
      scoring.MaskAndMax(
          sc, key0, lane, [flags, ci](int c) -> bool { return flags[ci * 16 + c]; }, blk_max);
      // Online-softmax update, then O += P V (the S accumulators are the A fragment of P).
      SoftmaxPvAt<T, kD, false>(
          sc, blk_max, m_run, l_run, o,
          [sv, ci](int row, int col) -> const void* {
            return sv + (ci * 16 + row) * Cfg::kStride + col;
          },
          lane);
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  // Epilogue: warps sharing an m16 tile merge (m, l, o) through shared memory (reused: every
  // warp is past its last stage read), normalize, then write out + lse or the split's partials.
  __syncthreads();
  float* so = reinterpret_cast<float*>(smem);                             // [4][16][kOStride]
  float* sm = so + Cfg::kWarps * 16 * Cfg::kOStride;                      // [4][16]
  float* sl = sm + Cfg::kWarps * 16;                                      // [4][16]
  float* slse = sl + Cfg::kWarps * 16;                                    // [64]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] = QuadSum(l_run[h]);
    if (lane % 4 == 0) {
      sm[warp * 16 + lane / 4 + 8 * h] = m_run[h];
      sl[warp * 16 + lane / 4 + 8 * h] = l_run[h];
    }
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = lane / 4 + 8 * h;
    float m_all = -INFINITY;
    for (int w = wm; w < Cfg::kWarps; w += m_tiles) m_all = fmaxf(m_all, sm[w * 16 + rr]);
    float l_all = 0.f;
    if (m_all != -INFINITY) {
      for (int w = wm; w < Cfg::kWarps; w += m_tiles)
        l_all += sl[w * 16 + rr] * exp2f(sm[w * 16 + rr] - m_all);
    }
    // Fully masked rows (and a split with no keys): out 0, lse -inf (the sink's logit with
    // sinks). A split's partial leaves the sink to the combine.
    const int pr = m0 + wm * 16 + rr;
    const SinkedRow fin = ApplySinkOf(num_splits > 1 ? nullptr : p.sinks,
                                      kv_head * group + pr % group,
                                      l_all > 0.f ? (m_all + log2f(l_all)) * kLn2 : -INFINITY);
    f[h] = l_all > 0.f ? fin.scale * exp2f(m_run[h] - m_all) / l_all : 0.f;
    if (wn == 0 && lane % 4 == 0) slse[wm * 16 + rr] = fin.lse;
  }
#pragma unroll
  for (int t = 0; t < kDT; ++t) {
    const int c = t * 8 + (lane % 4) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* dst = so + (warp * 16 + lane / 4 + 8 * h) * Cfg::kOStride + c;
      dst[0] = o[t][2 * h] * f[h];
      dst[1] = o[t][2 * h + 1] * f[h];
    }
  }
  __syncthreads();

  const bool split = num_splits > 1;
  const int dv = p.head_dim_v;
  for (int idx = threadIdx.x; idx < rows_here * Cfg::kChunks; idx += Cfg::kThreads) {
    const int r = idx / Cfg::kChunks, c = (idx % Cfg::kChunks) * 8;
    if (c >= dv) continue;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int w = r / 16; w < Cfg::kWarps; w += m_tiles) {
      const float4* src = reinterpret_cast<const float4*>(so + (w * 16 + r % 16) * Cfg::kOStride + c);
      const float4 x0 = src[0], x1 = src[1];
      acc[0] += x0.x; acc[1] += x0.y; acc[2] += x0.z; acc[3] += x0.w;
      acc[4] += x1.x; acc[5] += x1.y; acc[6] += x1.z; acc[7] += x1.w;
    }
    const int pr = m0 + r;
    const int64_t row_head = (s.q_row0 + pr / group) * p.num_heads + kv_head * group + pr % group;
    if (split) {
      float4* dst = reinterpret_cast<float4*>(
          args.fwd.o_partial + (int64_t(blockIdx.y) * p.total_q * p.num_heads + row_head) * dv + c);
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
  for (int r = threadIdx.x; r < rows_here; r += Cfg::kThreads) {
    const int pr = m0 + r;
    const int i = pr / group, head = kv_head * group + pr % group;
    if (split) {
      args.fwd.lse_partial[int64_t(blockIdx.y) * p.total_q * p.num_heads +
                           (s.q_row0 + i) * p.num_heads + head] = slse[r];
    } else {
      const int64_t idx = p.cu_seqlens_q ? int64_t(head) * p.total_q + s.lse_row0 + i
                                         : (int64_t(b) * p.num_heads + head) * p.seqlen_q + i;
      p.lse[idx] = slse[r];
    }
  }
}

}  // namespace decode

template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecode(const FlashDecodeArgs& args, cudaStream_t stream) {
  const AttentionParams& p = args.fwd.p;
  const dim3 grid(unsigned(int64_t(args.m_blocks) * p.batch * p.num_kv_heads),
                  unsigned(args.fwd.num_splits));
  return LaunchWithSmem(decode::FlashDecodeKernel<T, kHeadDim>, grid, kDecodeThreads,
                        DecodeSmemBytes(kHeadDim, args.stages, args.m_tiles), stream, args);
}

}  // namespace jax_sgl::cuda
