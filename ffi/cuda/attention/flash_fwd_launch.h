// Host-side contract of the CUDA attention forward: the plan (which kernel, how many KV splits,
// how much scratch) and the entry points the FFI handler calls. No CUDA syntax and no FFI headers:
// the handler (.cc) and the launchers (.cu) both include it.
//
// One kernel family (prefill_sm80/kernel.cuh, mma.sync, sm_80+) serves every layout: query rows of all
// q heads that share a kv head are packed into the M dimension (row r = query row r / group, head
// r % group), and each key row is gathered through AttentionParams (dense, varlen or paged), so
// GQA heads share every K/V load. Two warp layouts:
//   prefill: 4 warps x 16 packed rows, each warp against the whole key block;
//   decode:  16 packed rows (q length x group <= 16) shared by 4 warps that each take a quarter of
//            the key block, merged in shared memory at the end.
// Either may split the key range over blockIdx.y (split-KV); partial results then go to float32
// scratch and a combine kernel merges them by their LSEs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <type_traits>

#include "ffi/common/attention_params.h"
#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/common/device.h"

namespace jax_sgl::cuda {

// Head-dim capacities with a compiled kernel; a call runs on the smallest one >= max(d, d_v) and
// zero-fills the extra features, so every multiple of 8 up to 256 (and d_v != d) is served.
inline constexpr int kHeadDimCapacities[] = {64, 96, 128, 192, 256};

// Whether this build compiled the kernels of head-dim capacity d (CMake's JAX_SGL_ATTN_HEAD_DIMS
// defines JAX_SGL_ATTN_DISABLE_HDIM<d> for the others); forward and backward share the list.
// The built capacities as text, e.g. " 64 128" (jax_sgl.attention_backend_info()).
const char* PortableBuiltHeadDims();

// Calls f(std::integral_constant<int, D>{}) for the head-dim capacity D == cap when this build
// compiled it (JAX_SGL_ATTN_DISABLE_HDIM<D> unset), else returns `fallback`: the one switch from a
// run-time capacity to the instantiation of every per-head-dim kernel entry point.
template <typename R, typename F>
R WithHeadDimCap(int cap, R fallback, F&& f) {
  switch (cap) {
#ifndef JAX_SGL_ATTN_DISABLE_HDIM64
    case 64: return f(std::integral_constant<int, 64>{});
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM96
    case 96: return f(std::integral_constant<int, 96>{});
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM128
    case 128: return f(std::integral_constant<int, 128>{});
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM192
    case 192: return f(std::integral_constant<int, 192>{});
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM256
    case 256: return f(std::integral_constant<int, 256>{});
#endif
    default: return fallback;
  }
}

inline bool HeadDimBuilt(int d) {
  return WithHeadDimCap(d, false, [](auto) { return true; });
}

// The smallest of a kernel's head-dim capacities that holds the call's head dims (0: none).
template <size_t N>
int SmallestCapacity(const AttentionParams& p, const int (&caps)[N]) {
  const int need = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  for (int d : caps)
    if (d >= need) return d;
  return 0;
}
// The warp-sliced decode kernels' form (decode/warp_launch.cuh): TMA stages (sm_90+) or cp.async
// stages with 32-bit slot indices; or TMA / cp.async stages of an fp8 (e4m3) KV cache under
// bf16/fp16 q (the only fp8-KV forms).
enum class DecodeWarpForm { kTma, kCpAsync, kTmaFp8Kv, kCpAsyncFp8Kv };
// The forms that read an fp8 KV cache (their own launcher, LaunchFlashDecodeWarpFp8Kv).
inline bool IsFp8KvForm(DecodeWarpForm form) {
  return form == DecodeWarpForm::kTmaFp8Kv || form == DecodeWarpForm::kCpAsyncFp8Kv;
}

// Split-KV never uses more splits than one warp of the combine kernel reads at once.
inline constexpr int kMaxSplits = 32;

// The kernel a forward call runs (ChooseFwdKernel; docs/kernels.md has one row per kernel).
enum class FwdKernel {
  kNone,         // no CUDA kernel serves the call (FwdChoice::why says what is missing)
  kDecodeWarp,   // warp-sliced decode (decode/warp_launch.cuh), FwdChoice::warp_form
  kDecodeBlock,  // block-wide split-KV decode (decode/block_kernel.cuh)
  kSm90,         // Hopper wgmma + TMA (sm90/fwd/)
  kSm100,        // Blackwell tcgen05 + TMEM on CUTLASS's FMHA collectives (sm100/fwd/)
  kPortable,     // mma.sync prefill / decode layouts (prefill_sm80/kernel.cuh)
  kPortableFp8,  // the same kernel over e4m3 operands, prefill layout (LaunchFlashFwdFp8)
};

struct FwdChoice {
  FwdKernel kernel = FwdKernel::kNone;
  DecodeWarpForm warp_form = DecodeWarpForm::kCpAsync;  // kDecodeWarp only
  int head_dim_cap = 0;      // compiled head dim of the decode and portable kernels
  const char* why = nullptr;  // kNone only
};

// Which kernel runs the call on `dev`, from the shapes, the build and the device alone: the
// first decision of PlanFlashFwd, and what jax_sgl/_plan.py reports for a made-up device.
FwdChoice ChooseFwdKernel(const AttentionParams& p, const DeviceInfo& dev);

// The kernel's name as jax_sgl/_plan.py reports it ("sm90", "decode_warp_tma", ...).
const char* FwdKernelName(const FwdChoice& choice);

struct FlashPlan {
  FwdChoice choice;      // the kernel; the fields below size the decode and portable kernels
  int decode_stages;     // decode kernels: ring depth
  int decode_m_tiles;    // decode kernels: m16 tiles of q per CTA (shared-memory sizing)
  bool decode;           // portable: decode warp layout (16 packed rows) instead of prefill (64)
  int block_m;           // packed rows per CTA
  int m_blocks;          // CTAs along packed rows per (sequence, kv head)
  int num_splits;        // CTAs along the key range; > 1 uses the scratch and the combine kernel
  size_t scratch_bytes;  // float32 partial out [splits, total_q, H, d_v] + lse [splits, total_q, H]
};

// What one kernel launch reads: the API params plus the plan's runtime parts.
struct FlashFwdArgs {
  AttentionParams p;
  int group;          // num_heads / num_kv_heads
  int num_splits;
  float* o_partial;   // [num_splits, total_q, num_heads, head_dim_v] when num_splits > 1
  float* lse_partial; // [num_splits, total_q, num_heads] (natural log) when num_splits > 1
};

// Fills *plan; returns nullptr, or the reason the combination has no CUDA kernel.
const char* PlanFlashFwd(const AttentionParams& p, const DeviceInfo& dev, FlashPlan* plan);

// Launches the kernels of a plan on stream; `scratch` holds plan.scratch_bytes. Returns nullptr or
// an error text (a failed internal check or a CUDA launch error).
const char* RunFlashFwd(const AttentionParams& p, const FlashPlan& plan, void* scratch,
                        cudaStream_t stream);

// One instantiation per (storage type, head-dim capacity, warp layout), in instantiations/.
template <typename T, int kHeadDim, bool kDecode>
cudaError_t LaunchFlashFwd(const FlashFwdArgs& args, int m_blocks, cudaStream_t stream);

// The same kernel over fp8 operands (prefill_sm80/kernel.cuh, kFp8): e4m3 V under T = bf16 / fp16
// compute, K e4m3 or T, q e4m3 (T = bf16) or T; prefill warp layout only. Instantiated for the
// capacities kFp8HeadDimCapacities, with the shared memory one CTA takes.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashFwdFp8(const FlashFwdArgs& args, int m_blocks, cudaStream_t stream);
template <typename T, int kHeadDim>
int FlashFwdFp8SmemBytes();
// The fp8 kernel's head-dim capacities (instantiations.json's prefill_sm80_fp8): as the 16-bit
// kernel, a call runs on the smallest one >= max(d, d_v), so every multiple of 8 up to 256 is
// served; three instantiations per dtype instead of five, as the sm90 fp8 kernel's 64/128/256.
inline constexpr int kFp8HeadDimCapacities[] = {64, 128, 256};

// Combine step and the clearing of varlen rows no sequence covers (common/split_combine.cu).
struct SplitCombineArgs {
  AttentionParams p;
  int group;
  int num_splits;
  const float* o_partial;
  const float* lse_partial;
  DType lse_partial_type;  // always kF32: checked, as SGLang's combine does
  DType o_type;            // the type the combine writes: must match p.out_type
};
const char* LaunchSplitCombine(const SplitCombineArgs& args, cudaStream_t stream);
cudaError_t LaunchClearUncoveredRows(const AttentionParams& p, cudaStream_t stream);

}  // namespace jax_sgl::cuda
