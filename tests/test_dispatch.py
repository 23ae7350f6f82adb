"""The CUDA dispatch under a mocked compute capability, on any machine with the CUDA build.

Each call is lowered for CUDA and planned by the handlers' own code (jax_sgl/_plan.py) for a
made-up device, so the kernel choice of docs/kernels.md is checked for GPUs this machine does not
have (and without one at all). Expectations for the Hopper kernels depend on what the build holds
(CI trims them to hd128 bf16), so they read attention_backend_info().
"""

import jax
import jax.numpy as jnp
import pytest

import jax_sgl
from jax_sgl import _disable, _primitive, _registration

pytestmark = pytest.mark.skipif(not jax_sgl.CUDA_TARGETS,
                                reason="the dispatch is compiled with the CUDA build only")

if jax_sgl.CUDA_TARGETS:
  from jax_sgl._plan import cuda_attention_kernels

HOPPER = (9, 0)
BLACKWELL = (10, 0)
AMPERE = (8, 0)
ADA = (8, 9)
BF16 = jnp.bfloat16


def _sds(shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _built(family: str, head_dim: int, dtype=BF16) -> bool:
  k = jax_sgl.attention_backend_info()["kernels"].get(family, {})
  return head_dim in k.get("head_dims", []) and jnp.dtype(dtype).name in k.get("dtypes", [])


def _fwd(cc, *args, **kwargs):
  kernels = cuda_attention_kernels(lambda *a: jax_sgl.attention(*a, **kwargs), *args,
                                   compute_capability=cc)
  assert [d for d, _ in kernels] == ["fwd"], kernels
  return kernels[0][1]


def _cuda_call(fn, target, *args):
  """The line of the first `target` custom call in fn(*args) lowered for CUDA (its operand
  types: what a zero-padded call passes)."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return next(l for l in text.splitlines() if f"@{target}" in l)


def _dense(b=2, sq=1024, sk=1024, h=16, hkv=4, d=128, dtype=BF16):
  return _sds((b, sq, h, d), dtype), _sds((b, sk, hkv, d), dtype), _sds((b, sk, hkv, d), dtype)


def _paged(b=4, sq=1, h=32, hkv=8, d=128, page=16, pages=64, max_pages=16):
  q = _sds((b, sq, h, d))
  pool = _sds((pages, page, hkv, d)) if page > 1 else _sds((pages, hkv, d))
  return q, pool, pool, _sds((b, max_pages), jnp.int32), _sds((b,), jnp.int32)


def _paged_fwd(cc, q, k, v, page_table, seqused_k, **kwargs):
  f = lambda q, k, v, pt, su: jax_sgl.attention(q, k, v, page_table=pt, seqused_k=su, **kwargs)
  kernels = cuda_attention_kernels(f, q, k, v, page_table, seqused_k, compute_capability=cc)
  assert [d for d, _ in kernels] == ["fwd"], kernels
  return kernels[0][1]


@pytest.mark.parametrize("causal", [False, True])
def test_dense_prefill_runs_sm90_on_hopper_only(causal):
  if not _built("sm90_fwd", 128):
    pytest.skip("this build has no sm90 hd128 bf16 forward")
  assert _fwd(HOPPER, *_dense(), causal=causal) == "sm90"
  for cc in (AMPERE, ADA, (9, 1)):  # sm_90a code runs on exactly 9.0
    assert _fwd(cc, *_dense(), causal=causal) == "portable"


def test_disable_switch_routes_hopper_calls_to_the_portable_kernel(monkeypatch):
  monkeypatch.setenv(_disable.ENV, "sm90")
  assert _fwd(HOPPER, *_dense(), causal=True) == "portable"


def test_head_dims_without_a_hopper_kernel_run_portable():
  # 96 and 192 have no sm90 instantiation (docs/kernels.md); d != d_v neither. A build trimmed
  # of their portable kernels (JAX_SGL_ATTN_HEAD_DIMS) says so instead of running anything.
  portable = jax_sgl.attention_backend_info()["kernels"]["portable"]["head_dims"]
  for d in (96, 192):
    kernel = _fwd(HOPPER, *_dense(d=d), causal=True)
    if d in portable:
      assert kernel == "portable"
    else:
      assert kernel.startswith("none:") and "left out" in kernel, kernel
  q, k, _ = _dense()
  assert _fwd(HOPPER, q, k, _sds(k.shape[:-1] + (64,)), causal=True) == "portable"


def test_varlen_prefill():
  if not _built("sm90_fwd", 128):
    pytest.skip("this build has no sm90 hd128 bf16 forward")
  q, k = _sds((3000, 16, 128)), _sds((5000, 4, 128))
  cu = _sds((4,), jnp.int32)
  f = lambda q, k, v, cq, ck: jax_sgl.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                causal=True)
  assert cuda_attention_kernels(f, q, k, k, cu, cu, compute_capability=HOPPER) == [
      ("fwd", "sm90")]
  assert cuda_attention_kernels(f, q, k, k, cu, cu, compute_capability=AMPERE) == [
      ("fwd", "portable")]


@pytest.mark.parametrize("page", [16, 64])
def test_paged_decode_takes_the_tma_form_on_hopper(page):
  args = _paged(page=page)
  assert _paged_fwd(HOPPER, *args, causal=True) == "decode_warp_tma"
  assert _paged_fwd(AMPERE, *args, causal=True) == "decode_warp_cp_async"


@pytest.mark.parametrize("page", [1, 5])
def test_paged_decode_on_pages_no_tma_stage_fits_uses_cp_async(page):
  assert _paged_fwd(HOPPER, *_paged(page=page), causal=True) == "decode_warp_cp_async"


def test_decode_over_a_huge_pool_uses_64_bit_rows():
  # 2^31 rows or more: the warp forms' 32-bit slot indices would wrap, so the block kernel's
  # 64-bit rows take it (the pool is only a shape here); one row fewer stays on the warp form.
  q, _, _, pt, su = _paged(page=16)
  pool = _sds((1 << 27, 16, 8, 128))
  assert _paged_fwd(HOPPER, q, pool, pool, pt, su, causal=True) == "decode_block"
  assert _paged_fwd(AMPERE, q, pool, pool, pt, su, causal=True) == "decode_block"
  pool = _sds(((1 << 31) - 1, 1, 8, 128))
  assert _paged_fwd(AMPERE, q, pool, pool, pt, su, causal=True) == "decode_warp_cp_async"


def test_many_packed_decode_rows_take_the_block_kernel():
  # 8 q rows x a group of 4 = 32 packed rows: past the warp-sliced kernels' 16.
  q, k, v, pt, su = _paged(sq=8, h=32, hkv=8, page=16)
  assert _paged_fwd(AMPERE, q, k, v, pt, su, causal=True) == "decode_block"


def test_verify_with_8_drafts_runs_sm90_on_hopper():
  # 8 drafts x a group of 4 = 32 packed rows over a long paged history (4096 keys): the sm90
  # kernel with the key split instead of the block-wide decode kernel (Sm90KeySplits,
  # docs/kernels.md); off Hopper, or with sm90 switched off, the block-wide kernel as before.
  if not _built("sm90_fwd", 128):
    pytest.skip("this build has no sm90 hd128 bf16 forward")
  long = dict(sq=8, page=16, pages=4096, max_pages=256)
  for page, max_pages in ((1, 4096), (16, 256), (64, 64)):  # the gather and the TMA boxes
    assert _paged_fwd(HOPPER, *_paged(sq=8, page=page, pages=8192, max_pages=max_pages),
                      causal=True) == "sm90"
  assert _paged_fwd(HOPPER, *_paged(**long, h=64, hkv=8), causal=False) == "sm90"
  assert _paged_fwd(AMPERE, *_paged(**long), causal=True) == "decode_block"
  # A shorter history (at most 4096 keys in the page table) stays on the decode kernel.
  assert _paged_fwd(HOPPER, *_paged(sq=8, page=16, pages=4096, max_pages=255),
                    causal=True) == "decode_block"
  # Fewer than 32 packed rows (a group of 3: 24), or fewer than 8 q rows per sequence, too.
  assert _paged_fwd(HOPPER, *_paged(**long, h=24, hkv=8), causal=True) == "decode_block"
  assert _paged_fwd(HOPPER, *_paged(**{**long, "sq": 5}, h=64, hkv=8),
                    causal=True) == "decode_block"
  # 9-15 q rows of a group of 4 (36-60 packed rows) ran on the portable kernel: now sm90.
  assert _paged_fwd(HOPPER, *_paged(**{**long, "sq": 12}), causal=True) == "sm90"
  assert _paged_fwd(AMPERE, *_paged(**{**long, "sq": 12}), causal=True) == "portable"
  # Without GQA, 8-16 q rows are 8-16 tile rows: the decode / portable kernels keep them.
  assert _paged_fwd(HOPPER, *_paged(**{**long, "sq": 12}, h=8, hkv=8),
                    causal=True) == "portable"


def test_verify_disable_switch_keeps_the_decode_kernel(monkeypatch):
  monkeypatch.setenv(_disable.ENV, "sm90")
  assert _paged_fwd(HOPPER, *_paged(sq=8, page=16, pages=4096, max_pages=256),
                    causal=True) == "decode_block"


def test_paged_prefill_and_verify_run_sm90_on_hopper():
  if not _built("sm90_fwd", 128):
    pytest.skip("this build has no sm90 hd128 bf16 forward")
  for page in (1, 5, 16, 64):  # TMA boxes, or the gather when no box fits the page
    assert _paged_fwd(HOPPER, *_paged(sq=1024, page=page, pages=4096, max_pages=256),
                      causal=True) == "sm90"
  # Speculative verify: 32 drafts x a group of 4 fill 128 packed tile rows.
  assert _paged_fwd(HOPPER, *_paged(sq=32, page=16, pages=4096, max_pages=256),
                    causal=True) == "sm90"
  assert _paged_fwd(AMPERE, *_paged(sq=1024, page=16, pages=4096, max_pages=256),
                    causal=True) == "portable"


def test_kv_buffer_plans_like_a_page_pool():
  if not _built("sm90_fwd", 128):
    pytest.skip("this build has no sm90 hd128 bf16 forward")
  q = _sds((4, 1024, 32, 128))
  buf = _sds((4096, 16, 16, 128))  # [pages, page, 2 * Hkv, head_dim_pad]
  pt, su = _sds((4, 256), jnp.int32), _sds((4,), jnp.int32)
  f = lambda q, b, pt, su: jax_sgl.attention(q, kv_buffer=b, page_table=pt, seqused_k=su,
                                             causal=True)
  assert cuda_attention_kernels(f, q, buf, pt, su, compute_capability=HOPPER) == [("fwd", "sm90")]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e5m2])
def test_dtypes_without_a_cuda_kernel_raise_at_trace_time(dtype):
  q, k, v = _dense(dtype=dtype)
  kwargs = {}
  if dtype == jnp.float8_e5m2:
    descale = _sds((2, 4), jnp.float32)
    f = lambda q, k, v, qd, kd, vd: jax_sgl.attention(q, k, v, q_descale=qd, k_descale=kd,
                                                      v_descale=vd)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn only"):
      cuda_attention_kernels(f, q, k, v, descale, descale, descale, compute_capability=HOPPER)
    return
  with pytest.raises(NotImplementedError, match="CPU"):
    _fwd(HOPPER, q, k, v, **kwargs)


def _grad_kernels(cc, q, k, v, **kwargs):
  loss = lambda q, k, v: jax_sgl.attention(q, k, v, **kwargs).astype(jnp.float32).sum()
  return cuda_attention_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v,
                                compute_capability=cc)


@pytest.mark.parametrize("deterministic,kernel", [(False, "sm90_bwd"),
                                                  (True, "sm90_bwd_dq_kernel")])
def test_dense_backward_runs_sm90_on_hopper(deterministic, kernel):
  if not _built("sm90_bwd", 128):
    pytest.skip("this build has no sm90 hd128 bf16 backward")
  args = _dense()
  assert _grad_kernels(HOPPER, *args, causal=True, deterministic=deterministic) == [
      ("fwd", "sm90"), ("bwd", kernel)]
  assert _grad_kernels(AMPERE, *args, causal=True, deterministic=deterministic) == [
      ("fwd", "portable"), ("bwd", "portable_bwd")]


def test_backward_disable_switch(monkeypatch):
  monkeypatch.setenv(_disable.ENV, "sm90_bwd")
  kernels = _grad_kernels(HOPPER, *_dense(), causal=True)
  assert kernels[1] == ("bwd", "portable_bwd")


@pytest.mark.parametrize("cc", [HOPPER, BLACKWELL])
def test_varlen_backward_up_to_128_runs_the_sm90_kernel_on_hopper(cc):
  """Varlen at hd <= 128: config.h's kernel's varlen instantiation on Hopper (deterministic=True:
  then the dQ kernel's), the sm80 backward elsewhere."""
  sm90 = cc == HOPPER and _built("sm90_bwd", 128)
  assert _varlen_grad_kernels(cc, 128, causal=True)[-1] == (
      "bwd", "sm90_bwd" if sm90 else "portable_bwd")
  assert _varlen_grad_kernels(cc, 128, causal=True, deterministic=True)[-1] == (
      "bwd", "sm90_bwd_dq_kernel" if sm90 else "portable_bwd")


def test_head_dims_above_128_lower_to_the_reference_without_a_local_hopper(monkeypatch):
  """The lowering cannot see the GPU a program runs on: above 128 (Hopper-only backward) it takes
  the native call only when this process's CUDA devices are all Hopper; here none are."""
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: False)
  monkeypatch.setattr(_primitive, "_warned", set())  # the warning is once per process
  with pytest.warns(RuntimeWarning, match="reference"):
    kernels = _grad_kernels(HOPPER, *_dense(d=256), causal=True)
  assert [d for d, _ in kernels] == ["fwd"], kernels


@pytest.mark.parametrize("deterministic,want", [(False, "sm90_bwd"), (True, "sm90_bwd_dq_kernel")])
@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_backward_runs_sm90_on_hopper_only(monkeypatch, head_dim, deterministic, want):
  """deterministic=True: the wide dK/dV kernel, then the atomic-free dQ kernel."""
  if not _built("sm90_bwd", head_dim):
    pytest.skip(f"this build has no sm90 hd{head_dim} bf16 backward")
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  args = _dense(sq=1000, sk=777, h=12, hkv=4, d=head_dim)
  for kw in ({"causal": True}, {"window": (100, 0)}, {"softcap": 30.0}, {}):
    assert _grad_kernels(HOPPER, *args, deterministic=deterministic, **kw)[-1] == ("bwd", want), kw
  # Off Hopper the dispatch has no backward for it: the Python gate must not emit the call there.
  kind, kernel = _grad_kernels(AMPERE, *args, causal=True)[-1]
  assert kind == "bwd" and kernel.startswith("none") and "Hopper" in kernel, kernel
  kind, kernel = _grad_kernels(BLACKWELL, *args, causal=True)[-1]
  assert kind == "bwd" and kernel.startswith("none"), kernel


@pytest.mark.parametrize("head_dim,head_dim_v,padded",
                         [(160, 160, 192), (192, 128, 192), (224, 224, 256), (256, 128, 256),
                          (136, 200, 256)])
def test_other_wide_head_dims_run_the_sm90_backward_zero_padded(monkeypatch, head_dim,
                                                                 head_dim_v, padded):
  """Above 128, head dims the wide kernel does not serve as they are (between 192 and 256, or
  head_dim != head_dim_v: MLA's 192 / 128) run it zero-padded to its next head dim: the native
  backward call takes q / k / v / out / dout at `padded` features, no reference fallback."""
  if not _built("sm90_bwd", padded):
    pytest.skip(f"this build has no sm90 hd{padded} bf16 backward")
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  q, k, v = _dense(sq=300, sk=500, h=8, hkv=2, d=head_dim)
  v = _sds(v.shape[:-1] + (head_dim_v,))
  for kw in ({"causal": True}, {"deterministic": True}):
    want = "sm90_bwd_dq_kernel" if kw.get("deterministic") else "sm90_bwd"
    assert _grad_kernels(HOPPER, q, k, v, **kw)[-1] == ("bwd", want), kw
  loss = lambda q, k, v: jax_sgl.attention(q, k, v, causal=True).astype(jnp.float32).sum()
  call = _cuda_call(jax.grad(loss, argnums=(0, 1, 2)), "jax_sgl_attention_bwd", q, k, v)
  assert f"tensor<2x300x8x{padded}xbf16>" in call and f"tensor<2x500x2x{padded}xbf16>" in call, call


@pytest.mark.parametrize("head_dim,head_dim_v,padded", [(192, 128, 256), (160, 160, 256),
                                                      (80, 48, 128), (224, 224, 256)])
def test_forward_runs_sm90_zero_padded_where_it_serves_only_that(monkeypatch, head_dim,
                                                                 head_dim_v, padded):
  """A dense or varlen prefill at head dims the sm90 forward lacks (MLA's 192 / 128, 160, ...)
  runs it zero-padded to its next head dim on a Hopper process, not the portable kernel; decode
  calls keep the decode kernel, and without a local Hopper the call is lowered as it is."""
  if not _built("sm90_fwd", padded):
    pytest.skip(f"this build has no sm90 hd{padded} bf16 forward")
  q, k, v = _dense(sq=1000, sk=1200, h=8, hkv=2, d=head_dim)
  v = _sds(v.shape[:-1] + (head_dim_v,))
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: False)
  assert _fwd(HOPPER, q, k, v, causal=True) == "portable"
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  assert _fwd(HOPPER, q, k, v, causal=True) == "sm90"
  call = _cuda_call(lambda q, k, v: jax_sgl.attention(q, k, v, causal=True),
                    "jax_sgl_attention_fwd", q, k, v)
  assert f"tensor<2x1000x8x{padded}xbf16>" in call and f"tensor<2x1200x2x{padded}xbf16>" in call
  one = _sds((2, 1, 8, head_dim))
  assert _fwd(HOPPER, one, k, v) != "sm90"   # decode: no padding
  q, k = _sds((3000, 8, head_dim)), _sds((5000, 2, head_dim))
  v, cu = _sds((5000, 2, head_dim_v)), _sds((4,), jnp.int32)
  varlen = lambda q, k, v, cq, ck: jax_sgl.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                     causal=True)
  assert cuda_attention_kernels(varlen, q, k, v, cu, cu, compute_capability=HOPPER) == [
      ("fwd", "sm90")]


