"""The main job: a tiny random-weight decoder serving ragged prompts through a paged KV cache.

  jax-sgl-demo [--layers 2] [--steps 16] [--dtype float32] [--devices N]
  (or python -m jax_sgl.demo, from outside the source tree)

Prefill packs the prompts (varlen attention over the rotated keys, `rope_pool_fused` writing every
prompt token into the page pool); then each decode step rotates and writes one token per sequence
and reads the whole cache back through the page table (paged attention). Both steps run under
`jax.jit` with the pools donated, so the cache is updated in place. The same model written with
`jax_sgl.reference` runs beside it on the same tokens; the demo prints the backend, the largest
logit error and the decode throughput, and exits non-zero when the two disagree.

`--devices N` runs jax_sgl's model tensor-parallel over N devices: q heads, KV heads and the
pools' head axis split over a 1-D mesh ('model',) (wq/wk/wv by columns, wo by rows), so every
device runs the kernels on its own whole GQA groups; the model gets max(2, N) KV heads (4 q heads each) so N
divides them. On the CPU, when fewer than N devices exist, the demo reruns itself in a child
process with XLA_FLAGS=--xla_force_host_platform_device_count=N (the flag must be set before
jax starts its CPU backend). The reference model runs unsharded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sgl
from jax_sgl import reference
from jax_sgl._checks import KV_DENSE, KV_PAGED, KV_VARLEN


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 512
  hidden: int = 256
  layers: int = 2
  num_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64
  page_size: int = 16
  num_pages: int = 64
  max_pages: int = 8          # per sequence: up to 128 tokens
  rope_base: float = 10000.0


def init_params(cfg: Config, key, dtype):
  def dense(key, shape):
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[0])).astype(dtype)
  keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))
  hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  def kv_blocks(w):   # wk and wv as separate matrices, so each splits by heads on its own
    return {"wk": w[:, :hkv], "wv": w[:, hkv:]}
  return {
      "embed": (jax.random.normal(next(keys), (cfg.vocab, cfg.hidden)) * 0.5).astype(dtype),
      "unembed": dense(next(keys), (cfg.hidden, cfg.vocab)),
      "layers": [{"wq": dense(next(keys), (cfg.hidden, hq)),
                  **kv_blocks(dense(next(keys), (cfg.hidden, 2 * hkv))),
                  "wo": dense(next(keys), (hq, cfg.hidden)),
                  "w1": dense(next(keys), (cfg.hidden, cfg.hidden))} for _ in range(cfg.layers)],
  }


def rms_norm(x):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)


class Ops:
  """The two kernels the model calls: jax_sgl's, or the reference's on the same arguments."""

  def __init__(self, use_reference: bool):
    self.use_reference = use_reference

  def rope_pool(self, cfg, q, k, v, positions, slots, k_pool, v_pool):
    if self.use_reference:
      return reference.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool,
                                       rope_base=cfg.rope_base)
    return jax_sgl.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool,
                                   rope_base=cfg.rope_base)

  def attention(self, cfg, q, k, v, **arrays):
    if not self.use_reference:
      return jax_sgl.attention(q, k, v, causal=True, **arrays)
    if "page_table" in arrays:
      layout, varlen_q = KV_PAGED, False
    else:
      layout, varlen_q = (KV_VARLEN, True) if "cu_seqlens_k" in arrays else (KV_DENSE, False)
    batch = arrays["seqused_k"].shape[0] if "seqused_k" in arrays else \
        arrays["cu_seqlens_q"].shape[0] - 1
    out, _ = reference.attention(q, k, v, kv_layout=layout, varlen_q=varlen_q, batch=batch,
                                 softmax_scale=cfg.head_dim ** -0.5, causal=True, **arrays)
    return out


def layer_qkv(cfg, p, x):
  h = rms_norm(x)
  q = (h @ p["wq"]).reshape(-1, cfg.num_heads, cfg.head_dim)
  k, v = ((h @ p[w]).reshape(-1, cfg.num_kv_heads, cfg.head_dim) for w in ("wk", "wv"))
  return q, k, v


def layer_out(p, x, attn):
  x = x + attn.reshape(x.shape[0], -1) @ p["wo"]
  return x + jax.nn.gelu(rms_norm(x) @ p["w1"])


def prefill(ops, cfg, params, pools, tokens, positions, slots, cu_seqlens):
  """tokens [total] packed prompts; returns logits of each prompt's last token and the pools."""
  x = params["embed"][tokens]
  new_pools = []
  for p, (k_pool, v_pool) in zip(params["layers"], pools):
    q, k, v = layer_qkv(cfg, p, x)
    q, k, k_pool, v_pool = ops.rope_pool(cfg, q, k, v, positions, slots, k_pool, v_pool)
    attn = ops.attention(cfg, q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)
    x = layer_out(p, x, attn)
    new_pools.append((k_pool, v_pool))
  last = x[cu_seqlens[1:] - 1]
  return (rms_norm(last) @ params["unembed"]).astype(jnp.float32), new_pools


