// CPU flash attention forward: for each (sequence, kv head, block of query rows), the q rows of
// every q head sharing that kv head stream over the visible keys in blocks; each K/V block is
// converted to float32 once and used by all of them (GQA/MQA share the load). Their scores against
// the block and their P V update are one register-tiled matrix product each (MultiplyRows).
// Online softmax in float32, so memory is O(block) whatever the sequence length. Fully masked
// rows give 0 and lse = -inf (the sink's logit with sinks; attention_sink.h). Block-scaled q/k
// (qk_blockscaled) get their scales as they are converted, so the float32 operands are the exact
// dequantized values.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ffi/common/attention_ffi.h"
#include "ffi/common/attention_seq.h"
#include "ffi/common/attention_sink.h"
#include "ffi/common/dispatch.h"
#include "ffi/cpu/parallel.h"
#include "ffi/cpu/simd_kernels.h"

namespace jax_sgl::cpu {
namespace {

// Query rows per task: large enough to reuse each converted K/V block, small enough that a short
// batch still spreads over every thread.
constexpr int kBlockM = 32;
// Keys per block: 64 rows of K and V (up to 256 features each) stay in L2.
constexpr int kBlockN = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
void LoadRow(const T* src, float* dst, int n, float scale) {
  for (int i = 0; i < n; ++i) dst[i] = ToFloat(src[i]) * scale;
}

// A block-scaled row: dst[e] = (x[e] * scales[scale0 + e / 32]) * after, the first product exact
// for e8m0 scales (a power of two), so `after` (q's softmax scale, 1 for k) rounds once as it does
// for every dtype. Returns false when a scale it read is e8m0's NaN encoding.
template <typename T>
bool LoadBlockScaledRow(const T* src, const AttentionParams& p, const void* scales,
                        int64_t scale0, float* dst, int n, float after) {
  bool ok = true;
  for (int b = 0; b < n / kQkScaleBlock; ++b) {
    ok &= !IsBlockScaleNaN(scales, p.qk_block_scale, scale0 + b);
    const float s = BlockScale(scales, p.qk_block_scale, scale0 + b);
    for (int e = b * kQkScaleBlock; e < (b + 1) * kQkScaleBlock; ++e)
      dst[e] = ToFloat(src[e]) * s * after;
  }
  return ok;
}

// Bits of AttendBlock's result: which block scales it read held e8m0's NaN encoding.
enum : int { kQScaleNaN = 1, kKScaleNaN = 2 };

// One task: sequence b, kv head kh, query rows [m0, m0 + rows). Returns kQScaleNaN / kKScaleNaN
// bits (0 without block scales).
template <typename TQ, typename TK, typename TV, typename TO>
int AttendBlock(const AttentionParams& p, int b, int kh, const SeqBounds& s, int m0, int rows) {
  const int group = p.num_heads / p.num_kv_heads;
  const int d = p.head_dim, dv = p.head_dim_v;
  const int64_t q_row_stride = int64_t(p.num_heads) * d;
  const int64_t o_row_stride = int64_t(p.num_heads) * dv;
  const auto* q = static_cast<const TQ*>(p.q);
  const auto* k = static_cast<const TK*>(p.k);
  const auto* v = static_cast<const TV*>(p.v);
  auto* out = static_cast<TO*>(p.out);

  // Scores come out scaled: fold softmax_scale and the fp8 descales into q once.
  const float q_scale =
      p.softmax_scale * p.q_descale.At(b, kh) * p.k_descale.At(b, kh);
  const float v_scale = p.v_descale.At(b, kh);
  const int nq = rows * group;  // (row, head) pairs of this task, row-major in row
  const bool blockscaled = p.qk_block_scale != BlockScaleType::kNone;
  const int blocks = d / kQkScaleBlock;
  int nan_scales = 0;
  std::vector<float> qf(size_t(nq) * d), acc(size_t(nq) * dv, 0.f), m(nq, kNegInf), l(nq, 0.f);
  std::vector<int> lo(rows), hi(rows);
  for (int r = 0; r < rows; ++r) {
    KeyRange(p, s, m0 + r, &lo[r], &hi[r]);
    for (int g = 0; g < group; ++g) {
      const int h = kh * group + g;
      const int64_t q_row = s.q_row0 + m0 + r;
      float* dst = &qf[size_t(r * group + g) * d];
      if (!blockscaled) {
        LoadRow(q + q_row * q_row_stride + int64_t(h) * d, dst, d, q_scale);
      } else if (!LoadBlockScaledRow(q + q_row * q_row_stride + int64_t(h) * d, p,
                                     p.q_block_scale, (q_row * p.num_heads + h) * blocks, dst, d,
                                     q_scale)) {
        nan_scales |= kQScaleNaN;
      }
    }
  }
  const int key_begin = *std::min_element(lo.begin(), lo.end());
  const int key_end = *std::max_element(hi.begin(), hi.end());

  // K transposed (feature-major) is the right operand of the scores Q K^T, V row-major that of
  // P V: each is one register-tiled MultiplyRows over every (row, head) pair of the task.
  std::vector<float> kf(size_t(kBlockN) * d), kt(size_t(d) * kBlockN), vf(size_t(kBlockN) * dv);
  std::vector<float> sc(size_t(nq) * kBlockN);  // scores, then P; [pair][kBlockN]
  std::vector<char> valid(kBlockN);
  for (int n0 = key_begin; n0 < key_end; n0 += kBlockN) {
    const int cols = std::min(kBlockN, key_end - n0);
    for (int c = 0; c < cols; ++c) {
      const int64_t row = KeyRow(p, b, s, n0 + c);
      valid[c] = row >= 0;
      if (row < 0) {  // masked key: zeros, so its weight 0 never meets a stale NaN in V
        std::fill_n(&kf[size_t(c) * d], d, 0.f);
        std::fill_n(&vf[size_t(c) * dv], dv, 0.f);
        continue;
      }
      if (!blockscaled) {
        LoadRow(k + row * p.k_row_stride + kh * p.k_head_stride, &kf[size_t(c) * d], d, 1.f);
      } else if (!LoadBlockScaledRow(k + row * p.k_row_stride + kh * p.k_head_stride, p,
                                     p.k_block_scale, (row * p.num_kv_heads + kh) * blocks,
                                     &kf[size_t(c) * d], d, 1.f)) {
        nan_scales |= kKScaleNaN;
      }
      LoadRow(v + row * p.v_row_stride + kh * p.v_head_stride, &vf[size_t(c) * dv], dv, 1.f);
    }
    // Transposed after conversion, feature by feature: contiguous stores, and the conversion
    // loops above stay vectorized.
    for (int e = 0; e < d; ++e)
      for (int c = 0; c < cols; ++c) kt[size_t(e) * kBlockN + c] = kf[size_t(c) * d + e];
    std::fill(sc.begin(), sc.end(), 0.f);
    MultiplyRows(qf.data(), d, nq, kt.data(), kBlockN, d, cols, sc.data(), kBlockN);
    // Scores -> P in place, with the online-softmax rescale of each pair's accumulator. Keys a
    // pair does not see get weight 0, so P V below adds nothing for them.
    for (int i = 0; i < nq; ++i) {
      const int r = i / group;
      const int c_lo = std::max(lo[r] - n0, 0), c_hi = std::min(hi[r] - n0, cols);
      float* si = &sc[size_t(i) * kBlockN];
      float block_max = kNegInf;
      for (int c = c_lo; c < c_hi; ++c) {
        float x = si[c];
        if (!valid[c]) x = kNegInf;
        else if (p.softcap > 0.f) x = p.softcap * std::tanh(x / p.softcap);
        si[c] = x;
        block_max = std::max(block_max, x);
      }
      if (block_max == kNegInf) {  // nothing visible here: the pair's state is unchanged
        std::fill_n(si, cols, 0.f);
        continue;
      }
      std::fill_n(si, c_lo, 0.f);
      std::fill(si + c_hi, si + cols, 0.f);
      const float m_new = std::max(m[i], block_max);
      const float corr = std::exp(m[i] - m_new);  // 0 when m[i] is -inf
      float row_sum = 0.f;
      for (int c = c_lo; c < c_hi; ++c) {
        si[c] = std::exp(si[c] - m_new);  // masked keys: exp(-inf) = 0
        row_sum += si[c];
      }
      if (corr != 1.f) {
        float* ai = &acc[size_t(i) * dv];
        for (int e = 0; e < dv; ++e) ai[e] *= corr;
      }
      l[i] = l[i] * corr + row_sum;
      m[i] = m_new;
    }
    MultiplyRows(sc.data(), kBlockN, nq, vf.data(), dv, cols, dv, acc.data(), dv);
  }

  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < group; ++g) {
      const int i = r * group + g;
      const int h = kh * group + g;
      const int64_t row = s.q_row0 + m0 + r;
      const SinkedRow fin = ApplySinkOf(p.sinks, h, l[i] > 0.f ? m[i] + std::log(l[i]) : kNegInf);
      const float inv = l[i] > 0.f ? fin.scale * v_scale / l[i] : 0.f;
      TO* o = out + row * o_row_stride + int64_t(h) * dv;
      for (int e = 0; e < dv; ++e) o[e] = FromFloat<TO>(acc[size_t(i) * dv + e] * inv);
      const int64_t lse_idx = p.cu_seqlens_q
                                  ? int64_t(h) * p.total_q + s.lse_row0 + m0 + r
                                  : (int64_t(b) * p.num_heads + h) * p.seqlen_q + m0 + r;
      p.lse[lse_idx] = fin.lse;
    }
  }
  return nan_scales;
}

