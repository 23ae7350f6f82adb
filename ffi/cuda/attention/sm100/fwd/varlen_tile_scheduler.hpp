// The tile scheduler of the sm100 forward's varlen kernel, in the collectives' scheduler interface
// (77_blackwell_fmha/kernel/fmha_tile_scheduler.hpp: Params, to_underlying_arguments,
// get_grid_shape, is_valid, get_block_coord, operator++).
//
// Why its own: the collectives' IndividualTileScheduler launches ceil(max_length / 256) q tiles
// for every (head, sequence), and jax_sgl's only bound on a varlen sequence is total_q
// (attention_ffi.h), so a batch of B sequences would launch B times the tiles it has, each an
// empty CTA of 512 threads. This one launches ceil(total_q / 256) + batch tiles per head (at least
// the sum over sequences of their tiles) and maps tile t to (sequence, q tile) by walking the
// sequences' tile counts from the cumulative lengths; tiles past the last sequence's come out as
// row blocks past its end, which every warp role skips.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/kernel_hardware_info.h>

namespace jax_sgl::cuda::sm100 {

template <int kTileRows>
struct VarlenTileScheduler {
  struct Params {
    dim3 grid;
    const int* cu_seqlens_q;
    int batch;
  };

  Params params;
  bool valid = true;

  CUTLASS_DEVICE explicit VarlenTileScheduler(const Params& p) : params(p) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(const ProblemSize& problem_size,
                                        cutlass::KernelHardwareInfo, const ClusterShape&,
                                        const TileShape&) {
    const int rows = cute::get<0>(problem_size).total_length;
    const int batch = cute::size<3, 1>(problem_size);
    const dim3 grid((rows + kTileRows - 1) / kTileRows + batch, cute::size<3, 0>(problem_size), 1);
    return {grid, cute::get<0>(problem_size).cumulative_length, batch};
  }

  static dim3 get_grid_shape(const Params& p) { return p.grid; }

  CUTLASS_DEVICE bool is_valid() const { return valid; }

  CUTLASS_DEVICE auto get_block_coord() const {
    int tile = blockIdx.x;
    int seq = 0;
    for (; seq < params.batch - 1; ++seq) {
      const int tiles =
          (params.cu_seqlens_q[seq + 1] - params.cu_seqlens_q[seq] + kTileRows - 1) / kTileRows;
      if (tile < tiles) break;
      tile -= tiles;
    }
    return cute::make_coord(tile, cute::_0{}, cute::make_coord(int(blockIdx.y), seq));
  }

  CUTLASS_DEVICE VarlenTileScheduler& operator++() {
    valid = false;
    return *this;
  }
};

}  // namespace jax_sgl::cuda::sm100
