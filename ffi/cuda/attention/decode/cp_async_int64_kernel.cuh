// Decode attention, warp-sliced mma kernel with 64-bit row addressing: the form for pools of 2^31
// rows or more, which the 32-bit slot indices of cp_async_kernel.cuh cannot address (smaller
// pools run there or on tma_kernel.cuh). For calls whose packed rows (q length x GQA group) per
// (sequence, kv head) are at most kDecodeWarpMmaMaxRows. Each key's source row (dense, varlen or
// paged) is resolved as a 64-bit index by the lane that owns the key and shuffled to the copying
// lanes; every copy computes its own 64-bit address. Masks, layouts, outputs and split partials
// are those of block_kernel.cuh.
#pragma once

#include "ffi/cuda/attention/decode/block_kernel.cuh"
#include "ffi/cuda/attention/decode/warp_steps.cuh"

namespace jax_sgl::cuda {
namespace decode_int64 {

using flash::Elem;
using decode::CpAsync16;
using decode::CpAsyncCommit;
using decode::CpAsyncWaitPending;
using decode::KeySourceRow;
using flash::Ldmatrix4;

// grid: x = batch * num_kv_heads, y = KV splits; kDecodeWarpThreads threads, 4 warps, each with
// its own cp.async ring of 16-key stages in ldmatrix-padded rows, running the m16n8k16 chunk of
// block_kernel.cuh on them (one m16 tile of packed rows) with its own online softmax; the warps
// merge at the end as the block kernel's warps do. 2 CTAs per SM at d = 128 and 3 stages
// (8.5 KiB each per warp).
template <typename T, int kD>
__global__ void __launch_bounds__(kDecodeWarpThreads, kD <= 128 ? 2 : 1)
    FlashDecodeCpAsyncInt64Kernel(const FlashDecodeArgs args) {
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
  // This kv head's column of K and V; rows follow at the params' row strides.
  const T* k_head = k + kv_head * p.k_head_stride;
  const T* v_head = v + kv_head * p.v_head_stride;

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
      const bool kok = ok && c < p.head_dim, vok = ok && c < p.head_dim_v;
      CpAsync16<kD * 2>(sk + key * kStride + c, kok ? k_head + row * p.k_row_stride + c : k,
                        kok ? 16 : 0);
      CpAsync16<kD * 2>(sv + key * kStride + c, vok ? v_head + row * p.v_row_stride + c : v,
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

  const flash::RowScores scoring(p, s, group, 0, rows_here, 0, lane);

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
    float blk_max[2];
    scoring.MaskAndMax(sc, key0, lane, [valid](int c) -> bool { return (valid >> c) & 1u; },
                       blk_max);
    decode_warp_mma::SoftmaxPv<T, kD, false>(sc, blk_max, m_run, l_run, o, sv, lane);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  decode_warp_mma::MergeWarpsAndStore<T, kD>(args, s, b, kv_head, rows_here, smem, m_run, l_run,
                                             o);
}

template <typename T, int kD>
cudaError_t Launch(const FlashDecodeArgs& args, cudaStream_t stream) {
  return decode_warp_mma::Launch<kD>(FlashDecodeCpAsyncInt64Kernel<T, kD>, args, stream);
}

template <typename T, int kD>
int CtasPerSm(int stages) {
  return decode_warp_mma::CtasPerSm<kD>(FlashDecodeCpAsyncInt64Kernel<T, kD>, stages);
}

}  // namespace decode_int64
}  // namespace jax_sgl::cuda
