// Host-side contract of the CUDA attention backward (FlashAttention-2 style, mma.sync, sm_80+):
// the plan and the entry points the FFI handler calls. No CUDA syntax and no FFI headers: the
// handler (.cc) and the kernels (.cu) both include it.
//
// Three kernels, all reading the forward's saved out and lse (nothing else of the forward):
//   1. preprocess, one CTA per (64 q rows, head, sequence): D = rowsum(dO * O) - dlse, and lse
//      in the log2 domain with fully masked rows (lse = -inf) turned into +inf so that their P
//      is exactly 0;
//   2. dK/dV, one CTA per (key block, kv head, sequence): recomputes P^T and dS^T for its keys
//      against every packed q row (query row x q head of the GQA group) that can see them and
//      keeps dK, dV in registers until the end: each key row is written once, no atomics;
//   3. dQ, one CTA per (packed q-row block, kv head, sequence): recomputes P and dS against the
//      visible keys and keeps dQ in registers. This second recompute of P is what makes dQ
//      deterministic without atomics (the "deterministic option"; it is the only one).
// Masks come from attention_seq.h (KeyRange), the same code the forward runs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ffi/common/attention_bwd_params.h"
#include "ffi/common/attention_seq.h"
#include "ffi/common/host_device.h"
#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/common/device.h"

namespace jax_sgl::cuda {

// Head-dim capacities with a compiled backward; a call runs on the smallest one >= max(d, d_v)
// with the extra features zero-filled. Above 128 the dK + dV register accumulators of a warp
// (16 keys x 2 x d float32) no longer fit beside the score tiles; 192 and 256 run on the sm90
// backward's wide kernel on Hopper only (sm90/bwd/wide_kernel.cuh), the rest on the reference.
inline constexpr int kBwdHeadDimCapacities[] = {64, 96, 128};

// What the kernels read: the API params, the GQA group and the float32 workspace.
struct FlashBwdArgs {
  AttentionBwdParams bp;
  int group;        // num_heads / num_kv_heads
  float* lse_log2;  // lse's layout: lse * log2(e), +inf for fully masked rows
  // Dense calls: rows per (batch, head) of softmax_d and lse_log2, seqlen_q or (sm90 backward)
  // seqlen_q rounded up to its row block; varlen calls use lse's layout as it is, except on the
  // sm90 backward (ws_seq_align: rows per head of its padded layout).
  int ws_rows;
  bool skip_dkdv;   // LaunchFlashBwd runs the dQ kernel only (the sm90 kernel did dK, dV)
  // The preprocess writes -D and -lse_log2 (+inf rows: -inf): the sign convention of CUTLASS's
  // Blackwell backward collective, whose P = exp2(s * scale * log2(e) + lse) and
  // dS = P * (dP + D) read them (sm100/bwd/launch.h).
  bool negated = false;
  // sm90 tail split (Sm90BwdTailSplitRequested): Sm90BwdTailBytes of scratch for the float32
  // dK / dV shares, else nullptr.
  float* sm90_tail = nullptr;
  // Varlen q on the sm90 backward: the row block M of the padded workspace (PaddedSeqRow0), which
  // softmax_d and lse_log2 then use instead of lse's layout; 0 otherwise.
  int ws_seq_align = 0;
};

// Varlen q on the sm90 backward (ws_seq_align = its row block M): softmax_d, lse_log2 and the dQ
// accumulator are [num_heads, ws_rows] rows with sequence b's from PaddedSeqRow0 on
// (FlashAttention-3's layout). Every M-row block of a sequence then starts 16-byte aligned (the
// kernel's bulk copies of row values) and ends at or before the next sequence's first row, and
// all of them below total_q + batch M (Sm90BwdVarlenWsRows). The sm80 kernels never read it.
JAX_SGL_HD int64_t PaddedSeqRow0(int64_t q_row0, int b, int align) {
  return (q_row0 + int64_t(b) * align) / align * align;
}

// Packed q row i's row in that layout, or -1 where no sequence holds it. The binary searches
// here assume ascending cu_seqlens_q; bad ones still index inside the buffers (ClampedRows).
JAX_SGL_HD int64_t PaddedWsRow(const int32_t* cu, int batch, int64_t total_q, int64_t i,
                               int align) {
  if (batch <= 0) return -1;
  int lo = 0, hi = batch - 1;  // the last sequence starting at or before i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (ClampI64(cu[mid], 0, total_q) <= i) lo = mid;
    else hi = mid - 1;
  }
  const RowRange r = ClampedRows(cu[lo], cu[lo + 1], total_q);
  return i >= r.begin && i < r.begin + r.len ? PaddedSeqRow0(r.begin, lo, align) + i - r.begin
                                             : -1;
}

