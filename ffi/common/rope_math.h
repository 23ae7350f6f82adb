// Rotary embedding math shared by every backend. The frequencies come from the caller as a float32
// table inv_freq[rotary_dim / 2] (jax_sgl/rope_pool.py builds it from rope_base, in float64 rounded
// once to float32, or takes the caller's llama3 / yarn / proportional table as is), so every
// backend reads the same bits: angle_i = float32(position) * inv_freq[i].
#pragma once

#if defined(__METAL_VERSION__)
#define JAX_SGL_ROPE_FN inline
#define JAX_SGL_ROPE_OUT thread
#else
#include "ffi/common/host_device.h"
#define JAX_SGL_ROPE_FN JAX_SGL_HD
#define JAX_SGL_ROPE_OUT
#endif

namespace jax_sgl {

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
