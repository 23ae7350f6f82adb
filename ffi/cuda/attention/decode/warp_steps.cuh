// The parts the warp-sliced mma decode kernels share (cp_async_kernel.cuh and tma_kernel.cuh;
// they differ in how they stream K/V into shared memory): the split of the keys into per-warp
// stages, the q tile and its fragments, the scoring and masking of a 16-key stage, its
// online-softmax update and P V, the end where each warp's (m, l, o) of the same 16 packed rows
// over its own slice of the keys merge through shared memory and the CTA writes the rows' output
// and LSE (or its split's float32 partials), and the launch and occupancy query.
#pragma once

#include "ffi/cuda/attention/decode/block_kernel.cuh"
#include "ffi/cuda/attention/decode/fp8_kv_operands.cuh"
#include "ffi/cuda/attention/common/launch.cuh"

namespace jax_sgl::cuda::decode_warp_mma {

// The keys any of the CTA's rows may see, [n_lo, n_hi), cut into stages of kKeys keys from
// `first` (n_lo, or n_lo rounded down to a multiple of kKeys when kAligned); this split's
// stages [t_begin, t_end), of which warp w takes t_begin + w, + kWarps, ...: my_tiles of them.
template <int kKeys, bool kAligned = false>
struct WarpStages {
  static constexpr int kWarps = kDecodeWarpThreads / 32;
  int n_lo = 0, n_hi = 0, first = 0, t_begin = 0, my_tiles = 0, warp;

  __device__ WarpStages(const AttentionParams& p, const SeqBounds& s, int group, int rows_here,
                        int num_splits, int warp_in_cta)
      : warp(warp_in_cta) {
    int unused;
    if (rows_here > 0) {
      KeyRange(p, s, 0, &n_lo, &unused);
      KeyRange(p, s, (rows_here - 1) / group, &unused, &n_hi);
    }
    first = kAligned ? n_lo / kKeys * kKeys : n_lo;
    const int n_tiles = n_hi > n_lo ? (n_hi - first + kKeys - 1) / kKeys : 0;
    t_begin = int(int64_t(n_tiles) * blockIdx.y / num_splits);
    const int t_end = int(int64_t(n_tiles) * (blockIdx.y + 1) / num_splits);
    my_tiles = t_end - t_begin > warp ? (t_end - t_begin - warp + kWarps - 1) / kWarps : 0;
  }
  // First key of this warp's i-th stage.
  __device__ __forceinline__ int Key0(int i) const {
    return first + (t_begin + warp + i * kWarps) * kKeys;
  }
};

// Loads the CTA's 16 packed q rows (row r = query r / group, head r % group of this kv head) into
// sq (DecodeStride(kD)-element rows), zeros past rows_here and head_dim; plain loads, once. Over an
// fp8 KV cache (kFp8Kv) the rows are f16 whatever T is (decode_fp8kv's mma type), feature d in
// column decode_fp8kv::QColumn(d) (the K fragments' order), a bf16 row times 2^QRowExponent of its
// max |q|, and the row's pad (the float past its kD columns, which no fragment reads) holds that
// power's inverse (1 for f16 q) for QRowPow2.
template <typename T, int kD, bool kFp8Kv = false>
__device__ __forceinline__ void LoadQRows(const AttentionParams& p, const SeqBounds& s, int group,
                                          int kv_head, int rows_here, T* sq) {
  constexpr int kStride = DecodeStride(kD);
  constexpr int kChunks = kD / 8;
  static_assert(!kFp8Kv || (16 * kChunks) % kDecodeWarpThreads == 0,
                "every lane of a warp runs every pass (the row max is a shuffle reduction)");
  const T* qp = static_cast<const T*>(p.q);
  for (int idx = threadIdx.x; idx < 16 * kChunks; idx += kDecodeWarpThreads) {
    const int r = idx / kChunks, cq = (idx % kChunks) * 8;
    uint4 u = make_uint4(0, 0, 0, 0);
    if (r < rows_here && cq < p.head_dim) {
      const int64_t row_head = (s.q_row0 + r / group) * p.num_heads + kv_head * group + r % group;
      u = *reinterpret_cast<const uint4*>(qp + row_head * p.head_dim + cq);
    }
    if constexpr (kFp8Kv) {
      const T* e = reinterpret_cast<const T*>(&u);
      uint16_t* row = reinterpret_cast<uint16_t*>(sq + r * kStride);
      float inv_pow2 = 1.f;
      if constexpr (std::is_same_v<T, bf16_t>) {
        float x[8], amax = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          x[k] = ToFloat(e[k]);
          amax = fmaxf(amax, fabsf(x[k]));
        }
        // The row's kChunks chunks sit in kChunks consecutive lanes of one warp.
#pragma unroll
        for (int off = kChunks / 2; off > 0; off /= 2)
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        const int ex = decode_fp8kv::QRowExponent(amax);
        const float pow2 = decode_fp8kv::Pow2(ex);
        inv_pow2 = decode_fp8kv::Pow2(-ex);
#pragma unroll
        for (int k = 0; k < 8; ++k)
          row[decode_fp8kv::QColumn<kD>(cq + k)] = __half_as_ushort(__float2half_rn(x[k] * pow2));
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) row[decode_fp8kv::QColumn<kD>(cq + k)] = e[k].bits;
      }
      if (idx % kChunks == 0) *reinterpret_cast<float*>(row + kD) = inv_pow2;
    } else {
      *reinterpret_cast<uint4*>(sq + r * kStride + cq) = u;
    }
  }
}

