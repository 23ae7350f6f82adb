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
#include "ffi/cpu/simd_kernels.h"

namespace jax_sgl::cpu {
namespace {

// Keys per dK/dV task and per block of the dQ pass: 64 rows of K and V in float32 (up to 256
// features each) stay in L2 while every q row of the sequence streams past them.
constexpr int kBlockN = 64;
// q rows per dQ task and per q block of a dK/dV task (times the GQA group): enough rows to reuse
// each converted K/V block, and in dK/dV enough that each dK/dV row is read and written once per
// block of rows rather than once per row.
constexpr int kBlockM = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
void LoadRow(const T* src, float* dst, int n, float scale) {
  for (int i = 0; i < n; ++i) dst[i] = ToFloat(src[i]) * scale;
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

// Gradient of the scores for one (q row, key) pair, given the recomputed scaled score x:
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
  bool dead() const { return lse == kNegInf; }  // fully masked row: out is 0, no gradient
};

// The q rows of one block in float32 with what their score gradients need. Row-major in
// (row, head of the group); q is pre-scaled by softmax_scale, so q.k is the scaled score and
// dS^T q is already dK. A dead pair (fully masked row, or no visible key) keeps zero q and dO
// rows, so its zero weights never meet stale data.
struct QBlock {
  int rows = 0, group = 0;
  std::vector<float> q, dout;
  std::vector<ScoreGrad> grad;
  std::vector<int> lo, hi;  // visible keys [lo, hi) per row

  template <typename T>
  void Load(const AttentionBwdParams& bp, int b, int kh, const SeqBounds& s, int m0, int n_rows) {
    const AttentionParams& p = bp.fwd;
    const Strides st(p);
    const int d = p.head_dim, dv = p.head_dim_v;
    const auto* qp = static_cast<const T*>(p.q);
    const auto* op = static_cast<const T*>(bp.dout);
    rows = n_rows;
    group = p.num_heads / p.num_kv_heads;
    const int nq = rows * group;
    q.assign(size_t(nq) * d, 0.f);
    dout.assign(size_t(nq) * dv, 0.f);
    grad.resize(nq);
    lo.resize(rows);
    hi.resize(rows);
    for (int r = 0; r < rows; ++r) {
      KeyRange(p, s, m0 + r, &lo[r], &hi[r]);
      const int64_t row = s.q_row0 + m0 + r;
      for (int g = 0; g < group; ++g) {
        const int h = kh * group + g, i = r * group + g;
        const int64_t idx = LseIndex(p, s, b, h, m0 + r);
        grad[i] = ScoreGrad{p.softcap, p.lse[idx], bp.softmax_d[idx]};
        if (lo[r] >= hi[r]) grad[i].lse = kNegInf;
        if (grad[i].dead()) continue;
        LoadRow(qp + row * st.q + int64_t(h) * d, &q[size_t(i) * d], d, p.softmax_scale);
        LoadRow(op + row * st.o + int64_t(h) * dv, &dout[size_t(i) * dv], dv, 1.f);
      }
    }
  }
};

// One block of keys [n0, n0 + cols) of kv head kh in float32. Scores and dP of a block of q rows
// are the products Q K^T and dO V^T: kept transposed (feature-major, kBlockN keys per row) K and V
// are the right operands of MultiplyRows. dQ += dS K needs K row-major as well.
struct KvBlock {
  int n0 = 0, cols = 0;
  std::vector<float> k, kt, vt;  // [kBlockN][d], [d][kBlockN], [dv][kBlockN]