def test_wide_backward_without_its_head_dims_built_lowers_to_the_reference(monkeypatch):
  """No built head dim of the wide kernel to pad to: the reference backward, with a warning."""
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  monkeypatch.setattr(_registration, "sm90_bwd_built", lambda d, dtype: False)
  monkeypatch.setattr(_primitive, "_warned", set())
  q, k, v = _dense(d=256)
  with pytest.warns(RuntimeWarning, match="reference"):
    kernels = _grad_kernels(HOPPER, q, k, _sds(v.shape[:-1] + (128,)), causal=True)
  assert [d for d, _ in kernels] == ["fwd"], kernels


@pytest.mark.parametrize("deterministic,kernel", [(False, "sm90_bwd"),
                                                  (True, "sm90_bwd_dq_kernel")])
def test_hd96_backward_runs_sm90_on_hopper(deterministic, kernel):
  """hd96: config.h's kernel (64- / 32-byte swizzle atoms) on Hopper, dense and varlen, as at
  64 / 128."""
  if not _built("sm90_bwd", 96):
    pytest.skip("this build has no sm90 hd96 bf16 backward")
  args = _dense(d=96)
  assert _grad_kernels(HOPPER, *args, causal=True, deterministic=deterministic)[-1] == (
      "bwd", kernel)
  assert _grad_kernels(AMPERE, *args, causal=True, deterministic=deterministic)[-1] == (
      "bwd", "portable_bwd")
  assert _varlen_grad_kernels(HOPPER, 96, causal=True)[-1] == ("bwd", "sm90_bwd")


