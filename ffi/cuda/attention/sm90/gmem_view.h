// Global tensors as the sm_90a kernels' TMA descriptors see them, for every config (forward,
// backward, deterministic dQ): [rows, head dim, head, batch] with the head dim contiguous and the
// other strides in elements (64-bit: a pool or a packed batch can pass 2^31 elements); one head's
// rows and tiles of such a view, as every producer loads them.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

namespace jax_sgl::cuda::sm90 {

using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
template <typename E>
using GmemTensorOf = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<E*>(nullptr)),
                                                GmemShape{}, GmemStride{}));

// [rows, head dim] of one head of a TMA view: dense picks the batch, varlen starts at the
// sequence's row of the packed view (batch extent 1).
template <bool kVarlen, typename View>
__device__ __forceinline__ auto SeqHeadRows(View const& m, int head, int batch, int row0) {
  using namespace cute;
  if constexpr (kVarlen) return domain_offset(make_coord(row0, _0{}), m(_, _, head, _0{}));
  else return m(_, _, head, batch);
}

// One head's [Tile] tiles of a TMA view (SeqHeadRows) partitioned against the smem tile s:
// get<0>(...)(_, i) the view's tile i, get<1> s's stages.
template <bool kVarlen, typename Tile, typename Tma, typename Shape, typename Smem>
__device__ __forceinline__ auto HeadTiles(Tma const& tma, Shape const& shape, Smem const& s,
                                          int head, int batch, int row0) {
  using namespace cute;
  Tensor g = local_tile(SeqHeadRows<kVarlen>(tma.get_tma_tensor(shape), head, batch, row0),
                        Tile{}, make_coord(_, _0{}));
  return tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
}

}  // namespace jax_sgl::cuda::sm90
