"""FlashAttention-3 as an anchor of the attention benchmarks, through flash-attn3-jax (PyPI).

Imported lazily: the package is optional and its kernels run only on an NVIDIA GPU (Hopper), so a
benchmark without it, or on another backend, prints one line saying why and goes on with its
other anchors. The calls used, with the layouts jax_sgl's benchmarks already have:

  flash_mha(q, k, v, is_causal)                 dense [B, S, H, D] / [B, S, Hkv, D]; jax.grad
                                                runs FA3's backward;
  flash_mha_with_kvcache(q, k_pool, v_pool,     q dense [B, Sq, H, D] over a page pool
      cache_seqlens, page_table, is_causal)     [num_pages, page_size, Hkv, D] (forward only);
  flash_mha_varlen(q, k, v, cu_q, cu_k, ...)    packed q and k/v [total, H(kv), D];
  dense_fp8 below                               e4m3 q / k / v with descales, bf16 out: the
                                                package's FFI target itself (its Python layer
                                                admits 16-bit inputs only; the target takes
                                                F8E4M3FN and runs FA3's e4m3 kernels).

Causal masks are bottom-right in FA3 as in jax_sgl. flash-attn3-jax 0.2.3 is built with the head
dim 128 kernels only: its library instantiates run_mha_fwd_/run_mha_bwd_ for 128 alone, so another
head dim would be refused or sent to a kernel built for a different one. FA3 therefore runs only
at the head dims its library instantiates (`serves`, read from the kernel symbols), and every FA3
result is compared with another implementation's before it is timed, dropped ('n/a') when it
disagrees (`agrees`).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re

import jax
import jax.numpy as jnp

MISSING = "FA3 anchor missing (pip install flash-attn3-jax)"
# Max |difference| from the reference output above which FA3's result is taken as not served: a
# wrong or absent kernel is off by O(1); bf16 rounding of outputs of magnitude ~1 is ~1e-2.
MAX_DIFF = 5e-2
_loaded = []


def load():
  """The flash_attn3_jax module, or None (after one printed line saying why) when it is not
  installed or this backend cannot run it."""
  if not _loaded:
    module = None
    try:
      import flash_attn3_jax as module
    except Exception as e:  # not installed, or a dependency (einops) or its library missing
      print(f"{MISSING}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    else:
      if jax.default_backend() != "gpu":
        print(f"FA3 anchor skipped: flash-attn3-jax {module.__version__} runs only on an NVIDIA "
              f"GPU, this backend is {jax.default_backend()}")
        module = None
      else:
        print(f"FA3 anchor: flash-attn3-jax {module.__version__}")
    _loaded.append(module)
    if module is not None:
      print(f"FA3 kernels in its library, by head dim: {served_head_dims() or 'unreadable'}")
  return _loaded[0]


# FA3's kernel entry points, e.g. run_mha_fwd_<90, cutlass::bfloat16_t, 128, 128, ...>: direction,
# then the head dim (the first integer template argument after the dtype).
_KERNEL_SYMBOL = re.compile(rb"_Z12run_mha_(fwd|bwd)_ILi\d+EN7cutlass\d+\w+?_tELi(\d+)E")


@functools.lru_cache(maxsize=None)
def served_head_dims():
  """{'fwd': head dims, 'bwd': head dims} that flash-attn3-jax's library has kernels for, or None
  when its library or their symbols cannot be read (then the output checks alone decide)."""
  spec = importlib.util.find_spec("flash_attn3_jax_lib")
  if spec is None or not spec.submodule_search_locations:
    return None
  dims = {"fwd": set(), "bwd": set()}
  for path in glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.so")):
    with open(path, "rb") as f:
      for direction, head_dim in _KERNEL_SYMBOL.findall(f.read()):
        dims[direction.decode()].add(int(head_dim))
  return dims if dims["fwd"] else None


def serves(direction, head_dim):
  """Whether FA3's library has a `direction` ('fwd' or 'bwd') kernel for head_dim (True when its
  symbols cannot be read); prints why not, once per (direction, head dim)."""
  dims = served_head_dims()
  if dims is None or head_dim in dims[direction]:
    return True
  if (direction, head_dim) not in _said:
    _said.add((direction, head_dim))
    print(f"  (fa3 n/a at head dim {head_dim}: flash-attn3-jax has {direction} kernels for head "
          f"dims {sorted(dims[direction])} only)")
  return False


_said = set()


def dense(causal):
  """FA3's dense forward, jitted, as f(q, k, v)."""
  fa3 = load()
  return jax.jit(lambda q, k, v: fa3.flash_mha(q, k, v, is_causal=causal))