def _varlen_grad_kernels(cc, d, **kwargs):
  """The kernels of jax.grad of a ragged batch of 3 (packed q and k / v)."""
  q, k, cu = _sds((3000, 12, d)), _sds((5000, 4, d)), _sds((4,), jnp.int32)
  loss = lambda q, k, v, cq, ck: jax_sgl.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                   **kwargs).astype(jnp.float32).sum()
  return cuda_attention_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, cu, cu,
                                compute_capability=cc)


@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_varlen_backward_runs_sm90_on_hopper(monkeypatch, head_dim):
  """Above 128 varlen runs on the wide kernel's varlen instantiation."""
  if not _built("sm90_bwd", head_dim):
    pytest.skip(f"this build has no sm90 hd{head_dim} bf16 backward")
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  for kw in ({"causal": True}, {"window": (100, 0)}, {"softcap": 30.0}, {}):
    assert _varlen_grad_kernels(HOPPER, head_dim, **kw)[-1] == ("bwd", "sm90_bwd"), kw
  assert _varlen_grad_kernels(HOPPER, head_dim, causal=True, deterministic=True)[-1] == (
      "bwd", "sm90_bwd_dq_kernel")
  kind, kernel = _varlen_grad_kernels(AMPERE, head_dim, causal=True)[-1]
  assert kind == "bwd" and kernel.startswith("none") and "Hopper" in kernel, kernel


