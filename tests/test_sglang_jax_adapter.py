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
   Two substitutions let the harness run on the CPU without changing a case: its prefix write
   (a TPU-only Pallas kernel) runs as the same scatter in plain JAX, and its pool holds 16384
   slots instead of 200,000 (a size no result depends on).
2. Against NativeAttention (page size 1, the layout it supports; real slots >= 1 since it takes
   slot 0 as padding): EXTEND, MIXED (chunked prefill next to decode requests of extend length 1)
   and DECODE batches with prefixes already in the pool, shuffled slots, token-bucket padding
   (out_cache_loc -1), GQA, a sliding window, sinks; outputs close on the real tokens and the
   updated fused buffers equal (both write through the pool's own set_kv_buffer_legacy).
3. A tiny random-weight Qwen3 from sglang-jax's own model code (QWen3Model built from a config;
   logits through its tied embedding): prefill, decode, mixed (a new prompt next to decode
   requests) and decode again, each step with NativeAttention and with the adapter, each on its
   own pool: logits close and greedy tokens equal. Head dim 128: NativeAttention returns the
   pool's padded head dim, which the model's o_proj cannot take for smaller head dims.
4. The rest: the metadata built from cache_loc (page sizes 1, 4, 16), install(), that
   `import jax_sgl` imports no sglang-jax, and the compiled layer step's HLO (the pool reaches
   the custom call with no slice or gather).

