"""FlashAttention-3 as an anchor of the attention benchmarks, through flash-attn3-jax (PyPI).

Imported lazily: the package is optional and its kernels run only on an NVIDIA GPU (Hopper), so a
benchmark without it, or on another backend, prints one line saying why and goes on with its
other anchors. The calls used, with the layouts jax_sgl's benchmarks already have:

  flash_mha(q, k, v, is_causal)                 dense [B, S, H, D] / [B, S, Hkv, D]; jax.grad
                                                runs FA3's backward;
  flash_mha_with_kvcache(q, k_pool, v_pool,     q dense [B, Sq, H, D] over a page pool
      cache_seqlens, page_table, is_causal)     [num_pages, page_size, Hkv, D] (forward only);
  flash_mha_varlen(q, k, v, cu_q, cu_k, ...)    packed q and k/v [total, H(kv), D].

Causal masks are bottom-right in FA3 as in jax_sgl. flash-attn3-jax 0.2.3 is built with the head
dim 128 kernels only (its library holds run_mha_fwd_/run_mha_bwd_ for 128 alone); other head dims
may be refused, run on the 128 kernel, or not run at all, so every FA3 result is compared with
another implementation's before it is timed and dropped ('n/a') when it disagrees (`agrees`).
"""

from __future__ import annotations

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
  return _loaded[0]


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
