// The sm_90a flash forward's consumer GEMM building blocks: the named barriers of the ping-pong,
// and (sm90/wgmma.cuh, shared with the backward) one wgmma batch and the S accumulator turned
// into the P operand. The main loop that uses them (S = Q K^T, mask, online softmax, P V, last
// key tile first) is the consumer role of kernel.cuh: moved behind a struct of its own, ptxas
// allocated its registers differently (hd256 spilled 32/72 bytes instead of 12/40,
// benchmarks/notes/layout.md), so it stays in the kernel body, where the state it shares with
// the epilogue lives.
#pragma once

#include <cute/tensor.hpp>

#include "ffi/cuda/attention/sm90/fwd/config.h"
#include "ffi/cuda/attention/sm90/wgmma.cuh"

namespace jax_sgl::cuda::sm90 {

// Named barriers (ids after CUTLASS's reserved ones): one per consumer for its GEMM turn, one per
// consumer for its epilogue.
enum class Barrier : uint32_t {
  kTurn0 = 0, kTurn1 = 1, kEpilogue0 = 2, kEpilogue1 = 3,
  kProducer = 4,  // the producer warpgroup's threads (paged gather, mainloop_load.cuh)
};

}  // namespace jax_sgl::cuda::sm90
