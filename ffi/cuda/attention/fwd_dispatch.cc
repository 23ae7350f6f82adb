// Picks the CUDA attention kernel for a call and launches it: head-dim capacity, kernel (the
// dedicated decode kernel for at most kDecodeMaxQLen q rows per sequence, else sm100, sm90 or the
// sm80 prefill / decode layouts), and the number of KV splits, from the shapes and the device's facts
// alone (DeviceInfo; no device memory is read), so the same plan holds when XLA replays the
// call. Host code only: the kernels live in the generated instantiations/ files.
#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "ffi/common/attention_seq.h"
#include "ffi/cuda/attention/decode/launch.h"
#include "ffi/cuda/attention/flash_fwd_launch.h"
#include "ffi/cuda/attention/sm100/fwd/launch.h"
#include "ffi/cuda/attention/sm90/fwd/launch.h"
#include "ffi/cuda/attention/sm90/fwd/tile_size.h"

namespace jax_sgl::cuda {
namespace {

// Decode split heuristic: enough CTAs for kDecodeWaves full waves of the resident slots, so that
// the last, partial wave still keeps hundreds of CTAs' loads in flight; but never a split of
// fewer than kDecodeMinTilesPerSplit stages, whose prologue (q + page-table reads) would show.
constexpr int kDecodeWaves = 2;
constexpr int kDecodeMinTilesPerSplit = 8;
// CTAs of 128 threads per SM the decode kernel's registers allow (ptxas -v, sm_90a: 94-127
// registers up to d = 128, 160 at 192, 206 at 256); shared memory usually binds first.
int DecodeMaxCtasPerSm(int cap) { return cap <= 128 ? 4 : (cap <= 192 ? 3 : 2); }

// Whether the TMA form (decode/tma_kernel.cuh) can take the call: a device with the
// tensor copy engine, whole 128-byte column blocks, 16-key stages that never straddle a page.
bool DecodeTmaServes(const AttentionParams& p, int cap, const DeviceInfo& dev) {
  if (cap != 64 && cap != 128) return false;
  if (p.kv_layout == KvLayout::kPaged && p.page_size % 16 != 0) return false;
  return dev.cc_major >= 9;
}

// The warp-sliced form of a call: TMA where DecodeTmaServes (paged 0.96-1.00x cuDNN's contiguous
// decode on the H200 with the 128-byte L2 promotion, against the cp.async form's 0.91-0.93x),
// else cp.async.
DecodeWarpForm WarpForm(const AttentionParams& p, int cap, const DeviceInfo& dev) {
  return DecodeTmaServes(p, cap, dev) ? DecodeWarpForm::kTma : DecodeWarpForm::kCpAsync;
}

// Keys per sequence at most (the split heuristic sizes by it; kernels clamp to the real lengths).
int64_t KeyBound(const AttentionParams& p) {
  switch (p.kv_layout) {
    case KvLayout::kDense: return p.seqlen_k;
    case KvLayout::kVarlen: return p.total_k;
    default: return int64_t(p.max_pages) * p.page_size;
  }
}

// Whether the portable kernels take the call's dtypes and head dims; sets the head-dim capacity.
const char* CheckSm80Support(const AttentionParams& p, int* cap) {
  if (!HalfPrecisionOperands(p))
    return "jax_sgl.attention: the CUDA kernel supports float16 and bfloat16 q/k/v only "
           "(float32 inputs run on the CPU backend)";
  *cap = SmallestCapacity(p, kHeadDimCapacities);
  if (*cap == 0 || p.head_dim % 8 || p.head_dim_v % 8)
    return "jax_sgl.attention: the CUDA kernel supports head dims that are multiples of 8 up to 256";
  if (!HeadDimBuilt(*cap))
    return "jax_sgl.attention: this build left out the CUDA kernel for the head dim "
           "(JAX_SGL_ATTN_DISABLE_HDIM*)";
  return nullptr;
}

// Whether the warp-sliced decode forms can index every K/V row: they keep pool rows in 32 bits
// (one shuffled word per key, cp_async_kernel.cuh); pools of 2^31 rows or more (head dims of 32
// or less in 32+ GiB) take the block-wide kernel's 64-bit rows.
bool WarpDecodeRowsFit(const AttentionParams& p) { return p.total_k < (int64_t(1) << 31); }

// Whether the fp8-KV decode (the warp forms over e4m3 K/V, decode/fp8_kv_operands.cuh) takes the
// call; sets the head-dim capacity. The fp8-KV call shapes it leaves (more q rows, other head
// dims, float32 q) go to the portable kernel's fp8 form (CheckPortableFp8), or are refused there.
const char* CheckFp8KvDecode(const AttentionParams& p, const DeviceInfo& dev, int* cap) {
  *cap = 0;
  if (!(p.q_type == DType::kBF16 || p.q_type == DType::kF16) || p.out_type != p.q_type)
    return "jax_sgl.attention: the CUDA fp8 KV-cache decode takes bfloat16 or float16 q (float32 "
           "q over an fp8 KV cache runs on the CPU backend)";
  const int64_t rows = int64_t(p.seqlen_q) * (p.num_heads / p.num_kv_heads);
  if (p.seqlen_q < 1 || p.seqlen_q > kDecodeMaxQLen || rows > kDecodeWarpMmaMaxRows)
    return "jax_sgl.attention: the CUDA kernels read an fp8 KV cache in decode calls only (at "
           "most 8 q rows per sequence and 16 q rows x q heads per kv head)";
  const int need = std::max(p.head_dim, p.head_dim_v);
  const int c = need <= 64 ? 64 : 128;
  if (need > 128 || p.head_dim % 16 || p.head_dim_v % 16 || (c == 128 && need <= 96))
    return "jax_sgl.attention: the CUDA fp8 KV-cache decode serves head dims 64 and 128 (and "
           "multiples of 16 up to them, above 96 for 128)";
  if (!HeadDimBuilt(c))
    return "jax_sgl.attention: this build left out the CUDA kernel for the head dim "
           "(JAX_SGL_ATTN_DISABLE_HDIM*)";
  // 16-byte copies (the tensor maps' byte strides, cp.async's sources); 32-bit row indices.
  if (p.k_head_stride % 16 || p.k_row_stride % 16 || p.v_head_stride % 16 ||
      p.v_row_stride % 16 || !WarpDecodeRowsFit(p))
    return "jax_sgl.attention: the CUDA fp8 KV-cache decode needs K/V rows and heads at 16-byte "
           "strides and fewer than 2^31 rows";
  if (dev.cc_major < 8)
    return "jax_sgl.attention: the CUDA fp8 KV-cache decode needs compute capability 8.0 or later";
  *cap = c;
  return nullptr;
}

// Whether any of q, k, v is fp8 (e4m3 or e5m2): the call shapes ChooseFwdKernel routes apart.
bool HasFp8Operand(const AttentionParams& p) {
  auto fp8 = [](DType t) { return t == DType::kF8E4M3 || t == DType::kF8E5M2; };
  return fp8(p.q_type) || fp8(p.k_type) || fp8(p.v_type);
}

// The 16-bit type the mma.sync kernels compute in and write: q's, bf16 under e4m3 q (SGLang's
// fp8 output type).
DType KernelComputeType(const AttentionParams& p) {
  return p.q_type == DType::kF8E4M3 ? DType::kBF16 : p.q_type;
}

// Shared memory one CTA of the fp8 form takes at head-dim capacity cap (INT_MAX: not built).
int PortableFp8SmemBytes(int cap);

// Whether the portable kernel's fp8 form (LaunchFlashFwdFp8) takes the call; sets the head-dim
// capacity. Its dtypes: e4m3 q/k/v (bf16 out), bf16/fp16 q and k over e4m3 V (v_dequant), and
// bf16/fp16 q over e4m3 K and V (an fp8 KV cache), each dequantized by the descales the params
// carry; e5m2, float32 q and block-scaled q/k have no CUDA kernel.
const char* CheckPortableFp8(const AttentionParams& p, const DeviceInfo& dev, int* cap) {
  *cap = 0;
  if (p.qk_block_scale != BlockScaleType::kNone)
    return "jax_sgl.attention: block-scaled q/k (qk_blockscaled) runs on the CPU only: no CUDA "
           "kernel applies e8m0 block scales yet";
  const bool half_q = p.q_type == DType::kBF16 || p.q_type == DType::kF16;
  const bool types =
      p.v_type == DType::kF8E4M3 &&
      (p.q_type == DType::kF8E4M3
           ? p.k_type == DType::kF8E4M3 && p.out_type == DType::kBF16
           : half_q && (p.k_type == p.q_type || p.k_type == DType::kF8E4M3) &&
                 p.out_type == p.q_type);
  if (!types)
    return "jax_sgl.attention: the CUDA kernels read fp8 as float8_e4m3fn under bfloat16/float16 "
           "compute: e4m3 q/k/v, bfloat16/float16 q and k over e4m3 v (v_dequant), or "
           "bfloat16/float16 q over e4m3 k/v (an fp8 KV cache); float8_e5m2 and float32 q run on "
           "the CPU backend";
  *cap = SmallestCapacity(p, kFp8HeadDimCapacities);
  if (*cap == 0 || p.head_dim % 8 || p.head_dim_v % 8)
    return "jax_sgl.attention: the CUDA fp8 kernel supports head dims that are multiples of 8 up "
           "to 256";
  if (!HeadDimBuilt(*cap))
    return "jax_sgl.attention: this build left out the CUDA fp8 kernel for the head dim "
           "(JAX_SGL_ATTN_DISABLE_HDIM*; built for head-dim capacities 64, 128 and 256)";
  // 8-byte copies of the e4m3 rows, 16-byte ones of a 16-bit K's.
  if (p.k_row_stride % 8 || p.k_head_stride % 8 || p.v_row_stride % 8 || p.v_head_stride % 8)
    return "jax_sgl.attention: the CUDA fp8 kernel needs K/V rows and heads at strides of 8 "
           "elements";
  if (int64_t(p.batch) * p.num_kv_heads > 65535)
    return "jax_sgl.attention: the CUDA kernel supports batch * num_kv_heads <= 65535";
  if (dev.cc_major < 8)
    return "jax_sgl.attention: the CUDA fp8 kernel needs compute capability 8.0 or later";
  if (PortableFp8SmemBytes(*cap) > dev.smem_optin)
    return "jax_sgl.attention: the CUDA fp8 kernel at this head dim needs more shared memory per "
           "block than this device allows (99 KiB at head-dim capacity 256)";
  return nullptr;
}

void SetScratch(const AttentionParams& p, FlashPlan* plan) {
  plan->scratch_bytes = 0;
  if (plan->num_splits > 1) {
    const size_t per_split = size_t(p.total_q) * p.num_heads;
    plan->scratch_bytes = size_t(plan->num_splits) * per_split * (size_t(p.head_dim_v) + 1) * 4;
  }
}

// The split count whose CTAs fill their last wave of `slots`
// best (busy fraction of the waves), fewest splits on ties, at most 4 waves' worth and `most`.
// Uniform CTAs finish together, so a last wave a third full idles two thirds of the GPU for a
// wave's time: B=8 x 8 kv heads on 264 slots is 64 CTAs (a quarter wave) at 1 split, 448 (1.7
// waves) at the one-wave count 7, 256 (0.97) at 4.
int64_t FittedSplits(int64_t base, int64_t slots, int64_t most) {
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(most, (4 * slots + base - 1) / base));
  int64_t best = 1;
  double best_busy = 0.0;
  for (int64_t s = 1; s <= cap; ++s) {
    const int64_t ctas = base * s;
    const double busy = double(ctas) / double((ctas + slots - 1) / slots * slots);
    if (busy > best_busy + 1e-9) {
      best = s;
      best_busy = busy;
    }
  }
  return best;
}

// KV splits of a decode plan: enough CTAs for `waves` full waves of the `slots` resident CTA
// slots over `base` CTAs per split (waves 0: FittedSplits), but at most `max_by_keys` (each split
// keeps enough key tiles that its prologue does not show); within 1..kMaxSplits.
int DecodeSplits(int64_t base, int64_t slots, int waves, int64_t max_by_keys) {
  int64_t splits;
  if (waves == 0 && base > 0) {
    splits = FittedSplits(base, slots, std::min<int64_t>(max_by_keys, kMaxSplits));
  } else {
    splits = base > 0 ? (std::max(waves, 1) * slots + base - 1) / base : 1;
    splits = std::min<int64_t>(splits, max_by_keys);
  }
  return int(std::clamp<int64_t>(splits, 1, kMaxSplits));
}

// The decode kernel's plan: rows per CTA, ring depth (shrunk if the device's shared memory per
// block cannot hold it), and splits that fill every SM's CTA slots.
void PlanDecodeKernel(const AttentionParams& p, const DeviceInfo& dev, FlashPlan* plan) {
  const int cap = plan->choice.head_dim_cap;
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t rows = int64_t(p.seqlen_q) * group;
  const int64_t rows_cta = std::min<int64_t>(rows, kDecodeMaxRows);
  plan->decode = false;
  plan->block_m = kDecodeMaxRows;
  plan->m_blocks = int(std::max<int64_t>(1, (rows + kDecodeMaxRows - 1) / kDecodeMaxRows));
  plan->decode_m_tiles = rows_cta > 32 ? 4 : (rows_cta > 16 ? 2 : 1);
  int stages = kDecodeDefaultStages;
  while (stages > 2 && DecodeSmemBytes(cap, stages, plan->decode_m_tiles) > dev.smem_optin)
    --stages;
  plan->decode_stages = stages;

  const int smem = DecodeSmemBytes(cap, stages, plan->decode_m_tiles);
  const int ctas_per_sm =
      std::clamp(dev.smem_per_sm / (smem + dev.smem_reserved), 1, DecodeMaxCtasPerSm(cap));
  const int64_t slots = int64_t(ctas_per_sm) * std::max(dev.num_sms, 1);
  const int64_t base = int64_t(plan->m_blocks) * p.batch * p.num_kv_heads;
  const int64_t n_tiles = (KeyBound(p) + DecodeBlockN(cap) - 1) / DecodeBlockN(cap);
  plan->num_splits = DecodeSplits(base, slots, kDecodeWaves, n_tiles / kDecodeMinTilesPerSplit);
  SetScratch(p, plan);
}

template <typename T>
int DecodeWarpCtasPerSm(int cap, int stages, DecodeWarpForm form) {
  return WithHeadDimCap(cap, 1, [&](auto d) {
    return FlashDecodeWarpCtasPerSm<T, decltype(d)::value>(stages, form);
  });
}

// The fp8-KV forms' capacities: 64 and 128 (CheckFp8KvDecode).
template <typename T>
int DecodeWarpFp8KvCtasPerSm(int cap, int stages, DecodeWarpForm form) {
  return WithHeadDimCap(cap, 1, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    if constexpr (kD == 64 || kD == 128) return FlashDecodeWarpFp8KvCtasPerSm<T, kD>(stages, form);
    return 1;
  });
}

