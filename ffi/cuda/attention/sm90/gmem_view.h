// Global tensors as the sm_90a kernels' TMA descriptors see them, for every config (forward,
// backward, deterministic dQ): [rows, head dim, head, batch] with the head dim contiguous and the
// other strides in elements (64-bit: a pool or a packed batch can pass 2^31 elements).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

namespace jax_sgl::cuda::sm90 {

using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
template <typename E>
using GmemTensorOf = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<E*>(nullptr)),
                                                GmemShape{}, GmemStride{}));

}  // namespace jax_sgl::cuda::sm90
