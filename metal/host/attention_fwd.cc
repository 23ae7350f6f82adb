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

ffi::Error AttentionFwdMetalImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                 AttentionAttrs attrs) {
  AttentionParams p;
  AttentionOperands o;
  if (auto err = MakeAttentionParams(args, rets, attrs, &p, &o); err.failure()) return err;
  // Upper bound of the score work: every query against every key slot of its sequence.
  const double keys = p.kv_layout == KvLayout::kPaged ? double(p.max_pages) * p.page_size
                      : p.kv_layout == KvLayout::kVarlen ? double(p.total_k) / (p.batch ? p.batch : 1)
                                                         : double(p.seqlen_k);
  const double work = 4.0 * double(p.total_q) * p.num_heads * keys * p.head_dim;
  if (AttentionUnsupported(p) != nullptr || !UseMetal(work, kAttentionAutoThreshold)) {
    MarkDeclined();
    return ffi::Error::Success();
  }
  const MetalAttentionParams mp = ToMetalParams(p, o.v->untyped_data());
  const std::vector<HostArg> buffers = {
      {kAttnQ, o.q->untyped_data(), o.q->size_bytes(), false},
      {kAttnK, o.k->untyped_data(), o.k->size_bytes(), false},
      {kAttnV, o.v->untyped_data(), o.v->size_bytes(), false},
      {kAttnOut, o.out->untyped_data(), o.out->size_bytes(), true},
      {kAttnLse, o.lse->untyped_data(), o.lse->size_bytes(), true},
      {kAttnCuSeqlensQ, o.cu_seqlens_q->untyped_data(), o.cu_seqlens_q->size_bytes(), false},
      {kAttnCuSeqlensK, o.cu_seqlens_k->untyped_data(), o.cu_seqlens_k->size_bytes(), false},
      {kAttnSequsedK, o.seqused_k->untyped_data(), o.seqused_k->size_bytes(), false},
      {kAttnPageTable, o.page_table->untyped_data(), o.page_table->size_bytes(), false},
      {kAttnSinks, o.sinks->untyped_data(), o.sinks->size_bytes(), false},
  };
  std::string error;
  if (p.cu_seqlens_q && p.total_q > 0)
    error = Dispatch(AttentionClearKernelName(p.out_type), AttentionClearGrid(p), buffers, &mp,
                     sizeof(mp), kAttnParams);
  if (error.empty() && p.batch > 0 && p.num_heads > 0)
    error = Dispatch(AttentionFwdKernelName(p.q_type), AttentionFwdGrid(p), buffers, &mp, sizeof(mp),
                     kAttnParams);
  if (!error.empty()) return ffi::Error::Internal("jax_sgl.attention (Metal): " + error);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::metal

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSglAttentionFwdMetal, jax_sgl::metal::AttentionFwdMetalImpl,
                              jax_sgl::BindAttention(xla::ffi::Ffi::Bind()));

// The handler registered for platform "cpu" on macOS (see JaxSglRopePoolFwdApple).
extern "C" XLA_FFI_Error* JaxSglAttentionFwdApple(XLA_FFI_CallFrame* frame) {
  if (jax_sgl::metal::SelectedMode() == jax_sgl::metal::Mode::kOff)
    return JaxSglAttentionFwdCpu(frame);
  XLA_FFI_Error* err = JaxSglAttentionFwdMetal(frame);
  if (err == nullptr && jax_sgl::metal::TakeDeclined()) return JaxSglAttentionFwdCpu(frame);
  return err;
}