template <typename T>
cudaError_t LaunchDecodeFp8KvForType(int cap, const FlashDecodeArgs& args, cudaStream_t stream) {
  return WithHeadDimCap(cap, cudaErrorInvalidValue, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    if constexpr (kD == 64 || kD == 128) return LaunchFlashDecodeWarpFp8Kv<T, kD>(args, stream);
    return cudaErrorInvalidValue;
  });
}

// The warp-sliced decode kernels' plan (at most kDecodeWarpMmaMaxRows packed rows): the form,
// ring depth per warp (3 of the 8.5 KiB stages: 2 CTAs per SM at d = 128, shrunk if the device's
// shared memory per block cannot hold it), and splits for the resident CTA slots the occupancy
// API reports: one wave when the splits-of-one CTAs already fill the slots (B=64, KV 4k: 3842 vs
// 3710 GB/s at two; fitting the last wave there costs 3% at KV 32k), else the best-filled last
// wave (B=8, KV 32k: 3811 GB/s against 3027 at one wave), never under
// kDecodeWarpMinStagesPerWarp stages per warp.
constexpr int kDecodeWarpStages = 3;
// Over an fp8 KV cache a stage is half the bytes: about twice the stages keep the same bytes in
// flight per warp at the same 2 CTAs per SM (d = 128): 6 TMA stages (101 KiB), 5 padded cp.async
// ones (94 KiB; 6 would be 112 KiB, one CTA). Measured (H100, 2026-12-06,
// bench_attention_decode_fp8.py, KV 4k / 32k, % of copy): 3 or 4 stages 75-76 / 83%, 5 84 / 96%,
// these 83-84 / 95-96%, 8 (one CTA per SM) 62 / 71%.
constexpr int kDecodeWarpStagesTmaFp8Kv = 6;
constexpr int kDecodeWarpStagesCpAsyncFp8Kv = 5;
constexpr int kDecodeWarpMinStagesPerWarp = 4;
void PlanDecodeWarpKernel(const AttentionParams& p, const DeviceInfo& dev, FlashPlan* plan) {
  const int cap = plan->choice.head_dim_cap;
  const DecodeWarpForm form = plan->choice.warp_form;
  plan->decode = false;
  plan->block_m = kDecodeWarpMmaMaxRows;
  plan->m_blocks = 1;
  plan->decode_m_tiles = kDecodeWarpMmaMaxRows;
  int stages = form == DecodeWarpForm::kTmaFp8Kv       ? kDecodeWarpStagesTmaFp8Kv
               : form == DecodeWarpForm::kCpAsyncFp8Kv ? kDecodeWarpStagesCpAsyncFp8Kv
                                                       : kDecodeWarpStages;
  auto smem = [&](int st) {
    switch (form) {
      case DecodeWarpForm::kTma: return DecodeWarpTmaSmemBytes(cap, st);
      case DecodeWarpForm::kTmaFp8Kv: return DecodeWarpTmaSmemBytes(cap, st, 1);
      case DecodeWarpForm::kCpAsyncFp8Kv: return DecodeWarpMmaSmemBytes(cap, st, 1);
      default: return DecodeWarpMmaSmemBytes(cap, st);
    }
  };
  while (stages > 2 && smem(stages) > dev.smem_optin) --stages;
  plan->decode_stages = stages;
  int ctas_per_sm;
  if (IsFp8KvForm(form))
    ctas_per_sm = p.q_type == DType::kBF16 ? DecodeWarpFp8KvCtasPerSm<bf16_t>(cap, stages, form)
                                           : DecodeWarpFp8KvCtasPerSm<f16_t>(cap, stages, form);
  else
    ctas_per_sm = p.q_type == DType::kBF16 ? DecodeWarpCtasPerSm<bf16_t>(cap, stages, form)
                                           : DecodeWarpCtasPerSm<f16_t>(cap, stages, form);
  const int64_t slots = int64_t(ctas_per_sm) * std::max(dev.num_sms, 1);
  const int64_t base = int64_t(p.batch) * p.num_kv_heads;
  const int waves = base < slots ? 0 : 1;
  const int64_t n_tiles = (KeyBound(p) + 15) / 16;  // 16-key stages
  plan->num_splits = DecodeSplits(
      base, slots, waves, n_tiles / (int64_t(kDecodeWarpThreads / 32) * kDecodeWarpMinStagesPerWarp));
  SetScratch(p, plan);
}

