// CUDA rope_pool_fused: one pass over the tokens. Each thread owns one "group" of a head row (two
// vectors of kVec features: the two halves of kVec NeoX pairs, or 2*kVec contiguous features for
// interleaved pairs and for the unrotated tail) across kHeadsPerThread heads of one token, taken
// from the combined head list [q heads | k heads | v heads]. A thread first issues the loads of
// all its rows (memory-level parallelism), then the block computes cos/sin once per (token, pair)
// into a small shared table (sincosf of the same float32 angle as every backend,
// ffi/common/rope_math.h), each thread takes its kVec cos/sin into registers, rotates, and writes
// q_rot, k_rot and, for slots in [0, num_slots), the k/v pool rows (through the pool strides of
// RopePoolParams: separate pools and a fused kv_buffer take the same code). Every byte of q, k, v
// is read once and every output byte written once, with 16-byte accesses when the row layout
// allows it; other layouts (odd head_dim, unaligned rotary_dim, a pool stride that is not a whole
// number of vectors) take the same kernel with kVec = 1.
//
// An fp8 pool (RopePoolParams::pool_dtype kF8E4M3) gets e4m3(x / scale) of the rotated k (the
// k_rot values, in q's dtype) and of v, per KV head: the IEEE quotient (ScaleDivider) and the
// hardware's cvt.rn.satfinite.e4m3x2, bit for bit what the CPU's FromFloatE4m3 computes. A thread's
// kVec features become kVec bytes; where its two vectors are adjacent in the row (interleaved
// pairs, the unrotated tail) and the pool allows it, both go out as one 16-byte store (at bf16/fp16,
// kVec = 8), else as two 8-byte stores (NeoX halves lie rotary_dim / 2 apart).
//
// Why the table: computing cos/sin per thread (12 threads per token share each pair at
// Hq=32/Hkv=8) cost half the bandwidth on the H200 (50% of copy -> 95% with the table; see
// benchmarks/RESULTS.md). inv_freq is the caller's float32 table (rope_math.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ffi/common/dispatch.h"
#include "ffi/common/rope_math.h"
#include "ffi/cuda/rope_pool/rope_pool.h"

namespace jax_sgl::cuda {
namespace {

// 16 bytes is the widest global access a thread can issue (LDG.128 / STG.128).
constexpr int kAccessBytes = 16;
// Heads per thread: keeps 8 vector loads (128 bytes) per thread in flight at ~74 registers
// (4 resident blocks of 192 threads per SM at Hq=32/Hkv=8), enough bytes in flight for HBM.
constexpr int kHeadsPerThread = 4;
// Threads per block: small enough for many resident blocks per SM, large enough to hide launch.
constexpr int kBlockThreads = 256;

// Storage from float on the device: the hardware round-to-nearest-even converts (same results as
// numeric.h's bit versions, fewer instructions).
template <typename T>
__device__ __forceinline__ T ToStorage(float f) {
  return FromFloat<T>(f);
}
template <>
__device__ __forceinline__ bf16_t ToStorage<bf16_t>(float f) {
  return bf16_t{__bfloat16_as_ushort(__float2bfloat16_rn(f))};
}
template <>
__device__ __forceinline__ f16_t ToStorage<f16_t>(float f) {
  return f16_t{__half_as_ushort(__float2half_rn(f))};
}

// kVec elements of T as one access: 32-bit words (two 16-bit elements per word) so a 16-byte
// vector of bf16 lives in 4 registers; as T[8] the compiler would spread it over 8. Get/Set take a
// compile-time element index after unrolling, so nothing leaves registers.
template <typename T, int kVec, bool kWords = (sizeof(T) * kVec >= 4)>
struct alignas(sizeof(T) * kVec) Packed {
  static constexpr int kPerWord = 4 / sizeof(T);
  uint32_t w[sizeof(T) * kVec / 4];