// Rows of out/lse that no sequence covers (varlen padding past cu_seqlens_q[batch], or rows left
// out by inconsistent cu_seqlens) are defined as 0 / -inf rather than left uninitialized.
template <typename TO>
void ClearUncoveredRows(const AttentionParams& p) {
  if (!p.cu_seqlens_q) return;
  std::vector<char> covered(p.total_q, 0);
  for (int b = 0; b < p.batch; ++b) {
    const SeqBounds s = GetSeqBounds(p, b);
    std::fill_n(covered.begin() + s.q_row0, s.q_len, 1);
  }
  auto* out = static_cast<TO*>(p.out);
  const int64_t o_row = int64_t(p.num_heads) * p.head_dim_v;
  for (int64_t r = 0; r < p.total_q; ++r) {
    if (covered[r]) continue;
    std::fill_n(out + r * o_row, o_row, FromFloat<TO>(0.f));
    for (int h = 0; h < p.num_heads; ++h) p.lse[int64_t(h) * p.total_q + r] = kNegInf;
  }
}

// Returns AttendBlock's kQScaleNaN / kKScaleNaN bits over every task.
template <typename TO>
int RunAttention(ffi::ThreadPool& pool, const AttentionParams& p) {
  ClearUncoveredRows<TO>(p);
  struct Task {
    int b, kh, m0, rows;
  };
  std::vector<Task> tasks;
  std::vector<SeqBounds> bounds(p.batch);
  for (int b = 0; b < p.batch; ++b) {
    bounds[b] = GetSeqBounds(p, b);
    for (int kh = 0; kh < p.num_kv_heads; ++kh)
      for (int m0 = 0; m0 < bounds[b].q_len; m0 += kBlockM)
        tasks.push_back({b, kh, m0, std::min(kBlockM, bounds[b].q_len - m0)});
  }
  std::atomic<int> nan_scales{0};
  auto run = [&](auto tq, auto tk, auto tv) {
    using TQ = typename decltype(tq)::type;
    using TK = typename decltype(tk)::type;
    using TV = typename decltype(tv)::type;
    ParallelFor(pool, int64_t(tasks.size()), [&](int64_t t) {
      const Task& task = tasks[t];
      if (int nan = AttendBlock<TQ, TK, TV, TO>(p, task.b, task.kh, bounds[task.b], task.m0,
                                                task.rows))
        nan_scales.fetch_or(nan, std::memory_order_relaxed);
    });
  };
  DispatchInput(p.q_type, [&](auto tq) {
    if (Fp8KvCacheTypes(p))  // e4m3 pages under 16/32-bit q: K's type is not q's
      return run(tq, TypeTag<f8e4m3_t>{}, TypeTag<f8e4m3_t>{});
    DispatchInput(p.v_type, [&](auto tv) { run(tq, tq, tv); });
  });
  return nan_scales.load();
}

ffi::Error AttentionFwdImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                            AttentionAttrs attrs) {
  AttentionParams p;
  if (auto err = MakeAttentionParams(args, rets, attrs, &p); err.failure()) return err;
  const int nan_scales = DispatchFloat(
      p.out_type, [&](auto to) { return RunAttention<typename decltype(to)::type>(pool, p); });
  // The MX spec makes a block with a NaN scale NaN; a kernel that silently produced NaN rows
  // would hide a broken quantizer, so the call fails instead (the reference follows the spec).
  if (nan_scales)
    return InvalidArgument(std::string("jax_sgl.attention: ") +
                           (nan_scales & kQScaleNaN ? "q_descale" : "k_descale") +
                           " holds 0xff, float8_e8m0fnu's NaN encoding, in a block scale this "
                           "call reads; e8m0 block scales must be finite powers of two");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSglAttentionFwdCpu, jax_sgl::cpu::AttentionFwdImpl,
                              jax_sgl::BindAttention(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
