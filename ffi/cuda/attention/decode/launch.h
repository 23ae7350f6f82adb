// Host-side contract of the dedicated decode kernel (decode/block_kernel.cuh): its tile geometry as
// constexpr functions (so the dispatch can size shared memory, occupancy and splits without CUDA
// syntax), the launch arguments, and the per-(dtype, head dim) launcher the instantiations define.
//
// The kernel serves calls with at most kDecodeMaxQLen query rows per sequence (decode and short
// speculative / chunked steps): one CTA takes all q heads of one kv head (q length x group packed
// rows, up to kDecodeMaxRows) over a share of the keys, so each K/V byte is read once per CTA,
// through a kStages-deep cp.async ring. Partials of a split go to the same float32 scratch the
// sm80 kernel uses, merged by LaunchSplitCombine.
//
// Run-time switches (read by fwd_dispatch.cc at every call, so one process can A/B them):
//   JAX_SGL_DECODE=old|new|warp   the sm80 split-KV path, this kernel, or the warp-sliced
//                                 CUDA-core kernel (decode/warp_launch.cuh) for calls of at most
//                                 kDecodeWarpMaxRows packed rows (others: new)
//                 |warpmma        or its mma form for at most kDecodeWarpMmaMaxRows rows (calls
//                                 with more packed rows run this kernel)
//                 |warpmma2       the mma form with cheap copy addressing (decode/cp_async_kernel.cuh;
//                                 pools of < 2^31 rows, else warpmma)
//                 |warptma        warpmma2 with K/V stages loaded by TMA (decode/tma_kernel.cuh),
//                                 the default where it serves: sm_90+ devices, head-dim capacity
//                                 64 / 128, dense / varlen K/V or pages of a multiple of 16 keys;
//                                 other calls run warpmma2 (unset JAX_SGL_DECODE is the same)
//   JAX_SGL_DECODE_TMA_L2=N       warptma's L2 promotion of its loads: 0, 64, 128 or 256 bytes
//                                 (default 128; an A/B knob)
//   JAX_SGL_DECODE_SPLITS=N       KV splits (1..32) for decode-shaped calls, either path; 0 or
//                                 unset: the heuristic
//   JAX_SGL_DECODE_STAGES=N       cp.async ring depth of the new kernel (2..8, default 4), or of
//                                 each warp's ring in the warp kernel (default 4)
//   JAX_SGL_DECODE_WAVES=N        warp kernel split heuristic: CTAs for N full waves of the
//                                 resident slots (1..8; 2 for warp); 0: the split count that
//                                 fills its last wave best. The mma forms default to 1 when one
//                                 split already fills the slots, else 0
#pragma once

#include <cuda_runtime_api.h>

#include "ffi/cuda/attention/flash_fwd_launch.h"

