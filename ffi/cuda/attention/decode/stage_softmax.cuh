// The online-softmax step of the mma.sync decode kernels (decode/block_kernel.cuh and the
// warp-sliced kernels of warp_steps.cuh): one 16-key stage's update of a warp's m16 tile of packed
// rows, and o += P V over the stage's V tile. One copy, so that every decode form accumulates
// alike.
#pragma once

#include <cmath>

#include "ffi/cuda/attention/common/mma.cuh"
#include "ffi/cuda/attention/common/row_scores.cuh"

namespace jax_sgl::cuda::decode {

// 2^x with results below 2^-126 flushed to 0: the bare MUFU.EX2, where exp2f adds three
// instructions per element (a compare and two predicated multiplies) to keep them.
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One stage's online-softmax update of this lane's rows (sc: the stage's 16 x 16 scores in the
// log2 domain, masked to -inf; blk_max: this lane's max of its row halves): rescales o and l_run,
// and returns P as the A fragment of the P V mma (pa). kSkipSettled skips the accumulator rescale
// when no row's max moved (a warp-uniform vote): worth it once the maxima settle over a long
// sequence. kFlushTinyP takes P by Exp2Ftz: a P under 2^-126 next to l >= 1 counts for nothing
// (and an f16 P rounds it to 0 anyway), and the 24 instructions it saves a stage matter where the
// stage is bound by instruction issue (the fp8 KV form, decode_fp8kv); the 16-bit forms keep
// exp2f, the code they were measured with.
template <typename T, int kD, bool kSkipSettled, bool kFlushTinyP = false>
__device__ __forceinline__ void SoftmaxStep(float (&sc)[2][4], const float (&blk_max)[2],
                                            float (&m_run)[2], float (&l_run)[2],
                                            float (&o)[kD / 8][4], uint32_t (&pa)[4]) {
  using flash::Elem;
  float corr[2], m_use[2];
  flash::UpdateRowMax(m_run, blk_max, m_use, corr);
#pragma unroll
  for (int h = 0; h < 2; ++h) l_run[h] *= corr[h];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = sc[t][e] - m_use[e / 2];
      const float pe = kFlushTinyP ? Exp2Ftz(x) : exp2f(x);
      sc[t][e] = pe;
      l_run[e / 2] += pe;
    }
  }
  if (!kSkipSettled || __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))
    flash::ScaleAccRows(o, corr);
  pa[0] = Elem<T>::Pack(sc[0][0], sc[0][1]);
  pa[1] = Elem<T>::Pack(sc[0][2], sc[0][3]);
  pa[2] = Elem<T>::Pack(sc[1][0], sc[1][1]);
  pa[3] = Elem<T>::Pack(sc[1][2], sc[1][3]);
}

// SoftmaxStep and o += P V over the stage's V tile of q's type. v_at(row, col): the
// shared-memory address of V element (row, col), so that a padded tile (cp.async kernels) and a
// swizzled one (the TMA kernel) share this code.
template <typename T, int kD, bool kSkipSettled, typename VAt>
__device__ __forceinline__ void SoftmaxPvAt(float (&sc)[2][4], const float (&blk_max)[2],
                                            float (&m_run)[2], float (&l_run)[2],
                                            float (&o)[kD / 8][4], VAt v_at, int lane) {
  using flash::Elem;
  using flash::Ldmatrix4Trans;
  constexpr int kDT = kD / 8;
  uint32_t pa[4];
  SoftmaxStep<T, kD, kSkipSettled>(sc, blk_max, m_run, l_run, o, pa);
#pragma unroll
  for (int dt = 0; dt < kDT; dt += 2) {
    uint32_t bv[4];
    Ldmatrix4Trans(bv, v_at(lane % 8 + ((lane / 8) % 2) * 8, dt * 8 + (lane / 16) * 8));
    Elem<T>::Mma(o[dt], pa, bv);
    Elem<T>::Mma(o[dt + 1], pa, bv + 2);
  }
}

}  // namespace jax_sgl::cuda::decode
