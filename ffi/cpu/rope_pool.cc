// CPU rope_pool_fused: rotates q and k of each token (NeoX or interleaved pairs, the first
// rotary_dim features) and writes rotated k and plain v into the pools at the token's slot, through
// the pool strides of RopePoolParams (separate pools or one fused kv_buffer alike). Tokens are
// split into chunks over XLA's intra-op pool. Padding slots (< 0) and slots past the pool are
// skipped, so a bad slot can never write outside the pool. An fp8 pool gets e4m3(x / scale) of the
// rotated k (as returned in k_rot) and of v, per KV head (rope_pool_params.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ffi/common/dispatch.h"
#include "ffi/common/rope_math.h"
#include "ffi/common/rope_pool_ffi.h"
#include "ffi/cpu/parallel.h"

namespace jax_sgl::cpu {
namespace {

template <typename T>
void RotateRow(const T* x, T* out, int head_dim, int rotary_dim, bool is_neox, const float* cos,
               const float* sin) {
  const int half = rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    int a, b;
    RopePair(i, rotary_dim, is_neox, &a, &b);
    const float xa = ToFloat(x[a]);
    const float xb = ToFloat(x[b]);
    out[a] = FromFloat<T>(xa * cos[i] - xb * sin[i]);
    out[b] = FromFloat<T>(xb * cos[i] + xa * sin[i]);
  }
  for (int i = rotary_dim; i < head_dim; ++i) out[i] = x[i];
}

// One head row into the pool: as is when the pool has the rows' type, quantized into an e4m3 pool.
template <typename T, typename P>
void StoreRow(const T* src, P* dst, int n, float scale) {
  if constexpr (std::is_same_v<T, P>) {
    std::copy_n(src, n, dst);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = FromFloatE4m3(ToFloat(src[i]) / scale);
  }
}

template <typename T, typename P, typename I>
void RopePoolTokens(const RopePoolParams& p, int64_t begin, int64_t end) {
  const int half = p.rotary_dim / 2;
  std::vector<float> cos(half), sin(half);
  const int64_t q_row = int64_t(p.num_qo_heads) * p.head_dim;
  const int64_t kv_row = int64_t(p.num_kv_heads) * p.head_dim;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);
  auto* q_rot = static_cast<T*>(p.q_rot);
  auto* k_rot = static_cast<T*>(p.k_rot);
  auto* k_pool = static_cast<P*>(p.k_pool);
  auto* v_pool = static_cast<P*>(p.v_pool);
  const auto* positions = static_cast<const I*>(p.positions);
  const auto* slots = static_cast<const I*>(p.slots);

  for (int64_t t = begin; t < end; ++t) {
    const float pos = float(positions[t]);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * p.inv_freq[i];
      cos[i] = std::cos(angle);
      sin[i] = std::sin(angle);
    }
    for (int h = 0; h < p.num_qo_heads; ++h) {
      const int64_t off = t * q_row + int64_t(h) * p.head_dim;
      RotateRow(q + off, q_rot + off, p.head_dim, p.rotary_dim, p.is_neox, cos.data(), sin.data());
    }
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const int64_t off = t * kv_row + int64_t(h) * p.head_dim;
      RotateRow(k + off, k_rot + off, p.head_dim, p.rotary_dim, p.is_neox, cos.data(), sin.data());
    }
    const int64_t slot = int64_t(slots[t]);
    if (slot < 0 || slot >= p.num_slots) continue;
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const int64_t src = t * kv_row + int64_t(h) * p.head_dim;
      const int64_t dst = slot * p.pool_row_stride + h * p.pool_head_stride;
      StoreRow(k_rot + src, k_pool + dst, p.head_dim, p.k_scale ? p.k_scale[h] : 1.f);
      StoreRow(v + src, v_pool + dst, p.head_dim, p.v_scale ? p.v_scale[h] : 1.f);
    }
  }
}

ffi::Error RopePoolFwdImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           RopePoolAttrs attrs) {
  RopePoolParams p;
  RopePoolBuffers pools;
  if (auto err = MakeRopePoolParams(args, rets, attrs, &p, &pools); err.failure())
    return err;
  // Without donation XLA gives the outputs their own buffers: start them from the input pools.
  for (int i = 0; i < pools.count; ++i)
    if (pools.out[i] != pools.in[i])
      std::copy_n(static_cast<const char*>(pools.in[i]), pools.bytes[i],
                  static_cast<char*>(pools.out[i]));

  // ~64 tokens per chunk keeps the per-chunk cos/sin setup negligible.
  const int64_t chunks = NumChunks(pool, p.num_tokens, 64);
  DispatchFloat(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto run = [&](auto pool_tag, auto index_tag) {
      using P = typename decltype(pool_tag)::type;
      using I = typename decltype(index_tag)::type;
      ParallelFor(pool, chunks, [&](int64_t c) {
        RopePoolTokens<T, P, I>(p, p.num_tokens * c / chunks, p.num_tokens * (c + 1) / chunks);
      });
    };
    auto with_pool = [&](auto index_tag) {
      if (p.pool_dtype == DType::kF8E4M3)
        run(TypeTag<f8e4m3_t>{}, index_tag);
      else
        run(TypeTag<T>{}, index_tag);
    };
    if (p.index_type == IndexType::kI32)
      with_pool(TypeTag<int32_t>{});
    else
      with_pool(TypeTag<int64_t>{});
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSglRopePoolFwdCpu, jax_sgl::cpu::RopePoolFwdImpl,
                              jax_sgl::BindRopePool(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