// LoadQRows' (kFp8Kv) inverse powers of two of this lane's two accumulator rows (lane / 4 and
// lane / 4 + 8), after the CTA's barrier.
template <typename T, int kD>
__device__ __forceinline__ void QRowPow2(const T* sq, int lane, float (&inv_pow2)[2]) {
  constexpr int kStride = DecodeStride(kD);
#pragma unroll
  for (int h = 0; h < 2; ++h)
    inv_pow2[h] = *reinterpret_cast<const float*>(sq + (lane / 4 + 8 * h) * kStride + kD);
}

// q's A fragments for the whole loop (kD / 16 x 4 registers), from LoadQRows' tile.
template <typename T, int kD>
__device__ __forceinline__ void LoadQFragments(const T* sq, int lane, uint32_t (&qa)[kD / 16][4]) {
  constexpr int kStride = DecodeStride(kD);
#pragma unroll
  for (int k0 = 0; k0 < kD; k0 += 16)
    flash::Ldmatrix4(qa[k0 / 16], sq + (lane % 16) * kStride + k0 + (lane / 16) * 8);
}

// RowScores of the warp's 16 packed rows, and the keys every real row sees [all_lo, all_hi) (lo
// and hi grow with the q row, bottom-right aligned: the last row bounds lo, the first bounds hi).
struct StageScoring : flash::RowScores {
  int all_lo, all_hi;

  __device__ StageScoring(const AttentionParams& p, const SeqBounds& s, int group, int rows_here,
                          int lane) {
    int unused;
    InitRows(p, s, group, 0, rows_here, 0, lane);
    all_lo = all_hi = 0;
    if (rows_here > 0) {
      KeyRange(p, s, (rows_here - 1) / group, &all_lo, &unused);
      KeyRange(p, s, 0, &unused, &all_hi);
    }
    InitScale(p);
  }

