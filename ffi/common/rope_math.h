// Rotary embedding math shared by every backend, so CPU, CUDA and Metal agree bit for bit on the
// angles: angle_i = position * base^(-2i / rotary_dim), evaluated in float32 as
// exp2(-(2i / rotary_dim) * log2(base)) * position.
// Compiles as Metal Shading Language too (metal/kernels/rope_pool.h includes it).
#pragma once

#if defined(__METAL_VERSION__)
#define JAX_SGL_ROPE_FN inline
#define JAX_SGL_ROPE_EXP2 metal::precise::exp2
#define JAX_SGL_ROPE_OUT thread
#else
#include <cmath>
#include <cstdint>

#include "ffi/common/host_device.h"
#define JAX_SGL_ROPE_FN JAX_SGL_HD
#define JAX_SGL_ROPE_EXP2 exp2f
#define JAX_SGL_ROPE_OUT
#endif

namespace jax_sgl {

// Inverse frequency of rotation pair i (0 <= i < rotary_dim / 2).
JAX_SGL_ROPE_FN float RopeInvFreq(int i, int rotary_dim, float log2_base) {
  return JAX_SGL_ROPE_EXP2(-(float(2 * i) / float(rotary_dim)) * log2_base);
}

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
