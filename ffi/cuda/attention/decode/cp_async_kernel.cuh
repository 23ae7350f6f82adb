// Decode attention, warp-sliced mma kernel on cp.async stages with cheap copy addressing: the
// form for devices without the tensor copy engine's use here (tma_kernel.cuh) and pools of < 2^31
// rows. Per-warp cp.async rings of 16-key stages, the m16n8k16 chunk on one m16 tile of packed
// rows, merge of the 4 warps at the end (warp_steps.cuh), with the issue path at a few SASS
// instructions per key (~55 in a 64-bit-index form, benchmarks/notes/experiments.md):
//   - the key's source row is resolved once per stage by the lane that owns the key, as a 32-bit
//     slot index (the host sends only pools of < 2^31 rows here); the copying lanes shuffle that
//     one word and make the address with one IMAD.WIDE.U32 per tensor (slot x row stride + the
//     lane's fixed (kv head, 16-byte chunk) base), instead of 64-bit products per copy;
//   - the page lookup divides by the page size with a multiply-high (FastDiv, set up once), not
//     an integer division per stage;
//   - a key that is past the range or behind a bad page entry copies nothing from global memory
//     (ignore-src: its K/V rows are zero-filled); chunks past head_dim copy finite data of the
//     same row, which zero q columns / unwritten output columns cancel;
//   - a stage every row sees whole (all 16 keys valid and inside every row's [lo, hi)) skips the
//     per-element masking, and a stage that moves no row's running max skips the rescale of the
//     accumulators (warp-uniform branches): the middle of every long sequence.
// Layouts, masks, softcap, LSE and split partials are those of block_kernel.cuh.
//
// Over jax_sgl's fp8 KV cache (kFp8Kv: e4m3 K/V under bf16/fp16 q; any page size, where the TMA
// form needs pages of a multiple of 16): stage rows of kD bytes padded to kD + 16 (conflict-free
// 16-byte reads of decode_fp8kv's fragment orders at kD = 128), 16-byte copies of 16 elements,
// decode_fp8kv (fp8_kv_operands.cuh) for the mma operands and the descales.
#pragma once

#include "ffi/cuda/attention/common/fast_div.h"
#include "ffi/cuda/attention/decode/block_kernel.cuh"
#include "ffi/cuda/attention/decode/warp_steps.cuh"

namespace jax_sgl::cuda {
namespace decode_cp_async {

using flash::Elem;
using flash::Ldmatrix4;
using flash::SmemAddr;

// 16-byte cp.async; `skip` writes zeros and reads nothing (the ignore-src form, which LDGSTS
// takes as a predicate: no src-size register to select per copy).
__device__ __forceinline__ void CpAsync16(uint32_t dst, uint64_t src, bool skip) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " cp.async.cg.shared.global.L2::256B [%0], [%1], 16, p;\n}\n" ::"r"(dst),
      "l"(src), "r"(int(skip)));
}

// The value, opaque to the optimizer: keeps a 64-bit base in one register pair so that each
// copy address is a single IMAD.WIDE.U32 (slot x stride + base), not a product re-added to the
// pointer in two more instructions.
__device__ __forceinline__ uint64_t Opaque(uint64_t x) {
  asm volatile("mov.b64 %0, %0;" : "+l"(x));
  return x;
}

// The CTAs per SM the registers are held to: 3 at d <= 128 (168, no spills), which shared memory
// allows at 2 stages (~74 KiB a CTA). Over an fp8 KV cache at d = 128 the planned 5 stages (~94
// KiB) allow 2 CTAs whatever the registers, so they are held to 2 there: 168 left sm_100a one
// register short (a spill) once each q row has its own score scale (fp8_kv_operands.cuh).
constexpr int CpAsyncMinCtasPerSm(int d, bool fp8_kv) {
  return d > 128 ? 1 : fp8_kv && d == 128 ? 2 : 3;
}

