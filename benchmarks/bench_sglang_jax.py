"""sglang-jax model steps with jax_sgl as the attention backend, against sglang-jax's NativeAttention.

A random-weight Qwen3 built from sglang-jax's own model code (about 1B parameters by default: 16
layers, hidden 2048, 32 / 8 heads of 128, MLP 6144, vocab 32000, bf16) runs whole model steps, the
way sglang-jax's ModelRunner runs them (one jit per step, the KV pool donated):
- decode: `--batch` requests of `--context` tokens each, one new token per request;
- chunked prefill: `--prefill-requests` requests of `--prefill-chunk` new tokens each on top of a
  cached prefix that makes `--context` tokens.
Every backend runs the same steps on the same pool contents in one process, interleaved rounds:
  native   sglang-jax's NativeAttention (its only GPU backend)
  jax_sgl  jax_sgl.integrations.sglang_jax.JaxSglAttention
  none     the K/V write alone, q passed through as the attention output: the step without attention
           (its time is subtracted to give attention's share of the step).
Before timing, the native and jax_sgl steps start from the same pool: last-token logits are compared
(bf16 tolerance) and greedy tokens counted. Also printed: the compiled jax_sgl step's temporary
memory against one layer's pool buffer (a copy of the pool per layer would show there) and the
pool-sized slices / gathers / copies in its HLO.

    python3 benchmarks/bench_sglang_jax.py [--page-sizes 1 16] [--sglang-jax PATH]

sglang-jax is found at --sglang-jax (default ../shared/clients/sglang-jax/python beside the repo) and
needs flax (0.12.4 under jax 0.10, 0.12.10 under jax 0.11) and transformers; the other packages its
modules import are in tests/requirements-sglang-jax.txt. On the GPU machine (no network):
benchmarks/RESULTS.md, "sglang-jax model steps".
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time
import types

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sglang-jax", default=os.path.join(REPO, "..", "shared", "clients", "sglang-jax",
                                                       "python"))
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--intermediate", type=int, default=6144)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--batch", type=int, default=64, help="decode requests")
  p.add_argument("--context", type=int, default=4096, help="tokens per request after the step")
  p.add_argument("--prefill-requests", type=int, default=8)
  p.add_argument("--prefill-chunk", type=int, default=1024)
  p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
  p.add_argument("--backends", nargs="+", default=["native", "jax_sgl", "none"])
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--iters", type=int, default=5)
  return p.parse_args()


def main():
  args = parse_args()
  sys.path.insert(0, os.path.abspath(args.sglang_jax))
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from sgl_jax.srt.layers.attention.base_attn_backend import AttentionBackend
  from sgl_jax.srt.layers.attention.native_backend import NativeAttention
  from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool
  from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
  from sgl_jax.srt.models.qwen3 import QWen3Model
  from sgl_jax.srt.utils.mesh_utils import create_device_mesh
  from transformers import Qwen3Config

  import jax_sgl
  from jax_sgl.integrations.sglang_jax import JaxSglAttention

  mesh = create_device_mesh(ici_parallelism=[1, -1], dcn_parallelism=[1, 1])
  jax.sharding.set_mesh(mesh)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} | jax {jax.__version__} | jax_sgl "
        f"{jax_sgl.attention_backend_info()}", flush=True)

  class NoAttention(AttentionBackend):
    """The K/V write of every backend, then q as the output: a step's cost without attention."""

    def __init__(self):
      self.forward_metadata = None

    def get_forward_metadata(self, batch):
      return None

    def __call__(self, q, k, v, layer, forward_batch, token_to_kv_pool, **kwargs):
      t = q.shape[0]
      buf = token_to_kv_pool.set_kv_buffer_legacy(
          layer.layer_id, forward_batch.out_cache_loc, k.reshape(t, -1, layer.head_dim),
          v.reshape(t, -1, layer.head_dim))
      return q.reshape(t, -1), buf

  H, KVH, D = args.heads, args.kv_heads, args.head_dim
  config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=H, num_key_value_heads=KVH, head_dim=D,
                       max_position_embeddings=2 * args.context, rms_norm_eps=1e-6,
                       attention_bias=False, tie_word_embeddings=True)
  model = QWen3Model(config, mesh=mesh, dtype=jnp.bfloat16)   # random weights
  graphdef, state = nnx.split(model)
  params = sum(x.size for x in jax.tree.leaves(state))
  embed_t = np.asarray(model.embed_tokens.embedding[...], np.float32).T   # tied: the LM head
  print(f"model: Qwen3, {args.layers} layers, hidden {args.hidden}, {H}/{KVH} heads x {D}, "
        f"{params / 1e9:.2f}B parameters, bf16, random weights", flush=True)

  @functools.partial(jax.jit, donate_argnames=("pool",))
  def step(state, batch, pool):
    hidden, _, layers_kv, _ = nnx.merge(graphdef, state)(batch, pool)
    return hidden, layers_kv

  rng = np.random.default_rng(0)
  rows = []
  for page in args.page_sizes:
    # Request r's pages are drawn at random from the pool (page 0 never: slot 0 is sglang-jax's
    # padding slot); both workloads use the same requests' slots.
    reqs = max(args.batch, args.prefill_requests)
    pages_per_req = -(-args.context // page)
    perm = 1 + rng.permutation(reqs * pages_per_req)
    req_pages = perm.reshape(reqs, pages_per_req)
    pool_slots = (reqs * pages_per_req + 1) * page
    pool = MHATokenToKVPool(size=pool_slots, page_size=page, dtype=jnp.bfloat16, head_num=KVH,
                            head_dim=D, layer_num=args.layers, mesh=mesh)
    key = jax.random.key(page)
    pool.kv_buffer = [jax.random.normal(jax.random.fold_in(key, i), b.shape, jnp.bfloat16)
                      for i, b in enumerate(pool.kv_buffer)]
    layer_bytes = pool.kv_buffer[0].nbytes
    print(f"\npage size {page}: pool {pool_slots} slots, {layer_bytes * args.layers / 2**30:.1f} "
          f"GiB ({pool.kv_buffer[0].shape} per layer)", flush=True)

    def slots_of(r, n):
      s = (req_pages[r][:, None] * page + np.arange(page)).ravel()
      return s[:n]

    def make(mode, nreq, extend):
      seq_lens = np.full(nreq, args.context, np.int32)
      extend_lens = np.full(nreq, extend, np.int32)
      prefix = seq_lens - extend
      tokens = nreq * extend
      req_slots = [slots_of(r, args.context) for r in range(nreq)]
      # sglang-jax pads each request's cache_loc to a page multiple; NativeAttention takes the
      # request boundaries from seq_lens, so it gets them unpadded (page size 1, its layout).
      padded = np.concatenate([np.pad(s, (0, pages_per_req * page - args.context))
                               for s in req_slots]).astype(np.int32)
      unpadded = np.concatenate(req_slots).astype(np.int32)
      out_loc = np.concatenate([s[p:] for s, p in zip(req_slots, prefix)]).astype(np.int32)
      positions = np.concatenate([p + np.arange(extend) for p in prefix]).astype(np.int32)
      ids = rng.integers(0, args.vocab, tokens).astype(np.int32)
      decode = mode == ForwardMode.DECODE
      batches = {}
      for name in args.backends:
        cache_loc = unpadded if name == "native" else padded
        meta_in = types.SimpleNamespace(forward_mode=mode, seq_lens=seq_lens,
                                        extend_seq_lens=None if decode else extend_lens,
                                        cache_loc=cache_loc, dp_size=1, spec_info_padded=None)
        backend = {"native": lambda: NativeAttention(H, KVH, mesh),
                   "jax_sgl": lambda: JaxSglAttention(H, KVH, D, page_size=page, mesh=mesh),
                   "none": NoAttention}[name]()
        backend.forward_metadata = backend.get_forward_metadata(meta_in)
        batches[name] = ForwardBatch(
            bid=1, forward_mode=mode, batch_size=nreq, input_ids=jnp.asarray(ids),
            req_pool_indices=jnp.arange(nreq, dtype=jnp.int32), seq_lens=jnp.asarray(seq_lens),
            out_cache_loc=jnp.asarray(out_loc), positions=jnp.asarray(positions),
            attn_backend=backend, cache_loc=jnp.asarray(cache_loc),
            extend_prefix_lens=None if decode else jnp.asarray(prefix),
            extend_seq_lens=None if decode else jnp.asarray(extend_lens))
      last = np.cumsum(extend_lens) - 1
      return batches, last, tokens

    workloads = [("decode", ForwardMode.DECODE, args.batch, 1),
                 ("chunked prefill", ForwardMode.EXTEND, args.prefill_requests, args.prefill_chunk)]
    for label, mode, nreq, extend in workloads:
      batches, last, tokens = make(mode, nreq, extend)
      flops = attention_flops(nreq, extend, args.context, H, D) * args.layers
      print(f"-- {label}: {nreq} requests x {extend} new tokens, context {args.context} "
            f"({tokens} tokens in the step)", flush=True)

      # Compile (and check) each backend's step, from the same pool contents.
      snapshot = [jnp.copy(b) for b in pool.kv_buffer]
      logits, compiled = {}, {}
      for name in args.backends:
        pool.kv_buffer = [jnp.copy(b) for b in snapshot]
        try:
          t0 = time.perf_counter()
          lowered = step.lower(state, batches[name], pool)
          fn = lowered.compile()
          hidden, kv = fn(state, batches[name], pool)
          pool.kv_buffer = list(kv)
          logits[name] = np.asarray(hidden, np.float32)[last] @ embed_t
          compiled[name] = fn
          print(f"   {name}: compiled and ran in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:   # NativeAttention's [tokens, heads, keys] logits can exceed memory
          print(f"   {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                flush=True)
          pool.kv_buffer = [jnp.copy(b) for b in snapshot]
      del snapshot
      if "native" in logits and "jax_sgl" in logits:
        a, b = logits["native"], logits["jax_sgl"]
        scale = float(np.abs(a).max())
        diff = float(np.abs(a - b).max())
        top2 = np.sort(a, axis=-1)[:, -2:]
        decided = (top2[:, 1] - top2[:, 0]) > 2 * diff   # no bf16-level tie between the top two
        same = a.argmax(-1) == b.argmax(-1)
        print(f"   logits jax_sgl vs native: max |diff| {diff:.4f} (max |logit| {scale:.2f}, "
              f"{diff / scale:.2e} relative); greedy tokens equal {int(same.sum())}/{len(same)} "
              f"({int(same[decided].sum())}/{int(decided.sum())} where the top two differ by "
              f"more than 2x that)", flush=True)
      if "jax_sgl" in compiled:
        report_pool_copies(compiled["jax_sgl"], pool.kv_buffer[0].shape, layer_bytes)

      times = {name: [] for name in compiled}
      for _ in range(args.rounds):
        for name in compiled:
          hidden, kv = compiled[name](state, batches[name], pool)   # warm, and syncs the pool
          pool.kv_buffer = list(kv)
          hidden.block_until_ready()
          t0 = time.perf_counter()
          for _ in range(args.iters):
            hidden, kv = compiled[name](state, batches[name], pool)
            pool.kv_buffer = list(kv)
          hidden.block_until_ready()
          times[name].append((time.perf_counter() - t0) / args.iters)
      ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
      base = ms.get("none")
      for name, t in ms.items():
        line = f"   {name:8s} {t:9.2f} ms/step"
        if base is not None and name != "none":
          attn = t - base
          line += (f" | attention {attn:8.2f} ms ({100 * attn / t:4.1f}% of the step, "
                   f"{flops / max(attn, 1e-6) / 1e9:7.1f} TFLOP/s)")
        if "jax_sgl" in ms and name == "native":
          line += f" | jax_sgl {t / ms['jax_sgl']:.2f}x faster"
        print(line, flush=True)
      rows.append((page, label, ms))

  print("\nsummary (ms per model step; speedup = native / jax_sgl):")
  print(f"{'page':>4}  {'workload':16s} {'native':>9} {'jax_sgl':>9} {'none':>9} {'speedup':>8}")
  for page, label, ms in rows:
    n, j, z = (ms.get(k, float("nan")) for k in ("native", "jax_sgl", "none"))
    print(f"{page:4d}  {label:16s} {n:9.2f} {j:9.2f} {z:9.2f} {n / j:7.2f}x")


def attention_flops(nreq, extend, context, heads, head_dim):
  """Causal attention FLOPs of one layer: each new token sees its prefix and itself."""
  keys = sum(context - extend + i + 1 for i in range(extend))
  return 4 * nreq * heads * head_dim * keys


def report_pool_copies(compiled, layer_shape, layer_bytes):
  """The compiled step's temporaries against one layer's pool buffer, and the pool-sized
  slice / gather / copy / transpose / concatenate / pad / convert instructions in its HLO."""
  temp = compiled.memory_analysis().temp_size_in_bytes
  rows = {str(layer_shape[0]), str(layer_shape[0] * layer_shape[1])}
  ops = r"(slice|dynamic-slice|gather|copy|transpose|concatenate|pad|convert)\("
  found = [line.strip()[:160] for line in compiled.as_text().splitlines()
           if re.search(r"=\s*\S+\s+" + ops, line)
           and re.search(r"\[(" + "|".join(rows) + r"),", line.split("=", 1)[1])]
  print(f"   jax_sgl step: temporaries {temp / 2**20:.1f} MiB (one layer's pool buffer: "
        f"{layer_bytes / 2**20:.1f} MiB); pool-sized slice/gather/copy/convert in its HLO: "
        f"{len(found)}", flush=True)
  for line in found[:4]:
    print(f"     {line}", flush=True)


if __name__ == "__main__":
  main()