  // Over an fp8 KV cache, the score scale of each of the lane's two rows: the raw scores are
  // (2^e_row q) . stored k, so score_scale x k_descale[b, kv head] x 2^-e_row (LoadQRows).
  float row_scale[2];
  __device__ __forceinline__ void ScaleRows(float k_descale, const float (&inv_pow2)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) row_scale[h] = score_scale * k_descale * inv_pow2[h];
  }

  // The stage's 16 x 16 scores (keys key0 .. key0 + 15, `valid`: the keys that exist) into the
  // log2 domain, -inf where a row does not see the key, and each row half's max.
  __device__ __forceinline__ void Apply(float (&sc)[2][4], int key0, uint32_t valid, int lane,
                                        float (&blk_max)[2]) const {
    const bool whole = Whole(key0, valid);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[t][e] * score_scale;
        if (softcap) x = cap_log2 * tanhf(x);
        sc[t][e] = x;
      }
    }
    MaskStageAndMax(sc, key0, valid, whole, lane, blk_max);
  }
  // Apply with ScaleRows' per-row scales, and one softcap branch for the stage rather than the
  // compiler's one per element (8 branches a stage on the fp8 form's issue-bound path).
  __device__ __forceinline__ void ApplyRows(float (&sc)[2][4], int key0, uint32_t valid, int lane,
                                            float (&blk_max)[2]) const {
    const bool whole = Whole(key0, valid);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[t][e] *= row_scale[e / 2];
    }
    if (softcap) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[t][e] = cap_log2 * tanhf(sc[t][e]);
      }
    }
    MaskStageAndMax(sc, key0, valid, whole, lane, blk_max);
  }

  // Whether every row sees the whole stage: then Apply skips the per-element mask (a
  // warp-uniform branch).
  __device__ __forceinline__ bool Whole(int key0, uint32_t valid) const {
    return valid == 0xffffu && key0 >= all_lo && key0 + 16 <= all_hi;
  }

  // Apply's end: -inf where a row does not see the key, and each row half's max.
  __device__ __forceinline__ void MaskStageAndMax(float (&sc)[2][4], int key0, uint32_t valid,
                                                  bool whole, int lane,
                                                  float (&blk_max)[2]) const {
    if (!whole) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2;
          const int cc = t * 8 + (lane % 4) * 2 + (e % 2);
          const int j = key0 + cc;
          const bool ok = j >= row_lo[h] && j < row_hi[h] && ((valid >> cc) & 1u);
          sc[t][e] = ok ? sc[t][e] : -INFINITY;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      blk_max[h] = fmaxf(fmaxf(sc[0][2 * h], sc[0][2 * h + 1]),
                         fmaxf(sc[1][2 * h], sc[1][2 * h + 1]));
  }
};

// SoftmaxPvAt over a V tile `sv` of DecodeStride(kD)-element rows, skipping settled rescales.
template <typename T, int kD>
__device__ __forceinline__ void SoftmaxPv(float (&sc)[2][4], const float (&blk_max)[2],
                                          float (&m_run)[2], float (&l_run)[2],
                                          float (&o)[kD / 8][4], const T* sv, int lane) {
  constexpr int kStride = DecodeStride(kD);
  decode::SoftmaxPvAt<T, kD, true>(
      sc, blk_max, m_run, l_run, o,
      [sv](int row, int col) -> const void* { return sv + row * kStride + col; }, lane);
}

// Called by every thread after its last K/V load has landed; reuses the ring's shared memory.
// Over an fp8 KV cache (kFp8Kv) o's columns are in decode_fp8kv::OutFeature order and the rows
// take v_descale[b, kv head].
template <typename T, int kD, bool kFp8Kv = false>
__device__ __forceinline__ void MergeWarpsAndStore(const FlashDecodeArgs& args,
                                                   const SeqBounds& s, int b, int kv_head,
                                                   int rows_here, uint8_t* smem,
                                                   const float (&m_run)[2], float (&l_run)[2],
                                                   const float (&o)[kD / 8][4]) {
  using flash::Elem;
  using flash::kLn2;
  using flash::QuadSum;
  constexpr int kWarps = kDecodeWarpThreads / 32;
  constexpr int kChunks = kD / 8;
  constexpr int kDT = kD / 8;
  constexpr int kOStride = kD + 4;
  const AttentionParams& p = args.fwd.p;
  const int group = args.fwd.group;
  const int num_splits = args.fwd.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  float* so = reinterpret_cast<float*>(smem);     // [warps][16][kOStride]
  float* sm = so + kWarps * 16 * kOStride;        // [warps][16]
  float* sl = sm + kWarps * 16;                   // [warps][16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] = QuadSum(l_run[h]);
    if (lane % 4 == 0) {
      sm[warp * 16 + lane / 4 + 8 * h] = m_run[h];
      sl[warp * 16 + lane / 4 + 8 * h] = l_run[h];
    }
  }
