// CPU flash attention backward, FlashAttention-2 style: nothing of the forward is stored but out
// and lse, so every pass recomputes the probabilities P = exp(s - lse) from q, k and lse.
//
//   1. D = rowsum(dO * O) - dlse per (row, head)                      (softmax_d)
//   2. dK/dV: one task per (sequence, kv head, block of keys). The task owns those key rows, so it
//      accumulates dV = P^T dO and dK = scale * dS^T Q over every q row and every q head of the
//      kv head's group (GQA sums) in float32 and writes them once: no atomics, deterministic.
//   3. dQ: one task per (sequence, kv head, block of q rows), which owns the dQ rows of the
//      group's q heads: dQ = scale * dS K over the visible keys.
// with dS = P * (dP - D), dP = dO V^T, times 1 - tanh^2 under softcap. Splitting dQ from dK/dV
// costs a second recompute of P but keeps every output row owned by one task, so the result
// does not depend on the thread count, and both passes spread over every thread whatever the
// batch and head counts. Masks come from attention_seq.h, as in the forward.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ffi/common/attention_bwd_ffi.h"
#include "ffi/common/attention_seq.h"
#include "ffi/common/dispatch.h"
#include "ffi/cpu/parallel.h"

namespace jax_sgl::cpu {
namespace {

// Keys per dK/dV task and per block of the dQ pass: 64 rows of K and V in float32 (up to 256
// features each) stay in L2 while every q row of the sequence streams past them.
constexpr int kBlockN = 64;
// q rows per dQ task (times the GQA group): enough rows to reuse each converted K/V block.
constexpr int kBlockM = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float Dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void Axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

template <typename T>
void LoadRow(const T* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = ToFloat(src[i]);
}

template <typename T>
void StoreRow(const float* src, T* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = FromFloat<T>(src[i]);
}

// Row strides (elements) of the four tensor families; q-like tensors share q's, out-like out's.
struct Strides {
  int64_t q, o, k, v;
  explicit Strides(const AttentionParams& p)
      : q(int64_t(p.num_heads) * p.head_dim),
        o(int64_t(p.num_heads) * p.head_dim_v),
        k(int64_t(p.num_kv_heads) * p.head_dim),
        v(int64_t(p.num_kv_heads) * p.head_dim_v) {}
};

// Gradient of the scores for one (q row, key) pair, given the recomputed raw scaled score x:
// returns p and writes ds = dL/d(scaled raw score), i.e. before softmax_scale's chain factor.
struct ScoreGrad {
  float softcap, lse, d;
  // x: scale * q.k; dp: dO.v. Returns P; *ds gets P * (dP - D) * softcap'(x).
  inline float operator()(float x, float dp, float* ds) const {
    float t = 0.f;
    if (softcap > 0.f) {
      t = std::tanh(x / softcap);
      x = softcap * t;
    }
    const float pr = std::exp(x - lse);
    float g = pr * (dp - d);
    if (softcap > 0.f) g *= 1.f - t * t;
    *ds = g;
    return pr;
  }
};

// Pass 1: D for rows [m0, m0 + rows) of sequence b, every head.
template <typename T>
void SoftmaxDBlock(const AttentionBwdParams& bp, int b, const SeqBounds& s, int m0, int rows) {
  const AttentionParams& p = bp.fwd;
  const Strides st(p);
  const int dv = p.head_dim_v;
  const auto* out = static_cast<const T*>(p.out);
  const auto* dout = static_cast<const T*>(bp.dout);
  for (int r = m0; r < m0 + rows; ++r) {
    const int64_t row = s.q_row0 + r;
    for (int h = 0; h < p.num_heads; ++h) {
      const T* o = out + row * st.o + int64_t(h) * dv;
      const T* g = dout + row * st.o + int64_t(h) * dv;
      float acc = 0.f;
      for (int e = 0; e < dv; ++e) acc += ToFloat(o[e]) * ToFloat(g[e]);
      const int64_t idx = LseIndex(p, s, b, h, r);
      bp.softmax_d[idx] = acc - bp.dlse[idx];
    }
  }
}

// Pass 2: dK, dV for keys [n0, n0 + cols) of sequence b, kv head kh.
template <typename T>
void DkDvBlock(const AttentionBwdParams& bp, int b, int kh, const SeqBounds& s, int n0, int cols) {
  const AttentionParams& p = bp.fwd;
  const Strides st(p);
  const int group = p.num_heads / p.num_kv_heads;
  const int d = p.head_dim, dv = p.head_dim_v;
  const float scale = p.softmax_scale;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);
  const auto* dout = static_cast<const T*>(bp.dout);

