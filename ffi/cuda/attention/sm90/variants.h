// The run-time selectable variants of the sm_90a flash forward, for A/B runs on one build
// (benchmarks/ab_sm90.py). JAX_SGL_SM90_VARIANT=<index> picks one at each call (dispatch.cc);
// unset, or a variant this build left out (CMake JAX_SGL_SM90_VARIANTS), runs variant 0.
//   0 "base"       one CTA per work tile (128 query rows of one head), keys in tiles of
//                  DefaultBlockN (128; hd256: 64). The GPU-verified kernel.
//   1 "persistent" grid = #SMs; each CTA loops over work tiles: static round-robin when
//                  non-causal, a global atomic counter (longest row blocks of a head first) when
//                  causal. The producer loads the next tile's K, Q and V while the consumers run
//                  the epilogue of the current one.
//   2 "fast"       1 + tree reductions in the softmax and no O rescale when no row max moved.
//   3 "wide"       2 with wider key tiles (WideBlockN): fewer softmax rounds per FLOP.
// No CUDA or CuTe here: the host dispatch includes it.
#pragma once

namespace jax_sgl::cuda::sm90 {

inline constexpr int kNumVariants = 4;

// Keys per tile of variant 3. hd128: 176 (FA3's choice: S 88 + P 44 + O 64 registers per thread
// still fit 240); hd64: 192; hd256: 80 (Q 64 KiB + 2 x 2 stages x 40 KiB = 224 KiB of smem).
constexpr int WideBlockN(int head_dim) {
  return head_dim == 64 ? 192 : head_dim == 128 ? 176 : 80;
}

struct VariantTraits {
  bool persistent;
  bool fast_softmax;
  bool wide;
};

constexpr VariantTraits Variant(int v) {
  return {v >= 1, v >= 2, v >= 3};
}

}  // namespace jax_sgl::cuda::sm90