  template <typename T>
  void Load(const AttentionParams& p, int kh, const SeqBounds& s, int first, int n) {
    const Strides st(p);
    const int d = p.head_dim, dv = p.head_dim_v;
    const auto* kp = static_cast<const T*>(p.k);
    const auto* vp = static_cast<const T*>(p.v);
    n0 = first;
    cols = n;
    k.resize(size_t(kBlockN) * d);
    kt.resize(size_t(d) * kBlockN);
    vt.resize(size_t(dv) * kBlockN);
    for (int c = 0; c < cols; ++c) {
      const int64_t row = s.k_row0 + n0 + c;
      float* kc = &k[size_t(c) * d];
      LoadRow(kp + row * st.k + int64_t(kh) * d, kc, d, 1.f);
      for (int e = 0; e < d; ++e) kt[size_t(e) * kBlockN + c] = kc[e];
      const T* vc = vp + row * st.v + int64_t(kh) * dv;
      for (int e = 0; e < dv; ++e) vt[size_t(e) * kBlockN + c] = ToFloat(vc[e]);
    }
  }
  // Keys of this block that row r of qb sees, as [*c_lo, *c_hi) relative to n0.
  void Cols(const QBlock& qb, int r, int* c_lo, int* c_hi) const {
    *c_lo = std::max(qb.lo[r] - n0, 0);
    *c_hi = std::min(qb.hi[r] - n0, cols);
  }
};

// Recomputed scaled scores and dP = dO V^T of every pair of qb against every key of kv, both
// [pairs][kBlockN]; entries a pair does not see are computed and ignored.
void ScoresAndDp(const QBlock& qb, const KvBlock& kv, int d, int dv, float* sc, float* dp) {
  const int nq = qb.rows * qb.group;
  std::fill_n(sc, size_t(nq) * kBlockN, 0.f);
  std::fill_n(dp, size_t(nq) * kBlockN, 0.f);
  MultiplyRows(qb.q.data(), d, nq, kv.kt.data(), kBlockN, d, kv.cols, sc, kBlockN);
  MultiplyRows(qb.dout.data(), dv, nq, kv.vt.data(), kBlockN, dv, kv.cols, dp, kBlockN);
}

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

// Pass 2: dK, dV for keys [n0, n0 + cols) of sequence b, kv head kh. The q rows that see the block
// come in blocks of kBlockM; for each, P^T and dS^T are formed key-major (zero where a pair does
// not see a key) and dV += P^T dO, dK += dS^T q are two matrix products over the block's pairs.
template <typename T>
void DkDvBlock(const AttentionBwdParams& bp, int b, int kh, const SeqBounds& s, int n0, int cols) {
  const AttentionParams& p = bp.fwd;
  const int d = p.head_dim, dv = p.head_dim_v;
  KvBlock kv;
  kv.Load<T>(p, kh, s, n0, cols);
  std::vector<float> dk(size_t(cols) * d, 0.f), dvv(size_t(cols) * dv, 0.f);

  // Rows that see a key of the block: contiguous, as both ends of KeyRange are non-decreasing.
  int i_begin = s.q_len, i_end = 0;
  for (int i = 0; i < s.q_len; ++i) {
    int lo, hi;
    KeyRange(p, s, i, &lo, &hi);
    if (std::max(lo, n0) < std::min(hi, n0 + cols)) {
      i_begin = std::min(i_begin, i);
      i_end = i + 1;
    }
  }
  QBlock qb;
  const int group = p.num_heads / p.num_kv_heads;
  const size_t ld = size_t(kBlockM) * group;  // row stride of pt, dst: one key's pairs
  std::vector<float> pt(size_t(cols) * ld), dst(size_t(cols) * ld);
  std::vector<float> sc(ld * kBlockN), dp(ld * kBlockN);
  for (int m0 = i_begin; m0 < i_end; m0 += kBlockM) {
    qb.Load<T>(bp, b, kh, s, m0, std::min(kBlockM, i_end - m0));
    const int nq = qb.rows * group;
    std::fill(pt.begin(), pt.end(), 0.f);
    std::fill(dst.begin(), dst.end(), 0.f);
    ScoresAndDp(qb, kv, d, dv, sc.data(), dp.data());
    for (int i = 0; i < nq; ++i) {
      int c_lo, c_hi;
      kv.Cols(qb, i / group, &c_lo, &c_hi);
      if (c_lo >= c_hi || qb.grad[i].dead()) continue;
      const float* si = &sc[size_t(i) * kBlockN];
      const float* dpi = &dp[size_t(i) * kBlockN];
      for (int c = c_lo; c < c_hi; ++c)
        pt[c * ld + i] = qb.grad[i](si[c], dpi[c], &dst[c * ld + i]);
    }
    // dV += P^T dO, dK += dS^T (scale q): weights of pairs that do not see a key are zero.
    MultiplyRows(pt.data(), int(ld), cols, qb.dout.data(), dv, nq, dv, dvv.data(), dv);
    MultiplyRows(dst.data(), int(ld), cols, qb.q.data(), d, nq, d, dk.data(), d);
  }
  const Strides st(p);
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
  const int group = p.num_heads / p.num_kv_heads;
  const int d = p.head_dim, dv = p.head_dim_v;
  QBlock qb;
  qb.Load<T>(bp, b, kh, s, m0, rows);
  const int nq = rows * group;
  std::vector<float> dq(size_t(nq) * d, 0.f);
  int key_begin = s.k_len, key_end = 0;
  for (int r = 0; r < rows; ++r)
    if (qb.lo[r] < qb.hi[r]) {
      key_begin = std::min(key_begin, qb.lo[r]);
      key_end = std::max(key_end, qb.hi[r]);
    }

  KvBlock kv;
  std::vector<float> sc(size_t(nq) * kBlockN), dp(size_t(nq) * kBlockN);
  std::vector<float> ds(size_t(nq) * kBlockN);  // scale * dS, zero where a pair sees no key
  for (int n0 = key_begin; n0 < key_end; n0 += kBlockN) {
    kv.Load<T>(p, kh, s, n0, std::min(kBlockN, key_end - n0));
    ScoresAndDp(qb, kv, d, dv, sc.data(), dp.data());
    std::fill(ds.begin(), ds.end(), 0.f);
    for (int i = 0; i < nq; ++i) {
      int c_lo, c_hi;
      kv.Cols(qb, i / group, &c_lo, &c_hi);
      if (c_lo >= c_hi || qb.grad[i].dead()) continue;
      const size_t row = size_t(i) * kBlockN;
      for (int c = c_lo; c < c_hi; ++c) {
        qb.grad[i](sc[row + c], dp[row + c], &ds[row + c]);
        ds[row + c] *= p.softmax_scale;
      }
    }
    MultiplyRows(ds.data(), kBlockN, nq, kv.k.data(), d, kv.cols, d, dq.data(), d);
  }

  const Strides st(p);
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

ffi::Error AttentionBwdImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                            AttentionAttrs attrs) {
  AttentionBwdParams bp;
  if (auto err = MakeAttentionBwdParams(args, rets, attrs, &bp); err.failure()) return err;
  // lse's layout holds num_heads * total_q rows, dense or varlen.
  std::vector<float> softmax_d(size_t(bp.fwd.num_heads) * size_t(bp.fwd.total_q), 0.f);
  bp.softmax_d = softmax_d.data();
  DispatchFloat(bp.fwd.q_type,
                [&](auto tag) { RunAttentionBwd<typename decltype(tag)::type>(pool, bp); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSglAttentionBwdCpu, jax_sgl::cpu::AttentionBwdImpl,
                              jax_sgl::BindAttention(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