def test_wide_backward_disable_switch(monkeypatch):
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  monkeypatch.setattr(_primitive, "_warned", set())
  monkeypatch.setenv(_disable.ENV, "sm90_bwd")
  with pytest.warns(RuntimeWarning, match="reference"):
    kernels = _grad_kernels(HOPPER, *_dense(d=256), causal=True)
  assert [d for d, _ in kernels] == ["fwd"], kernels


# ---- Blackwell (compute capability 10.0): the sm100 forward (sm100/fwd/dispatch.cc says what it
# covers); what it leaves runs where it would on any other GPU.


def _need_sm100():
  if not _built("sm100_fwd", 128):
    pytest.skip("this build has no sm100 hd128 bf16 forward")


@pytest.mark.parametrize("causal", [False, True])
def test_dense_prefill_runs_sm100_on_blackwell_only(causal):
  _need_sm100()
  assert _fwd(BLACKWELL, *_dense(), causal=causal) == "sm100"
  # sm_100a code runs on exactly 10.0; a 10.3 device and Hopper take their own kernels.
  assert _fwd((10, 3), *_dense(), causal=causal) == "portable"
  assert _fwd(HOPPER, *_dense(), causal=causal) != "sm100"


def test_sm100_varlen_and_sinks():
  _need_sm100()
  q, k = _sds((3000, 16, 128)), _sds((5000, 4, 128))
  cu = _sds((4,), jnp.int32)
  for causal, kernel in ((False, "sm100"), (True, "portable")):  # varlen causal: rows may see no key
    f = lambda q, k, v, cq, ck, causal=causal: jax_sgl.attention(
        q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal)
    assert cuda_attention_kernels(f, q, k, k, cu, cu, compute_capability=BLACKWELL) == [
        ("fwd", kernel)]
  sinks = _sds((16,), jnp.float32)
  g = lambda q, k, v, s: jax_sgl.attention(q, k, v, sinks=s, causal=True)
  assert cuda_attention_kernels(g, *_dense(), sinks, compute_capability=BLACKWELL) == [
      ("fwd", "sm100")]


