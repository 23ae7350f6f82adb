"""jax_sgl as an attention backend of sglang-jax (sgl-project/sglang-jax), on its own fused KV pool.

sglang-jax runs on NVIDIA GPUs only through `NativeAttention`, which slices K and V out of the pool,
gathers every cached key of the batch and builds a [tokens, heads, keys] logits tensor. This backend
keeps sglang-jax's contract (same constructor arguments as its `FlashAttention` backend, host-side
`get_forward_metadata`, `__call__` returning (out [T, H * Dv], the layer's updated fused buffer))
and runs `jax_sgl.attention` over the pool's fused buffer itself (`kv_buffer=`): packed q over the
paged pool for EXTEND and MIXED batches, one q row per request for DECODE, no copy of the pool.

    import jax_sgl.integrations.sglang_jax as jsg
    jsg.install()    # then ServerArgs(attention_backend="jax_sgl", ...) picks this backend

sglang-jax is imported here and only here: `import jax_sgl` never imports this module.
docs/sglang_jax.md has the usage, the scope and the upstream change `install()` stands in for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.tree_util import register_pytree_node_class
from sgl_jax.srt.layers.attention.base_attn_backend import AttentionBackend
from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

import jax_sgl

BACKEND_NAME = "jax_sgl"   # the ServerArgs.attention_backend value install() adds
_MIN_PAGES = 16            # page_table width buckets: powers of two from here, so a serving loop
                           # compiles once per bucket, not once per longest request


@register_pytree_node_class
@dataclasses.dataclass
class JaxSglMetadata:
  """jax_sgl's index arrays for one forward pass, shared by every layer (built on the host)."""
  cu_seqlens_q: jax.Array = None  # [batch + 1] int32: request r's q rows are [cu[r], cu[r + 1])
  page_table: jax.Array = None    # [batch, max_pages] int32: page ids in the layer's fused buffer
  seqused_k: jax.Array = None     # [batch] int32: request r's keys (its whole sequence)

  # sglang-jax's names for the same offsets (its tests and tools read them off any backend).
  @property
  def cu_q_lens(self):
    return self.cu_seqlens_q

  @property
  def cu_kv_lens(self):
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(self.seqused_k, dtype=jnp.int32)])

  def tree_flatten(self):
    return (self.cu_seqlens_q, self.page_table, self.seqused_k), None

  @classmethod
  def tree_unflatten(cls, aux_data, children):
    return cls(*children)


def _bucket(n: int) -> int:
  """The page_table width for a longest request of n pages."""
  return max(_MIN_PAGES, 1 << max(0, n - 1).bit_length())


