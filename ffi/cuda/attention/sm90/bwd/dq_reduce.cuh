// The dQ part's way into dq_accum in config.h's kernel: each consumer writes its float32 part to
// smem and one warp of the producer warpgroup adds it to dq_accum with a TMA bulk reduce-add
// (cp.reduce.async.bulk .add.f32), as FlashAttention-3 does. Against per-thread
// red.global.add.v4.f32 the consumers trade 8 vector reductions (each with its own 64-bit
// address) per step for 8 16-byte smem stores at fixed offsets, and the L2 receives one 16 KiB
// reduction per part instead of 1024 16-byte ones (benchmarks/notes/NOTES_bwd.md, "sm90
// backward against FlashAttention-3's").
//
// The destination slots are accessed as volatile: the barriers' asm has no memory clobber, so
// nothing else keeps the compiler from moving those accesses across them (or out of the loop).
//
// Handshake per consumer (one smem buffer and one destination slot each, two named barriers of
// 128 + 32 threads): the consumer syncs on "empty", stores its part and the part's address in
// dq_accum, fences (generic -> async proxy) and arrives on "full"; the writer warp syncs on
// "full", issues the reduction, waits until the bulk copy has read the buffer and arrives on
// "empty". The writer's first arrivals on "empty" stand for step -1. After its last step each
// consumer stores a null destination, which ends the writer's loop: the writer needs none of
// the CTA's step geometry, so the TMA loader beside it in the 24-register producer warpgroup
// keeps the registers it had alone (with the geometry, ptxas spilled the loader at hd64).
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/util.hpp>
#include <cutlass/arch/barrier.h>

namespace jax_sgl::cuda::sm90 {

// Threads on each dQ buffer barrier: one consumer warpgroup and the writer warp.
constexpr uint32_t kDqBufferThreads = 128 + 32;

// Adds `bytes` of float32 at smem_src to gmem_dst (both 16-byte aligned, bytes a multiple of
// 16), in the calling thread's bulk group. Evict-last: every key block of the (head, batch)
// adds into the same dq_accum rows, so they should stay in L2 until the last one.
__device__ __forceinline__ void BulkReduceAddF32(float* gmem_dst, const float* smem_src,
                                                 int bytes) {
  const uint32_t src = cute::cast_smem_ptr_to_uint(smem_src);
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, "
      "%3;" ::"l"(gmem_dst),
      "r"(src), "r"(bytes), "l"(uint64_t(cute::TMA::CacheHintSm90::EVICT_LAST))
      : "memory");
}

// Consumer side, one step: thread `thread` of the warpgroup writes its accumulator registers
// (groups of 4 consecutive registers j, at float offset index(j, thread) of the part) into its
// smem buffer once the writer has read the previous step's, thread 0 the part's destination
// gmem_dst, and the buffer goes to the writer.
template <typename Acc, typename Index>
__device__ __forceinline__ void StoreDqPart(float* gmem_dst, float* part,
                                            float* volatile* dst_slot,
                                            const Acc& dq, int thread, Index index,
                                            uint32_t empty_barrier, uint32_t full_barrier) {
  cutlass::arch::NamedBarrier::sync(kDqBufferThreads, empty_barrier);
#pragma unroll
  for (int j = 0; j < size(dq) / 4; ++j)
    *reinterpret_cast<float4*>(part + index(j, thread)) =
        make_float4(dq(4 * j), dq(4 * j + 1), dq(4 * j + 2), dq(4 * j + 3));
  if (thread == 0) *dst_slot = gmem_dst;
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> bulk copy reads
  cutlass::arch::NamedBarrier::arrive(kDqBufferThreads, full_barrier);
}

// Consumer side, after its last step (or with none): tells the writer there is no more part.
__device__ __forceinline__ void EndDqParts(float* volatile* dst_slot, int thread,
                                           uint32_t empty_barrier,
                                           uint32_t full_barrier) {
  cutlass::arch::NamedBarrier::sync(kDqBufferThreads, empty_barrier);
  if (thread == 0) *dst_slot = nullptr;
  cutlass::arch::NamedBarrier::arrive(kDqBufferThreads, full_barrier);
}

// Writer warp: the two consumers' parts (kPartFloats floats each, smem buffers back to back
// from `parts`), step after step, to their destinations, until consumer 0's null destination
// (both consumers run the same steps: consumer 1's end marker is left unread).
template <int kPartFloats>
__device__ __forceinline__ void ReduceDqParts(const float* parts,
                                              float* const volatile* dst_slots,
                                              uint32_t empty_barrier0, uint32_t full_barrier0) {
  const bool leader = threadIdx.x % 32 == 0;
  cutlass::arch::NamedBarrier::arrive(kDqBufferThreads, empty_barrier0);
  cutlass::arch::NamedBarrier::arrive(kDqBufferThreads, empty_barrier0 + 1);
  for (;;) {
    cutlass::arch::NamedBarrier::sync(kDqBufferThreads, full_barrier0);
    float* const dst0 = dst_slots[0];
    if (dst0 == nullptr) break;
    if (leader) {
      BulkReduceAddF32(dst0, parts, kPartFloats * int(sizeof(float)));
      cute::tma_store_arrive();  // one bulk group per part
    }
    cutlass::arch::NamedBarrier::sync(kDqBufferThreads, full_barrier0 + 1);
    if (leader) {
      BulkReduceAddF32(dst_slots[1], parts + kPartFloats, kPartFloats * int(sizeof(float)));
      cute::tma_store_arrive();
    }
    // A buffer is free once its group has been read; groups complete in order.
    if (leader) cute::tma_store_wait<1>();
    __syncwarp();
    cutlass::arch::NamedBarrier::arrive(kDqBufferThreads, empty_barrier0);
    if (leader) cute::tma_store_wait<0>();
    __syncwarp();
    cutlass::arch::NamedBarrier::arrive(kDqBufferThreads, empty_barrier0 + 1);
  }
  // The last reductions performed, not only read, before the warp (and the CTA) exits.
  if (leader) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace jax_sgl::cuda::sm90