def test_calls_sm100_does_not_cover_run_portable_on_blackwell(monkeypatch):
  _need_sm100()
  assert _fwd(BLACKWELL, *_dense(), window=(256, 0), causal=True) == "portable"
  assert _fwd(BLACKWELL, *_dense(), softcap=30.0) == "portable"
  assert _fwd(BLACKWELL, *_dense(sq=2048, sk=1024), causal=True) == "portable"  # empty rows
  assert _fwd(BLACKWELL, *_dense(d=256)) != "sm100"  # portable, or "none" in a trimmed build
  assert _fwd(BLACKWELL, *_dense(sq=1)) == "decode_warp_tma"
  assert _paged_fwd(BLACKWELL, *_paged(sq=512), causal=True) == "portable"
  monkeypatch.setenv(_disable.ENV, "sm100")
  assert _fwd(BLACKWELL, *_dense(), causal=True) == "portable"

@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_backward_runs_sm100_on_blackwell_only(causal, head_dim):
  if not _built("sm100_bwd", head_dim):
    pytest.skip(f"this build has no sm100 hd{head_dim} bf16 backward")
  args = _dense(sq=1000, sk=777, h=12, hkv=4, d=head_dim)
  assert _grad_kernels(BLACKWELL, *args, causal=causal)[-1] == ("bwd", "sm100_bwd")
  # sm_100a code runs on 10.0 only: a 10.3 device and Hopper take their own kernels.
  assert _grad_kernels((10, 3), *args, causal=causal)[-1] == ("bwd", "portable_bwd")
  assert _grad_kernels(HOPPER, *args, causal=causal)[-1] != ("bwd", "sm100_bwd")


# What the Blackwell backward collective leaves to the portable backward (Sm100BwdUnsupported).
@pytest.mark.parametrize("kwargs", [{"window": (64, 0)}, {"softcap": 30.0, "causal": True},
                                    {"deterministic": True}],
                         ids=["window", "softcap", "deterministic"])