// Keys per tile of each layout (FlashConfig::kBlockN), for the split heuristic.
int BlockN(int head_dim_cap, bool decode) { return decode || head_dim_cap <= 128 ? 64 : 32; }

template <typename T, int kD>
cudaError_t LaunchForHeadDim(const FlashPlan& plan, const FlashFwdArgs& args, cudaStream_t stream) {
  return plan.decode ? LaunchFlashFwd<T, kD, true>(args, plan.m_blocks, stream)
                     : LaunchFlashFwd<T, kD, false>(args, plan.m_blocks, stream);
}

template <typename T, int kD>
cudaError_t LaunchDecodeForHeadDim(bool warp, const FlashDecodeArgs& args, cudaStream_t stream) {
  return warp ? LaunchFlashDecodeWarp<T, kD>(args, stream) : LaunchFlashDecode<T, kD>(args, stream);
}

template <typename T>
cudaError_t LaunchDecodeForType(int head_dim_cap, bool warp, const FlashDecodeArgs& args,
                                cudaStream_t stream) {
  return WithHeadDimCap(head_dim_cap, cudaErrorInvalidValue, [&](auto d) {
    return LaunchDecodeForHeadDim<T, decltype(d)::value>(warp, args, stream);
  });
}

template <typename T>
cudaError_t LaunchForType(const FlashPlan& plan, const FlashFwdArgs& args, cudaStream_t stream) {
  return WithHeadDimCap(plan.choice.head_dim_cap, cudaErrorInvalidValue, [&](auto d) {
    return LaunchForHeadDim<T, decltype(d)::value>(plan, args, stream);
  });
}