  __device__ __forceinline__ float Get(int e) const {
    if constexpr (kPerWord == 1) {
      return __uint_as_float(w[e]);
    } else {
      return ToFloat(T{uint16_t(e % 2 ? w[e / 2] >> 16 : w[e / 2] & 0xffffu)});
    }
  }
  __device__ __forceinline__ void Set(int e, float f) {
    if constexpr (kPerWord == 1) {
      w[e] = __float_as_uint(f);
    } else {
      const uint32_t bits = ToStorage<T>(f).bits;
      w[e / 2] = e % 2 ? (w[e / 2] & 0xffffu) | (bits << 16) : (w[e / 2] & 0xffff0000u) | bits;
    }
  }
};
// A single 16-bit element (the kVec = 1 fallback of bf16 / fp16).
template <typename T, int kVec>
struct Packed<T, kVec, false> {
  T x;
  __device__ __forceinline__ float Get(int) const { return ToFloat(x); }
  __device__ __forceinline__ void Set(int, float f) { x = ToStorage<T>(f); }
};

// Rotates the kVec pairs of the 2 * kVec features [x0 | x1] in place: pair j is (j, kVec + j) for
// NeoX and (2j, 2j + 1) interleaved, with rotation index g * kVec + j either way. The pair layout
// is a template argument so every index is a compile-time constant.
template <int kVec, bool kNeox, typename P>
__device__ __forceinline__ void RotatePairs(P& x0, P& x1, const float* cos_v, const float* sin_v) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int ea = kNeox ? j : 2 * j;
    const int eb = kNeox ? kVec + j : 2 * j + 1;
    P& pa = ea < kVec ? x0 : x1;
    P& pb = eb < kVec ? x0 : x1;
    const float a = pa.Get(ea % kVec), b = pb.Get(eb % kVec);
    pa.Set(ea % kVec, a * cos_v[j] - b * sin_v[j]);
    pb.Set(eb % kVec, b * cos_v[j] + a * sin_v[j]);
  }
}

// kVec e4m3 bytes of a quantized vector, in 32-bit words (one byte when kVec = 1).
template <int kVec, bool kWords = (kVec >= 4)>
struct alignas(kVec) Fp8Packed {
  uint32_t w[kVec / 4];
};
template <int kVec>
struct Fp8Packed<kVec, false> {
  uint8_t b[kVec];
};

// x / scale as IEEE division rounds it (the quotient the CPU's FromFloatE4m3 gets). __fdiv_rn
// checks every quotient for its slow path, and those 256 check-and-branch regions per thread
// serialized the kernel: on the H200 (2026-12-05) the fp8-pool write ran at 51-61% of copy, 0.76-
// 0.84x the same write in jitted JAX. Here, with inv the correctly rounded 1 / scale, two fma
// residual corrections of x * inv give the IEEE quotient of every finite x whose quotient is a
// normal float; the rest (quotients below 2^-30, or rounding past the largest float) differ from
// it only where e4m3 gives the same byte (+-0, +-448): tools/check_fp8_quotient.c checks this
// over every finite float32 x (58 scales in [2^-20, 2^10], x at strides 3-61, on the CPU).
// Scales outside [2^-125, 2^125], where 1 / scale or the residuals leave the normal range, keep
// __fdiv_rn (a branch per row, not per element).
struct ScaleDivider {
  float scale, inv;
  bool use_fdiv;
  __device__ static ScaleDivider Of(float s) {
    return {s, __frcp_rn(s), !(fabsf(s) >= 0x1p-125f && fabsf(s) <= 0x1p125f)};
  }
  __device__ __forceinline__ float operator()(float x) const {
    const float q0 = x * inv;
    const float q1 = fmaf(fmaf(-q0, scale, x), inv, q0);
    const float q2 = fmaf(fmaf(-q1, scale, x), inv, q1);
    // Past the largest float at q0 or q1 the quotient overflows (the next step would make NaN of
    // the infinity); NaN x passes as x * inv.
    return !(fabsf(q0) <= 3.402823466e38f) ? q0 : fabsf(q1) > 3.402823466e38f ? q1 : q2;
  }
};

// e4m3(div(x[e])) of the kVec features of x (FromFloatE4m3's rounding and saturation).
template <int kVec, typename P, typename Div>
__device__ __forceinline__ Fp8Packed<kVec> Quantize(const P& x, const Div& div) {
  Fp8Packed<kVec> out;
  if constexpr (kVec >= 4) {
#pragma unroll
    for (int j = 0; j < kVec; j += 4) {
      const float2 lo = make_float2(div(x.Get(j)), div(x.Get(j + 1)));
      const float2 hi = make_float2(div(x.Get(j + 2)), div(x.Get(j + 3)));
      out.w[j / 4] = uint32_t(__nv_cvt_float2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3)) |
                     (uint32_t(__nv_cvt_float2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3)) << 16);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      out.b[j] = __nv_cvt_float_to_fp8(div(x.Get(j)), __NV_SATFINITE, __NV_E4M3);
  }
  return out;
}