  std::vector<float> kf(size_t(cols) * d), vf(size_t(cols) * dv);
  std::vector<float> dk(size_t(cols) * d, 0.f), dvv(size_t(cols) * dv, 0.f);
  for (int c = 0; c < cols; ++c) {
    const int64_t row = s.k_row0 + n0 + c;
    LoadRow(k + row * st.k + int64_t(kh) * d, &kf[size_t(c) * d], d);
    LoadRow(v + row * st.v + int64_t(kh) * dv, &vf[size_t(c) * dv], dv);
  }
  std::vector<float> qf(d), gf(dv);
  for (int i = 0; i < s.q_len; ++i) {
    int lo, hi;
    KeyRange(p, s, i, &lo, &hi);
    const int c_lo = std::max(lo - n0, 0), c_hi = std::min(hi - n0, cols);
    if (c_lo >= c_hi) continue;
    const int64_t qrow = s.q_row0 + i;
    for (int g = 0; g < group; ++g) {
      const int h = kh * group + g;
      const int64_t idx = LseIndex(p, s, b, h, i);
      const ScoreGrad grad{p.softcap, p.lse[idx], bp.softmax_d[idx]};
      if (grad.lse == kNegInf) continue;  // fully masked row: out is 0, no gradient
      LoadRow(q + qrow * st.q + int64_t(h) * d, qf.data(), d);
      LoadRow(dout + qrow * st.o + int64_t(h) * dv, gf.data(), dv);
      for (int c = c_lo; c < c_hi; ++c) {
        float ds;
        const float pr = grad(scale * Dot(qf.data(), &kf[size_t(c) * d], d),
                              Dot(gf.data(), &vf[size_t(c) * dv], dv), &ds);
        Axpy(pr, gf.data(), &dvv[size_t(c) * dv], dv);
        Axpy(scale * ds, qf.data(), &dk[size_t(c) * d], d);
      }
    }
  }
  auto* dk_out = static_cast<T*>(bp.dk);
  auto* dv_out = static_cast<T*>(bp.dv);
  for (int c = 0; c < cols; ++c) {
    const int64_t row = s.k_row0 + n0 + c;
    StoreRow(&dk[size_t(c) * d], dk_out + row * st.k + int64_t(kh) * d, d);
    StoreRow(&dvv[size_t(c) * dv], dv_out + row * st.v + int64_t(kh) * dv, dv);
  }
}

// Pass 3: dQ for q rows [m0, m0 + rows) of sequence b, every q head of kv head kh.
template <typename T>
void DqBlock(const AttentionBwdParams& bp, int b, int kh, const SeqBounds& s, int m0, int rows) {
  const AttentionParams& p = bp.fwd;
  const Strides st(p);
  const int group = p.num_heads / p.num_kv_heads;
  const int d = p.head_dim, dv = p.head_dim_v;
  const float scale = p.softmax_scale;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);
  const auto* dout = static_cast<const T*>(bp.dout);

  const int nq = rows * group;  // (row, head) pairs, row-major in row
  std::vector<float> qf(size_t(nq) * d), gf(size_t(nq) * dv), dq(size_t(nq) * d, 0.f);
  std::vector<ScoreGrad> grads(nq);
  std::vector<int> lo(rows), hi(rows);
  int key_begin = s.k_len, key_end = 0;
  for (int r = 0; r < rows; ++r) {
    KeyRange(p, s, m0 + r, &lo[r], &hi[r]);
    if (lo[r] < hi[r]) {
      key_begin = std::min(key_begin, lo[r]);
      key_end = std::max(key_end, hi[r]);
    }
    const int64_t qrow = s.q_row0 + m0 + r;
    for (int g = 0; g < group; ++g) {
      const int h = kh * group + g, i = r * group + g;
      const int64_t idx = LseIndex(p, s, b, h, m0 + r);
      grads[i] = ScoreGrad{p.softcap, p.lse[idx], bp.softmax_d[idx]};
      LoadRow(q + qrow * st.q + int64_t(h) * d, &qf[size_t(i) * d], d);
      LoadRow(dout + qrow * st.o + int64_t(h) * dv, &gf[size_t(i) * dv], dv);
    }
  }

