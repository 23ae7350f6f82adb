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
// Calls of at most kDecodeWarpMmaMaxRows packed rows run the warp-sliced forms instead
// (warp_launch.cuh): the TMA form where it serves, else the cp.async form; both index pool rows
// in 32 bits, so pools of 2^31 rows or more stay here.
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

// Warp-sliced kernels (warp_launch.cuh): 4 warps, each with its own ring of stages of 16 keys in
// ldmatrix-padded rows, one m16 tile of q (rows bound <= 16).
inline constexpr int kDecodeWarpThreads = 128;
inline constexpr int kDecodeWarpMmaMaxRows = 16;
// kv_bytes: bytes of a K/V element (2, or 1 over an fp8 KV cache: rows of d + 16 bytes).
constexpr int DecodeWarpMmaRowBytes(int d, int kv_bytes = 2) {
  return kv_bytes == 1 ? d + 16 : DecodeStride(d) * 2;
}
constexpr int DecodeWarpMmaRingBytes(int d, int stages, int kv_bytes = 2) {
  return kDecodeWarpThreads / 32 * stages * 2 * 16 * DecodeWarpMmaRowBytes(d, kv_bytes);
}
constexpr int DecodeWarpMmaSmemBytes(int d, int stages, int kv_bytes = 2) {
  const int main = 16 * DecodeStride(d) * 2 + DecodeWarpMmaRingBytes(d, stages, kv_bytes) +
                   kDecodeWarpThreads / 32 * kDecodeMaxStages * 4;
  const int epilogue = kDecodeWarpThreads / 32 * 16 * (d + 4) * 4 + 2 * 4 * 16 * 4 + 16 * 4;
  return main > epilogue ? main : epilogue;
}

// The TMA form's shared memory: q (16 padded rows), slack to the 1024-byte alignment of the
// 128-byte swizzle, per warp `stages` x (K, V) tiles of 16 rows x d (unpadded), per warp
// kDecodeMaxStages mbarriers and key masks; the epilogue reuses it as the mma kernels do.
// kv_bytes: bytes of a K/V element (2, or 1 over an fp8 KV cache).
constexpr int DecodeWarpTmaSmemBytes(int d, int stages, int kv_bytes = 2) {
  const int warps = kDecodeWarpThreads / 32;
  const int main = 16 * DecodeStride(d) * 2 + 1024 + warps * stages * 2 * 16 * d * kv_bytes +
                   warps * kDecodeMaxStages * (8 + 4);
  const int epilogue = warps * 16 * (d + 4) * 4 + 2 * warps * 16 * 4 + 16 * 4;
  return main > epilogue ? main : epilogue;
}

struct FlashDecodeArgs {
  FlashFwdArgs fwd;  // params, group, splits and the split-KV scratch, as the sm80 kernel takes
  int stages;        // cp.async ring depth, 2..kDecodeMaxStages
  int m_tiles;       // m16 tiles of q the shared memory holds (1, 2 or 4: rows bound / 16)
  int m_blocks;      // CTAs along packed rows per (sequence, kv head): ceil(rows / 64)
  DecodeWarpForm warp_form = DecodeWarpForm::kCpAsync;  // the warp-sliced kernels' form
};

// One instantiation per (storage type, head-dim capacity), in instantiations/decode_*.cu.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecode(const FlashDecodeArgs& args, cudaStream_t stream);
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecodeWarp(const FlashDecodeArgs& args, cudaStream_t stream);
// Resident CTAs per SM of a warp-sliced form at this ring depth, from the occupancy API.
template <typename T, int kHeadDim>
int FlashDecodeWarpCtasPerSm(int stages, DecodeWarpForm form);
// The warp forms over jax_sgl's fp8 KV cache (e4m3 K/V, q of type T; kHeadDim 64 or 128):
// args.warp_form kTmaFp8Kv or kCpAsyncFp8Kv; in instantiations/decode_fp8kv_*.cu.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecodeWarpFp8Kv(const FlashDecodeArgs& args, cudaStream_t stream);
template <typename T, int kHeadDim>
int FlashDecodeWarpFp8KvCtasPerSm(int stages, DecodeWarpForm form);

}  // namespace jax_sgl::cuda
