// Host side of the sm_90a flash forward: whether it may run a call (switch, device, coverage)
// and the (dtype, head dim) switch over the instantiations this build compiled.
//
// Varlen calls (cu_seqlens_q, varlen k/v, seqused_k) run on the sm90 kernel's varlen
// instantiation unless JAX_SGL_DISABLE=sm90_varlen (p.disable) keeps them on the portable
// kernel. Paged k/v runs on it at any page size (TMA boxes for multiples of 16, else the
// producer's cp.async gather, Sm90PagedGather); paged calls of few q rows per sequence pack the
// GQA group's heads into the tile rows (Sm90PackGqa), and those whose tiles are too few for the
// SMs run each tile as key shares merged by the split-KV combine (Sm90KeySplits). e4m3 q/k/v
// (bf16 out) run on the fp8 instantiations (instantiations.json sm90_fwd_e4m3, head dims 64 / 128
// / 256) over dense, varlen and paged k/v alike.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/flash_fwd_launch.h"
#include "ffi/cuda/attention/sm90/kernel_list.h"
#include "ffi/cuda/attention/sm90/fwd/launch.h"
#include "ffi/cuda/attention/sm90/fwd/tile_size.h"

namespace jax_sgl::cuda {
namespace {

// The (head dim, dtype) pairs this build compiled (sm90/kernel_list.h).

bool Built(DType t, int d) {
  (void)t, (void)d;
#define JAX_SGL_SM90_FWD(D, T) \
  if (t == sm90::kDType_##T && d == D) return true;
#include "ffi/cuda/attention/instantiations/sm90_kernels.inc"
  return false;
}

// Launches the (dtype, head dim) instantiation, which must be built.
cudaError_t Launch(DType t, int d, const AttentionParams& p, int key_splits, void* scratch,
                   cudaStream_t stream) {
  (void)t, (void)d, (void)p, (void)key_splits, (void)scratch, (void)stream;
#define JAX_SGL_SM90_FWD(D, T)            \
  if (t == sm90::kDType_##T && d == D) \
    return LaunchFlashFwdSm90<sm90::Type_##T, D>(p, key_splits, scratch, stream);
#include "ffi/cuda/attention/instantiations/sm90_kernels.inc"
  return cudaErrorInvalidValue;
}

// Query rows per sequence: the average of a packed (varlen) q.
int64_t QRowsPerSequence(const AttentionParams& p) {
  return p.cu_seqlens_q ? p.total_q / std::max(p.batch, 1) : p.seqlen_q;
}

// What the varlen instantiation lacks for a call, or nullptr.
const char* VarlenUnsupported(const AttentionParams& p) {
  if (p.kv_layout == KvLayout::kPaged) {
    if (p.num_pages < 1 || p.max_pages < 1) return "sm90 kernel: a non-empty pool and page table";
    // Its 128-row tiles hold one sequence's rows, of one q head or, packed (Sm90PackGqa), of
    // the q heads of one kv head: below an average of 64 tile rows per sequence (decode-like
    // calls without GQA) they are mostly empty and the portable kernel runs the call. Verify-like
    // calls (kSm90VerifyMinQRows q rows per sequence) may have half that: their tiles stream
    // a long history each, whose K/V bytes bound them rather than the empty rows' MMAs, and
    // the key split (Sm90KeySplits) spreads them over the SMs.
    const int64_t q_rows = QRowsPerSequence(p);
    const int64_t rows = q_rows * (Sm90PackGqa(p) ? p.num_heads / p.num_kv_heads : 1);
    if (rows < 64 && !(q_rows >= kSm90VerifyMinQRows && rows >= kSm90VerifyMinRows))
      return "sm90 kernel: paged k/v with at least 64 tile rows per sequence on average (32 "
             "with at least 8 q rows per sequence)";
    // PackGQA's tile rows (q rows x group) stay in int.
    if (Sm90PackGqa(p) && p.total_q * (p.num_heads / p.num_kv_heads) >= (int64_t(1) << 30))
      return "sm90 kernel: paged total_q * group below 2^30";
    // Key indices (and batch * keys, the unused dense row offset) stay in int.
    if (int64_t(p.max_pages) * p.page_size * std::max(p.batch, 1) >= (int64_t(1) << 30))
      return "sm90 kernel: batch * max_pages * page_size below 2^30";
    // The gather forms each copy's address as a 32-bit pool row times a 32-bit row stride in
    // bytes (mainloop_load.cuh GatherPages), and pool rows stay in int.
    const int64_t kv_bytes = p.k_type == DType::kF8E4M3 ? 1 : 2;  // e4m3 or 16-bit k/v
    if (Sm90PagedGather(p) &&
        (std::max(p.k_row_stride, p.v_row_stride) * kv_bytes >= (int64_t(1) << 32) ||
         int64_t(p.num_pages) * p.page_size >= (int64_t(1) << 31)))
      return "sm90 kernel: paged k/v row strides below 4 GiB and pools below 2^31 rows";
  }
  if (p.disable & kDisableSm90Varlen)
    return "sm90 kernel: varlen turned off by JAX_SGL_DISABLE=sm90_varlen (runs on the sm80 kernel)";
  // TMA descriptors need every dimension >= 1; row indices and the kernel's window sums stay in
  // int (launch.cuh).
  if (p.total_q < 1 || p.total_k < 1) return "sm90 kernel: non-empty q and k buffers";
  if (p.total_q + p.total_k >= (int64_t(1) << 30)) return "sm90 kernel: below 2^30 rows";
  if (p.kv_layout == KvLayout::kDense && p.seqlen_k < 1) return "sm90 kernel: non-empty k";
  if (p.cu_seqlens_q == nullptr && p.seqlen_q < 1) return "sm90 kernel: non-empty q";
  return nullptr;
}

}  // namespace

bool Sm90Fp8Operands(const AttentionParams& p) {
  return p.q_type == DType::kF8E4M3 && p.k_type == DType::kF8E4M3 &&
         p.v_type == DType::kF8E4M3 && p.out_type == DType::kBF16;
}

namespace {

// The tile the call's instantiation runs (fp8 and 16-bit choose theirs apart, tile_size.h).
sm90::FwdTileSize CallTile(const AttentionParams& p) {
  return Sm90Fp8Operands(p) ? sm90::FwdTileFp8(p.head_dim) : sm90::FwdTile(p.head_dim);
}

}  // namespace

const char* Sm90Unsupported(const AttentionParams& p) {
  const bool varlen =
      p.cu_seqlens_q != nullptr || p.kv_layout != KvLayout::kDense || p.seqused_k != nullptr;
  if (varlen) {
    if (const char* why = VarlenUnsupported(p)) return why;
  }
  if (Sm90Fp8Operands(p)) {
    // fp8 (e4m3 q/k/v, bf16 out; sm90/fwd/fp8.cuh): per-head descales.
    if (p.qk_block_scale != BlockScaleType::kNone)
      return "sm90 kernel: fp8 q/k with per-head descales (block scales have no Hopper MMA)";
  } else if (!HalfPrecisionOperands(p)) {
    return "sm90 kernel: float16/bfloat16 (or e4m3 with bfloat16 out) q, k, v and out only";
  }
  if (p.head_dim != p.head_dim_v || !Built(p.q_type, p.head_dim))
    return "sm90 kernel: head_dim == head_dim_v in the built set (JAX_SGL_SM90_HEAD_DIMS) only";
  // TMA descriptors need every dimension >= 1 (an empty KV runs on the sm80 kernel) and byte
  // strides below 2^40; the grid's y/z take heads and batch.
  if (!varlen && (p.seqlen_q < 1 || p.seqlen_k < 1)) return "sm90 kernel: non-empty q and k";
  // K/V span total_k rows at their row stride (a fused K/V buffer: both halves and the padding).
  if (p.total_q * p.num_heads * p.head_dim + p.total_k * p.k_row_stride >= (int64_t(1) << 38))
    return "sm90 kernel: tensors below 2^38 elements";
  if (p.num_heads > 65535 || p.batch > 65535) return "sm90 kernel: batch and heads <= 65535";
  // TMA wants 16-byte aligned bases (XLA's buffers are).
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "sm90 kernel: 16-byte aligned buffers";
  return nullptr;
}

bool Sm90Enabled(const AttentionParams& p, const DeviceInfo& dev) {
  // Every instantiation passed the sm90 GPU tests on an H200 (benchmarks/notes/NOTES_sm90.md,
  // 2026-12-02), so all built ones run by default; JAX_SGL_DISABLE=sm90 (a bit of p.disable, set
  // when the call was lowered) routes everything to the portable kernel.
  if (p.disable & kDisableSm90) return false;
  return IsSm90(dev);
}

const char* Sm90BuiltKernels() {
  return ""
#define JAX_SGL_SM90_FWD(D, T) " hdim" #D "_" #T
#include "ffi/cuda/attention/instantiations/sm90_kernels.inc"
      ;
}

// H200, hd128 bf16, 32 q / 8 kv heads, causal, 2026-12-04 (bench_attention_paged.py): a mixed
// batch (4 x 512 new + 64 decode rows over 8k keys) ran 205 / 254 TFLOP/s packed at pages of 16 /
// 64 against 104-106 on the portable kernel; verify with 32 drafts 345 against 141. Chunked
// prefill (1024 rows per sequence) ran the same packed or not (421 / 514-559 against 422 /
// 527-555), so calls of a full tile of rows per sequence keep the unpacked tile and its TMA Q
// load. Verify with 8 drafts stays on the decode kernels (70 TFLOP/s either way).
// H200, hd128 bf16, 32/8 heads, causal, 2026-12-04: the gather ran chunked prefill (B=8 x 1024
// new over 4k) at 308 TFLOP/s on a token pool (page 1) and a mixed batch at 147, against about
// 155 / 105 on the portable kernel; forced onto pages of 16 and 64 it ran 311, where the TMA
// boxes run 424 / 513, so it only takes the pages no box fits.
bool Sm90PagedGather(const AttentionParams& p) {
  return p.page_size % sm90::kSm90PageBoxRows != 0;
}

bool Sm90PackGqa(const AttentionParams& p) {
  if (p.kv_layout != KvLayout::kPaged || p.num_heads == p.num_kv_heads) return false;
  return QRowsPerSequence(p) < 128;
}

Sm90Tiles Sm90TileGrid(const AttentionParams& p, int block_m) {
  const bool varlen =
      p.cu_seqlens_q != nullptr || p.kv_layout != KvLayout::kDense || p.seqused_k != nullptr;
  const int pack = Sm90PackGqa(p) ? p.num_heads / p.num_kv_heads : 1;
  const int num_m_blocks =
      !varlen ? (p.seqlen_q + block_m - 1) / block_m
      : p.cu_seqlens_q != nullptr
          ? int((p.total_q * pack + block_m - 1) / block_m) + p.batch
          : (p.seqlen_q * pack + block_m - 1) / block_m * p.batch;
  return {pack, p.num_heads / pack, num_m_blocks, varlen ? 1 : p.batch};
}

// The key split's share count n, by a model of the call's time on the SMs' one persistent CTA
// each: waves of shares times a share's length, ceil(tiles n / SMs) (K / n + c) in key tiles,
// where K is the longest sequence's key tiles and c = kKeySplitShareCost the fixed cost of a
// share (its Q load and first K wait, a page-table window, the partial's write and its part of
// the combine), the smallest n of the least time. At one CTA per SM, shares add no loads in
// flight per SM: they only fill the SMs that the tiles leave idle, so calls of a wave or more
// of tiles whose last wave is full keep n = 1 (B=32 sequences x 8 kv heads of verify: 256
// tiles, 1.94 waves on 132 SMs), and few tiles split most (B=4: 32 tiles, a quarter wave, run
// as 4 shares each). Each share keeps kKeySplitMinKeyTiles key tiles at least, and n <=
// kMaxSplits (the combine holds one split per lane). A split must save kKeySplitMinGain of the
// time, as the model leaves out the partials' traffic (float32 rows of O: up to 7% of the K/V
// bytes of an 8k history at 2 shares) and a varlen call's tile count is a bound: the mixed
// batch (4 x 512 + 64 decode rows, 1072 tiles bound, 1024 real) keeps whole tiles. Measured with
// these constants (H100, 2026-12-05, bench_attention_paged.py --only verify mixed
// --verify-batches 4 8 32, against main before it): verify B=4 / 8 1.31-2.13x, mixed unchanged.
constexpr int kKeySplitShareCost = 2;
constexpr int kKeySplitMinKeyTiles = 8;
constexpr double kKeySplitMinGain = 0.1;

int Sm90KeySplits(const AttentionParams& p, int num_sms) {
  const sm90::FwdTileSize tile = CallTile(p);
  if (p.kv_layout != KvLayout::kPaged || !tile.persistent || num_sms < 1) return 1;
  const int64_t tiles = Sm90TileGrid(p, sm90::kSm90FwdBlockM).count();
  const int64_t key_tiles = (int64_t(p.max_pages) * p.page_size + tile.block_n - 1) / tile.block_n;
  const int64_t most = std::min<int64_t>(key_tiles / kKeySplitMinKeyTiles, kMaxSplits);
  if (tiles < 1 || most < 2 || tiles * most >= (int64_t(1) << 30)) return 1;  // items in int
  auto time = [&](int n) {
    return double((tiles * n + num_sms - 1) / num_sms) *
           (double(key_tiles) / n + kKeySplitShareCost);
  };
  int best = 1;
  for (int n = 2; n <= most; ++n)
    if (time(n) < time(best)) best = n;
  return time(best) <= (1.0 - kKeySplitMinGain) * time(1) ? best : 1;
}

bool Sm90TailSplitRequested(const AttentionParams& p) {
  const bool dense = p.cu_seqlens_q == nullptr && p.kv_layout == KvLayout::kDense &&
                     p.seqused_k == nullptr;
  return dense && !p.causal;
}

size_t Sm90ScratchBytes(const AttentionParams& p, int num_sms, int key_splits) {
  if (key_splits > 1) return kSm90CounterBytes + Sm90KeySplitBytes(p, key_splits);
  const sm90::FwdTileSize tile = CallTile(p);
  if (!Sm90TailSplitRequested(p) || !tile.persistent)
    return kSm90CounterBytes;
  return kSm90CounterBytes + Sm90TailBytes(num_sms, std::max(p.head_dim, p.head_dim_v));
}

cudaError_t RunFlashFwdSm90(const AttentionParams& p, int key_splits, void* scratch,
                            cudaStream_t stream) {
  return Launch(p.q_type, p.head_dim, p, key_splits, scratch, stream);
}

}  // namespace jax_sgl::cuda
