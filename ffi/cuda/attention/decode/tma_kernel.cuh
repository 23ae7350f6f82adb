// Decode attention, warp-sliced mma kernel fed by the tensor copy engine (the default decode
// kernel on sm_90+ where it serves, below): the cp.async form (decode/cp_async_kernel.cuh:
// per-warp rings of 16-key stages, one m16 tile of packed rows, merge of the 4 warps at the end)
// with each stage's K and V loaded by `cp.async.bulk.tensor` instead of 32 lanes x 16 cp.async
// copies of 16 bytes.
//
// Why: the L2 prefetch experiment (benchmarks/notes/NOTES_decode.md) read the cp.async form's
// stream as bound by L2 request work, not by DRAM locality or bytes in flight. A stage's 16 keys of one kv head are
// 16 rows of 2 x 128 bytes (d = 128); one TMA box per 128-byte column block asks for them in one
// instruction, and the copy engine, not 32 lanes' LDGSTS, makes the L2 requests.
//
// Geometry: K and V are seen as 3-D tensors (head dim, kv head, row) over the whole buffer
// (dense: batch x seqlen_k rows, varlen: total_k, paged: num_pages x page_size), box
// (64, 1, 16) with the 128-byte swizzle, so ldmatrix reads the tile without bank conflicts. A
// stage is 16 consecutive rows: the keys of a sequence from n_lo rounded down to 16, so with
// pages of a multiple of 16 keys a stage never straddles two pages. Keys of the stage outside
// [n_lo, n_hi) or behind a page entry outside [0, num_pages) are masked: their K rows give -inf
// scores, and their V rows (whatever the buffer holds there: another sequence, an unwritten
// slot) are zeroed in shared memory before P V, as the cp.async kernels zero-fill them. A stage
// behind a bad page entry issues no copy at all; rows past the buffer's end are the copy
// engine's zero fill. So nothing outside the buffers is read.
//
// Served (fwd_dispatch.cc): head-dim capacity 64 or 128, dense / varlen K/V, or paged with a
// page size that is a multiple of 16, buffers of < 2^31 rows, on a device of compute capability
// 9.0 or later. Everything else of the warp mma kernels (masks, softcap, LSE, splits) is theirs.
//
// Over jax_sgl's fp8 KV cache (kFp8Kv: e4m3 K/V under bf16/fp16 q), a stage's K and V tiles are
// 16 rows of kD bytes, one TMA box (kD, 1, 16) each with the kD-byte swizzle (128 or 64 bytes),
// half the 16-bit tiles' bytes; decode_fp8kv (fp8_kv_operands.cuh) turns them into f16 in
// registers (the mma type under bf16 q too), k_descale joins the score scale and v_descale the
// output.
#pragma once

#include "ffi/cuda/attention/common/tensor_map.h"
#include "ffi/cuda/attention/decode/block_kernel.cuh"
#include "ffi/cuda/attention/decode/cp_async_kernel.cuh"
#include "ffi/cuda/attention/decode/warp_steps.cuh"

namespace jax_sgl::cuda {
namespace decode_tma {

using flash::Elem;
using flash::Ldmatrix4;
using flash::SmemAddr;

struct Params {
  FlashDecodeArgs args;
  CUtensorMap k_map;  // (head_dim, num_kv_heads, rows), box (64, 1, 16), 128-byte swizzle
  CUtensorMap v_map;  // (head_dim_v, ...), the same box
};

constexpr int kKeys = 16;
constexpr int kBlockBytes = kKeys * 128;  // one 128-byte column block of a 16-key tile

// Byte offset of element (row, col) in a tile of kD / 64 column blocks of 16 rows x 128 bytes,
// each written by the copy engine with the 128-byte swizzle (16-byte chunk c of row r lands at
// chunk c ^ (r % 8)).
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int col) {
  return uint32_t((col / 64) * kBlockBytes + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) +
                  (col % 8) * 2);
}

__device__ __forceinline__ void BarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void BarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void BarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "wait_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                          int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

template <int kD>
constexpr int StageBytes() { return 2 * (kD / 64) * kBlockBytes; }
static_assert(DecodeWarpTmaSmemBytes(128, 3) >=
                  16 * DecodeStride(128) * 2 + 1024 + 4 * 3 * StageBytes<128>() + 4 * 8 * 12,
              "DecodeWarpTmaSmemBytes covers the layout below");