namespace jax_sgl::cuda {

// Query rows per sequence the decode kernel takes (longer q runs on the prefill kernel).
inline constexpr int kDecodeMaxQLen = 8;
// Packed rows per CTA: 4 warps x one m16 tile each when the rows need them all.
inline constexpr int kDecodeMaxRows = 64;
inline constexpr int kDecodeThreads = 128;
inline constexpr int kDecodeMaxStages = 8;
inline constexpr int kDecodeDefaultStages = 4;

// Keys per pipeline stage: 16 KiB of K+V per stage at d = 64 and 128 (12 KiB at 96 and 192, 16 at
// 256), so 3 stages in flight keep 36-48 KiB of loads outstanding per CTA; every thread of the CTA
// then stages exactly one key row (a quarter, half or eighth of it).
constexpr int DecodeBlockN(int d) { return d <= 64 ? 64 : (d <= 128 ? 32 : 16); }

// Shared memory of one CTA: q rows, then `stages` x (K tile, V tile, key-valid flags); the
// epilogue reuses it for the per-warp float32 outputs and (m, l) of the merge.
constexpr int DecodeStride(int d) { return d + 8; }  // +16 bytes per row: conflict-free ldmatrix
constexpr int DecodeTileBytes(int d) { return DecodeBlockN(d) * DecodeStride(d) * 2; }
constexpr int DecodeFlagBytes(int d) { return (DecodeBlockN(d) + 15) / 16 * 16; }
constexpr int DecodeStageBytes(int d) { return 2 * DecodeTileBytes(d) + DecodeFlagBytes(d); }
constexpr int DecodeQBytes(int d, int m_tiles) { return m_tiles * 16 * DecodeStride(d) * 2; }
constexpr int DecodeEpilogueBytes(int d) {
  return 4 * 16 * (d + 4) * 4 + 2 * 4 * 16 * 4 + kDecodeMaxRows * 4;
}
constexpr int DecodeSmemBytes(int d, int stages, int m_tiles) {
  const int main = DecodeQBytes(d, m_tiles) + stages * DecodeStageBytes(d);
  return main > DecodeEpilogueBytes(d) ? main : DecodeEpilogueBytes(d);
}

// Warp-sliced kernel (decode/warp_launch.cuh): 4 warps, each with its own ring of stages of
// DecodeWarpStageKeys keys (K + V: 4 KiB at d = 64 / 128 / 256, 3 KiB at 96 / 192); a group of
// DecodeWarpVecLanes lanes (8 dims, 16 bytes each) holds one key; row capacity 4 or 8.
inline constexpr int kDecodeWarpThreads = 128;
inline constexpr int kDecodeWarpMaxRows = 8;
constexpr int DecodeWarpVecLanes(int d) { return d <= 64 ? 8 : (d <= 128 ? 16 : 32); }
constexpr int DecodeWarpStageKeys(int d) { return d <= 64 ? 16 : (d <= 128 ? 8 : 4); }
constexpr int DecodeWarpRingBytes(int d, int stages) {
  return kDecodeWarpThreads / 32 * stages * 2 * DecodeWarpStageKeys(d) * d * 2;
}
constexpr int DecodeWarpSmemBytes(int d, int stages, int rows_cap) {
  const int main = DecodeWarpRingBytes(d, stages) + kDecodeWarpThreads / 32 * kDecodeMaxStages * 4;
  const int epilogue = kDecodeWarpThreads / 32 * rows_cap * (d + 2) * 4;
  return main > epilogue ? main : epilogue;
}

// Warp-sliced mma kernel (JAX_SGL_DECODE=warpmma, same file): the same per-warp rings and
// copies, stages of 16 keys in ldmatrix-padded rows, one m16 tile of q (rows bound <= 16).
inline constexpr int kDecodeWarpMmaMaxRows = 16;
constexpr int DecodeWarpMmaRingBytes(int d, int stages) {
  return kDecodeWarpThreads / 32 * stages * 2 * 16 * DecodeStride(d) * 2;
}
constexpr int DecodeWarpMmaSmemBytes(int d, int stages) {
  const int main = 16 * DecodeStride(d) * 2 + DecodeWarpMmaRingBytes(d, stages) +
                   kDecodeWarpThreads / 32 * kDecodeMaxStages * 4;
  const int epilogue = kDecodeWarpThreads / 32 * 16 * (d + 4) * 4 + 2 * 4 * 16 * 4 + 16 * 4;
  return main > epilogue ? main : epilogue;
}

// Which warp mma kernel runs rows bounds of 9..16 (and all rows when selected): the warpmma kernel,
// warpmma2 (decode/cp_async_kernel.cuh) or its TMA form (decode/tma_kernel.cuh).
inline constexpr int kDecodeWarpMma1 = 1;
inline constexpr int kDecodeWarpMma2 = 2;
inline constexpr int kDecodeWarpTma = 3;  // decode/tma_kernel.cuh

// The TMA form's shared memory: q (16 padded rows), slack to the 1024-byte alignment of the
// 128-byte swizzle, per warp `stages` x (K, V) tiles of 16 rows x d (unpadded), per warp
// kDecodeMaxStages mbarriers and key masks; the epilogue reuses it as the mma kernels do.
constexpr int DecodeWarpTmaSmemBytes(int d, int stages) {
  const int warps = kDecodeWarpThreads / 32;
  const int main = 16 * DecodeStride(d) * 2 + 1024 + warps * stages * 2 * 16 * d * 2 +
                   warps * kDecodeMaxStages * (8 + 4);
  const int epilogue = warps * 16 * (d + 4) * 4 + 2 * warps * 16 * 4 + 16 * 4;
  return main > epilogue ? main : epilogue;
}

struct FlashDecodeArgs {
  FlashFwdArgs fwd;  // params, group, splits and the split-KV scratch, as the sm80 kernel takes
  int stages;        // cp.async ring depth, 2..kDecodeMaxStages
  int m_tiles;       // m16 tiles of q the shared memory holds (1, 2 or 4: rows bound / 16);
                     // warp kernel: its row capacity (4 or 8; 16 = the warp mma kernel)
  int m_blocks;      // CTAs along packed rows per (sequence, kv head): ceil(rows / 64)
  int warp_variant = kDecodeWarpMma1;  // warp mma kernel (m_tiles 16): kDecodeWarp*
};

// One instantiation per (storage type, head-dim capacity), in instantiations/flash_decode_*.cu.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecode(const FlashDecodeArgs& args, cudaStream_t stream);
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecodeWarp(const FlashDecodeArgs& args, cudaStream_t stream);
// Resident CTAs per SM of the warp kernel at this ring depth, row capacity and mma variant
// (kDecodeWarpMma1 / 2), from the occupancy API.
template <typename T, int kHeadDim>
int FlashDecodeWarpCtasPerSm(int stages, int rows_cap, int variant);

}  // namespace jax_sgl::cuda
