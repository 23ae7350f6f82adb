// Host launcher of the sm_90a flash forward: builds the TMA descriptors for one call (dense
// [batch, seq, heads, head_dim] tensors) and launches one CTA per (128 query rows, q head, batch),
// or, for the persistent variants, one CTA per SM.
// Included only by the generated instantiations/flash_fwd_sm90_*.cu files.
#pragma once

#include <algorithm>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/sm90/kernel.cuh"
#include "ffi/cuda/attention/sm90/launch.h"
#include "ffi/cuda/attention/sm90/variants.h"

namespace jax_sgl::cuda {
namespace sm90 {

// jax_sgl's 16-bit storage types -> CUTLASS's (same bits).
template <typename T> struct CutlassType;
template <> struct CutlassType<bf16_t> { using type = cutlass::bfloat16_t; };
template <> struct CutlassType<f16_t> { using type = cutlass::half_t; };

// [rows, head_dim, heads, batch] view of a dense [batch, rows, heads, head_dim] buffer.
template <typename Cfg>
auto DenseTensor(const void* ptr, int rows, int head_dim, int heads, int batch) {
  using E = typename Cfg::Element;
  const int64_t row = int64_t(heads) * head_dim;
  return make_tensor(make_gmem_ptr(static_cast<E*>(const_cast<void*>(ptr))),
                     make_shape(rows, head_dim, heads, batch),
                     make_stride(row, _1{}, int64_t(head_dim), row * rows));
}

template <typename T, int kHeadDim, int kVariant>
using VariantConfig =
    FlashConfig<typename CutlassType<T>::type, kHeadDim,
                Variant(kVariant).wide ? WideBlockN(kHeadDim) : DefaultBlockN(kHeadDim),
                Variant(kVariant).persistent, Variant(kVariant).fast_softmax,
                Variant(kVariant).early_rescale, Variant(kVariant).lean_softmax,
                Variant(kVariant).defer_pv_wait>;

}  // namespace sm90

template <typename T, int kHeadDim, int kVariant>
cudaError_t LaunchFlashFwdSm90(const AttentionParams& p, void* scratch, cudaStream_t stream) {
  using Cfg = sm90::VariantConfig<T, kHeadDim, kVariant>;
  using namespace cute;
  const int num_m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int num_tiles = num_m_blocks * p.num_heads * p.batch;
  auto q = sm90::DenseTensor<Cfg>(p.q, p.seqlen_q, kHeadDim, p.num_heads, p.batch);
  auto k = sm90::DenseTensor<Cfg>(p.k, p.seqlen_k, kHeadDim, p.num_kv_heads, p.batch);
  auto v = sm90::DenseTensor<Cfg>(p.v, p.seqlen_k, kHeadDim, p.num_kv_heads, p.batch);
  auto o = sm90::DenseTensor<Cfg>(p.out, p.seqlen_q, kHeadDim, p.num_heads, p.batch);
  using KVTile = Shape<Int<Cfg::kBlockN>, Int<kHeadDim>>;
  // Window bounds as the kernel wants them (kernel.cuh KernelParams): causal is a right bound of
  // 0, and a bound that no row reaches (left >= seqlen_k - 1, right >= seqlen_q - 1) is none,
  // which also keeps the kernel's index sums far from int overflow.
  int window_left = p.window_left, window_right = p.causal ? 0 : p.window_right;
  if (window_left >= p.seqlen_k - 1) window_left = -1;
  if (window_right >= p.seqlen_q - 1) window_right = -1;
  const bool softcap = p.softcap > 0.f;
  sm90::KernelParams<Cfg> params{
      make_tma_copy(SM90_TMA_LOAD{}, q, typename Cfg::SmemLayoutQHalf{}, typename Cfg::RowsD{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, typename Cfg::SmemLayoutKVTile{}, KVTile{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, typename Cfg::SmemLayoutKVTile{}, KVTile{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, o, typename Cfg::SmemLayoutQHalf{}, typename Cfg::RowsD{},
                    _1{}),
      q.shape(),
      k.shape(),
      p.lse,
      p.seqlen_q,
      p.seqlen_k,
      p.num_heads,
      p.num_heads / p.num_kv_heads,
      softcap ? 1.f : p.softmax_scale,
      p.causal,
      window_left,
      window_right,
      softcap ? p.softcap : 0.f,
      softcap ? 2.f * float(M_LOG2E) * p.softmax_scale / p.softcap : 0.f,
      num_m_blocks,
      num_tiles,
      static_cast<int*>(scratch),
  };
  auto kernel = sm90::FlashFwdSm90Kernel<Cfg>;
  constexpr int kSmem = sizeof(typename Cfg::SharedStorage);
  if (cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      err != cudaSuccess)
    return err;
  dim3 grid(num_m_blocks, p.num_heads, p.batch);
  if constexpr (Cfg::kPersistent) {
    int device = 0, num_sms = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    if (cudaError_t err =
            cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
        err != cudaSuccess)
      return err;
    grid = dim3(std::min(num_tiles, num_sms));
    // The causal scheduler's counter starts at 0 for every call (kernel.cuh NextTile).
    if (p.causal) {
      if (cudaError_t err = cudaMemsetAsync(scratch, 0, sizeof(int), stream); err != cudaSuccess)
        return err;
    }
  }
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda
