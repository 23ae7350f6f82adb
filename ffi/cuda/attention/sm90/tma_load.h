// TMA tile loads without an L2 cache hint, for the forward kernel's producer (kernel.cuh).
// CuTe's executable SM90_TMA_LOAD always issues the .L2::cache_hint form, even for
// EVICT_NORMAL, and the 64-bit hint then occupies a register pair at every load. The producer
// runs with 24 registers after setmaxnreg, and that pair is what pushed its loop state onto the
// stack. Without the operand the load behaves as EVICT_NORMAL does (the default policy).
//
// Use: copy(NoCacheHint(tma.with(mbar)), src, dst), exactly where copy(tma.with(mbar), src,
// dst) stood: CuTe's partitioning and per-instruction recursion are unchanged, only the
// instruction at the bottom differs.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

namespace jax_sgl::cuda::sm90 {

// The instruction: cp.async.bulk.tensor.{4,5}d, completing on an mbarrier, no L2 policy.
struct TmaLoadNoHintOp {
  template <class... Coords>
  __device__ static void copy(void const* desc_ptr, uint64_t* mbar_ptr, void* smem_ptr,
                              Coords const&... coords) {
    const uint64_t desc = reinterpret_cast<uint64_t>(desc_ptr);
    const uint32_t mbar = cute::cast_smem_ptr_to_uint(mbar_ptr);
    const uint32_t smem = cute::cast_smem_ptr_to_uint(smem_ptr);
    const int32_t c[] = {int32_t(coords)...};
    constexpr int kRank = sizeof...(Coords);
    // The kernels' views have four modes (CuTe's) or five (the paged forward's page map).
    static_assert(kRank == 4 || kRank == 5, "the forward's TMA views have 4 or 5 modes");
    if constexpr (kRank == 4) {
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%3, %4, %5, %6}], [%2];"
          :: "r"(smem), "l"(desc), "r"(mbar), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3])
          : "memory");
    } else {
      asm volatile(
          "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];"
          :: "r"(smem), "l"(desc), "r"(mbar), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]),
             "r"(c[4])
          : "memory");
    }
  }
};

}  // namespace jax_sgl::cuda::sm90

namespace cute {

// The executable atom of TmaLoadNoHintOp: CuTe's SM90_TMA_LOAD_OP traits less the hint operand.
// TMA_LOAD_Unpack passes (descriptor, mbarrier, smem pointer, coordinates...) to the op.
template <class NumBitsPerTMA>
struct Copy_Traits<jax_sgl::cuda::sm90::TmaLoadNoHintOp, NumBitsPerTMA>
    : TMA_LOAD_Unpack<jax_sgl::cuda::sm90::TmaLoadNoHintOp, NumBitsPerTMA> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  tuple<TmaDescriptor const*, uint64_t*> const opargs_;

  CUTE_HOST_DEVICE Copy_Traits(TmaDescriptor const* desc, uint64_t* mbar)
      : opargs_(desc, mbar) {}

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const {
    return get<0>(opargs_);
  }
};

}  // namespace cute

namespace jax_sgl::cuda::sm90 {

// The atom tma.with(mbar) returned, issuing its loads without the cache hint (its hint, always
// EVICT_NORMAL here, is dropped).
template <class NumBitsPerTMA, class ValType>
__device__ __forceinline__ auto NoCacheHint(
    cute::Copy_Atom<cute::Copy_Traits<cute::SM90_TMA_LOAD_OP, NumBitsPerTMA>, ValType> const&
        atom) {
  using Traits = cute::Copy_Traits<TmaLoadNoHintOp, NumBitsPerTMA>;
  return cute::Copy_Atom<Traits, ValType>{
      Traits(atom.get_tma_descriptor(), cute::get<1>(atom.opargs_))};
}

}  // namespace jax_sgl::cuda::sm90