// Both vectors quantized into an e4m3 pool row (one 2 * kVec-byte access when `adjacent`).
template <int kVec, typename V, typename Div>
__device__ __forceinline__ void StoreFp8Row(f8e4m3_t* row, int off0, int off1, bool has_second,
                                            bool adjacent, const V& y0, const V& y1,
                                            const Div& div) {
  const Fp8Packed<kVec> a = Quantize<kVec>(y0, div);
  if (adjacent) {
    struct alignas(2 * kVec) Pair {
      Fp8Packed<kVec> a, b;
    };
    *reinterpret_cast<Pair*>(row + off0) = Pair{a, Quantize<kVec>(y1, div)};
    return;
  }
  *reinterpret_cast<Fp8Packed<kVec>*>(row + off0) = a;
  if (has_second) *reinterpret_cast<Fp8Packed<kVec>*>(row + off1) = Quantize<kVec>(y1, div);
}

// Both vectors of a thread into a pool row: as they are, or quantized into an e4m3 pool (as one
// access of 2 * kVec bytes when `adjacent`: off1 == off0 + kVec and the pool aligned for it).
template <typename P, int kVec, typename V>
__device__ __forceinline__ void StorePoolRow(P* row, int off0, int off1, bool has_second,
                                             bool adjacent, const V& y0, const V& y1,
                                             float scale) {
  if constexpr (std::is_same_v<P, f8e4m3_t>) {
    const ScaleDivider div = ScaleDivider::Of(scale);
    if (div.use_fdiv)
      StoreFp8Row<kVec>(row, off0, off1, has_second, adjacent, y0, y1,
                        [scale](float x) { return __fdiv_rn(x, scale); });
    else
      StoreFp8Row<kVec>(row, off0, off1, has_second, adjacent, y0, y1, div);
  } else {
    *reinterpret_cast<V*>(row + off0) = y0;
    if (has_second) *reinterpret_cast<V*>(row + off1) = y1;
  }
}

// The kHeadsPerThread-head set a token's thread group `position` owns: sets from both ends of
// the head list in turn (0, n - 1, 1, n - 2, ...). The k and v sets at the end are the heavy
// ones (k_rot, the pool rows and, for an e4m3 pool, the quantization of every element), and in
// list order they all fell to the token's last warp, which then held its block after the
// others were done (Hq 32 / Hkv 8 at hd128: 4 heavy sets of 12 in one warp of 3; now at most 2).
__device__ __forceinline__ int HeadSet(int position, int sets) {
  return position % 2 == 0 ? position / 2 : sets - 1 - position / 2;
}

// Per-launch geometry derived once on the host from RopePoolParams.
struct Geometry {
  int rot_groups;        // rotary_dim / (2 * kVec): groups holding rotated pairs
  int groups;            // rot_groups + unrotated-tail groups, per head row
  int heads_total;       // num_qo_heads + 2 * num_kv_heads (q, k, v rows of one token)
  int head_sets;         // ceil(heads_total / kHeadsPerThread)
  int threads_per_token; // groups * head_sets
  bool pair_stores;      // an fp8 pool aligned for 2 * kVec-byte stores of adjacent vectors
};

// Blocks per SM the register budget must allow. An e4m3 pool's quantization took 88-107
// registers (2 blocks of 256 threads per SM) against the 16-bit pools' 74-80 (3 blocks), and on
// the H200 (2026-12-05) its write ran at 51-61% of copy against their 85-95%: the loads a thread
// issues up front are this kernel's bytes in flight, so it needs the 16-bit pools' occupancy
// (3 blocks: 80 registers, 8-12 bytes spilled). 0 leaves the 16-bit kernels as they were (same
// SASS). To be measured: bench_rope_pool's fp8 rows.
template <typename T, typename P>
constexpr int kMinBlocksPerSm = std::is_same_v<P, T> ? 0 : 3;