// Byte offset of K/V byte (row, byte) of an fp8 tile: rows of kD bytes, written by the copy engine
// with the kD-byte swizzle (16-byte chunk bits 4.. XOR address bits 7..; 128B: chunk c of row r
// lands at c ^ (r % 8), 64B: at c ^ (r / 2 % 4)).
template <int kD>
__device__ __forceinline__ uint32_t Fp8SwizzledOffset(int row, int byte) {
  const uint32_t off = uint32_t(row * kD + byte);
  return off ^ (((off >> 7) & uint32_t(kD / 16 - 1)) << 4);
}

// grid: x = batch * num_kv_heads, y = KV splits; kDecodeWarpThreads threads.
template <typename T, int kD, bool kFp8Kv = false>
__global__ void __launch_bounds__(kDecodeWarpThreads, 3)
    FlashDecodeTmaKernel(const __grid_constant__ Params prm) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kD == 64 || kD == 128, "whole 128-byte column blocks, at most two");
  constexpr int kStride = DecodeStride(kD);
  constexpr int kWarps = kDecodeWarpThreads / 32;
  constexpr int kBlocks = kD / 64;
  constexpr int kTileBytes = kFp8Kv ? kKeys * kD : kBlocks * kBlockBytes;
  constexpr int kDT = kD / 8;
  constexpr uint32_t kNoRow = 0xffffffffu;
  extern __shared__ __align__(16) uint8_t smem[];
  const FlashDecodeArgs& args = prm.args;
  const AttentionParams& p = args.fwd.p;
  const int group = args.fwd.group;
  const int num_splits = args.fwd.num_splits;
  const int stages = args.stages;
  const int b = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const SeqBounds s = GetSeqBounds(p, b);
  const int rows_here = min(kDecodeWarpMmaMaxRows, s.q_len * group);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Stages start at a multiple of 16 keys, so that none straddles a page.
  const decode_warp_mma::WarpStages<kKeys, true> stages_of(p, s, group, rows_here, num_splits,
                                                           warp);
  const int n_lo = stages_of.n_lo, n_hi = stages_of.n_hi, my_tiles = stages_of.my_tiles;

  T* sq = reinterpret_cast<T*>(smem);
  const uint32_t smem0 = SmemAddr(smem);
  const uint32_t ring0 = (smem0 + 16 * kStride * 2 + 1023) & ~1023u;
  const uint32_t ring = ring0 + uint32_t(warp * stages * 2 * kTileBytes);
  uint8_t* ring_ptr = smem + (ring - smem0);
  const uint32_t bars = ring0 + uint32_t(kWarps * stages * 2 * kTileBytes) +
                        uint32_t(warp * kDecodeMaxStages * 8);
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + (ring0 - smem0) +
                                                kWarps * stages * 2 * kTileBytes +
                                                kWarps * kDecodeMaxStages * 8) +
                    warp * kDecodeMaxStages;

  // First row of this warp's i-th stage in the [rows, Hkv, D] buffer, kNoRow past the range or
  // behind a bad page entry; and which of its 16 keys are in [n_lo, n_hi).
  const bool paged = p.kv_layout == KvLayout::kPaged;
  const FastDiv page_div(paged ? uint32_t(p.page_size) : 1u);
  const int32_t* page_row = paged ? p.page_table + int64_t(b) * p.max_pages : nullptr;
  auto stage_row = [&](int i) -> uint32_t {
    if (i >= my_tiles) return kNoRow;
    const int j = stages_of.Key0(i);
    if (!paged) return uint32_t(s.k_row0) + uint32_t(j);
    const uint32_t pg = page_div.Div(uint32_t(j));
    const int page = page_row[pg];
    if (page < 0 || page >= p.num_pages) return kNoRow;
    return uint32_t(page) * uint32_t(p.page_size) + (uint32_t(j) - pg * uint32_t(p.page_size));
  };
  auto in_range = [&](int key0) -> uint32_t {
    const int lo = max(n_lo - key0, 0), hi = min(n_hi - key0, kKeys);
    return hi > lo ? ((0xffffu >> (kKeys - (hi - lo))) << lo) : 0u;
  };

  // Lane 0 copies stage i into ring slot st: both tensors' column blocks on the slot's barrier,
  // or, behind a bad page entry, nothing (the barrier completes on the arrival alone).
  auto issue = [&](uint32_t row, int i, int st) {
    const uint32_t bar = bars + uint32_t(st) * 8;
    const uint32_t dst = ring + uint32_t(st) * 2 * kTileBytes;
    if (row != kNoRow && kFp8Kv) {
      BarArriveExpectTx(bar, 2 * kTileBytes);
      TmaLoad3d(dst, &prm.k_map, bar, 0, kv_head, int(row));
      TmaLoad3d(dst + kTileBytes, &prm.v_map, bar, 0, kv_head, int(row));
    } else if (row != kNoRow) {
      BarArriveExpectTx(bar, 2 * kTileBytes);
#pragma unroll
      for (int blk = 0; blk < kBlocks; ++blk) {
        TmaLoad3d(dst + blk * kBlockBytes, &prm.k_map, bar, blk * 64, kv_head, int(row));
        TmaLoad3d(dst + kTileBytes + blk * kBlockBytes, &prm.v_map, bar, blk * 64, kv_head,
                  int(row));
      }
    } else {
      BarArrive(bar);
    }
    masks[st] = row != kNoRow ? in_range(stages_of.Key0(i)) : 0u;
  };

  if (lane == 0) {
    for (int st = 0; st < stages; ++st) BarInit(bars + uint32_t(st) * 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  uint32_t next_row = kNoRow;
  if (lane == 0) {
    for (int i = 0; i < stages - 1 && i < my_tiles; ++i) issue(stage_row(i), i, i);
    next_row = stage_row(stages - 1);
  }
  decode_warp_mma::LoadQRows<T, kD, kFp8Kv>(p, s, group, kv_head, rows_here, sq);
  __syncthreads();

  decode_warp_mma::StageScoring scoring(p, s, group, rows_here, lane);
  if constexpr (kFp8Kv) {
    float inv_pow2[2];
    decode_warp_mma::QRowPow2<T, kD>(sq, lane, inv_pow2);
    scoring.ScaleRows(p.k_descale.At(b, kv_head), inv_pow2);
  }

  uint32_t qa[kD / 16][4];
  decode_warp_mma::LoadQFragments<T, kD>(sq, lane, qa);

  float o[kDT][4];
#pragma unroll
  for (int t = 0; t < kDT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  int st_read = 0, st_write = stages - 1;
  uint32_t parity = 0;
  for (int it = 0; it < my_tiles; ++it) {
    // Every lane is done with the slot read last iteration (st_write now) before it refills.
    __syncwarp();
    if (lane == 0) {
      if (it + stages - 1 < my_tiles) issue(next_row, it + stages - 1, st_write);
      next_row = stage_row(it + stages);
    }
    st_write = st_write + 1 == stages ? 0 : st_write + 1;

    BarWait(bars + uint32_t(st_read) * 8, parity);
    __syncwarp();
    const uint32_t valid = masks[st_read];
    const uint32_t sk = ring + uint32_t(st_read) * 2 * kTileBytes;
    uint8_t* sv_ptr = ring_ptr + st_read * 2 * kTileBytes + kTileBytes;
    if (valid != 0xffffu) {
      // Masked keys' V rows hold whatever the buffer has there: zero them, so 0 x V stays 0.
      constexpr int kRowChunks = kTileBytes / kKeys / 16;
      for (int idx = lane; idx < kKeys * kRowChunks; idx += 32) {
        const int r = idx / kRowChunks, c = idx % kRowChunks;
        if constexpr (kFp8Kv) {
          if (!((valid >> r) & 1u))
            *reinterpret_cast<uint4*>(sv_ptr + r * kD + c * 16) = make_uint4(0, 0, 0, 0);
        } else {
          if (!((valid >> r) & 1u))
            *reinterpret_cast<uint4*>(sv_ptr + (c / 8) * kBlockBytes + r * 128 + (c % 8) * 16) =
                make_uint4(0, 0, 0, 0);
        }
      }
      // The slot's next fill is the copy engine's (async proxy) write after these.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
    }
    st_read = st_read + 1 == stages ? 0 : st_read + 1;
    if (st_read == 0) parity ^= 1u;
    const int key0 = stages_of.Key0(it);

    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if constexpr (kFp8Kv) {
      decode_fp8kv::Scores<kD>(
          qa, [&](int row, int byte) { return sk + Fp8SwizzledOffset<kD>(row, byte); }, lane, sc);
    } else {
#pragma unroll
      for (int k0 = 0; k0 < kD; k0 += 16) {
        uint32_t bk[4];
        const int row = lane % 8 + (lane / 16) * 8, col = k0 + ((lane / 8) % 2) * 8;
        asm volatile(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
            : "=r"(bk[0]), "=r"(bk[1]), "=r"(bk[2]), "=r"(bk[3])
            : "r"(sk + SwizzledOffset(row, col)));
        Elem<T>::Mma(sc[0], qa[k0 / 16], bk);
        Elem<T>::Mma(sc[1], qa[k0 / 16], bk + 2);
      }
    }
    float blk_max[2];
    if constexpr (kFp8Kv) {
      scoring.ApplyRows(sc, key0, valid, lane, blk_max);
      decode_fp8kv::SoftmaxPv<kD>(
          sc, blk_max, m_run, l_run, o,
          [&](int row, int byte) { return sk + kTileBytes + Fp8SwizzledOffset<kD>(row, byte); },
          lane);
    } else {
      scoring.Apply(sc, key0, valid, lane, blk_max);
      decode::SoftmaxPvAt<T, kD, true>(
          sc, blk_max, m_run, l_run, o,
          [&](int row, int col) -> const void* { return sv_ptr + SwizzledOffset(row, col); },
          lane);
    }
  }

  decode_warp_mma::MergeWarpsAndStore<T, kD, kFp8Kv>(args, s, b, kv_head, rows_here, smem, m_run,
                                                     l_run, o);
#endif
}

// The copy engine's L2 promotion of the loads: 128 bytes. With 256 (as cp_async_kernel.cuh's
// .L2::256B hint) half of the L2 reads hit (ncu): each stage row is 256 bytes, so the promoted
// second half comes back as a hit and costs L2 work for no DRAM gain; 128 and 0 ran 3-6% faster
// on the H200.
inline constexpr CUtensorMapL2promotion kL2Promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;

// A 3-D tiled map of one K/V buffer: (head dim, kv head, row), box (box_d, 1, 16) of
// elem_bytes-byte elements with `swizzle`, with the params' element strides of a kv head and a row
// (a fused K/V buffer is read in place); false when the driver refuses it (the dispatch checked
// the shapes it needs).
inline bool EncodeMap(CUtensorMap* map, CUtensorMapDataType type, int elem_bytes, int box_d,
                      CUtensorMapSwizzle swizzle, const void* base, int head_dim,
                      int num_kv_heads, int64_t rows, int64_t head_stride, int64_t row_stride,
                      CUtensorMapL2promotion promotion) {
  const TensorMapEncodeFn encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(head_dim), cuuint64_t(num_kv_heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(head_stride) * elem_bytes,
                                 cuuint64_t(row_stride) * elem_bytes};
  const cuuint32_t box[3] = {cuuint32_t(box_d), 1, kKeys};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, type, 3, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// kFp8Kv: K/V are e4m3 bytes (boxes of whole kD-byte rows), else q's 16-bit type.
template <typename T, int kD, bool kFp8Kv = false>
cudaError_t Launch(const FlashDecodeArgs& args, cudaStream_t stream) {
  const AttentionParams& p = args.fwd.p;
  Params prm;
  prm.args = args;
  const CUtensorMapDataType type = TensorMapType<T>(kFp8Kv);
  const int elem_bytes = kFp8Kv ? 1 : 2;
  const int box_d = kFp8Kv ? kD : 64;
  const CUtensorMapSwizzle swizzle = !kFp8Kv || kD == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                                          : CU_TENSOR_MAP_SWIZZLE_64B;
  const CUtensorMapL2promotion promotion = kL2Promotion;
  if (!EncodeMap(&prm.k_map, type, elem_bytes, box_d, swizzle, p.k, p.head_dim, p.num_kv_heads,
                 p.total_k, p.k_head_stride, p.k_row_stride, promotion) ||
      !EncodeMap(&prm.v_map, type, elem_bytes, box_d, swizzle, p.v, p.head_dim_v, p.num_kv_heads,
                 p.total_k, p.v_head_stride, p.v_row_stride, promotion))
    return cudaErrorInvalidValue;
  return decode_warp_mma::LaunchWithSmem(FlashDecodeTmaKernel<T, kD, kFp8Kv>, prm, args,
                                         DecodeWarpTmaSmemBytes(kD, args.stages, elem_bytes),
                                         stream);
}

template <typename T, int kD, bool kFp8Kv = false>
int CtasPerSm(int stages) {
  return decode_warp_mma::CtasPerSmWithSmem(FlashDecodeTmaKernel<T, kD, kFp8Kv>,
                                            DecodeWarpTmaSmemBytes(kD, stages, kFp8Kv ? 1 : 2));
}

}  // namespace decode_tma
}  // namespace jax_sgl::cuda