def test_sm100_backward_leaves_uncovered_calls_to_portable(kwargs):
  assert _grad_kernels(BLACKWELL, *_dense(), **kwargs)[-1] == ("bwd", "portable_bwd")


def test_sm100_backward_leaves_seqused_k_to_portable():
  q, k, v = _dense()
  su = _sds((2,), jnp.int32)
  loss = lambda q, k, v, su: jax_sgl.attention(q, k, v, seqused_k=su).astype(jnp.float32).sum()
  kernels = cuda_attention_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, su,
                                   compute_capability=BLACKWELL)
  assert kernels[-1] == ("bwd", "portable_bwd")


def test_sm100_backward_disable_switch(monkeypatch):
  monkeypatch.setenv(_disable.ENV, "sm100_bwd")
  assert _grad_kernels(BLACKWELL, *_dense(), causal=True)[-1] == ("bwd", "portable_bwd")


@pytest.mark.parametrize("page", [1, 16, 64])
def test_paged_decode_on_blackwell_keeps_the_decode_kernels(page):
  # CUTLASS's Blackwell generation kernel cannot hold 16-bit K/V in shared memory and writes no
  # LSE (docs/kernels.md): 10.0 decodes on the same kernels as Hopper.
  args = _paged(page=page)
  assert _paged_fwd(BLACKWELL, *args, causal=True) == _paged_fwd(HOPPER, *args, causal=True)


# --------------------------------------------------------------------------------------------
# jax_sgl's fp8 (e4m3) KV cache under bf16/fp16 q: the TMA decode form reads it (docs/kernels.md)
# --------------------------------------------------------------------------------------------

E4M3 = jnp.float8_e4m3fn


def _fp8_paged_fwd(cc, *, b=4, sq=1, h=32, hkv=8, d=128, page=16, q_dtype=BF16, dense=False,
                   **kwargs):
  q = _sds((b, sq, h, d), q_dtype)
  descale = _sds((hkv,), jnp.float32)
  if dense:
    kv = _sds((b, 256, hkv, d), E4M3)
    f = lambda q, k, v, kd, vd: jax_sgl.attention(q, k, v, k_descale=kd, v_descale=vd, **kwargs)
    kernels = cuda_attention_kernels(f, q, kv, kv, descale, descale, compute_capability=cc)
  else:
    pool = _sds((64, page, hkv, d), E4M3)
    f = lambda q, k, v, pt, su, kd, vd: jax_sgl.attention(
        q, k, v, page_table=pt, seqused_k=su, k_descale=kd, v_descale=vd, **kwargs)
    kernels = cuda_attention_kernels(f, q, pool, pool, _sds((b, 16), jnp.int32),
                                     _sds((b,), jnp.int32), descale, descale,
                                     compute_capability=cc)
  assert [k for k, _ in kernels] == ["fwd"], kernels
  return kernels[0][1]


@pytest.mark.parametrize("cc", [HOPPER, BLACKWELL])
@pytest.mark.parametrize("case", [
    dict(), dict(page=64), dict(q_dtype=jnp.float16), dict(sq=4, h=32, hkv=8, causal=True),
    dict(sq=2, h=64, hkv=8, causal=True), dict(h=8, hkv=8), dict(dense=True),
    dict(softcap=30.0, window=(128, 0), causal=True)])
def test_fp8_kv_decode_takes_the_tma_fp8kv_form(cc, case):
  portable = jax_sgl.attention_backend_info()["kernels"]["portable"]["head_dims"]
  if 128 not in portable:
    pytest.skip("this build left out the hd128 decode kernels")
  assert _fp8_paged_fwd(cc, **case) == "decode_warp_tma_fp8kv"


def test_fp8_kv_decode_at_hd64():
  if 64 not in jax_sgl.attention_backend_info()["kernels"]["portable"]["head_dims"]:
    pytest.skip("this build left out the hd64 decode kernels")
  assert _fp8_paged_fwd(HOPPER, d=64) == "decode_warp_tma_fp8kv"


@pytest.mark.parametrize("cc", [HOPPER, BLACKWELL, AMPERE])
@pytest.mark.parametrize("page", [1, 5])
def test_fp8_kv_decode_on_pages_no_tma_stage_fits_uses_cp_async(cc, page):
  if 128 not in jax_sgl.attention_backend_info()["kernels"]["portable"]["head_dims"]:
    pytest.skip("this build left out the hd128 decode kernels")
  assert _fp8_paged_fwd(cc, page=page) == "decode_warp_cp_async_fp8kv"


@pytest.mark.parametrize("cc", [AMPERE, ADA])
def test_fp8_kv_decode_before_hopper_uses_cp_async(cc):
  if 128 not in jax_sgl.attention_backend_info()["kernels"]["portable"]["head_dims"]:
    pytest.skip("this build left out the hd128 decode kernels")
  assert _fp8_paged_fwd(cc) == "decode_warp_cp_async_fp8kv"


def test_fp8_kv_decode_needs_ampere():
  # The trace-time check cannot see the device: the dispatch names what is missing.
  kernel = _fp8_paged_fwd((7, 5))
  assert kernel.startswith("none: ") and "compute capability 8.0" in kernel, kernel