template <typename T, typename P, typename I, int kVec>
__global__ void __launch_bounds__(kBlockThreads, (kMinBlocksPerSm<T, P>)) RopePoolKernel(RopePoolParams p, Geometry geo) {
  using V = Packed<T, kVec>;
  // (cos, sin) of every rotation pair of the block's tokens: [blockDim.y][rotary_dim / 2].
  extern __shared__ float2 cos_sin[];
  const int half = p.rotary_dim / 2;
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int w = blockIdx.y * blockDim.x + threadIdx.x;
  const bool active = t < p.num_tokens && w < geo.threads_per_token;
  const int g = w % geo.groups;
  const int h_begin = HeadSet(w / geo.groups, geo.head_sets) * kHeadsPerThread;

  int64_t slot = -1;
  if (active) slot = int64_t(static_cast<const I*>(p.slots)[t]);
  const bool write_pool = slot >= 0 && slot < p.num_slots;
  const bool rotate = g < geo.rot_groups;

  // The two vectors of this group inside a head row, in features.
  int off0, off1;
  bool has_second = true;
  if (rotate) {
    off0 = p.is_neox ? g * kVec : 2 * g * kVec;
    off1 = p.is_neox ? half + g * kVec : off0 + kVec;
  } else {
    off0 = p.rotary_dim + 2 * (g - geo.rot_groups) * kVec;
    off1 = off0 + kVec;
    has_second = off1 < p.head_dim;
  }

  const int hq = p.num_qo_heads, hkv = p.num_kv_heads, d = p.head_dim;
  const int64_t q_row = int64_t(hq) * d, kv_row = int64_t(hkv) * d;
  const T* __restrict__ q = static_cast<const T*>(p.q) + t * q_row;
  const T* __restrict__ k = static_cast<const T*>(p.k) + t * kv_row;
  const T* __restrict__ v = static_cast<const T*>(p.v) + t * kv_row;

  // Issue the loads of every owned row first: they are in flight while the table is computed.
  V x0[kHeadsPerThread], x1[kHeadsPerThread];
#pragma unroll
  for (int i = 0; i < kHeadsPerThread; ++i) {
    const int h = h_begin + i;
    if (!active || h >= geo.heads_total) break;
    const T* src;
    if (h < hq) {
      src = q + h * d;
    } else if (h < hq + hkv) {
      src = k + (h - hq) * d;
    } else {
      if (!write_pool) break;  // v rows only go to the pool
      src = v + (h - hq - hkv) * d;
    }
    x0[i] = *reinterpret_cast<const V*>(src + off0);
    if (has_second) x1[i] = *reinterpret_cast<const V*>(src + off1);
  }

  // cos/sin once per (token, pair) for the whole block instead of once per thread: every
  // thread of a token shares them, and sincosf is the only arithmetic here that is not trivially
  // cheap.
  const int threads = blockDim.x * blockDim.y;
  for (int e = threadIdx.y * blockDim.x + threadIdx.x; e < int(blockDim.y) * half; e += threads) {
    const int64_t te = int64_t(blockIdx.x) * blockDim.y + e / half;
    if (te >= p.num_tokens) break;
    const float pos = float(static_cast<const I*>(p.positions)[te]);
    float s, c;
    sincosf(pos * p.inv_freq[e % half], &s, &c);
    cos_sin[e] = make_float2(c, s);
  }
  __syncthreads();
  if (!active) return;

  float cos_v[kVec], sin_v[kVec];
  if (rotate) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float2 cs = cos_sin[threadIdx.y * half + g * kVec + j];
      cos_v[j] = cs.x;
      sin_v[j] = cs.y;
    }
  }