// The fp8 form's capacities: kFp8HeadDimCapacities (64, 128, 256).
template <int kD>
constexpr bool kFp8Built = kD == 64 || kD == 128 || kD == 256;

template <typename T>
cudaError_t LaunchFp8ForType(const FlashPlan& plan, const FlashFwdArgs& args, cudaStream_t stream) {
  return WithHeadDimCap(plan.choice.head_dim_cap, cudaErrorInvalidValue, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    if constexpr (kFp8Built<kD>) return LaunchFlashFwdFp8<T, kD>(args, plan.m_blocks, stream);
    return cudaErrorInvalidValue;
  });
}

int PortableFp8SmemBytes(int cap) {
  return WithHeadDimCap(cap, INT_MAX, [](auto d) {
    constexpr int kD = decltype(d)::value;
    if constexpr (kFp8Built<kD>) return FlashFwdFp8SmemBytes<bf16_t, kD>();
    return INT_MAX;
  });
}

// Split-KV partials, as the split kernels write them and LaunchSplitCombine reads them: float32
// O [splits, total_q, num_heads, head_dim_v] at o_partial, then LSE [splits, total_q, num_heads].
float* LsePartial(const AttentionParams& p, int splits, float* o_partial) {
  return o_partial + size_t(splits) * p.total_q * p.num_heads * p.head_dim_v;
}