Skips as a whole where sglang-jax or its dependencies (flax, ...) are absent, unless
JAX_SGL_REQUIRE_SGLANG_JAX is set (CI's adapter leg): sglang-jax's source is at
../shared/clients/sglang-jax/python (put it on PYTHONPATH); tests/requirements-sglang-jax.txt lists
what to install. Importing the harness sets a global jax mesh (one device here), as sglang-jax's tests do.
"""

import importlib
import os
import types
import unittest
from unittest import mock

import pytest

if os.environ.get("JAX_SGL_REQUIRE_SGLANG_JAX"):   # CI's adapter leg: a missing import fails
  fc = importlib.import_module("sgl_jax.test.flashattention_common")
else:
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
HARNESS_POOL_SLOTS = 16384
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

  def run_test(self, *args, max_total_token_size=None, **kwargs):
    # The pool's size changes no result; the harness's 200,000 slots (3 GB at 32 KV heads x 128 in
    # bf16) make every case minutes of zeroing and copying on the CPU. 16384 holds every case.
    return super().run_test(*args, max_total_token_size=HARNESS_POOL_SLOTS, **kwargs)


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


# --- against NativeAttention -------------------------------------------------------------------

POOL_SLOTS = 256  # the test pool; slots are drawn from 1..POOL_SLOTS (0 is NativeAttention's pad)


def _native_vs_adapter(mode, reqs, *, num_heads=8, num_kv_heads=2, head_dim=128, pad_tokens=3,
                       window=0, sinks=False, dtype=jnp.float32, seed=0):
  """One layer step of `reqs` [(prefix_len, extend_len)] with each backend on the same pool:
  (native out [T, H, Dpool], adapter out [T, H, D], native buffer, adapter buffer, real tokens)."""
  rng = np.random.default_rng(seed)
  prefix = np.array([p for p, _ in reqs], np.int32)
  extend = np.array([e for _, e in reqs], np.int32)
  seq_lens = prefix + extend
  pool = MHATokenToKVPool(size=POOL_SLOTS, page_size=1, dtype=dtype, head_num=num_kv_heads,
                          head_dim=-(-head_dim // 128) * 128, layer_num=1, mesh=fc.mesh)
  slots = np.split(1 + rng.permutation(POOL_SLOTS)[:seq_lens.sum()], np.cumsum(seq_lens)[:-1])

  def randn(*shape):
    return jnp.asarray(rng.standard_normal(shape), dtype)

  prefix_loc = np.concatenate([s[:p] for s, p in zip(slots, prefix)]).astype(np.int32)
  pool.kv_buffer[0] = pool.set_kv_buffer_legacy(
      0, jnp.asarray(prefix_loc), randn(len(prefix_loc), num_kv_heads, head_dim),
      randn(len(prefix_loc), num_kv_heads, head_dim))

  real = int(extend.sum())
  tokens = real + pad_tokens
  q, k, v = (randn(tokens, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
  out_cache_loc = np.concatenate([np.concatenate([s[p:] for s, p in zip(slots, prefix)]),
                                  np.full(pad_tokens, -1)]).astype(np.int32)
  cache_loc = np.concatenate(slots + [np.zeros(5, np.int64)]).astype(np.int32)  # bucket tail
  decode = mode == ForwardMode.DECODE
  layer = RadixAttention(num_heads=num_heads, head_dim=head_dim, scaling=head_dim**-0.5,
                         num_kv_heads=num_kv_heads, layer_id=0, sliding_window_size=window)
  sink = jnp.asarray(rng.uniform(-1, 2, num_heads), jnp.float32) if sinks else None
  if sinks == "param":   # as the models hold it (gpt-oss): an nnx.Param
    from flax import nnx
    sink = nnx.Param(sink)

  adapter = JaxSglAttention(num_heads, num_kv_heads, head_dim, page_size=1, mesh=fc.mesh)
  adapter.forward_metadata = adapter.get_forward_metadata(types.SimpleNamespace(
      forward_mode=mode, seq_lens=seq_lens, extend_seq_lens=None if decode else extend,
      cache_loc=cache_loc, dp_size=1, spec_info_padded=None))
  native = NativeAttention(num_heads, num_kv_heads, fc.mesh)

  def step(backend):
    batch = ForwardBatch(
        bid=1, forward_mode=mode, batch_size=len(reqs), input_ids=jnp.zeros(tokens, jnp.int32),
        req_pool_indices=jnp.arange(len(reqs), dtype=jnp.int32), seq_lens=jnp.asarray(seq_lens),
        out_cache_loc=jnp.asarray(out_cache_loc), positions=jnp.zeros(tokens, jnp.int32),
        attn_backend=backend, cache_loc=jnp.asarray(cache_loc),
        extend_prefix_lens=None if decode else jnp.asarray(prefix),
        extend_seq_lens=None if decode else jnp.asarray(extend))
    run = jax.jit(lambda q, k, v, batch, pool: layer(q, k, v, batch, pool, attention_sink=sink))
    out, buf = run(q, k, v, batch, pool)
    return np.asarray(out.astype(jnp.float32)).reshape(tokens, num_heads, -1), np.asarray(buf)

  (out_n, buf_n), (out_a, buf_a) = step(native), step(adapter)
  return out_n, out_a, buf_n, buf_a, real


MIXED = [(0, 7), (5, 3), (20, 1), (0, 1), (9, 1)]  # prefill, chunked prefill, decode requests
CASES = {
    "prefill": (ForwardMode.EXTEND, [(0, 19), (0, 5)], {}),
    "mixed": (ForwardMode.EXTEND, MIXED, {}),
    "decode": (ForwardMode.DECODE, [(6, 1), (30, 1), (1, 1)], {}),
    "mha": (ForwardMode.EXTEND, MIXED, dict(num_kv_heads=8)),
    "window": (ForwardMode.EXTEND, MIXED, dict(window=4)),
    "decode_window": (ForwardMode.DECODE, [(6, 1), (30, 1)], dict(window=4)),
    "sinks": (ForwardMode.EXTEND, MIXED, dict(sinks=True)),
    "decode_sinks": (ForwardMode.DECODE, [(6, 1), (30, 1)], dict(sinks="param", num_kv_heads=1)),
    "head_dim_64_in_128": (ForwardMode.EXTEND, MIXED, dict(head_dim=64)),
    "bf16": (ForwardMode.EXTEND, MIXED, dict(dtype=jnp.bfloat16)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_native_attention(case):
  mode, reqs, flags = CASES[case]
  out_n, out_a, buf_n, buf_a, real = _native_vs_adapter(mode, reqs, **flags)
  tol = 2e-2 if flags.get("dtype") == jnp.bfloat16 else 2e-5
  head_dim = out_a.shape[-1]
  # NativeAttention returns the pool's padded head dim (zeros past head_dim there).
  np.testing.assert_allclose(out_a[:real], out_n[:real, :, :head_dim], atol=tol, rtol=tol)
  assert not out_a[real:].any(), "token-bucket padding rows must be zero"
  np.testing.assert_array_equal(buf_a, buf_n)


def test_mixed_mode_is_extend():
  """ForwardMode.MIXED (extend requests next to decode ones) maps as EXTEND does."""
  from jax_sgl.integrations.sglang_jax import build_metadata
  args = (np.array([7, 8, 21]), np.array([7, 3, 1]), np.arange(1, 40), 1)
  for a, b in zip(build_metadata(ForwardMode.MIXED, *args), build_metadata(ForwardMode.EXTEND,
                                                                           *args)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_metadata_from_cache_loc(page_size):
  """page_table names each request's pages by the first slot of each page in cache_loc."""
  from jax_sgl.integrations.sglang_jax import build_metadata
  seq_lens = np.array([5, 0, 17, 1])
  num_pages = -(-seq_lens // page_size)
  ids = np.random.default_rng(page_size).permutation(100)[:num_pages.sum()]
  pages = np.split(ids, np.cumsum(num_pages)[:-1])
  per_req = [(p[:, None] * page_size + np.arange(page_size)).ravel() for p in pages]
  cache_loc = np.concatenate(per_req + [np.zeros(3 * page_size, int)])
  cu, table, used = build_metadata(ForwardMode.EXTEND, seq_lens, np.array([2, 0, 17, 1]),
                                   cache_loc, page_size)
  np.testing.assert_array_equal(cu, [0, 2, 2, 19, 20])
  np.testing.assert_array_equal(used, seq_lens)
  for r, p in enumerate(pages):
    np.testing.assert_array_equal(table[r, :len(p)], p)
  _, decode_table, _ = build_metadata(ForwardMode.DECODE, seq_lens, None, cache_loc, page_size)
  np.testing.assert_array_equal(decode_table, table)


def test_install_routes_jax_sgl_and_leaves_other_backends():
  """install() makes ModelRunner build JaxSglAttention for "jax_sgl" and nothing else changes."""
  from sgl_jax.srt.model_executor.model_runner import ModelRunner

  from jax_sgl.integrations import sglang_jax

  original = ModelRunner._get_attention_backend
  try:
    sglang_jax.install()
    sglang_jax.install()   # idempotent: wraps once
    wrapped = ModelRunner._get_attention_backend
    assert wrapped is not original and wrapped._jax_sgl
    runner = types.SimpleNamespace(
        server_args=types.SimpleNamespace(attention_backend="jax_sgl", device="gpu"),
        use_mla_backend=False, num_attn_heads=8, num_kv_heads=2, page_size=16, mesh=fc.mesh,
        model_config=types.SimpleNamespace(head_dim=128), linear_recurrent_config=None)
    backend = wrapped(runner)
    assert isinstance(backend, JaxSglAttention)
    assert (backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.page_size) == (
        8, 2, 128, 16)
    runner.server_args.attention_backend = "native"
    assert isinstance(wrapped(runner), NativeAttention)
  finally:
    ModelRunner._get_attention_backend = original


def test_import_jax_sgl_does_not_import_sglang_jax():
  import subprocess
  import sys
  code = "import sys, jax_sgl; assert 'sgl_jax' not in sys.modules and 'flax' not in sys.modules"
  subprocess.run([sys.executable, "-P", "-c", code], check=True)


# --- a tiny random-weight Qwen3 ----------------------------------------------------------------

REGION = 64  # request r owns slots 1 + REGION * r ...: shuffled enough, and never slot 0


def _qwen3_step(model, backend, pool, mode, steps, pad_tokens=2, region=REGION, page_size=1):
  """One forward pass of `steps` [(request, prefix_len, new_ids)]: last-token logits [B, vocab].
  Request r owns the `region` slots from page_size * (1 + r * region // page_size) (never slot 0,
  NativeAttention's padding slot)."""
  prefix = np.array([p for _, p, _ in steps], np.int32)
  extend = np.array([len(ids) for _, _, ids in steps], np.int32)
  seq_lens = prefix + extend
  slots = [page_size * (1 + r * (region // page_size)) + np.arange(n)
           for (r, _, _), n in zip(steps, seq_lens)]
  tokens = int(extend.sum()) + pad_tokens
  ids = np.zeros(tokens, np.int32)
  ids[:extend.sum()] = np.concatenate([ids_ for _, _, ids_ in steps])
  positions = np.zeros(tokens, np.int32)
  positions[:extend.sum()] = np.concatenate([p + np.arange(e) for p, e in zip(prefix, extend)])
  out_cache_loc = np.full(tokens, -1, np.int32)
  out_cache_loc[:extend.sum()] = np.concatenate([s[p:] for s, p in zip(slots, prefix)])
  # sglang-jax pads each request's cache_loc to a page multiple; NativeAttention, which takes
  # request boundaries from seq_lens, reads only unpadded ones (page size 1, its layout).
  ours = isinstance(backend, JaxSglAttention)
  cache_loc = np.concatenate([np.pad(sl, (0, -len(sl) % page_size if ours else 0))
                              for sl in slots]).astype(np.int32)
  decode = mode == ForwardMode.DECODE
  if ours:
    backend.forward_metadata = backend.get_forward_metadata(types.SimpleNamespace(
        forward_mode=mode, seq_lens=seq_lens, extend_seq_lens=None if decode else extend,
        cache_loc=cache_loc, dp_size=1, spec_info_padded=None))
  batch = ForwardBatch(
      bid=1, forward_mode=mode, batch_size=len(steps), input_ids=jnp.asarray(ids),
      req_pool_indices=jnp.arange(len(steps), dtype=jnp.int32), seq_lens=jnp.asarray(seq_lens),
      out_cache_loc=jnp.asarray(out_cache_loc), positions=jnp.asarray(positions),
      attn_backend=backend, cache_loc=jnp.asarray(cache_loc),
      extend_prefix_lens=None if decode else jnp.asarray(prefix),
      extend_seq_lens=None if decode else jnp.asarray(extend))
  hidden, _, layers_kv, _ = model(batch, pool)
  pool.kv_buffer = list(layers_kv)   # what ModelRunner does with the returned buffers
  last = np.cumsum(extend) - 1
  embed = np.asarray(model.embed_tokens.embedding[...], np.float32)
  return np.asarray(hidden, np.float32)[last] @ embed.T


def _prefill_decode_mixed(step, seqs, new_prompt):
  """The steps of the model tests: prefill of requests 0 and 1, decode, a mixed batch (request 2's
  `new_prompt` beside decodes of 0 and 1), decode of all three. step(mode, steps) gets
  [(request, prefix length, new ids)] (each request's earlier tokens are its prefix) and returns
  the requests' greedy tokens, which are appended to seqs."""
  def run(mode, plan):   # plan [(request, new ids)]
    steps = [(r, len(seqs[r]) - len(new), np.array(new, np.int32)) for r, new in plan]
    for (r, _), token in zip(plan, step(mode, steps)):
      seqs[r].append(int(token))

  run(ForwardMode.EXTEND, [(0, seqs[0]), (1, seqs[1])])
  run(ForwardMode.DECODE, [(0, seqs[0][-1:]), (1, seqs[1][-1:])])
  seqs[2] = new_prompt
  run(ForwardMode.EXTEND, [(2, seqs[2]), (0, seqs[0][-1:]), (1, seqs[1][-1:])])
  run(ForwardMode.DECODE, [(r, seqs[r][-1:]) for r in (0, 1, 2)])


def test_tiny_qwen3_prefill_decode_mixed():
  from sgl_jax.srt.models.qwen3 import QWen3Model
  from transformers import Qwen3Config

  heads, kv_heads, head_dim = 4, 2, 128
  config = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=4 * REGION, rms_norm_eps=1e-6,
                       attention_bias=False, tie_word_embeddings=True)
  model = QWen3Model(config, mesh=fc.mesh, dtype=jnp.float32)   # random weights
  backends = {
      "native": NativeAttention(heads, kv_heads, fc.mesh),
      "jax_sgl": JaxSglAttention(heads, kv_heads, head_dim, page_size=1, mesh=fc.mesh)}
  pools = {name: MHATokenToKVPool(size=4 * REGION, page_size=1, dtype=jnp.float32,
                                  head_num=kv_heads, head_dim=head_dim, layer_num=2, mesh=fc.mesh)
           for name in backends}
  rng = np.random.default_rng(0)
  seqs = {0: list(rng.integers(0, 101, 9)), 1: list(rng.integers(0, 101, 14))}

  def step(mode, steps):
    logits = {name: _qwen3_step(model, backends[name], pools[name], mode, steps)
              for name in backends}
    np.testing.assert_allclose(logits["jax_sgl"], logits["native"], atol=1e-3, rtol=1e-3)
    greedy = logits["native"].argmax(-1)
    np.testing.assert_array_equal(logits["jax_sgl"].argmax(-1), greedy)
    assert logits["native"].std() > 0.1, "random weights expected"
    return greedy

  _prefill_decode_mixed(step, seqs, list(rng.integers(0, 101, 6)))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_qwen3_on_the_gpu_against_a_float32_oracle(page_size):
  """A larger random-weight Qwen3 in bf16 on the GPU (4 layers, hidden 512, 16 / 4 heads x 128), on
  jax_sgl's GPU kernels (packed q over the paged pool for prefill and mixed steps, paged decode):
  prefill of two prompts (300 and 700 tokens), decode, mixed (a 200-token prompt beside two decode
  requests), decode. Oracle: the same weights in float32 with NativeAttention at the highest matmul
  precision. Per step, the adapter's logit error is at most 3x NativeAttention's in bf16 (the same
  model with sglang-jax's GPU path; FlashAttention's rule), and its greedy tokens equal the oracle's
  wherever the oracle's top two differ by more than the two bf16 models' errors."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU as jax's default backend")
  from flax import nnx
  from sgl_jax.srt.models.qwen3 import QWen3Model
  from transformers import Qwen3Config

  heads, kv_heads, head_dim, layers, region = 16, 4, 128, 4, 1024
  config = Qwen3Config(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=region, rms_norm_eps=1e-6, attention_bias=False,
                       tie_word_embeddings=True)
  oracle_model = QWen3Model(config, mesh=fc.mesh, dtype=jnp.float32)   # random weights
  model = QWen3Model(config, mesh=fc.mesh, dtype=jnp.bfloat16)
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(oracle_model)))
  runs = {  # name: (model, backend, pool dtype)
      "oracle": (oracle_model, NativeAttention(heads, kv_heads, fc.mesh), jnp.float32),
      "native": (model, NativeAttention(heads, kv_heads, fc.mesh), jnp.bfloat16),
      "jax_sgl": (model, JaxSglAttention(heads, kv_heads, head_dim, page_size=page_size,
                                         mesh=fc.mesh), jnp.bfloat16)}
  pools = {name: MHATokenToKVPool(size=4 * region, page_size=page_size, dtype=dtype,
                                  head_num=kv_heads, head_dim=head_dim, layer_num=layers,
                                  mesh=fc.mesh)
           for name, (_, _, dtype) in runs.items()}
  rng = np.random.default_rng(1)
  seqs = {0: list(rng.integers(0, 1024, 300)), 1: list(rng.integers(0, 1024, 700))}

  def step(mode, steps):
    logits = {}
    for name, (m, backend, _) in runs.items():
      with jax.default_matmul_precision("highest" if name == "oracle" else "default"):
        logits[name] = _qwen3_step(m, backend, pools[name], mode, steps, region=region,
                                   page_size=page_size)
    oracle = logits["oracle"]
    err = {name: float(np.abs(logits[name] - oracle).max()) for name in ("native", "jax_sgl")}
    scale = float(np.abs(oracle).max())
    assert np.isfinite(logits["jax_sgl"]).all()
    assert err["jax_sgl"] <= 3 * err["native"] + 1e-3 * scale, (mode, err, scale)
    top2 = np.sort(oracle, axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > err["native"] + err["jax_sgl"]
    greedy = oracle.argmax(-1)
    np.testing.assert_array_equal(logits["jax_sgl"].argmax(-1)[decided], greedy[decided])
    assert scale > 1.0, "random weights expected"
    return greedy

  _prefill_decode_mixed(step, seqs, list(rng.integers(0, 1024, 200)))


# --- no copy of the pool -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_compiled_layer_step_reads_the_pool_in_place(page_size, mode):
  """One jitted layer step with the pool donated, as ModelRunner runs it: the custom call gets the
  written buffer itself as K and V (one operand, a bitcast at most), and nothing in the compiled
  HLO slices, gathers or concatenates the pool (no K or V half cut out, no per-request gather:
  NativeAttention's per-layer costs). On the GPU, no copy or conversion of the pool either. On the
  CPU those are not asserted: there the compiled step copies the pool around sglang-jax's own
  write (set_kv_buffer_legacy, a scatter; in bf16 XLA's CPU backend runs it in float32,
  converting the whole pool)."""
  import re
  heads, kv_heads, head_dim, pages = 8, 2, 128, 64
  pool = MHATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=jnp.bfloat16,
                          head_num=kv_heads, head_dim=head_dim, layer_num=1, mesh=fc.mesh)
  seq_lens = np.array([3 * page_size + 2, page_size + 1], np.int32)
  extend = np.ones(2, np.int32) if mode == ForwardMode.DECODE else np.array([5, 1], np.int32)
  num_pages = -(-seq_lens // page_size)
  page_ids = np.split(1 + np.arange(num_pages.sum())[::-1], np.cumsum(num_pages)[:-1])
  slots = [(p[:, None] * page_size + np.arange(page_size)).ravel() for p in page_ids]
  tokens = int(extend.sum()) + 2
  out_cache_loc = np.full(tokens, -1, np.int32)
  out_cache_loc[:extend.sum()] = np.concatenate([s[n - e:n] for s, n, e in
                                                 zip(slots, seq_lens, extend)])
  decode = mode == ForwardMode.DECODE
  adapter = JaxSglAttention(heads, kv_heads, head_dim, page_size=page_size, mesh=fc.mesh)
  adapter.forward_metadata = adapter.get_forward_metadata(types.SimpleNamespace(
      forward_mode=mode, seq_lens=seq_lens, extend_seq_lens=None if decode else extend,
      cache_loc=np.concatenate(slots), dp_size=1, spec_info_padded=None))
  batch = ForwardBatch(
      bid=1, forward_mode=mode, batch_size=2, input_ids=jnp.zeros(tokens, jnp.int32),
      req_pool_indices=jnp.arange(2, dtype=jnp.int32), seq_lens=jnp.asarray(seq_lens),
      out_cache_loc=jnp.asarray(out_cache_loc), positions=jnp.zeros(tokens, jnp.int32),
      attn_backend=adapter, cache_loc=jnp.asarray(np.concatenate(slots)),
      extend_prefix_lens=None if decode else jnp.asarray(seq_lens - extend),
      extend_seq_lens=None if decode else jnp.asarray(extend))
  layer = RadixAttention(num_heads=heads, head_dim=head_dim, scaling=head_dim**-0.5,
                         num_kv_heads=kv_heads, layer_id=0)
  q, k, v = (jnp.ones((tokens, h, head_dim), jnp.bfloat16) for h in (heads, kv_heads, kv_heads))
  step = jax.jit(lambda q, k, v, batch, pool: layer(q, k, v, batch, pool), donate_argnums=(4,))
  hlo = step.lower(q, k, v, batch, pool).compile().as_text()
  assert "jax_sgl_attention_fwd" in hlo
  rows = {str(pool.kv_buffer[0].shape[0]), str(pool.kv_buffer[0].shape[0] * page_size)}
  ops = r"(slice|dynamic-slice|gather|transpose|concatenate|pad"
  ops += (r"|copy|convert)\(" if jax.default_backend() == "gpu" else r")\(")
  copies = [line.strip() for line in hlo.splitlines()
            if re.search(r"=\s*\S+\s+" + ops, line)
            and re.search(r"\[(" + "|".join(rows) + r"),", line.split("=", 1)[1])]
  assert not copies, copies
  call = next(line for line in hlo.splitlines() if "custom-call(" in line
              and "jax_sgl_attention_fwd" in line)
  operands = re.search(r"custom-call\(([^)]*)\)", call).group(1).split(", ")
  assert operands[1] == operands[2], call     # K and V: the same buffer