#pragma unroll
  for (int i = 0; i < kHeadsPerThread; ++i) {
    const int h = h_begin + i;
    if (h >= geo.heads_total) break;
    const bool is_v = h >= hq + hkv;
    if (is_v && !write_pool) break;
    V y0 = x0[i], y1 = x1[i];
    if (rotate && !is_v) {
      if (p.is_neox)
        RotatePairs<kVec, true>(y0, y1, cos_v, sin_v);
      else
        RotatePairs<kVec, false>(y0, y1, cos_v, sin_v);
    }
    const bool adjacent = geo.pair_stores && has_second && off1 == off0 + kVec;
    if (is_v) {
      const int kh = h - hq - hkv;
      StorePoolRow<P, kVec>(static_cast<P*>(p.v_pool) + slot * p.pool_row_stride +
                                kh * p.pool_head_stride,
                            off0, off1, has_second, adjacent, y0, y1,
                            p.v_scale ? p.v_scale[kh] : 1.f);
      continue;
    }
    T* dst = h < hq ? static_cast<T*>(p.q_rot) + t * q_row + h * d
                    : static_cast<T*>(p.k_rot) + t * kv_row + (h - hq) * d;
    *reinterpret_cast<V*>(dst + off0) = y0;
    if (has_second) *reinterpret_cast<V*>(dst + off1) = y1;
    if (h >= hq && write_pool) {
      const int kh = h - hq;
      StorePoolRow<P, kVec>(static_cast<P*>(p.k_pool) + slot * p.pool_row_stride +
                                kh * p.pool_head_stride,
                            off0, off1, has_second, adjacent, y0, y1,
                            p.k_scale ? p.k_scale[kh] : 1.f);
    }
  }
}

bool Aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <typename T, typename P, typename I, int kVec>
cudaError_t Launch(cudaStream_t stream, const RopePoolParams& p) {
  Geometry geo;
  geo.rot_groups = p.rotary_dim / (2 * kVec);
  const int tail_vectors = (p.head_dim - p.rotary_dim) / kVec;
  geo.groups = geo.rot_groups + (tail_vectors + 1) / 2;
  geo.heads_total = p.num_qo_heads + 2 * p.num_kv_heads;
  geo.head_sets = (geo.heads_total + kHeadsPerThread - 1) / kHeadsPerThread;
  geo.threads_per_token = geo.groups * geo.head_sets;
  constexpr int kPairBytes = 2 * kVec * int(sizeof(P));
  geo.pair_stores = !std::is_same_v<P, T> && p.pool_row_stride % (2 * kVec) == 0 &&
                    p.pool_head_stride % (2 * kVec) == 0 && Aligned(p.k_pool, kPairBytes) &&
                    Aligned(p.v_pool, kPairBytes);
  // x: the threads of one token (split over blockIdx.y when more than a block); y: tokens.
  const int bx = std::min(geo.threads_per_token, kBlockThreads);
  const int by = std::max(1, kBlockThreads / bx);
  const dim3 block(bx, by);
  const dim3 grid(unsigned((p.num_tokens + by - 1) / by),
                  unsigned((geo.threads_per_token + bx - 1) / bx));
  const size_t smem = size_t(by) * (p.rotary_dim / 2) * sizeof(float2);
  RopePoolKernel<T, P, I, kVec><<<grid, block, smem, stream>>>(p, geo);
  return cudaGetLastError();
}

template <typename T, typename P, typename I>
cudaError_t LaunchForLayout(cudaStream_t stream, const RopePoolParams& p) {
  constexpr int kVec = kAccessBytes / sizeof(T);
  constexpr int kPoolBytes = kVec * sizeof(P);  // an fp8 pool's vectors are kVec bytes
  const bool vectorizable = p.head_dim % kVec == 0 && p.rotary_dim % (2 * kVec) == 0 &&
                            p.pool_row_stride % kVec == 0 && p.pool_head_stride % kVec == 0 &&
                            Aligned(p.q, kAccessBytes) && Aligned(p.k, kAccessBytes) &&
                            Aligned(p.v, kAccessBytes) && Aligned(p.q_rot, kAccessBytes) &&
                            Aligned(p.k_rot, kAccessBytes) && Aligned(p.k_pool, kPoolBytes) &&
                            Aligned(p.v_pool, kPoolBytes);
  return vectorizable ? Launch<T, P, I, kVec>(stream, p) : Launch<T, P, I, 1>(stream, p);
}

}  // namespace

cudaError_t LaunchRopePool(cudaStream_t stream, const RopePoolParams& p) {
  if (p.num_tokens == 0) return cudaSuccess;
  return DispatchFloat(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto for_pool = [&](auto pool_tag) {
      using P = typename decltype(pool_tag)::type;
      return p.index_type == IndexType::kI32 ? LaunchForLayout<T, P, int32_t>(stream, p)
                                             : LaunchForLayout<T, P, int64_t>(stream, p);
    };
    return p.pool_dtype == DType::kF8E4M3 ? for_pool(TypeTag<f8e4m3_t>{})
                                          : for_pool(TypeTag<T>{});
  });
}

}  // namespace jax_sgl::cuda