def _fp8_built(d: int) -> bool:
  return d in jax_sgl.attention_backend_info()["kernels"]["portable_fp8"]["head_dims"]


@pytest.mark.parametrize("cc", [HOPPER, BLACKWELL, AMPERE, ADA])
@pytest.mark.parametrize("case", [
    dict(sq=16, causal=True),                 # chunked prefill over the pool
    dict(sq=32, causal=True),                 # a 32-row verify
    dict(sq=4, h=64, hkv=8, causal=True),     # 32 packed rows: past the warp decode's 16
    dict(sq=300, page=1, causal=True), dict(sq=300, page=5, causal=True),
    dict(sq=300, page=64, causal=True, window=(100, 0)), dict(sq=100, dense=True, softcap=30.0),
    dict(sq=100, q_dtype=jnp.float16, causal=True)])
def test_other_fp8_kv_call_shapes_take_the_portable_fp8_kernel(cc, case):
  if not _fp8_built(128):
    pytest.skip("this build left out the hd128 fp8 kernels")
  assert _fp8_paged_fwd(cc, **case) == "portable_fp8"


@pytest.mark.parametrize("d,cap", [(256, 256), (96, 128), (192, 256), (64, 64)])
def test_fp8_kv_head_dims_the_decode_leaves_take_the_portable_fp8_kernel(d, cap):
  if not _fp8_built(cap):
    pytest.skip(f"this build left out the hd{cap} fp8 kernels")
  # hd64 decodes on the fp8-KV decode; a 16-row prefill at 64 is the portable kernel's.
  assert _fp8_paged_fwd(HOPPER, d=d, sq=16 if d == 64 else 1, causal=True) == "portable_fp8"


def _fp8_qkv_fwd(cc, *, layout="dense", b=2, sq=128, h=16, hkv=4, d=128, page=16, **kwargs):
  """e4m3 q/k/v with q/k/v descales [B, Hkv]: dense, varlen or paged."""
  q = _sds((b, sq, h, d), E4M3)
  descale = _sds((b, hkv), jnp.float32)
  att = lambda q, k, v, qd, kd, vd, **kw: jax_sgl.attention(q, k, v, q_descale=qd, k_descale=kd,
                                                              v_descale=vd, **kw, **kwargs)
  if layout == "dense":
    kv = _sds((b, 256, hkv, d), E4M3)
    kernels = cuda_attention_kernels(att, q, kv, kv, descale, descale, descale,
                                     compute_capability=cc)
  elif layout == "varlen":
    qv, kv = _sds((b * sq, h, d), E4M3), _sds((b * 256, hkv, d), E4M3)
    cu = _sds((b + 1,), jnp.int32)
    f = lambda q, k, v, cq, ck, qd, kd, vd: att(q, k, v, qd, kd, vd, cu_seqlens_q=cq,
                                                cu_seqlens_k=ck)
    kernels = cuda_attention_kernels(f, qv, kv, kv, cu, cu, descale, descale, descale,
                                     compute_capability=cc)
  else:
    pool = _sds((64, page, hkv, d), E4M3) if page > 1 else _sds((64, hkv, d), E4M3)
    f = lambda q, k, v, pt, su, qd, kd, vd: att(q, k, v, qd, kd, vd, page_table=pt,
                                                seqused_k=su)
    kernels = cuda_attention_kernels(f, q, pool, pool, _sds((b, 16), jnp.int32),
                                     _sds((b,), jnp.int32), descale, descale, descale,
                                     compute_capability=cc)
  assert [k for k, _ in kernels] == ["fwd"], kernels
  return kernels[0][1]


@pytest.mark.parametrize("cc", [HOPPER, BLACKWELL, AMPERE, ADA])
@pytest.mark.parametrize("case", [
    dict(), dict(causal=True), dict(sq=1), dict(layout="varlen", causal=True),
    dict(layout="paged", page=1), dict(layout="paged", page=5, causal=True),
    dict(layout="paged", page=16, sq=1), dict(layout="paged", page=64, window=(64, 0)),
    dict(softcap=20.0, causal=True)])
def test_fp8_qkv_takes_sm90_on_hopper_else_portable_fp8(cc, case):
  """e4m3 q/k/v: no 16-bit kernel and not the fp8-KV decode (its q is 16-bit), whatever the
  rows; on Hopper the sm90 fp8 kernel takes its shapes first: dense, varlen and paged k/v (any
  page size), except paged calls below its tile rows (one q row, a GQA group of 4)."""
  if not _fp8_built(128):
    pytest.skip("this build left out the hd128 fp8 kernels")
  few_rows = case.get("layout") == "paged" and case.get("sq", 128) == 1
  sm90 = cc == HOPPER and not few_rows and _built("sm90_fwd", 128, E4M3)
  assert _fp8_qkv_fwd(cc, **case) == ("sm90" if sm90 else "portable_fp8")