// grid: x = batch * num_kv_heads, y = KV splits; kDecodeWarpThreads threads; shared memory as
// the 64-bit form (DecodeWarpMmaSmemBytes).
template <typename T, int kD, bool kFp8Kv = false>
__global__ void __launch_bounds__(kDecodeWarpThreads, CpAsyncMinCtasPerSm(kD, kFp8Kv))
    FlashDecodeCpAsyncKernel(const FlashDecodeArgs args) {
  constexpr int kStride = DecodeStride(kD);
  constexpr int kKeys = 16;
  // Bytes of a K/V element, and of a ring row (kFp8Kv: kD + 16; else kStride elements of T).
  constexpr int kKvBytes = kFp8Kv ? 1 : int(sizeof(T));
  constexpr int kRowBytes = DecodeWarpMmaRowBytes(kD, kKvBytes);
  constexpr int kChunks = kD * kKvBytes / 16;
  // One copy instruction of the warp covers kKeysPerCopy whole rows (d = 96 / 192: 24 of the
  // 32 lanes copy, so every lane keeps one fixed chunk of its rows).
  constexpr int kKeysPerCopy = kChunks >= 32 ? 1 : 32 / kChunks;
  constexpr int kCopyLanes = kKeysPerCopy * kChunks;
  constexpr int kCopies = kKeys / kKeysPerCopy;  // 16-byte copies per lane, K or V
  constexpr int kTileElems = kKeys * kStride;
  constexpr int kDT = kD / 8;
  constexpr uint32_t kNoRow = 0xffffffffu;
  static_assert(kChunks <= 32 && kKeys % kKeysPerCopy == 0, "whole rows per copy step");
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
  // kFp8Kv: the warp's byte ring (smaller than the 16-bit one `ring` would index).
  const uint32_t fp8_ring =
      SmemAddr(smem) + uint32_t(16 * kStride * 2 + warp * stages * 2 * kKeys * kRowBytes);
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + 16 * kStride * 2 +
                                                DecodeWarpMmaRingBytes(kD, stages, kKvBytes)) +
                    warp * kDecodeMaxStages;

  // Slot (row of the [rows, Hkv, D] pool) of key `key` of this warp's i-th stage, kNoRow past
  // the range or behind a bad page entry.
  const bool paged = p.kv_layout == KvLayout::kPaged;
  const FastDiv page_div(paged ? uint32_t(p.page_size) : 1u);
  const int32_t* page_row = paged ? p.page_table + int64_t(b) * p.max_pages : nullptr;
  const uint32_t dense_row0 = paged ? 0u : uint32_t(s.k_row0);
  auto source_slot = [&](int i, int key) -> uint32_t {
    if (i >= my_tiles || key >= kKeys) return kNoRow;
    const int j = stages_of.Key0(i) + key;
    if (j >= n_hi) return kNoRow;
    if (!paged) return dense_row0 + uint32_t(j);
    const uint32_t pg = page_div.Div(uint32_t(j));
    const int page = page_row[pg];
    if (page < 0 || page >= p.num_pages) return kNoRow;
    return uint32_t(page) * uint32_t(p.page_size) + (uint32_t(j) - pg * uint32_t(p.page_size));
  };

  // This lane's fixed part of every copy: chunk c of key (lane / kChunks) + kKeysPerCopy * i;
  // global bases at (kv_head, c) and row strides in bytes. A chunk past head_dim (a padded head
  // dim) copies the row's chunk 0 instead: finite data of the same row, which the zero q columns
  // (K) or the never-written output columns (V) cancel, so no copy needs a per-lane size.
  const int c = (lane % kChunks) * (16 / kKvBytes);
  const int key_lane = lane / kChunks;
  const int ck = c < p.head_dim ? c : 0, cv = c < p.head_dim_v ? c : 0;
  // Strides from the params (attention_params.h), so a fused K/V buffer is read in place; a row
  // stride is a few KiB at most (2 * Hkv * head_dim_pad elements), so 32 bits hold it in bytes.
  const uint64_t k_base = Opaque(reinterpret_cast<uint64_t>(p.k) +
                                 uint64_t(kv_head * p.k_head_stride + ck) * kKvBytes);
  const uint64_t v_base = Opaque(reinterpret_cast<uint64_t>(p.v) +
                                 uint64_t(kv_head * p.v_head_stride + cv) * kKvBytes);
  const uint32_t k_stride = uint32_t(p.k_row_stride * kKvBytes);
  const uint32_t v_stride = uint32_t(p.v_row_stride * kKvBytes);
  const uint32_t ring_lane =
      kFp8Kv ? fp8_ring + uint32_t(key_lane * kRowBytes + c)
             : SmemAddr(ring) + uint32_t((key_lane * kStride + c) * int(sizeof(T)));
  constexpr uint32_t kTileBytes = kKeys * kRowBytes;
  constexpr uint32_t kStageBytes = 2 * kTileBytes;

  // Copies a stage into ring slot st; lane lane0 + j holds the slot of its key j.
  const bool copy_lane = kCopyLanes == 32 || lane < kCopyLanes;
  auto issue = [&](uint32_t my_slot, int lane0, int st) {
    const uint32_t dst = ring_lane + uint32_t(st) * kStageBytes;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int src_lane = (lane0 + key_lane + i * kKeysPerCopy) & 31;
      const uint32_t slot = __shfl_sync(0xffffffffu, my_slot, src_lane);
      if (!copy_lane) continue;
      const bool ok = slot != kNoRow;
      const uint32_t row = ok ? slot : 0u;
      const uint32_t key_off = uint32_t(i * kKeysPerCopy * kRowBytes);
      CpAsync16(dst + key_off, k_base + uint64_t(row) * k_stride, !ok);
      CpAsync16(dst + key_off + kTileBytes, v_base + uint64_t(row) * v_stride, !ok);
    }
    const uint32_t valid = __ballot_sync(0xffffffffu, my_slot != kNoRow) >> lane0;
    if (lane == 0) masks[st] = valid & 0xffffu;
  };

  // Prologue: two stages' slots per lane register (lane l: key l % 16 of stage l / 16), the
  // first stages - 1 stages' copies, then q (plain loads: one barrier, once).
  constexpr int kRegs = (kDecodeMaxStages - 1 + 1) / 2;
  uint32_t first_slots[kRegs];