def decode(ops, cfg, params, pools, tokens, lengths, page_table):
  """One token per sequence at position lengths[b]; returns logits and the pools."""
  x = params["embed"][tokens]
  page = page_table[jnp.arange(tokens.shape[0]), lengths // cfg.page_size]
  slots = page * cfg.page_size + lengths % cfg.page_size
  paged_shape = (cfg.num_pages, cfg.page_size, cfg.num_kv_heads, cfg.head_dim)
  new_pools = []
  for p, (k_pool, v_pool) in zip(params["layers"], pools):
    q, k, v = layer_qkv(cfg, p, x)
    q, k, k_pool, v_pool = ops.rope_pool(cfg, q, k, v, lengths, slots, k_pool, v_pool)
    attn = ops.attention(cfg, q[:, None], k_pool.reshape(paged_shape),
                         v_pool.reshape(paged_shape), page_table=page_table,
                         seqused_k=lengths + 1)
    x = layer_out(p, x, attn[:, 0])
    new_pools.append((k_pool, v_pool))
  return (rms_norm(x) @ params["unembed"]).astype(jnp.float32), new_pools


def shard_params(params, mesh):
  """Tensor parallel over heads: wq/wk/wv by columns (whole heads per device), wo by rows (its
  product is summed over devices); the rest replicated."""
  split = {"wq": P(None, "model"), "wk": P(None, "model"), "wv": P(None, "model"),
           "wo": P("model", None)}
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  return {"embed": put(params["embed"], P()), "unembed": put(params["unembed"], P()),
          "layers": [{k: put(w, split.get(k, P())) for k, w in p.items()}
                     for p in params["layers"]]}


def serve(ops, cfg, params, prompts, steps, dtype, forced=None, mesh=None):
  """Prefill + `steps` greedy decode steps; the fed tokens are `forced[step]` when given. With a
  mesh, the pools are split over KV heads (params already placed by shard_params)."""
  rng = np.random.default_rng(0)
  batch = len(prompts)
  lens = np.array([len(p) for p in prompts], np.int32)
  # Pages handed out in a shuffled order, as a serving engine's allocator would.
  order = rng.permutation(cfg.num_pages)[: batch * cfg.max_pages]
  page_table = jnp.asarray(order.reshape(batch, cfg.max_pages), jnp.int32)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
  seq_of = np.repeat(np.arange(batch), lens)
  slots = np.asarray(page_table)[seq_of, positions // cfg.page_size] * cfg.page_size + \
      positions % cfg.page_size
  pool_shape = (cfg.num_pages * cfg.page_size, cfg.num_kv_heads, cfg.head_dim)
  pools = [(jnp.zeros(pool_shape, dtype), jnp.zeros(pool_shape, dtype))
           for _ in range(cfg.layers)]
  if mesh is not None:
    pools = jax.device_put(pools, NamedSharding(mesh, P(None, "model", None)))

  prefill_fn = jax.jit(lambda params, pools, *a: prefill(ops, cfg, params, pools, *a),
                       donate_argnums=1)
  decode_fn = jax.jit(lambda params, pools, *a: decode(ops, cfg, params, pools, *a),
                      donate_argnums=1)
  logits, pools = prefill_fn(params, pools, jnp.asarray(np.concatenate(prompts)),
                             jnp.asarray(positions), jnp.asarray(slots, np.int32),
                             jnp.asarray(cu))
  all_logits = [logits]
  lengths = jnp.asarray(lens)
  start = None
  for step in range(steps):
    tokens = jnp.argmax(logits, -1).astype(jnp.int32) if forced is None else forced[step]
    logits, pools = decode_fn(params, pools, tokens, lengths, page_table)
    all_logits.append(logits)
    lengths = lengths + 1
    if start is None:           # the first step compiles: time the rest
      jax.block_until_ready(logits)
      start = time.perf_counter()
  jax.block_until_ready(logits)
  elapsed = time.perf_counter() - start
  return all_logits, elapsed, pools


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--steps", type=int, default=16, help="decode steps (>= 2)")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--devices", type=int, default=1,
                      help="split heads over N devices (CPU: virtual devices if needed)")
  args = parser.parse_args(argv)
  if args.devices < 1:
    parser.error("--devices must be >= 1")
  if args.devices > len(jax.devices()):
    if jax.default_backend() != "cpu":
      parser.error(f"--devices {args.devices}: only {len(jax.devices())} devices")
    return _rerun_with_cpu_devices(args.devices, sys.argv[1:] if argv is None else argv)

  kv_heads = max(Config.num_kv_heads, args.devices)
  cfg = Config(layers=args.layers, num_kv_heads=kv_heads,
               num_heads=kv_heads * (Config.num_heads // Config.num_kv_heads))
  mesh = None
  if args.devices > 1:
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("model",))
  dtype = jnp.dtype(args.dtype)
  max_len = cfg.max_pages * cfg.page_size
  rng = np.random.default_rng(args.seed)
  prompt_lens = [5, 23, 1, 40, 17, 64]
  if args.steps < 2:
    parser.error("--steps must be >= 2 (the first step compiles and is not timed)")
  if max(prompt_lens) + args.steps > max_len:
    parser.error(f"--steps too large: prompts + steps must fit {max_len} tokens")
  prompts = [rng.integers(0, cfg.vocab, n).astype(np.int32) for n in prompt_lens]
  params = init_params(cfg, jax.random.PRNGKey(args.seed), dtype)
  our_params = params if mesh is None else shard_params(params, mesh)

  # Greedy decoding from nearly equal logits could fork on a near-tie, so the reference model is
  # fed jax_sgl's tokens and the logits are compared at every step.
  ours, elapsed, our_pools = serve(Ops(False), cfg, our_params, prompts, args.steps, dtype,
                                   mesh=mesh)
  fed = [jax.device_get(jnp.argmax(l, -1).astype(jnp.int32)) for l in ours[:-1]]
  theirs, _, _ = serve(Ops(True), cfg, params, prompts, args.steps, dtype, forced=fed)
  ours = [jax.device_get(l) for l in ours]
  scale = max(float(jnp.max(jnp.abs(t))) for t in theirs)
  err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ours, theirs)) / scale
  tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}[args.dtype]
  same_tokens = all(bool(jnp.all(jnp.argmax(a, -1) == jnp.argmax(b, -1)))
                    for a, b in zip(ours, theirs))

  backend = jax.default_backend()
  kernels = "native" if (backend == "cpu" and jax_sgl.CPU_TARGETS) or \
      (backend == "gpu" and jax_sgl.CUDA_TARGETS) else "reference fallback"
  print(f"jax_sgl demo: backend={backend} ({kernels} kernels), device={jax.devices()[0]}")
  print(f"  model: {cfg.layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads (GQA), "
        f"head_dim {cfg.head_dim}, {args.dtype}; {len(prompts)} prompts of {prompt_lens} tokens")
  print(f"  paged KV: {cfg.num_pages} pages x {cfg.page_size} tokens, pools donated under jit")
  if mesh is not None:
    print(f"  sharded: heads over {args.devices} devices, pool sharding "
          f"{our_pools[0][0].sharding.spec}")
  timed = args.steps - 1
  print(f"  decode: {timed} timed steps x {len(prompts)} sequences in {elapsed * 1e3:.1f} ms = "
        f"{timed * len(prompts) / max(elapsed, 1e-9):.1f} tokens/s")
  print(f"  max |logit error| vs jax_sgl.reference: {err:.2e} of max |logit| (tolerance {tol:.0e});"
        f" reference's own greedy picks {'agree' if same_tokens else 'differ at a near-tie'}")
  ok = err <= tol
  print("  OK" if ok else "  MISMATCH")
  return 0 if ok else 1


def _rerun_with_cpu_devices(n: int, argv) -> int:
  """Runs the demo in a child process whose CPU backend has n devices (XLA reads the flag only
  when the backend starts, which it already has in this process)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" in flags:   # set, and still too few: don't loop
    print(f"jax_sgl demo: XLA_FLAGS={flags!r} gives {len(jax.devices())} devices, < {n}")
    return 1
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={n}".strip(),
             JAX_PLATFORMS="cpu")
  # Run from the installed package's parent: `-m` puts the working directory first on sys.path,
  # where a source checkout (which has no compiled extension) would shadow the installed package.
  site = os.path.dirname(os.path.dirname(os.path.abspath(jax_sgl.__file__)))
  proc = subprocess.run([sys.executable, "-m", "jax_sgl.demo", *argv], env=env, cwd=site)
  return proc.returncode


if __name__ == "__main__":
  sys.exit(main())