def dense_attention(causal):
  """FA3's dense attention, not jitted (for the caller's loss under jax.grad), as f(q, k, v)."""
  fa3 = load()
  return lambda q, k, v: fa3.flash_mha(q, k, v, is_causal=causal)


def paged(causal):
  """FA3 over a page pool, jitted, as f(q, k_pool, v_pool, page_table, seqused_k): q dense
  [B, Sq, H, D], pools [num_pages, page_size, Hkv, D], page_table [B, max_pages] int32,
  seqused_k [B] int32 (the keys of each sequence, its new tokens included). num_splits stays at
  the wrapper's default 1: flash-attn3-jax has no automatic split heuristic."""
  fa3 = load()
  return jax.jit(lambda q, kp, vp, table, seqused: fa3.flash_mha_with_kvcache(
      q, kp, vp, cache_seqlens=seqused, page_table=table, is_causal=causal))


def varlen(causal, max_seqlen_q, max_seqlen_k):
  """FA3 on packed sequences, jitted, as f(q, k, v, cu_seqlens_q, cu_seqlens_k)."""
  fa3 = load()
  return jax.jit(lambda q, k, v, cu_q, cu_k: fa3.flash_mha_varlen(
      q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
      is_causal=causal))


def dense_fp8(causal, softmax_scale):
  """FA3's e4m3 forward, jitted, as f(q8, k8, v8, q_descale, k_descale, v_descale): dense e4m3
  [B, S, H(kv), D], descales float32 [B, Hkv] (FA3's layout: one per batch and kv head), bf16
  output. The operands and attributes are those of flash-attn3-jax's own lowering of flash_mha
  (flash_hlo.py), with the descales given instead of empty."""
  load()

  def f(q, k, v, q_descale, k_descale, v_descale):
    b, s, h, d = q.shape
    empty_i32 = jnp.zeros((0,), jnp.int32)
    empty_q = jnp.zeros((0,), q.dtype)
    out_types = [jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16),
                 jax.ShapeDtypeStruct((b, h, s), jnp.float32),
                 jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
                 jax.ShapeDtypeStruct((1, 1, 1), jnp.float32)]
    out = jax.ffi.ffi_call("flash_mha_fwd", out_types, has_side_effect=False)(
        q, k, v, empty_q, empty_q, empty_q, empty_i32, empty_i32, empty_i32, empty_i32,
        empty_i32, empty_i32, empty_i32, empty_i32, empty_q, empty_q, empty_i32, q_descale,
        k_descale, v_descale, empty_i32, max_seqlen_q=s, max_seqlen_q_has_value=True,
        max_seqlen_k=k.shape[1], max_seqlen_k_has_value=True,
        softmax_scale_val=float(softmax_scale), softmax_scale_has_value=True,
        pack_gqa_val=False, pack_gqa_has_value=False, is_causal=causal, window_size_left=-1,
        window_size_right=-1, attention_chunk=0, softcap=0.0, is_rotary_interleaved=False,
        num_splits=1, sm_margin=0)
    return out[0]
  return jax.jit(f)


def max_diff(a, b):
  """max |a - b| in float32, over arrays of the same shape."""
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def agrees(got, want, what, tol=MAX_DIFF):
  """True when FA3's `got` is within `tol` of `want`; otherwise prints why FA3 is 'n/a' here."""
  diff = max_diff(got, want)
  if diff <= tol:
    return True
  print(f"  (fa3 n/a for {what}: differs from the reference by {diff:.3g}, so not timed; "
        f"a case this wheel does not serve)")
  return False