const char* CombineSplits(const AttentionParams& p, int splits, float* o_partial,
                          cudaStream_t stream) {
  SplitCombineArgs c;
  c.p = p;
  c.group = p.num_heads / p.num_kv_heads;
  c.num_splits = splits;
  c.o_partial = o_partial;
  c.lse_partial = LsePartial(p, splits, o_partial);
  c.lse_partial_type = DType::kF32;
  c.o_type = KernelComputeType(p);  // bf16 / fp16 out, fp8 q too
  return LaunchSplitCombine(c, stream);
}

}  // namespace

FwdChoice ChooseFwdKernel(const AttentionParams& p, const DeviceInfo& dev) {
  FwdChoice c;
  if (HasFp8Operand(p)) {
    // Decode calls over an fp8 KV cache: the fp8-KV decode, which reads the pool's bytes as they
    // are (decode is bandwidth bound: half the bytes per key is the cache's point).
    if (Fp8KvCacheTypes(p) && CheckFp8KvDecode(p, dev, &c.head_dim_cap) == nullptr) {
      c.kernel = FwdKernel::kDecodeWarp;
      c.warp_form = DecodeTmaServes(p, c.head_dim_cap, dev) ? DecodeWarpForm::kTmaFp8Kv
                                                            : DecodeWarpForm::kCpAsyncFp8Kv;
      return c;
    }
    // Every other fp8 call shape (fp8 q/k/v, v_dequant, prefill / mixed batches / verify over an
    // fp8 pool; dense, varlen, paged at any page size): the portable kernel's fp8 form, on any
    // GPU from sm80, except what the Hopper fp8 forward takes first on a 9.0 device (e4m3 q/k/v
    // over dense, varlen or paged k/v at its built head dims, with the 16-bit kernel's bounds on
    // paged calls' rows; sm90/fwd/dispatch.cc Sm90Fp8Operands, VarlenUnsupported).
#ifdef JAX_SGL_HAVE_SM90
    if (Sm90Unsupported(p) == nullptr && Sm90Enabled(p, dev)) {
      c.kernel = FwdKernel::kSm90;
      return c;
    }
#endif
    if ((c.why = CheckPortableFp8(p, dev, &c.head_dim_cap)) != nullptr) return c;
    c.kernel = FwdKernel::kPortableFp8;
    return c;
  }
  // Decode-shaped calls (a bound of kDecodeMaxQLen q rows per sequence: dense q, or varlen q
  // with that few rows in all) take the dedicated decode kernels: the warp-sliced ones for at
  // most kDecodeWarpMmaMaxRows packed rows, else the block-wide one, except verify-like paged
  // calls (kSm90VerifyMinQRows q rows per sequence and kSm90VerifyMinRows packed rows: 8 drafts
  // of a GQA group of 4 or more, over kSm90VerifyMinKeys keys) on Hopper, which the sm90 kernel
  // takes, packed and key-split (Sm90KeySplits): the block-wide kernel ran B=32 x 8 drafts over
  // 8k keys at 0.53x FA3. Only head dims whose sm90 tiles are persistent (64, 128): the key
  // split needs them, and hd256's one-CTA-per-tile kernel was never measured on such calls.
  const bool decode_shape = p.seqlen_q >= 1 && p.seqlen_q <= kDecodeMaxQLen;
#ifdef JAX_SGL_HAVE_SM90
  if (decode_shape && p.kv_layout == KvLayout::kPaged && p.seqlen_q >= kSm90VerifyMinQRows &&
      KeyBound(p) >= kSm90VerifyMinKeys && sm90::FwdTile(p.head_dim).persistent &&
      Sm90Unsupported(p) == nullptr && Sm90Enabled(p, dev)) {
    c.kernel = FwdKernel::kSm90;
    return c;
  }
#endif
  if (decode_shape && CheckSm80Support(p, &c.head_dim_cap) == nullptr) {
    const int64_t rows = int64_t(p.seqlen_q) * (p.num_heads / p.num_kv_heads);
    if (rows <= kDecodeWarpMmaMaxRows && WarpDecodeRowsFit(p)) {
      c.kernel = FwdKernel::kDecodeWarp;
      c.warp_form = WarpForm(p, c.head_dim_cap, dev);
    } else {
      c.kernel = FwdKernel::kDecodeBlock;
    }
    return c;
  }
  // The Blackwell forward on a 10.0 device, for what it covers unless JAX_SGL_DISABLE names sm100.
#ifdef JAX_SGL_HAVE_SM100
  if (Sm100FwdUnsupported(p) == nullptr && Sm100FwdEnabled(p, dev)) {
    c.kernel = FwdKernel::kSm100;
    return c;
  }
#endif
  // The Hopper kernel on a 9.0 device, for what it covers unless JAX_SGL_DISABLE names sm90;
  // everything else falls through to the portable sm80 kernel.
#ifdef JAX_SGL_HAVE_SM90
  if (Sm90Unsupported(p) == nullptr && Sm90Enabled(p, dev)) {
    c.kernel = FwdKernel::kSm90;
    return c;
  }
#endif
  if ((c.why = CheckSm80Support(p, &c.head_dim_cap)) != nullptr) return c;
  if (int64_t(p.batch) * p.num_kv_heads > 65535) {
    c.why = "jax_sgl.attention: the CUDA kernel supports batch * num_kv_heads <= 65535";
    return c;
  }
  c.kernel = FwdKernel::kPortable;
  return c;
}

