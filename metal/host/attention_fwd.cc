// macOS "cpu" handler of jax_sgl_attention_fwd: runs the Metal kernels (metal/kernels/attention.metal)
// on XLA's host buffers, or hands the call to the C++ CPU handler (JaxSglAttentionFwdCpu) when
// Metal is off, absent, not worth it, or the call needs what the Metal kernels lack (fp8,
// descales, head_dim > 128: metal::AttentionUnsupported).
#include <string>
#include <vector>

#include "ffi/common/attention_ffi.h"
#include "metal/host/context.h"
#include "metal/host/plan.h"

extern "C" XLA_FFI_Error* JaxSglAttentionFwdCpu(XLA_FFI_CallFrame*);

namespace jax_sgl::metal {
namespace {

// Below ~16 MFLOP the CPU kernel finishes before a command buffer returns (a guess until
// measured on Apple hardware).
constexpr double kAttentionAutoThreshold = 16e6;

ffi::Error AttentionFwdMetalImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::Buffer<ffi::S32> cu_seqlens_q,
                                 ffi::Buffer<ffi::S32> cu_seqlens_k,
                                 ffi::Buffer<ffi::S32> seqused_k, ffi::Buffer<ffi::S32> page_table,
                                 ffi::Buffer<ffi::F32> q_descale, ffi::Buffer<ffi::F32> k_descale,
                                 ffi::Buffer<ffi::F32> v_descale, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t kv_layout,
                                 bool varlen_q, int64_t batch, int64_t max_seqlen_q,
                                 float softmax_scale, float softcap, bool causal,
                                 int64_t window_left, int64_t window_right) {
  AttentionParams p;
  if (auto err = MakeAttentionParams(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                                     q_descale, k_descale, v_descale, out, lse, kv_layout,
                                     varlen_q, batch, max_seqlen_q, softmax_scale, softcap, causal,
                                     window_left, window_right, &p);
      err.failure())
    return err;
  // Upper bound of the score work: every query against every key slot of its sequence.
  const double keys = p.kv_layout == KvLayout::kPaged ? double(p.max_pages) * p.page_size
                      : p.kv_layout == KvLayout::kVarlen ? double(p.total_k) / (p.batch ? p.batch : 1)
                                                         : double(p.seqlen_k);
  const double work = 4.0 * double(p.total_q) * p.num_heads * keys * p.head_dim;
  if (AttentionUnsupported(p) != nullptr || !UseMetal(work, kAttentionAutoThreshold)) {
    MarkDeclined();
    return ffi::Error::Success();
  }
  const MetalAttentionParams mp = ToMetalParams(p);
  const std::vector<HostArg> args = {
      {kAttnQ, q.untyped_data(), q.size_bytes(), false},
      {kAttnK, k.untyped_data(), k.size_bytes(), false},
      {kAttnV, v.untyped_data(), v.size_bytes(), false},
      {kAttnOut, out->untyped_data(), out->size_bytes(), true},
      {kAttnLse, lse->untyped_data(), lse->size_bytes(), true},
      {kAttnCuSeqlensQ, cu_seqlens_q.untyped_data(), cu_seqlens_q.size_bytes(), false},
      {kAttnCuSeqlensK, cu_seqlens_k.untyped_data(), cu_seqlens_k.size_bytes(), false},
      {kAttnSequsedK, seqused_k.untyped_data(), seqused_k.size_bytes(), false},
      {kAttnPageTable, page_table.untyped_data(), page_table.size_bytes(), false},
  };
  std::string error;
  if (p.cu_seqlens_q && p.total_q > 0)
    error = Dispatch(AttentionClearKernelName(p.out_type), AttentionClearGrid(p), args, &mp,
                     sizeof(mp), kAttnParams);
  if (error.empty() && p.batch > 0 && p.num_heads > 0)
    error = Dispatch(AttentionFwdKernelName(p.q_type), AttentionFwdGrid(p), args, &mp, sizeof(mp),
                     kAttnParams);
  if (!error.empty()) return ffi::Error::Internal("jax_sgl.attention (Metal): " + error);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::metal

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSglAttentionFwdMetal, jax_sgl::metal::AttentionFwdMetalImpl,
                              jax_sgl::BindAttentionFwd(xla::ffi::Ffi::Bind()));

// The handler registered for platform "cpu" on macOS (see JaxSglRopePoolFwdApple).
extern "C" XLA_FFI_Error* JaxSglAttentionFwdApple(XLA_FFI_CallFrame* frame) {
  if (jax_sgl::metal::SelectedMode() == jax_sgl::metal::Mode::kOff)
    return JaxSglAttentionFwdCpu(frame);
  XLA_FFI_Error* err = JaxSglAttentionFwdMetal(frame);
  if (err == nullptr && jax_sgl::metal::TakeDeclined()) return JaxSglAttentionFwdCpu(frame);
  return err;
}
