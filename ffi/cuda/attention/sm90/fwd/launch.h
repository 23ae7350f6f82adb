// Host contract of the sm_90a flash forward (wgmma + TMA, warp-specialized; sm90/fwd/kernel.cuh).
// No CUDA kernel syntax: fwd_dispatch.cc includes it.
//
// The dispatcher uses this kernel unless JAX_SGL_DISABLE names sm90 (p.disable), when the device is
// compute capability 9.0, the build has the (dtype, head dim) instantiation
// (JAX_SGL_SM90_HEAD_DIMS x JAX_SGL_SM90_DTYPES) and Sm90Unsupported() finds nothing missing. Anything else runs on the
// portable sm80 kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ffi/common/attention_params.h"
#include "ffi/cuda/attention/common/device.h"

namespace jax_sgl::cuda {

// e4m3 q, k and v with bf16 out: the fp8 instantiations' operands (Sm90Unsupported).
bool Sm90Fp8Operands(const AttentionParams& p);

// nullptr when the sm90 kernel covers the call, else what it lacks (the fallback decision).
const char* Sm90Unsupported(const AttentionParams& p);

// Whether a call the sm90 kernel covers runs on it: the device is compute capability 9.0 and
// JAX_SGL_DISABLE does not name sm90 (p.disable, set when the call was lowered).
bool Sm90Enabled(const AttentionParams& p, const DeviceInfo& dev);

// The instantiations this build holds, space separated with a leading space: each (head dim,
// dtype) (" hdim128_bf16"), for jax_sgl.attention_backend_info().
const char* Sm90BuiltKernels();

// Device scratch of a call on the sm90 kernel: the persistent kernel's tile counter, then, for
// the tail split, room for one float32 O row block and LSE per SM (launch.cuh), or, for the key
// split of a paged call, its partials (Sm90KeySplitBytes).
inline constexpr size_t kSm90CounterBytes = 256;
inline size_t Sm90TailBytes(int num_sms, int head_dim) {
  return size_t(num_sms) * 128 * (size_t(head_dim) + 1) * sizeof(float);
}

// The tail split of `units` equal work units (forward tiles, backward key blocks) on num_sms
// SMs, one unit per SM at a time: the r units past the last full wave would run alone while the
// other SMs idle, so each runs as `splits` shares (num_sms / r, at most max_shares) instead.
// Only when r is at most half a wave (a fuller last wave loses little); a call of at most half
// a wave in all is all tail. {0, 0}: no split. tail * splits <= num_sms.
struct TailSplit {
  int tail;
  int splits;
};
inline TailSplit ChooseTailSplit(int units, int num_sms, int max_shares) {
  const int r = num_sms > 0 ? units % num_sms : 0;
  const int splits = r > 0 ? (num_sms / r < max_shares ? num_sms / r : max_shares) : 0;
  return r > 0 && 2 * r <= num_sms && splits >= 2 ? TailSplit{r, splits} : TailSplit{0, 0};
}

// The work tiles of a call (launch.cuh): 128-row blocks (num_m_blocks; varlen q: a bound, each
// sequence adding at most one partial block) of tile_heads heads of tile_batches batches. pack:
// tile rows per q row (PackGQA, Sm90PackGqa). The launcher, the key split and the scratch size
// count the same tiles.
struct Sm90Tiles {
  int pack;
  int tile_heads;
  int num_m_blocks;
  int tile_batches;
  int64_t count() const { return int64_t(num_m_blocks) * tile_heads * tile_batches; }
};
Sm90Tiles Sm90TileGrid(const AttentionParams& p, int block_m);

// The key split of a paged call (every tile runs as `splits` shares of the key tiles it visits,
// each writing float32 O and LSE partials [split, total_q, num_heads, (head_dim)] that
// LaunchSplitCombine merges): 1 when the call takes none. Paged calls on the persistent kernel
// only (head dims 64 and 128). Decided from the shapes and the device's SMs: the plan sizes the
// scratch and the combine by it and the launcher runs it, so both take it from the plan.
int Sm90KeySplits(const AttentionParams& p, int num_sms);

// Bytes of the key split's partials after the counter: float32 O and LSE of every q row and head
// per share.
inline size_t Sm90KeySplitBytes(const AttentionParams& p, int splits) {
  return splits > 1 ? size_t(splits) * size_t(p.total_q) * size_t(p.num_heads) *
                          (size_t(p.head_dim_v) + 1) * sizeof(float)
                    : 0;
}

// Verify-like paged calls: at least kSm90VerifyMinQRows q rows per sequence and
// kSm90VerifyMinRows packed tile rows (q rows x GQA group) run on the sm90 kernel, with the key
// split where their tiles are too few for the SMs, instead of the block-wide decode kernel
// (8 q rows, fwd_dispatch.cc) or the portable kernel (9-15 q rows of a group of 4).
inline constexpr int kSm90VerifyMinQRows = 8;
inline constexpr int kSm90VerifyMinRows = 32;
// Decode-shaped verify calls (kDecodeMaxQLen q rows) leave the decode kernel only over at least
// this many keys per sequence (the page table's bound): 32 key tiles, a history the key split
// can cut into four shares of its minimum (the 0.53x FA3 row is 8k); shorter calls stay on the
// decode kernels, measured and tested on them (decode GPU tests: about 2k keys).
inline constexpr int kSm90VerifyMinKeys = 4096;

// Whether a paged call packs the q heads of each GQA group into the tile rows (PackGQA,
// sm90/fwd/tile_scheduler.cuh): the tile then covers group x fewer q rows of all the group's
// heads, and the K/V of a kv head load once for them.
bool Sm90PackGqa(const AttentionParams& p);

// Whether a paged call loads K/V with the producer warpgroup's cp.async gather rather than TMA
// boxes (sm90/fwd/mainloop_load.cuh): pages that are not a multiple of a box.
bool Sm90PagedGather(const AttentionParams& p);

// Whether a call takes the tail split: a dense, non-causal call (measured +1.0-2.9% at S = 1k-8k).
// Persistent kernels then run the tiles of the last, partial wave as key shares on every CTA,
// merged by a second kernel.
bool Sm90TailSplitRequested(const AttentionParams& p);

// Bytes of scratch the call needs (Sm90TailSplitRequested, the plan's Sm90KeySplits, the tile
// choice and the device's SMs).
size_t Sm90ScratchBytes(const AttentionParams& p, int num_sms, int key_splits);

// Launches the sm90 kernel; the caller checked Sm90Unsupported(p) == nullptr. key_splits:
// Sm90KeySplits(p, SMs); > 1 leaves the partials in scratch for the caller's LaunchSplitCombine
// (o_partial at kSm90CounterBytes, lse_partial after it). scratch: Sm90ScratchBytes(p, SMs) of
// device memory that this call may overwrite.
cudaError_t RunFlashFwdSm90(const AttentionParams& p, int key_splits, void* scratch,
                            cudaStream_t stream);

// One instantiation per (storage type, head dim), in instantiations/sm90_fwd_*.cu.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashFwdSm90(const AttentionParams& p, int key_splits, void* scratch,
                               cudaStream_t stream);

}  // namespace jax_sgl::cuda
