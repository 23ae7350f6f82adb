// The CUDA dispatch as jax_sgl/_plan.py sees it: which kernel an attention call would run on a
// made-up device, decided by the handlers' own code (FillAttentionParams, then ChooseFwdKernel /
// ChooseBwdKernel) from the shapes and attributes of the lowered call. Nothing is launched and
// no buffer is read, so it runs on machines without a GPU (tests with a mocked compute
// capability). No CUDA syntax: ffi/module.cc includes it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ffi/common/attention_ffi.h"

namespace jax_sgl::cuda {

struct ProbeOperand {
  std::vector<int64_t> dims;
  std::string dtype;  // numpy's name: "bfloat16", "float16", "float32", "int32", "float8_e4m3fn", ...
};

struct ProbeDevice {
  int cc_major;
  int cc_minor;
  int num_sms;
};

// operands: the forward FFI call's eleven operands, then out and lse. Returns the kernel's name
// ("sm90", "decode_warp_tma", "portable_bwd", ...) or "none: <why>"; a malformed call gives
// "invalid: <message>".
std::string ProbeAttentionKernel(bool backward, const std::vector<ProbeOperand>& operands,
                                 const AttentionAttrs& attrs, const ProbeDevice& device);

}  // namespace jax_sgl::cuda
