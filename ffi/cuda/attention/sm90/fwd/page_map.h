// The paged sm90 forward's TMA map of one K or V pool (mainloop_load.cuh load_pages).
#pragma once

#include <cstdint>

#include "ffi/cuda/attention/common/tensor_map.h"

namespace jax_sgl::cuda::sm90 {

// Dims (128 bytes of columns, 8 rows, row bytes / 128 column blocks, kv head, 8-row group of the
// pool), box (128 bytes, 8, row bytes / 128, 1, box_rows / 8), 128-byte swizzle: one load writes
// box_rows whole rows in the order the paged kernel's ring holds them (config.h
// SmemLayoutKVRows), where a map of (columns, rows, ...) takes one load per 128-byte block. Rows
// of 64 bytes (e4m3 hd64) take one 64-byte block and the 64-byte swizzle, as their smem atoms.
// Strides in elements of elem_bytes: row_stride between pool rows (a page is page_size
// consecutive rows), head_stride between kv heads (a fused K/V buffer too). Group coordinates
// past pool_rows / 8 load zeros. False when the driver refuses it.
inline bool EncodePageMap(CUtensorMap* map, CUtensorMapDataType type, int elem_bytes,
                          const void* base, int head_dim, int num_kv_heads, int64_t pool_rows,
                          int64_t row_stride, int64_t head_stride, int box_rows) {
  const TensorMapEncodeFn encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const int row_bytes = head_dim * elem_bytes;
  const int block_bytes = row_bytes < 128 ? 64 : 128;  // the swizzle span
  if (row_bytes % block_bytes != 0) return false;
  const int column_blocks = row_bytes / block_bytes;
  const cuuint64_t dims[5] = {cuuint64_t(block_bytes / elem_bytes), 8, cuuint64_t(column_blocks),
                              cuuint64_t(num_kv_heads), cuuint64_t(pool_rows / 8)};
  const cuuint64_t strides[4] = {cuuint64_t(row_stride) * elem_bytes, cuuint64_t(block_bytes),
                                 cuuint64_t(head_stride) * elem_bytes,
                                 cuuint64_t(row_stride) * elem_bytes * 8};
  const cuuint32_t box[5] = {cuuint32_t(block_bytes / elem_bytes), 8, cuuint32_t(column_blocks),
                             1, cuuint32_t(box_rows / 8)};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  return encode(map, type, 5, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                block_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
}

}  // namespace jax_sgl::cuda::sm90