const char* FwdKernelName(const FwdChoice& choice) {
  switch (choice.kernel) {
    case FwdKernel::kDecodeWarp:
      switch (choice.warp_form) {
        case DecodeWarpForm::kTma: return "decode_warp_tma";
        case DecodeWarpForm::kCpAsync: return "decode_warp_cp_async";
        case DecodeWarpForm::kTmaFp8Kv: return "decode_warp_tma_fp8kv";
        case DecodeWarpForm::kCpAsyncFp8Kv: return "decode_warp_cp_async_fp8kv";
      }
      break;
    case FwdKernel::kDecodeBlock: return "decode_block";
    case FwdKernel::kSm90: return "sm90";
    case FwdKernel::kSm100: return "sm100";
    case FwdKernel::kPortable: return "portable";
    case FwdKernel::kPortableFp8: return "portable_fp8";
    case FwdKernel::kNone: break;
  }
  return "none";
}

const char* PlanFlashFwd(const AttentionParams& p, const DeviceInfo& dev, FlashPlan* plan) {
  plan->choice = ChooseFwdKernel(p, dev);
  plan->num_splits = 1;
  plan->scratch_bytes = 0;
  switch (plan->choice.kernel) {
    case FwdKernel::kNone: return plan->choice.why;
    case FwdKernel::kDecodeWarp: PlanDecodeWarpKernel(p, dev, plan); return nullptr;
    case FwdKernel::kDecodeBlock: PlanDecodeKernel(p, dev, plan); return nullptr;
    case FwdKernel::kSm90:
#ifdef JAX_SGL_HAVE_SM90
      plan->num_splits = Sm90KeySplits(p, dev.num_sms);
      plan->scratch_bytes = Sm90ScratchBytes(p, dev.num_sms, plan->num_splits);
#endif
      return nullptr;
    case FwdKernel::kSm100: return nullptr;  // no scratch
    case FwdKernel::kPortable:
    case FwdKernel::kPortableFp8: break;
  }
  const int cap = plan->choice.head_dim_cap;
  const int num_sms = dev.num_sms;
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t rows = int64_t(p.seqlen_q) * group;  // packed rows per sequence (a bound)
  plan->decode = rows <= 16 && plan->choice.kernel == FwdKernel::kPortable;  // fp8: prefill only
  plan->block_m = plan->decode ? 16 : 64;
  plan->m_blocks = int(std::max<int64_t>(1, (rows + plan->block_m - 1) / plan->block_m));

  // Split the keys when the grid would leave SMs idle: decode (few rows, long KV) wants several
  // CTAs per SM to keep enough loads in flight; prefill splits only when it lacks one full wave.
  const int64_t ctas = int64_t(plan->m_blocks) * p.batch * p.num_kv_heads;
  const int64_t blocks_n = (KeyBound(p) + BlockN(cap, plan->decode) - 1) / BlockN(cap, plan->decode);
  const int64_t target = plan->decode ? 8LL * num_sms : (ctas < num_sms ? 2LL * num_sms : ctas);
  int64_t splits = ctas > 0 ? (target + ctas - 1) / ctas : 1;
  splits = std::min<int64_t>({splits, kMaxSplits, std::max<int64_t>(1, blocks_n / 4)});
  plan->num_splits = int(std::max<int64_t>(1, splits));
  SetScratch(p, plan);
  return nullptr;
}