#pragma unroll
  for (int g = 0; g < kRegs; ++g) {
    const int i = g * 2 + lane / kKeys;
    first_slots[g] = i < stages - 1 ? source_slot(i, lane % kKeys) : kNoRow;
  }
  uint32_t next_slot = source_slot(stages - 1, lane);
#pragma unroll
  for (int i = 0; i < kDecodeMaxStages - 1; ++i) {
    if (i < stages - 1) {
      if (i < my_tiles) issue(first_slots[i / 2], (i % 2) * kKeys, i);
      decode::CpAsyncCommit();
    }
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
  for (int it = 0; it < my_tiles; ++it) {
    decode::CpAsyncWaitPending(stages - 2);
    __syncwarp();
    if (it + stages - 1 < my_tiles) issue(next_slot, 0, st_write);
    decode::CpAsyncCommit();
    next_slot = source_slot(it + stages, lane);
    st_write = st_write + 1 == stages ? 0 : st_write + 1;

    const T* sk = ring + st_read * 2 * kTileElems;
    const T* sv = sk + kTileElems;
    [[maybe_unused]] const uint32_t sk8 = fp8_ring + uint32_t(st_read) * kStageBytes;
    const uint32_t valid = masks[st_read];
    st_read = st_read + 1 == stages ? 0 : st_read + 1;
    const int key0 = stages_of.Key0(it);

    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if constexpr (kFp8Kv) {
      decode_fp8kv::Scores<kD>(
          qa, [&](int row, int byte) { return sk8 + uint32_t(row * kRowBytes + byte); }, lane,
          sc);
    } else {
#pragma unroll
      for (int k0 = 0; k0 < kD; k0 += 16) {
        uint32_t bk[4];
        Ldmatrix4(bk, sk + (lane % 8 + (lane / 16) * 8) * kStride + k0 + ((lane / 8) % 2) * 8);
        Elem<T>::Mma(sc[0], qa[k0 / 16], bk);
        Elem<T>::Mma(sc[1], qa[k0 / 16], bk + 2);
      }
    }
    float blk_max[2];
    if constexpr (kFp8Kv) {
      scoring.ApplyRows(sc, key0, valid, lane, blk_max);
      decode_fp8kv::SoftmaxPv<kD>(
          sc, blk_max, m_run, l_run, o,
          [&](int row, int byte) { return sk8 + kTileBytes + uint32_t(row * kRowBytes + byte); },
          lane);
    } else {
      scoring.Apply(sc, key0, valid, lane, blk_max);
      decode_warp_mma::SoftmaxPv<T, kD>(sc, blk_max, m_run, l_run, o, sv, lane);
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  decode_warp_mma::MergeWarpsAndStore<T, kD, kFp8Kv>(args, s, b, kv_head, rows_here, smem, m_run,
                                                     l_run, o);
}

template <typename T, int kD>
cudaError_t Launch(const FlashDecodeArgs& args, cudaStream_t stream) {
  return decode_warp_mma::Launch<kD>(FlashDecodeCpAsyncKernel<T, kD>, args, stream);
}

template <typename T, int kD>
int CtasPerSm(int stages) {
  return decode_warp_mma::CtasPerSm<kD>(FlashDecodeCpAsyncKernel<T, kD>, stages);
}

// Over an fp8 KV cache: the byte ring's shared memory.
template <typename T, int kD>
cudaError_t LaunchFp8Kv(const FlashDecodeArgs& args, cudaStream_t stream) {
  return decode_warp_mma::LaunchWithSmem(FlashDecodeCpAsyncKernel<T, kD, true>, args, args,
                                         DecodeWarpMmaSmemBytes(kD, args.stages, 1), stream);
}

template <typename T, int kD>
int CtasPerSmFp8Kv(int stages) {
  return decode_warp_mma::CtasPerSmWithSmem(FlashDecodeCpAsyncKernel<T, kD, true>,
                                            DecodeWarpMmaSmemBytes(kD, stages, 1));
}

}  // namespace decode_cp_async
}  // namespace jax_sgl::cuda