def build_metadata(forward_mode, seq_lens, extend_seq_lens, cache_loc, page_size: int):
  """jax_sgl's (cu_seqlens_q, page_table, seqused_k) as numpy arrays from sglang-jax's batch.

  `cache_loc` holds each request's slots, padded to a page multiple, one request after another
  (ScheduleBatch._merge_cache_loc; its tail past the last request is bucket padding): the first
  slot of each page names the page (slot // page_size). EXTEND and MIXED batches have
  `extend_seq_lens` q rows per request, packed in request order; DECODE has one per request.
  Token-bucket padding rows past the last request's rows belong to no sequence, so jax_sgl
  writes zeros there and reads nothing for them.
  """
  seq_lens = np.asarray(seq_lens, np.int64)
  cache_loc = np.asarray(cache_loc, np.int64)
  batch = len(seq_lens)
  if forward_mode.is_decode():
    q_lens = np.ones(batch, np.int64)
  elif forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
    q_lens = np.asarray(extend_seq_lens, np.int64)
  else:
    raise NotImplementedError(f"jax_sgl.integrations.sglang_jax: forward mode {forward_mode!r} "
                              "is not supported (EXTEND, MIXED and DECODE are)")
  cu_seqlens_q = np.zeros(batch + 1, np.int32)
  cu_seqlens_q[1:] = np.cumsum(q_lens)

  num_pages = -(-seq_lens // page_size)
  total = int(num_pages.sum())
  first_slots = cache_loc[::page_size][:total]
  if len(first_slots) < total:
    raise ValueError(f"jax_sgl.integrations.sglang_jax: cache_loc has {len(cache_loc)} slots, "
                     f"fewer than the {total} pages of seq_lens {seq_lens.tolist()} "
                     f"(page_size {page_size})")
  page_table = np.zeros((batch, _bucket(int(num_pages.max(initial=0)))), np.int32)
  rows = np.repeat(np.arange(batch), num_pages)
  cols = np.arange(total) - np.repeat(np.cumsum(num_pages) - num_pages, num_pages)
  page_table[rows, cols] = first_slots // page_size
  return cu_seqlens_q, page_table, seq_lens.astype(np.int32)


class JaxSglAttention(AttentionBackend):
  """sglang-jax attention backend on jax_sgl's kernels (constructor as sglang-jax's FlashAttention).

  Per layer it does what NativeAttention does with the pool (writes the new tokens' K and V at
  `out_cache_loc` through the pool's own `set_kv_buffer_legacy`; -1 slots are dropped) and then
  runs one `jax_sgl.attention` call over that fused buffer. Layer settings map as: `scaling` ->
  softmax_scale, `sliding_window_size` W -> window (W - 1, 0) (a key is seen while q_pos - k_pos
  < W, as sglang-jax masks it), `logit_cap` -> softcap, `attention_sink` -> sinks; GQA from the
  head counts; encoder-only layers are not causal. `softmax_dtype` needs no mapping: jax_sgl's
  softmax is always float32. Not supported (they raise): xai temperature, custom (speculative
  tree) masks, data-parallel attention (dp_size > 1), pools without a fused buffer (SWA, MLA).
  """

  def __init__(self, num_attn_heads, num_kv_heads, head_dim, page_size: int = 1, mesh=None,
               **unused):
    # `unused`: FlashAttention's partition-axis arguments, accepted so that this class can stand
    # wherever sglang-jax builds FlashAttention (its tests do); one device's view needs none.
    self.num_heads = num_attn_heads
    self.num_kv_heads = num_attn_heads if num_kv_heads is None else num_kv_heads
    self.head_dim = head_dim
    self.page_size = page_size
    self.mesh = mesh
    self.forward_metadata = nnx.data(JaxSglMetadata())

  def get_forward_metadata(self, batch) -> JaxSglMetadata:
    """Host side, once per forward pass: the index arrays every layer's attention reads."""
    if getattr(batch, "dp_size", 1) > 1:
      raise NotImplementedError("jax_sgl.integrations.sglang_jax: data-parallel attention "
                                f"(dp_size {batch.dp_size}) is not supported")
    if getattr(batch, "spec_info_padded", None) is not None:
      raise NotImplementedError("jax_sgl.integrations.sglang_jax: speculative decoding (custom "
                                "masks) is not supported")
    arrays = build_metadata(batch.forward_mode, batch.seq_lens, batch.extend_seq_lens,
                            batch.cache_loc, self.page_size)
    return JaxSglMetadata(*(jnp.asarray(a) for a in arrays))

  def __call__(self, q, k, v, layer, forward_batch, token_to_kv_pool, causal: int = 1,
               attention_sink=None, **kwargs):
    """out [T, H * v_head_dim] and the layer's updated fused KV buffer, as NativeAttention."""
    if getattr(layer, "xai_temperature_len", -1) > 0:
      raise NotImplementedError("jax_sgl.integrations.sglang_jax: xai temperature "
                                f"(layer {layer.layer_id}) is not supported")
    if not hasattr(token_to_kv_pool, "set_kv_buffer_legacy"):
      raise NotImplementedError("jax_sgl.integrations.sglang_jax: the pool must keep one fused "
                                "K/V buffer per layer (MHATokenToKVPool), got "
                                f"{type(token_to_kv_pool).__name__}")
    head_dim = layer.head_dim
    tokens = q.shape[0]
    kv_buffer = token_to_kv_pool.set_kv_buffer_legacy(
        layer.layer_id, forward_batch.out_cache_loc,
        k.reshape(tokens, -1, head_dim), v.reshape(tokens, -1, head_dim))

    attn_type = getattr(layer, "attn_type", None)
    causal = bool(causal) and getattr(attn_type, "value", attn_type) != "encoder_only"
    window = (-1, -1)
    if layer.sliding_window_size:
      window = (layer.sliding_window_size - 1, 0 if causal else -1)
    if isinstance(attention_sink, nnx.Variable):
      attention_sink = attention_sink[...]   # an nnx.Param in the models (`.value` is deprecated)
    md = self.forward_metadata
    attn_buffer = kv_buffer
    if kv_buffer.shape[1] == 1:
      # Page size 1: handed over as the 3-D token pool it is (the reshape sglang-jax's own write
      # does, a bitcast); as a 4-D pool with a unit page axis, XLA copies the whole pool.
      attn_buffer = jax.lax.reshape(
          kv_buffer, (kv_buffer.shape[0], int(np.prod(kv_buffer.shape[2:-1])), kv_buffer.shape[-1]),
          out_sharding=P(None, getattr(token_to_kv_pool, "kv_partition_axis", None), None))
    flags = dict(kv_buffer=attn_buffer, page_table=md.page_table, seqused_k=md.seqused_k,
                 causal=causal, window=window, softcap=float(layer.logit_cap or 0.0),
                 sinks=attention_sink,
                 softmax_scale=head_dim**-0.5 if layer.scaling is None else layer.scaling)
    q = q.reshape(tokens, -1, head_dim)
    if forward_batch.forward_mode.is_decode():
      # One row per request as a dense q [batch, 1, H, D]: the call shape jax_sgl's paged decode
      # kernels serve (a varlen q is planned for up to all its rows in one sequence).
      batch = md.seqused_k.shape[0]
      out = jax_sgl.attention(q[:batch, None], None, None, **flags)[:, 0]
      out = jnp.pad(out, ((0, tokens - batch), (0, 0), (0, 0)))   # token-bucket padding rows
    else:
      out = jax_sgl.attention(q, None, None, cu_seqlens_q=md.cu_seqlens_q, **flags)
    # Split K/V dims (v_head_dim < head_dim) store V zero-padded to head_dim, as merge_kv does.
    out = out[:, :, :layer.v_head_dim]
    return out.reshape(tokens, -1), kv_buffer

  @staticmethod
  def get_max_running_reqests(max_context_len: int, page_size: int) -> int:
    # jax_sgl's kernels size nothing by the number of requests (as NativeAttention).
    return 4096


def install() -> None:
  """Make sglang-jax's ModelRunner build JaxSglAttention for attention_backend="jax_sgl".

  sglang-jax has no backend registry (`ModelRunner._get_attention_backend` is an if/elif), so this
  wraps that method: other backend names go to the original untouched. Idempotent. The upstream
  change it stands in for is one more elif branch (docs/sglang_jax.md).
  """
  from sgl_jax.srt.model_executor.model_runner import ModelRunner

  original = ModelRunner._get_attention_backend
  if getattr(original, "_jax_sgl", False):
    return

  def _get_attention_backend(self):
    if self.server_args.attention_backend != BACKEND_NAME:
      return original(self)
    from sgl_jax.srt.layers.attention.hybrid_linear_attn_backend import attn_backend_wrapper

    if self.use_mla_backend:
      raise NotImplementedError("jax_sgl.integrations.sglang_jax: MLA models are not supported")
    backend = JaxSglAttention(self.num_attn_heads, self.num_kv_heads, self.model_config.head_dim,
                              page_size=self.page_size, mesh=self.mesh)
    return attn_backend_wrapper(self, backend)

  _get_attention_backend._jax_sgl = True
  ModelRunner._get_attention_backend = _get_attention_backend