const char* RunFlashFwd(const AttentionParams& p, const FlashPlan& plan, void* scratch,
                        cudaStream_t stream) {
  if (p.batch == 0 || p.total_q == 0) return nullptr;
  // Packed q rows past cu_seqlens_q[batch] belong to no sequence: every kernel leaves them to this.
  if (p.cu_seqlens_q) {
    if (cudaError_t err = LaunchClearUncoveredRows(p, stream); err != cudaSuccess)
      return cudaGetErrorString(err);
  }
#ifdef JAX_SGL_HAVE_SM100
  if (plan.choice.kernel == FwdKernel::kSm100) {
    const cudaError_t err = RunFlashFwdSm100(p, stream);
    return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
  }
#endif
#ifdef JAX_SGL_HAVE_SM90
  if (plan.choice.kernel == FwdKernel::kSm90) {
    const cudaError_t err = RunFlashFwdSm90(p, plan.num_splits, scratch, stream);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    if (plan.num_splits == 1) return nullptr;
    // The key split's partials (Sm90KeySplitBytes), after the kernel's tile counter.
    return CombineSplits(p, plan.num_splits,
                         reinterpret_cast<float*>(static_cast<char*>(scratch) + kSm90CounterBytes),
                         stream);
  }
#endif
  FlashFwdArgs args;
  args.p = p;
  args.group = p.num_heads / p.num_kv_heads;
  args.num_splits = plan.num_splits;
  args.o_partial = nullptr;
  args.lse_partial = nullptr;
  if (plan.num_splits > 1) {
    args.o_partial = static_cast<float*>(scratch);
    args.lse_partial = LsePartial(p, plan.num_splits, args.o_partial);
  }
  cudaError_t err;
  const FwdKernel kernel = plan.choice.kernel;
  if (kernel == FwdKernel::kDecodeWarp || kernel == FwdKernel::kDecodeBlock) {
    const bool warp = kernel == FwdKernel::kDecodeWarp;
    FlashDecodeArgs d{args, plan.decode_stages, plan.decode_m_tiles, plan.m_blocks};
    if (warp) d.warp_form = plan.choice.warp_form;
    if (warp && IsFp8KvForm(d.warp_form))
      err = p.q_type == DType::kBF16
                ? LaunchDecodeFp8KvForType<bf16_t>(plan.choice.head_dim_cap, d, stream)
                : LaunchDecodeFp8KvForType<f16_t>(plan.choice.head_dim_cap, d, stream);
    else
      err = p.q_type == DType::kBF16
              ? LaunchDecodeForType<bf16_t>(plan.choice.head_dim_cap, warp, d, stream)
              : LaunchDecodeForType<f16_t>(plan.choice.head_dim_cap, warp, d, stream);
  } else if (kernel == FwdKernel::kPortableFp8) {
    err = KernelComputeType(p) == DType::kBF16 ? LaunchFp8ForType<bf16_t>(plan, args, stream)
                                               : LaunchFp8ForType<f16_t>(plan, args, stream);
  } else {
    err = p.q_type == DType::kBF16 ? LaunchForType<bf16_t>(plan, args, stream)
                                   : LaunchForType<f16_t>(plan, args, stream);
  }
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (plan.num_splits == 1) return nullptr;
  return CombineSplits(p, plan.num_splits, args.o_partial, stream);
}

const char* PortableBuiltHeadDims() {
  // Built once: the list is fixed at compile time.
  static const std::string dims = [] {
    std::string s;
    for (int d : kHeadDimCapacities)
      if (HeadDimBuilt(d)) s += " " + std::to_string(d);
    return s;
  }();
  return dims.c_str();
}

}  // namespace jax_sgl::cuda