#pragma unroll
  for (int t = 0; t < kDT; ++t) {
    const int cc = t * 8 + (lane % 4) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kFp8Kv) {
        float* row = so + (warp * 16 + lane / 4 + 8 * h) * kOStride;
        row[decode_fp8kv::OutFeature<kD>(t, cc % 8)] = o[t][2 * h];
        row[decode_fp8kv::OutFeature<kD>(t, cc % 8 + 1)] = o[t][2 * h + 1];
      } else {
        float* dst = so + (warp * 16 + lane / 4 + 8 * h) * kOStride + cc;
        dst[0] = o[t][2 * h];
        dst[1] = o[t][2 * h + 1];
      }
    }
  }
  __syncthreads();

  const bool split = num_splits > 1;
  const int dv = p.head_dim_v;
  for (int idx = threadIdx.x; idx < rows_here * kChunks; idx += kDecodeWarpThreads) {
    const int r = idx / kChunks, cc = (idx % kChunks) * 8;
    if (cc >= dv) continue;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, sm[w * 16 + r]);
    float l_all = 0.f;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sm[w * 16 + r] - m_all);
        l_all += sl[w * 16 + r] * f;
        const float4* src = reinterpret_cast<const float4*>(so + (w * 16 + r) * kOStride + cc);
        const float4 x0 = src[0], x1 = src[1];
        acc[0] += x0.x * f; acc[1] += x0.y * f; acc[2] += x0.z * f; acc[3] += x0.w * f;
        acc[4] += x1.x * f; acc[5] += x1.y * f; acc[6] += x1.z * f; acc[7] += x1.w * f;
      }
    }
    const int i = r / group, head = kv_head * group + r % group;
    // The sink joins the row's denominator here, or in the combine for a split's partial.
    const SinkedRow fin = ApplySinkOf(split ? nullptr : p.sinks, head,
                                      l_all > 0.f ? (m_all + log2f(l_all)) * kLn2 : -INFINITY);
    float inv = l_all > 0.f ? fin.scale / l_all : 0.f;
    if constexpr (kFp8Kv) inv *= p.v_descale.At(b, kv_head);
    const float lse = fin.lse;
    const int64_t row_head = (s.q_row0 + i) * p.num_heads + head;
    if (split) {
      const int64_t part_row = int64_t(blockIdx.y) * p.total_q * p.num_heads + row_head;
      float4* dst = reinterpret_cast<float4*>(args.fwd.o_partial + part_row * dv + cc);
      dst[0] = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      dst[1] = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (cc == 0) args.fwd.lse_partial[part_row] = lse;
    } else {
      uint4 packed;
      packed.x = Elem<T>::Pack(acc[0] * inv, acc[1] * inv);
      packed.y = Elem<T>::Pack(acc[2] * inv, acc[3] * inv);
      packed.z = Elem<T>::Pack(acc[4] * inv, acc[5] * inv);
      packed.w = Elem<T>::Pack(acc[6] * inv, acc[7] * inv);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row_head * dv + cc) = packed;
      if (cc == 0) {
        const int64_t li = p.cu_seqlens_q ? int64_t(head) * p.total_q + s.lse_row0 + i
                                          : (int64_t(b) * p.num_heads + head) * p.seqlen_q + i;
        p.lse[li] = lse;
      }
    }
  }
}

// Launches a warp-sliced kernel taking `param` (its FlashDecodeArgs, or a struct holding them)
// with `smem` bytes of dynamic shared memory; grid: x = batch * num_kv_heads, y = KV splits.
template <typename Kernel, typename Param>
cudaError_t LaunchWithSmem(Kernel kernel, const Param& param, const FlashDecodeArgs& args,
                           int smem, cudaStream_t stream) {
  const AttentionParams& p = args.fwd.p;
  const dim3 grid(unsigned(int64_t(p.batch) * p.num_kv_heads), unsigned(args.fwd.num_splits));
  return cuda::LaunchWithSmem(kernel, grid, kDecodeWarpThreads, smem, stream, param);
}

template <int kD, typename Kernel>
cudaError_t Launch(Kernel kernel, const FlashDecodeArgs& args, cudaStream_t stream) {
  return LaunchWithSmem(kernel, args, args, DecodeWarpMmaSmemBytes(kD, args.stages), stream);
}

// Resident CTAs per SM of a warp-sliced kernel taking `smem` bytes of dynamic shared memory.
template <typename Kernel>
int CtasPerSmWithSmem(Kernel kernel, int smem) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kDecodeWarpThreads, smem) !=
      cudaSuccess)
    return 1;
  return n > 0 ? n : 1;
}

template <int kD, typename Kernel>
int CtasPerSm(Kernel kernel, int stages) {
  return CtasPerSmWithSmem(kernel, DecodeWarpMmaSmemBytes(kD, stages));
}

}  // namespace jax_sgl::cuda::decode_warp_mma
