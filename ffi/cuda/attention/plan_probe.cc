#include "ffi/cuda/attention/plan_probe.h"

#include <cstdint>
#include <string>

#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"
#include "ffi/cuda/attention/flash_fwd_launch.h"

namespace jax_sgl::cuda {
namespace {

bool ToFfiType(const std::string& name, XLA_FFI_DataType* out) {
  static const struct { const char* name; ffi::DataType type; } kTypes[] = {
      {"bfloat16", ffi::DataType::BF16},  {"float16", ffi::DataType::F16},
      {"float32", ffi::DataType::F32},    {"int32", ffi::DataType::S32},
      {"float8_e4m3fn", ffi::DataType::F8E4M3FN}, {"float8_e5m2", ffi::DataType::F8E5M2},
      {"float8_e8m0fnu", ffi::DataType::F8E8M0FNU},
  };
  for (const auto& t : kTypes) {
    if (name == t.name) {
      *out = static_cast<XLA_FFI_DataType>(t.type);
      return true;
    }
  }
  return false;
}

}  // namespace

std::string ProbeAttentionKernel(bool backward, const std::vector<ProbeOperand>& operands,
                                 const AttentionAttrs& attrs, const ProbeDevice& device) {
  constexpr size_t kCount = kAttentionOperands + 2;  // + out, lse
  if (operands.size() != kCount) return "invalid: expected the 11 operands, out and lse";
  std::vector<XLA_FFI_Buffer> buffers(kCount);
  std::vector<std::vector<int64_t>> dims(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    XLA_FFI_Buffer& b = buffers[i];
    b = {};
    b.struct_size = sizeof(XLA_FFI_Buffer);
    if (!ToFfiType(operands[i].dtype, &b.dtype)) return "invalid: dtype " + operands[i].dtype;
    // What XLA's decoding checks for the typed operands (index arrays, v_descale, sinks, lse;
    // q/k descales may be e8m0 block scales, which FillAttentionParams checks).
    const bool index = i >= 3 && i <= 6, f32 = i == 9 || i == 10 || i == 12;
    if ((index && operands[i].dtype != "int32") || (f32 && operands[i].dtype != "float32"))
      return "invalid: operand " + std::to_string(i) + " has dtype " + operands[i].dtype;
    dims[i] = operands[i].dims;
    b.rank = int64_t(dims[i].size());
    b.dims = dims[i].data();
    // A distinct, 256-byte aligned placeholder per operand: the plan tests pointers for null and
    // alignment only, and never dereferences them.
    b.data = reinterpret_cast<void*>(uintptr_t(i + 1) << 20);
  }
  AttentionOperands o;
  o.q.emplace(&buffers[0]);
  o.k.emplace(&buffers[1]);
  o.v.emplace(&buffers[2]);
  o.cu_seqlens_q.emplace(&buffers[3]);
  o.cu_seqlens_k.emplace(&buffers[4]);
  o.seqused_k.emplace(&buffers[5]);
  o.page_table.emplace(&buffers[6]);
  o.q_descale.emplace(&buffers[7]);
  o.k_descale.emplace(&buffers[8]);
  o.v_descale.emplace(&buffers[9]);
  o.sinks.emplace(&buffers[10]);
  o.out.emplace(&buffers[11]);
  o.lse.emplace(&buffers[12]);
  AttentionParams p;
  if (ffi::Error err = FillAttentionParams(o, attrs, &p); err.failure())
    return "invalid: " + err.message();
  DeviceInfo dev;
  dev.cc_major = device.cc_major;
  dev.cc_minor = device.cc_minor;
  dev.num_sms = device.num_sms;
  if (backward) {
    const BwdChoice c = ChooseBwdKernel(p, dev);
    return c.kernel == BwdKernel::kNone ? std::string("none: ") + c.why : BwdKernelName(c);
  }
  const FwdChoice c = ChooseFwdKernel(p, dev);
  return c.kernel == FwdKernel::kNone ? std::string("none: ") + c.why : FwdKernelName(c);
}

}  // namespace jax_sgl::cuda
