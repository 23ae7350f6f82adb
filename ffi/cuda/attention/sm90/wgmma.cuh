// The wgmma building blocks the sm_90a forward and backward consumers share: one GEMM batch
// (Gemm) and an fp32 accumulator turned into the 16-bit A operand of the next GEMM (AccToA: P of
// P V in the forward, P^T / dS^T of the backward's dV / dK / dQ).
#pragma once

#include <cute/tensor.hpp>

namespace jax_sgl::cuda::sm90 {

using namespace cute;

// The calling thread's warpgroup, broadcast from lane 0 so that ptxas knows it is warp-uniform
// and keeps what derives from it (a consumer's smem halves, its wgmma descriptors) in uniform
// registers. From threadIdx.x / 128 as such, the forward's consumers formed both descriptors of
// every wgmma in ordinary registers and moved them over (R2UR x 4, VIADD, IMAD.MOV: 274 R2UR in
// the hd128 dense kernel, 80 this way; 29 M of its 526 M warp instructions at page-1 prefill,
// ncu, H100, where FA3's descriptors stay in UIADD3 / UMOV).
__device__ __forceinline__ int WarpgroupIndex() {
  return __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
}

// One wgmma batch: C (+)= A B over the K blocks, committed as one group; the caller waits.
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

// A 64 x kN accumulator as the A operand of an RS wgmma over K = kN: its (2, 2, kN / 8) values
// regrouped as ((2, 2, 2), 1, kN / 16), same order, so the conversion is element-wise.
template <typename Element, int kN, typename Acc>
__device__ __forceinline__ auto AccToA(Acc const& acc) {
  Tensor a = make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<kN / 16>>>{});
#pragma unroll
  for (int i = 0; i < size(acc); ++i) a(i) = Element(acc(i));
  return a;
}

}  // namespace jax_sgl::cuda::sm90