// The sequence holding padded row w: q_row, its packed q row, and rows_left, its rows from there
// on (<= 0: padding that no sequence holds).
struct PaddedSeq {
  int64_t q_row;
  int rows_left;
};
JAX_SGL_HD PaddedSeq FindPaddedSeq(const int32_t* cu, int batch, int64_t total_q, int64_t w,
                                   int align) {
  if (batch <= 0) return {0, 0};
  int lo = 0, hi = batch - 1;  // the last sequence whose rows start at or before w
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (PaddedSeqRow0(ClampI64(cu[mid], 0, total_q), mid, align) <= w) lo = mid;
    else hi = mid - 1;
  }
  const RowRange r = ClampedRows(cu[lo], cu[lo + 1], total_q);
  const int64_t off = w - PaddedSeqRow0(r.begin, lo, align);
  if (off < 0 || off >= r.len) return {0, 0};
  return {r.begin + off, int(r.len - off)};
}

// Rows and batch extent of the sm90 backward's TMA views: dense [batch, seq, ...]; varlen
// (cu_seqlens_q with cu_seqlens_k) the packed rows [total, ...] as a batch of one.
struct BwdViewRows {
  int q;
  int k;
  int batch;
};
inline BwdViewRows Sm90BwdViewRows(const AttentionParams& p, bool varlen) {
  return varlen ? BwdViewRows{int(p.total_q), int(p.total_k), 1}
                : BwdViewRows{p.seqlen_q, p.seqlen_k, p.batch};
}

// Index of (sequence b, head h, row i of that sequence) in softmax_d and lse_log2.
JAX_SGL_HD int64_t WsIndex(const FlashBwdArgs& a, const SeqBounds& s, int b, int h, int i) {
  const AttentionParams& p = a.bp.fwd;
  return p.cu_seqlens_q ? LseIndex(p, s, b, h, i) : (int64_t(b) * p.num_heads + h) * a.ws_rows + i;
}

// The kernels a backward call runs (ChooseBwdKernel; docs/kernels.md).
enum class BwdKernel {
  kNone,      // no CUDA backward serves the call (BwdChoice::why)
  kSm90,      // Hopper dK/dV + dQ by float32 reductions (sm90/bwd/kernel.cuh)
  kSm90DqKernel,  // deterministic: Hopper dK/dV, dQ by the atomic-free sm90 dQ kernel
  kSm100,     // Blackwell dK/dV + dQ on CUTLASS's FMHA backward collective (sm100/bwd/)
  kPortable,  // mma.sync dK/dV and dQ kernels (bwd_sm80/kernel.cuh)
};

struct BwdChoice {
  BwdKernel kernel = BwdKernel::kNone;
  const char* why = nullptr;  // kNone only
};

// Which kernels run the backward of p on `dev` (the first decision of PlanFlashBwd, and what
// jax_sgl/_plan.py reports for a made-up device).
BwdChoice ChooseBwdKernel(const AttentionParams& p, const DeviceInfo& dev);

// The choice's name as jax_sgl/_plan.py reports it ("sm90_bwd", "portable_bwd", ...).
const char* BwdKernelName(const BwdChoice& choice);

// How one call's backward runs (PlanFlashBwd), decided from the shapes and the device once per
// call, so the workspace size and the launches agree.
struct FlashBwdPlan {
  BwdChoice choice;
  int ws_rows;           // dense calls: rows per (batch, head) of softmax_d and lse_log2; varlen
                         // q on the sm90 backward: rows per head (Sm90BwdVarlenWsRows)
  int ws_seq_align = 0;  // varlen q on the sm90 backward: FlashBwdArgs::ws_seq_align
  size_t sm90_tail_bytes = 0;  // sm90 tail split's dK / dV shares (Sm90BwdTailBytes), or 0
  size_t scratch_bytes;  // softmax_d, lse_log2, (kSm90, kSm100) the float32 dQ accumulator,
                         // the shares
};

// Fills *plan and returns nullptr, or returns the reason the combination has no CUDA backward
// (names what is missing). The sm90 kernel serves a call when it covers it, the build has it,
// the device is compute capability 9.0 and JAX_SGL_DISABLE does not name sm90_bwd (p.disable,
// sm90/bwd/launch.h); p.deterministic computes its dQ with the atomic-free sm90 dQ kernel.
const char* PlanFlashBwd(const AttentionParams& p, const DeviceInfo& dev, FlashBwdPlan* plan);

// Launches the backward of bp on stream; `scratch` holds plan.scratch_bytes. Returns nullptr
// or an error text (a CUDA launch error).
const char* RunFlashBwd(const AttentionBwdParams& bp, const FlashBwdPlan& plan, void* scratch,
                        cudaStream_t stream);

// One instantiation per (storage type, head-dim capacity), in instantiations/: the dK/dV and dQ
// kernels. The preprocess kernel is not templated on the head dim (bwd_sm80/preprocess.cu).
template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwd(const FlashBwdArgs& args, cudaStream_t stream);
cudaError_t LaunchFlashBwdPreprocess(const FlashBwdArgs& args, cudaStream_t stream);

}  // namespace jax_sgl::cuda
