// Rotary embedding math shared by every backend, so CPU, CUDA, Metal and the pure-JAX reference
// agree bit for bit on the angles: angle_i = float32(position) * inv_freq_i, where inv_freq_i =
// base^(-2i / rotary_dim) is evaluated in double and rounded once to float32. A one-ulp difference
// in inv_freq would move the angle of position 4096 by ~2e-4 rad, far above float32 noise.
// Metal has no double: its kernels read a table of RopeInvFreq computed by the host
// (metal/host/plan.h), and include this header only for RopePair.
#pragma once

#if defined(__METAL_VERSION__)
#define JAX_SGL_ROPE_FN inline
#define JAX_SGL_ROPE_OUT thread
#else
#include <cmath>
#include <cstdint>

#include "ffi/common/host_device.h"
#define JAX_SGL_ROPE_FN JAX_SGL_HD
#define JAX_SGL_ROPE_OUT
#endif

namespace jax_sgl {

#if !defined(__METAL_VERSION__)
// Inverse frequency of rotation pair i (0 <= i < rotary_dim / 2).
JAX_SGL_HD float RopeInvFreq(int i, int rotary_dim, double log2_base) {
  return float(exp2(-(double(2 * i) / double(rotary_dim)) * log2_base));
}
#endif

// Index of the two features rotated together as pair i: NeoX style pairs (i, i + half), GPT-J
// ("interleaved") style pairs (2i, 2i + 1).
JAX_SGL_ROPE_FN void RopePair(int i, int rotary_dim, bool is_neox, JAX_SGL_ROPE_OUT int* a,
                             JAX_SGL_ROPE_OUT int* b) {
  if (is_neox) {
    *a = i;
    *b = i + rotary_dim / 2;
  } else {
    *a = 2 * i;
    *b = 2 * i + 1;
  }
}

}  // namespace jax_sgl