@pytest.mark.parametrize("sq", [1, 128])
def test_v_dequant_takes_the_portable_fp8_kernel(sq):
  if not _fp8_built(128):
    pytest.skip("this build left out the hd128 fp8 kernels")
  q, k, _ = _dense(sq=sq)
  v, vd = _sds(k.shape, E4M3), _sds((2, 4), jnp.float32)
  f = lambda q, k, v, vd: jax_sgl.attention(q, k, v, v_descale=vd, causal=True)
  assert cuda_attention_kernels(f, q, k, v, vd, compute_capability=HOPPER) == [
      ("fwd", "portable_fp8")]


def test_fp8_needs_ampere():
  kernel = _fp8_qkv_fwd((7, 5))
  assert kernel.startswith("none: ") and "compute capability 8.0" in kernel, kernel


@pytest.mark.parametrize("page,want", [(16, "decode_warp_tma_fp8kv"),
                                       (5, "decode_warp_cp_async_fp8kv")])
def test_fp8_kv_buffer_decodes_like_a_page_pool(page, want):
  if 128 not in jax_sgl.attention_backend_info()["kernels"]["portable"]["head_dims"]:
    pytest.skip("this build left out the hd128 decode kernels")
  q = _sds((4, 1, 32, 128))
  buf = _sds((64, page, 16, 128), E4M3)  # [pages, page, 2 * Hkv, head_dim_pad]
  pt, su, descale = _sds((4, 16), jnp.int32), _sds((4,), jnp.int32), _sds((8,), jnp.float32)
  f = lambda q, b, pt, su, kd, vd: jax_sgl.attention(q, kv_buffer=b, page_table=pt, seqused_k=su,
                                                     k_descale=kd, v_descale=vd)
  assert cuda_attention_kernels(f, q, buf, pt, su, descale, descale,
                                compute_capability=HOPPER) == [("fwd", want)]


# The Hopper fp8 forward (sm90/fwd/fp8.cuh): e4m3 q/k/v with per-head descales, dense or varlen
# k/v, head dims 64 / 128 / 256. The Python gate emits the native call only when every local CUDA device
# is Hopper (mocked here); off Hopper, or for what it lacks, sm90 does not take the call (the
# portable kernel or the dispatch's reason does).
E4M3 = jnp.float8_e4m3fn


def _fp8_kernels(cc, q, k, v, *extra, **kwargs):
  d = _sds((q.shape[0] if len(extra) == 0 else extra[0].shape[0] - 1, k.shape[-2]), jnp.float32)
  if extra:  # varlen: cu_seqlens_q, cu_seqlens_k
    f = lambda q, k, v, cq, ck, qd, kd, vd: jax_sgl.attention(
        q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, q_descale=qd, k_descale=kd, v_descale=vd,
        **kwargs)
  else:
    f = lambda q, k, v, qd, kd, vd: jax_sgl.attention(q, k, v, q_descale=qd, k_descale=kd,
                                                      v_descale=vd, **kwargs)
  kernels = cuda_attention_kernels(f, q, k, v, *extra, d, d, d, compute_capability=cc)
  assert [x for x, _ in kernels] == ["fwd"], kernels
  return kernels[0][1]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window": (100, 0)},
                                    {"softcap": 30.0}], ids=["full", "causal", "window", "softcap"])
def test_fp8_prefill_runs_sm90_on_hopper_only(monkeypatch, head_dim, kwargs):
  if not _built("sm90_fwd", head_dim, E4M3):
    pytest.skip(f"this build has no sm90 hd{head_dim} e4m3 forward")
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  args = _dense(sq=1000, sk=777, h=12, hkv=4, d=head_dim, dtype=E4M3)
  assert _fp8_kernels(HOPPER, *args, **kwargs) == "sm90"
  for cc in (AMPERE, ADA, (9, 1), BLACKWELL):
    assert _fp8_kernels(cc, *args, **kwargs) != "sm90"


def test_fp8_varlen_runs_sm90_on_hopper(monkeypatch):
  if not _built("sm90_fwd", 128, E4M3):
    pytest.skip("this build has no sm90 hd128 e4m3 forward")
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  q, k = _sds((3000, 16, 128), E4M3), _sds((5000, 4, 128), E4M3)
  cu = _sds((4,), jnp.int32)
  assert _fp8_kernels(HOPPER, q, k, k, cu, cu, causal=True) == "sm90"


def test_fp8_disable_switch(monkeypatch):
  if not _built("sm90_fwd", 128, E4M3):
    pytest.skip("this build has no sm90 hd128 e4m3 forward")
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  monkeypatch.setenv(_disable.ENV, "sm90")
  try:
    kernel = _fp8_kernels(HOPPER, *_dense(dtype=E4M3), causal=True)
  except NotImplementedError:  # no other CUDA kernel takes fp8 q/k/v yet
    return
  assert kernel != "sm90"


@pytest.mark.parametrize("head_dim", [96, 192])
def test_fp8_head_dims_without_the_hopper_kernel(monkeypatch, head_dim):
  monkeypatch.setattr(_registration, "local_cuda_devices_are_hopper", lambda: True)
  try:
    kernel = _fp8_kernels(HOPPER, *_dense(d=head_dim, dtype=E4M3), causal=True)
  except NotImplementedError:
    return
  assert kernel != "sm90"
