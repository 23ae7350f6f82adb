// jax_sgl._metal_emu: runs the Metal kernels on the CPU grid emulator for tests (never a backend).
// The functions take numpy arrays (2-byte floats viewed as uint16, since numpy has no bfloat16),
// fill the same host params the macOS glue fills, plan the dispatch with metal/host/plan.h, and
// launch the kernels by name. Outputs are written in place into the arrays passed in.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffi/common/attention_params.h"
#include "ffi/common/rope_pool_params.h"
#include "metal/emulator/launch.h"
#include "metal/host/plan.h"

namespace nb = nanobind;

namespace jax_sgl::metal_emu {
namespace {

using Array = nb::ndarray<nb::c_contig, nb::device::cpu>;

int ElementBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

void* Data(Array& a) { return a.data(); }

void Check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("jax_sgl._metal_emu: " + what);
}

void Run(const char* name, const metal::Grid& g, void* const* buffers, const void* params) {
  Check(name != nullptr, "no Metal kernel for this dtype");
  Launch(name, g.groups, g.threads, buffers, params);
}

// Operands as jax_sgl.rope_pool_fused's FFI call gets them: an empty v_pool means k_pool is a fused
// kv_buffer [..., 2 * Hkv, Dp].
void RopePool(Array q, Array k, Array v, Array positions, Array slots, Array inv_freq,
              Array q_rot, Array k_rot, Array k_pool, Array v_pool, int dtype, int rotary_dim,
              bool is_neox) {
  RopePoolParams p{};
  p.dtype = static_cast<DType>(dtype);
  const int bytes = ElementBytes(p.dtype);
  for (Array* a : {&q, &k, &v, &q_rot, &k_rot})
    Check(a->ndim() == 3 && int(a->itemsize()) == bytes, "q/k/v: 3-D arrays of the dtype");
  Check(positions.ndim() == 1 && slots.ndim() == 1 && positions.itemsize() == slots.itemsize() &&
            (positions.itemsize() == 4 || positions.itemsize() == 8),
        "positions/slots: 1-D int32 or int64");
  p.num_tokens = int64_t(q.shape(0));
  p.num_qo_heads = int(q.shape(1));
  p.head_dim = int(q.shape(2));
  p.num_kv_heads = int(k.shape(1));
  Check(q_rot.size() == q.size() && k_rot.size() == k.size() && v.size() == k.size() &&
            int64_t(positions.shape(0)) == p.num_tokens && int64_t(slots.shape(0)) == p.num_tokens &&
            int64_t(k.shape(0)) == p.num_tokens,
        "inconsistent shapes");
  Check(rotary_dim > 0 && rotary_dim <= p.head_dim && rotary_dim % 2 == 0, "rotary_dim");
  Check(inv_freq.ndim() == 1 && inv_freq.itemsize() == 4 &&
            int(inv_freq.shape(0)) == rotary_dim / 2,
        "inv_freq: float32 [rotary_dim / 2]");
  p.rotary_dim = rotary_dim;
  p.is_neox = is_neox;
  p.inv_freq = static_cast<const float*>(Data(inv_freq));
  p.index_type = positions.itemsize() == 4 ? IndexType::kI32 : IndexType::kI64;
  const bool fused = v_pool.size() == 0;
  Check(int(k_pool.itemsize()) == bytes && k_pool.ndim() >= 3, "pools: arrays of the dtype");
  if (fused) {
    const int64_t d_pad = int64_t(k_pool.shape(k_pool.ndim() - 1));
    Check(d_pad >= p.head_dim && int64_t(k_pool.size()) % (2 * p.num_kv_heads * d_pad) == 0,
          "kv_buffer: [..., 2 * Hkv, Dp] with Dp >= head_dim");
    SetFusedPool(&p, Data(k_pool), int64_t(k_pool.size()), d_pad, bytes);
  } else {
    Check(k_pool.ndim() == 3 && v_pool.size() == k_pool.size() &&
              int(k_pool.shape(1)) == p.num_kv_heads && int(k_pool.shape(2)) == p.head_dim,
          "k_pool/v_pool: [num_slots, Hkv, D]");
    SetSeparatePools(&p, Data(k_pool), Data(v_pool), int64_t(k_pool.shape(0)));
  }

  static float dummy = 0.f;
  void* buffers[kRopeParams] = {};
  buffers[kRopeQ] = Data(q);
  buffers[kRopeK] = Data(k);
  buffers[kRopeV] = Data(v);
  buffers[kRopePositions] = Data(positions);
  buffers[kRopeSlots] = Data(slots);
  buffers[kRopeQRot] = Data(q_rot);
  buffers[kRopeKRot] = Data(k_rot);
  buffers[kRopeKPool] = p.k_pool;
  buffers[kRopeVPool] = fused ? &dummy : p.v_pool;  // as the macOS handler binds them
  buffers[kRopeInvFreq] = Data(inv_freq);
  const MetalRopePoolParams mp = metal::ToMetalParams(p, fused);
  if (p.num_tokens == 0) return;
  nb::gil_scoped_release release;
  Run(metal::RopePoolKernelName(p.dtype, p.index_type), metal::RopePoolGrid(p), buffers, &mp);
}

// Operands as jax_sgl.attention's FFI call gets them (absent index arrays are empty int32, absent
// sinks empty float32); with kv_buffer, k and v are both the fused buffer [P, page, 2 * Hkv,
// head_dim_pad].
void Attention(Array q, Array k, Array v, Array out, Array lse, Array cu_seqlens_q,
               Array cu_seqlens_k, Array seqused_k, Array page_table, Array sinks, int dtype,
               int kv_layout,
               bool varlen_q, int batch, int max_seqlen_q, float softmax_scale, float softcap,
               bool causal, int window_left, int window_right, bool kv_buffer) {
  AttentionParams p{};
  p.q_type = p.k_type = p.v_type = p.out_type = static_cast<DType>(dtype);
  const int bytes = ElementBytes(p.q_type);
  for (Array* a : {&q, &k, &v, &out})
    Check(int(a->itemsize()) == bytes, "q/k/v/out must have the dtype's element size");
  for (Array* a : {&cu_seqlens_q, &cu_seqlens_k, &seqused_k, &page_table})
    Check(a->size() == 0 || a->itemsize() == 4, "index arrays must be int32");
  const size_t q_rank = varlen_q ? 3 : 4;
  p.kv_layout = static_cast<KvLayout>(kv_layout);
  const size_t kv_rank = p.kv_layout == KvLayout::kVarlen ? 3 : 4;
  Check(q.ndim() == q_rank && k.ndim() == kv_rank && v.ndim() == kv_rank, "ranks");
  p.batch = batch;
  p.num_heads = int(q.shape(q_rank - 2));
  p.head_dim = int(q.shape(q_rank - 1));
  p.num_kv_heads = int(k.shape(kv_rank - 2));
  p.head_dim_v = int(v.shape(kv_rank - 1));
  p.k = Data(k);
  p.v = Data(v);
  SetContiguousKvStrides(&p);
  if (kv_buffer) {
    Check(p.kv_layout == KvLayout::kPaged && Data(k) == Data(v) && k.shape(2) % 2 == 0 &&
              int64_t(k.shape(3)) >= p.head_dim,
          "kv_buffer: one paged buffer [P, page, 2 * Hkv, head_dim_pad] bound as k and v");
    SetFusedKvBuffer(&p, int64_t(k.shape(2)), int64_t(k.shape(3)), size_t(bytes));
  }
  p.total_q = varlen_q ? int64_t(q.shape(0)) : int64_t(q.shape(0) * q.shape(1));
  p.seqlen_q = varlen_q ? max_seqlen_q : int(q.shape(1));
  Check(out.size() == size_t(p.total_q) * p.num_heads * p.head_dim_v, "out size");
  Check(lse.size() == size_t(p.total_q) * p.num_heads && lse.itemsize() == 4, "lse size");
  p.cu_seqlens_q = varlen_q ? static_cast<const int32_t*>(Data(cu_seqlens_q)) : nullptr;
  Check(!varlen_q || int(cu_seqlens_q.size()) == batch + 1, "cu_seqlens_q size");
  switch (p.kv_layout) {
    case KvLayout::kDense:
      Check(int(k.shape(0)) == batch, "dense k batch");
      p.seqlen_k = int(k.shape(1));
      p.total_k = int64_t(k.shape(0) * k.shape(1));
      break;
    case KvLayout::kVarlen:
      Check(int(cu_seqlens_k.size()) == batch + 1, "cu_seqlens_k size");
      p.cu_seqlens_k = static_cast<const int32_t*>(Data(cu_seqlens_k));
      p.total_k = int64_t(k.shape(0));
      break;
    case KvLayout::kPaged:
      Check(page_table.ndim() == 2 && int(page_table.shape(0)) == batch, "page_table shape");
      p.page_table = static_cast<const int32_t*>(Data(page_table));
      p.num_pages = int(k.shape(0));
      p.page_size = int(k.shape(1));
      p.max_pages = int(page_table.shape(1));
      p.total_k = int64_t(k.shape(0) * k.shape(1));
      break;
  }
  Check(kv_buffer || k.size() / p.head_dim == v.size() / p.head_dim_v, "k/v rows");
  p.seqused_k = seqused_k.size() > 0 ? static_cast<const int32_t*>(Data(seqused_k)) : nullptr;
  Check(!p.seqused_k || int(seqused_k.size()) == batch, "seqused_k size");
  p.sinks = sinks.size() > 0 ? static_cast<const float*>(Data(sinks)) : nullptr;
  Check(!p.sinks || (int(sinks.size()) == p.num_heads && sinks.itemsize() == 4), "sinks size");
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = causal ? 0 : window_right;
  if (const char* why = metal::AttentionUnsupported(p))
    throw std::invalid_argument(std::string("the Metal kernels do not support this call: ") + why);

  // Metal needs a buffer at every index: absent index arrays get a dummy (flagged off in params).
  static int32_t dummy = 0;
  auto index_or_dummy = [&](Array& a) -> void* { return a.size() > 0 ? Data(a) : &dummy; };
  static float dummy_sinks = 0.f;
  void* buffers[kAttnParams] = {};
  buffers[kAttnQ] = Data(q);
  buffers[kAttnK] = Data(k);
  buffers[kAttnV] = Data(v);
  buffers[kAttnOut] = Data(out);
  buffers[kAttnLse] = Data(lse);
  buffers[kAttnCuSeqlensQ] = index_or_dummy(cu_seqlens_q);
  buffers[kAttnCuSeqlensK] = index_or_dummy(cu_seqlens_k);
  buffers[kAttnSequsedK] = index_or_dummy(seqused_k);
  buffers[kAttnPageTable] = index_or_dummy(page_table);
  buffers[kAttnSinks] = p.sinks ? Data(sinks) : &dummy_sinks;
  const MetalAttentionParams mp = metal::ToMetalParams(p, Data(v));
  nb::gil_scoped_release release;
  if (p.cu_seqlens_q && p.total_q > 0)
    Run(metal::AttentionClearKernelName(p.out_type), metal::AttentionClearGrid(p), buffers, &mp);
  if (p.batch > 0 && p.num_heads > 0)
    Run(metal::AttentionFwdKernelName(p.q_type), metal::AttentionFwdGrid(p), buffers, &mp);
}

// Runs an emulator self-test kernel (emu_selftest_*) on one threadgroup, writing into out.
void Selftest(const std::string& name, nb::ndarray<float, nb::c_contig, nb::device::cpu> out,
              uint32_t threads) {
  Check(name.rfind("emu_selftest_", 0) == 0, "not a self-test kernel");
  Check(out.size() >= 3 * size_t(threads), "out too small");
  void* buffers[1] = {out.data()};
  const uint32_t groups[3] = {1, 1, 1};
  nb::gil_scoped_release release;
  Launch(name, groups, threads, buffers, nullptr);
}

}  // namespace
}  // namespace jax_sgl::metal_emu

NB_MODULE(_metal_emu, m) {
  using namespace jax_sgl::metal_emu;
  m.doc() = "Metal kernels of jax_sgl run on a CPU grid emulator (test infrastructure).";
  m.def("kernel_names", &KernelNames);
  m.def("selftest", &Selftest, nb::arg("name"), nb::arg("out"), nb::arg("threads"));
  m.def("rope_pool", &RopePool, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("positions"),
        nb::arg("slots"), nb::arg("inv_freq"), nb::arg("q_rot"), nb::arg("k_rot"),
        nb::arg("k_pool"), nb::arg("v_pool"), nb::arg("dtype"), nb::arg("rotary_dim"),
        nb::arg("is_neox"));
  m.def("attention", &Attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("seqused_k"),
        nb::arg("page_table"), nb::arg("sinks"), nb::arg("dtype"), nb::arg("kv_layout"), nb::arg("varlen_q"),
        nb::arg("batch"), nb::arg("max_seqlen_q"), nb::arg("softmax_scale"), nb::arg("softcap"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("kv_buffer") = false);
}
