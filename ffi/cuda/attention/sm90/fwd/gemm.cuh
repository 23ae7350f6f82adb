// The sm_90a flash forward's consumer GEMM building blocks: the named barriers of the ping-pong,
// one wgmma batch (Gemm) and the S accumulator turned into the P operand (ToP). The main loop
// that uses them (S = Q K^T, mask, online softmax, P V, last key tile first) is the consumer role
// of kernel.cuh: moved behind a struct of its own, ptxas allocated its registers differently (hd256
// spilled 32/72 bytes instead of 12/40, benchmarks/notes/layout.md), so it stays in the kernel
// body, where the state it shares with the epilogue lives.
#pragma once

#include <cute/tensor.hpp>

#include "ffi/cuda/attention/sm90/fwd/config.h"

namespace jax_sgl::cuda::sm90 {

// Named barriers (ids after CUTLASS's reserved ones): one per consumer for its GEMM turn, one per
// consumer for its epilogue.
enum class Barrier : uint32_t { kTurn0 = 0, kTurn1 = 1, kEpilogue0 = 2, kEpilogue1 = 3 };

// One wgmma GEMM batch: C (+)= A B over the K blocks, committed as one group; the caller waits.
// kARegs: A is a register fragment (fenced like the accumulator) rather than smem descriptors.
template <bool kZeroInit, bool kARegs, typename Mma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void Gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(a));
}

// P as the A operand of P V: the accumulator's (2, 2, N/8) values regrouped as
// ((2, 2, 2), 1, N/16), same order, so the conversion is element-wise.
template <typename Element, int kBlockN, typename TensorS>
__device__ __forceinline__ auto ToP(TensorS const& s) {
  Tensor p = make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>{});
#pragma unroll
  for (int i = 0; i < size(s); ++i) p(i) = Element(s(i));
  return p;
}

}  // namespace jax_sgl::cuda::sm90
