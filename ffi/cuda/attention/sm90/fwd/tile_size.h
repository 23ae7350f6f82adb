// The run-time selectable variants of the sm_90a flash forward. JAX_SGL_SM90_VARIANT=<index>
// picks one at each call (dispatch.cc) for A/B runs (benchmarks/ab_sm90.py); unset, or a variant
// this build left out, runs the default of the call's (head dim, causal): the best measured one,
// CMake JAX_SGL_SM90_DEFAULT_VARIANTS (cmake/cuda.cmake), which the build always compiles.
//   0 "base"       one CTA per work tile (128 query rows of one head), keys in tiles of
//                  DefaultBlockN (128; hd256: 64). The first GPU-verified kernel.
//   1 "persistent" grid = #SMs; each CTA loops over work tiles: static round-robin when
//                  non-causal, a global atomic counter (longest row blocks of a head first) when
//                  causal. The producer loads the next tile's K, Q and V while the consumers run
//                  the epilogue of the current one.
//   2 "fast"       1 + tree reductions in the softmax and no O rescale when no row max moved
//                  (measured 6% slower than 1 at hd128 / hd64: kept for reference only).
//   3 "wide fast"  2 with wider key tiles (WideBlockN): fewer softmax rounds per FLOP.
//   4 "lean"       1 with a branch-free softmax on ex2.approx.ftz: the branch around 1's
//                  correction exp made ptxas wait for this warpgroup's P V before the softmax
//                  (no intra-warpgroup overlap in 0-3; softmax.h).
//   5 "lean early" 4 with the O rescale moved into the warpgroup's own GEMM turn (FA3's order):
//                  right after S = Q K^T is issued, before P V, so the rescale runs while the
//                  tensor cores compute S instead of in the window the other warpgroup hides.
//   6 "lean early wide" 5 with wide key tiles.
//   7 "np lean early wide" 6 with one CTA per tile (hd64's best measured was the non-persistent 0).
//   8 "np lean early" 5 with one CTA per tile.
//   9 "deferred"   5 with the wait for a step's P V moved to the top of the next step, so ptxas
//                  cannot put it ahead of the softmax (kernel.cuh, NOTES_sm90.md v3).
//  10 "direct O"   6 with O stored from registers straight to global memory: 6 has no smem
//                  for an O buffer of its own, so its O went out through the Q buffer and the
//                  next tile's Q could load only after that store; here Q is free as soon as
//                  the main loop ends, and its load overlaps this tile's epilogue.
//  11 "double Q"   4 with two Q buffers: the next tile's Q loads while this tile's main loop
//                  runs, instead of after it (4 waits for it at every tile start).
//  12 "wide double Q" 6 with two Q buffers, where they fit (launch.cuh QStages: hd64; at hd128
//                  and hd256 it is 6 itself).
// No CUDA or CuTe here: the host dispatch includes it.
#pragma once

namespace jax_sgl::cuda::sm90 {

inline constexpr int kNumVariants = 13;

// Keys per tile of the wide variants. hd128: 176 (FA3's choice: S 88 + P 44 + O 64 registers per
// thread still fit 240); hd64: 192; hd256: 80 (Q 64 KiB + 2 x 2 stages x 40 KiB = 224 KiB of smem).
constexpr int WideBlockN(int head_dim) {
  return head_dim == 64 ? 192 : head_dim == 128 ? 176 : 80;
}

struct VariantTraits {
  bool persistent;
  bool fast_softmax;
  bool wide;
  bool early_rescale;
  bool lean_softmax;
  bool defer_pv_wait;
  bool direct_o;
  int q_stages = 1;  // Q buffers (persistent)
};

constexpr VariantTraits Variant(int v) {
  switch (v) {
    //               persistent fast   wide   early  lean   defer  direct O Q buffers
    case 1: return  {true,      false, false, false, false, false, false};
    case 2: return  {true,      true,  false, false, false, false, false};
    case 3: return  {true,      true,  true,  false, false, false, false};
    case 4: return  {true,      false, false, false, true,  false, false};
    case 5: return  {true,      false, false, true,  true,  false, false};
    case 6: return  {true,      false, true,  true,  true,  false, false};
    case 7: return  {false,     false, true,  true,  true,  false, false};
    case 8: return  {false,     false, false, true,  true,  false, false};
    case 9: return  {true,      false, false, true,  true,  true,  false};
    case 10: return {true,      false, true,  true,  true,  false, true};
    case 11: return {true,      false, false, false, true,  false, false, 2};
    case 12: return {true,      false, true,  true,  true,  false, false, 2};
    default: return {false,     false, false, false, false, false, false};
  }
}

}  // namespace jax_sgl::cuda::sm90
