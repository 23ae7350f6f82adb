// Host launchers of the warp-sliced decode kernels (one CTA per (sequence x kv head, KV split),
// 4 warps with a ring of 16-key stages each, one m16 tile of packed rows): picks the form the
// dispatch planned (DecodeWarpForm, decode/launch.h). Also instantiates the block-wide kernel
// (block_kernel.cuh) through its header, so one generated file holds every decode kernel of a
// (dtype, head-dim capacity).
#pragma once

#include "ffi/cuda/attention/decode/block_kernel.cuh"
#include "ffi/cuda/attention/decode/cp_async_kernel.cuh"
#include "ffi/cuda/attention/decode/tma_kernel.cuh"

namespace jax_sgl::cuda {

// The warp form args.warp_form names; the TMA form at head-dim capacity 64 and 128 only, which
// the dispatch ensures.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecodeWarp(const FlashDecodeArgs& args, cudaStream_t stream) {
  switch (args.warp_form) {
    case DecodeWarpForm::kTma:
      if constexpr (kHeadDim == 64 || kHeadDim == 128)
        return decode_tma::Launch<T, kHeadDim>(args, stream);
      return cudaErrorInvalidValue;
    case DecodeWarpForm::kCpAsync:
      return decode_cp_async::Launch<T, kHeadDim>(args, stream);
    case DecodeWarpForm::kTmaFp8Kv:  // LaunchFlashDecodeWarpFp8Kv's
    case DecodeWarpForm::kCpAsyncFp8Kv:
      return cudaErrorInvalidValue;
  }
  return cudaErrorInvalidValue;
}

template <typename T, int kHeadDim>
int FlashDecodeWarpCtasPerSm(int stages, DecodeWarpForm form) {
  switch (form) {
    case DecodeWarpForm::kTma:
      if constexpr (kHeadDim == 64 || kHeadDim == 128)
        return decode_tma::CtasPerSm<T, kHeadDim>(stages);
      return 1;
    case DecodeWarpForm::kCpAsync:
      return decode_cp_async::CtasPerSm<T, kHeadDim>(stages);
    case DecodeWarpForm::kTmaFp8Kv:  // FlashDecodeWarpFp8KvCtasPerSm's
    case DecodeWarpForm::kCpAsyncFp8Kv:
      return 1;
  }
  return 1;
}

// The forms over an fp8 KV cache: TMA, or cp.async for pages that are no multiple of 16 keys
// (and pre-Hopper devices).
template <typename T, int kHeadDim>
cudaError_t LaunchFlashDecodeWarpFp8Kv(const FlashDecodeArgs& args, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the fp8 KV cache's head-dim capacities");
  switch (args.warp_form) {
    case DecodeWarpForm::kTmaFp8Kv: return decode_tma::Launch<T, kHeadDim, true>(args, stream);
    case DecodeWarpForm::kCpAsyncFp8Kv: return decode_cp_async::LaunchFp8Kv<T, kHeadDim>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int kHeadDim>
int FlashDecodeWarpFp8KvCtasPerSm(int stages, DecodeWarpForm form) {
  return form == DecodeWarpForm::kTmaFp8Kv ? decode_tma::CtasPerSm<T, kHeadDim, true>(stages)
                                           : decode_cp_async::CtasPerSmFp8Kv<T, kHeadDim>(stages);
}

}  // namespace jax_sgl::cuda

// Instantiates one (storage type T, head dim D) of the launchers above (instantiations/).
#define JAX_SGL_INSTANTIATE_DECODE(T, D)                                                  \
  namespace jax_sgl::cuda {                                                               \
  template cudaError_t LaunchFlashDecode<T, D>(const FlashDecodeArgs&, cudaStream_t);     \
  template cudaError_t LaunchFlashDecodeWarp<T, D>(const FlashDecodeArgs&, cudaStream_t); \
  template int FlashDecodeWarpCtasPerSm<T, D>(int, DecodeWarpForm);                       \
  }
#define JAX_SGL_INSTANTIATE_DECODE_FP8KV(T, D)                                                 \
  namespace jax_sgl::cuda {                                                                    \
  template cudaError_t LaunchFlashDecodeWarpFp8Kv<T, D>(const FlashDecodeArgs&, cudaStream_t); \
  template int FlashDecodeWarpFp8KvCtasPerSm<T, D>(int, DecodeWarpForm);                       \
  }