  std::vector<float> kf(size_t(kBlockN) * d), vf(size_t(kBlockN) * dv);
  for (int n0 = key_begin; n0 < key_end; n0 += kBlockN) {
    const int cols = std::min(kBlockN, key_end - n0);
    for (int c = 0; c < cols; ++c) {
      const int64_t row = s.k_row0 + n0 + c;
      LoadRow(k + row * st.k + int64_t(kh) * d, &kf[size_t(c) * d], d);
      LoadRow(v + row * st.v + int64_t(kh) * dv, &vf[size_t(c) * dv], dv);
    }
    for (int r = 0; r < rows; ++r) {
      const int c_lo = std::max(lo[r] - n0, 0), c_hi = std::min(hi[r] - n0, cols);
      if (c_lo >= c_hi) continue;
      for (int g = 0; g < group; ++g) {
        const int i = r * group + g;
        if (grads[i].lse == kNegInf) continue;
        const float* qi = &qf[size_t(i) * d];
        const float* gi = &gf[size_t(i) * dv];
        float* dqi = &dq[size_t(i) * d];
        for (int c = c_lo; c < c_hi; ++c) {
          float ds;
          grads[i](scale * Dot(qi, &kf[size_t(c) * d], d), Dot(gi, &vf[size_t(c) * dv], dv),
                   &ds);
          Axpy(scale * ds, &kf[size_t(c) * d], dqi, d);
        }
      }
    }
  }

  auto* dq_out = static_cast<T*>(bp.dq);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < group; ++g) {
      const int h = kh * group + g, i = r * group + g;
      StoreRow(&dq[size_t(i) * d], dq_out + (s.q_row0 + m0 + r) * st.q + int64_t(h) * d, d);
    }
}

template <typename T>
void RunAttentionBwd(ffi::ThreadPool& pool, const AttentionBwdParams& bp) {
  const AttentionParams& p = bp.fwd;
  // Rows no sequence owns (varlen padding, keys past seqused_k) get zero gradients; zero bits are
  // 0.0 in every float dtype. Owned rows are overwritten below.
  std::memset(bp.dq, 0, size_t(p.total_q) * p.num_heads * p.head_dim * sizeof(T));
  std::memset(bp.dk, 0, size_t(p.total_k) * p.num_kv_heads * p.head_dim * sizeof(T));
  std::memset(bp.dv, 0, size_t(p.total_k) * p.num_kv_heads * p.head_dim_v * sizeof(T));

  struct Task {
    int b, kh, r0, len;
  };
  std::vector<SeqBounds> bounds(p.batch);
  std::vector<Task> row_tasks, key_tasks;
  for (int b = 0; b < p.batch; ++b) {
    const SeqBounds& s = bounds[b] = GetSeqBounds(p, b);
    for (int m0 = 0; m0 < s.q_len; m0 += kBlockM)
      row_tasks.push_back({b, 0, m0, std::min(kBlockM, s.q_len - m0)});
    for (int kh = 0; kh < p.num_kv_heads; ++kh)
      for (int n0 = 0; n0 < s.k_len; n0 += kBlockN)
        key_tasks.push_back({b, kh, n0, std::min(kBlockN, s.k_len - n0)});
  }
  ParallelFor(pool, int64_t(row_tasks.size()), [&](int64_t t) {
    const Task& w = row_tasks[t];
    SoftmaxDBlock<T>(bp, w.b, bounds[w.b], w.r0, w.len);
  });
  ParallelFor(pool, int64_t(key_tasks.size()), [&](int64_t t) {
    const Task& w = key_tasks[t];
    DkDvBlock<T>(bp, w.b, w.kh, bounds[w.b], w.r0, w.len);
  });
  const int64_t per_head = int64_t(row_tasks.size());
  ParallelFor(pool, per_head * p.num_kv_heads, [&](int64_t t) {
    const Task& w = row_tasks[t % per_head];
    DqBlock<T>(bp, w.b, int(t / per_head), bounds[w.b], w.r0, w.len);
  });
}

ffi::Error AttentionBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::S32> cu_seqlens_q,
                            ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Buffer<ffi::S32> seqused_k,
                            ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> q_descale,
                            ffi::Buffer<ffi::F32> k_descale, ffi::Buffer<ffi::F32> v_descale,
                            ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                            ffi::Buffer<ffi::F32> dlse, ffi::Result<ffi::AnyBuffer> dq,
                            ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                            int64_t kv_layout, bool varlen_q, int64_t batch, int64_t max_seqlen_q,
                            float softmax_scale, float softcap, bool causal, int64_t window_left,
                            int64_t window_right) {
  AttentionBwdParams bp;
  if (auto err = MakeAttentionBwdParams(
          q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, q_descale, k_descale,
          v_descale, out, lse, dout, dlse, dq, dk, dv, kv_layout, varlen_q, batch, max_seqlen_q,
          softmax_scale, softcap, causal, window_left, window_right, &bp);
      err.failure())
    return err;
  std::vector<float> softmax_d(lse.element_count(), 0.f);
  bp.softmax_d = softmax_d.data();
  DispatchFloat(bp.fwd.q_type,
                [&](auto tag) { RunAttentionBwd<typename decltype(tag)::type>(pool, bp); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSglAttentionBwdCpu, jax_sgl::cpu::AttentionBwdImpl,
                              jax_sgl::BindAttentionBwd(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
