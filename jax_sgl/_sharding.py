"""Sharding rules: how jax_sgl's primitives run under `jax.jit` with sharded operands.

Each primitive keeps its abstract eval, batching rule and vjp; only its lowering changes. It
lowers to a `jax.experimental.custom_partitioning` call around a per-device twin primitive
(`<name>_local`: same abstract eval, the native/reference lowerings). With one device the call
lowers inline to the twin. On a mesh, the Shardy rule (or, with the GSPMD partitioner,
`infer_sharding_from_operands`) lets shardings propagate through the op, and `partition` fixes the
sharding it runs with; the per-device body binds the twin on its block with the head counts and
batch divided. No collective runs inside the op.

Supported shardings (taken from the operands, no data moved):
  attention        heads: q's head axis and k/v's KV head axis over the same mesh axes, which
                   must divide num_kv_heads (so every device holds whole GQA groups: its q heads
                   [i*H/n, (i+1)*H/n) and their KV heads [i*Hkv/n, (i+1)*Hkv/n)). A fused
                   kv_buffer splits its 2 * Hkv head axis the same way: whole K/V pairs.
                   batch: dense layout, and paged KV with dense q (page_table/seqused_k split on
                   batch, the pools replicated on their page axis). Varlen q/k keep the batch whole
                   (cu_seqlens hold global offsets).
  rope_pool_fused  KV heads: q heads, k/v heads and the pools' head axis split together; tokens,
                   positions, slots and the pools' slot axis replicated, so each pool shard
                   receives every token's write for its heads. A fused kv_buffer splits on its
                   head axis (K and V of a head stay together); a 5-D one with a packing other
                   than 1 or 2 runs replicated.
Every other sharding (the sequence/token axis, head_dim, the pools' slot or page axis, a head
split not dividing num_kv_heads, varlen batch) is resharded by XLA to the supported one before the
op (an all-gather of that operand) and the result is correct; only speed is lost. Token-sharded
rope_pool_fused in particular becomes token-replicated: a token-sharded write into slot-replicated
pools would leave each pool replica with only its own tokens' rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jax import lax
from jax._src import dispatch  # prim_requires_devices_during_lowering: no public API
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_sgl._checks import KV_DENSE, KV_PAGED, KV_VARLEN

# --------------------------------------------------------------------------------------------
# generic machinery
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How one op instance runs on a mesh: mesh axes of the head and batch splits (() = none)."""
  heads: tuple[str, ...]
  batch: tuple[str, ...]


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _dim_axes(shape, dim: int) -> tuple[str, ...]:
  """Mesh axes splitting dimension `dim` of an operand (() if unsharded or not a NamedSharding)."""
  sharding = getattr(shape, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return ()
  spec = tuple(sharding.spec) + (None,) * len(shape.shape)
  return _axes(spec[dim % len(shape.shape)])


def _shapes(values) -> list[tuple[int, ...]]:
  """The shapes of a partitioning callback's operands (ShapeDtypeStructs or MLIR types)."""
  return [tuple(v.shape) for v in values]


def _pick(mesh, candidates, sizes, taken=()) -> tuple[str, ...]:
  """The first candidate axes whose mesh size divides every size and which avoid `taken`."""
  for axes in candidates:
    if not axes or set(axes) & set(taken):
      continue
    n = math.prod(mesh.shape[a] for a in axes)
    if all(s % n == 0 for s in sizes):
      return axes
  return ()


def _mesh_size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class _OpRules:
  """The op-specific part: which operands the partitioned call takes, their factor strings, and
  the shardings/local params of a plan."""
  select: Callable        # (params, args) -> operands of the partitioned call
  restore: Callable       # (params, operands) -> all operands of the twin primitive
  rule: Callable          # (params, shapes) -> (Shardy rule string, str_to_sdy_sharding_rule's
                          # kwargs); shapes: the operands' shapes, as tuples
  plan: Callable          # (params, mesh, arg_shapes) -> _Plan
  shardings: Callable     # (params, mesh, plan, shapes) -> (arg specs, result specs),
                          # PartitionSpecs
  local_params: Callable  # (params, mesh, plan) -> params of the per-device twin


def _partitioned(prim: Primitive, abstract_eval: Callable, rules: _OpRules) -> Primitive:
  local = Primitive(prim.name + "_local")
  local.multiple_results = prim.multiple_results
  local.def_abstract_eval(abstract_eval)

  def call(static, *ops):
    params = dict(static)
    return local.bind(*rules.restore(params, ops), **params)

  def named(mesh, specs):
    return [NamedSharding(mesh, s) for s in specs]

  def partition(static, mesh, arg_shapes, result_shape):
    params = dict(static)
    plan = rules.plan(params, mesh, arg_shapes)
    arg_specs, result_specs = rules.shardings(params, mesh, plan, _shapes(arg_shapes))
    local_params = rules.local_params(params, mesh, plan)

    def lower_fn(*ops):
      return local.bind(*rules.restore(params, ops), **local_params)
    # The trees custom_partitioning expects: operands a tuple, results bind's list.
    return mesh, lower_fn, named(mesh, result_specs), tuple(named(mesh, arg_specs))

  def infer(static, mesh, arg_shapes, result_shape):
    params = dict(static)
    _, result_specs = rules.shardings(params, mesh, rules.plan(params, mesh, arg_shapes),
                                      _shapes(arg_shapes))
    return named(mesh, result_specs)

  def sharding_rule(static, mesh, value_types, result_types):
    return rules.rule(dict(static), _shapes(value_types))

  cp = custom_partitioning(call, static_argnums=(0,))
  cp.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule)

  def lowering(ctx, *args, **params):
    static = tuple(sorted(params.items()))
    fn = lambda *a: cp(static, *rules.select(params, a))
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

  mlir.register_lowering(prim, lowering)
  # Lowering a custom_partitioning call needs the device assignment, which jit computes only for
  # primitives listed here (jax's own cuDNN attention registers its wrappers the same way).
  dispatch.prim_requires_devices_during_lowering.add(prim)
  return local


def _heads(g: int) -> str:
  """q's head factor: KV heads k times group g, so splitting k splits q heads GQA-aligned."""
  return "(k g)" if g > 1 else "k"


def _rule(operands, results, replicated, g, **sizes):
  """`sizes`: the sizes of other inner factors of compound dimensions (as g is q's)."""
  text = " ".join(operands + results).replace("(", " ").replace(")", " ").split()
  factors = list(dict.fromkeys(text))   # Shardy numbers factors by first use and wants the
  kwargs = {"need_replication_factors": tuple(f for f in factors if f in replicated)}  # order
  if g > 1:
    kwargs["g"] = g
  kwargs.update({f: n for f, n in sizes.items() if f in factors})
  return ", ".join(operands) + " -> " + ", ".join(results), kwargs


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------
# Factors: b batch, s/n query rows (dense/packed), t/m key rows (dense/packed), p pages, r page
# size, x max pages, c batch + 1, k KV heads, g group, d head_dim, e head_dim_v; a fused kv_buffer
# [p, r, 2 * Hkv, head_dim_pad] is "p r (k i) w": i the K/V pair (2, innermost, so a head split
# keeps whole pairs on a device), w the padded head dim; f the blocks of q/k block scales
# (head_dim // 32); o a per-tensor descale's single entry.

_ATTN_OPTIONAL = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale",
                  "k_descale", "v_descale", "sinks")


def _attn_names(params) -> list[str]:
  return ["q", "k", "v"] + [n for n, p in zip(_ATTN_OPTIONAL, params["present"]) if p]


def _attn_select(params, args):
  return tuple(args[:3]) + tuple(a for a, p in zip(args[3:], params["present"]) if p)


def _attn_restore(params, ops):
  ops = list(ops)
  out = ops[:3]
  given = iter(ops[3:])
  for name, p in zip(_ATTN_OPTIONAL, params["present"]):
    if p:
      out.append(next(given))
    else:   # absent optional operands travel as empty arrays (see attention.py)
      dtype = "int32" if name in _ATTN_OPTIONAL[:4] else "float32"
      out.append(lax.full((0,), 0, dtype))
  return out


def _attn_batch_split(spec) -> bool:
  return not spec.varlen_q and spec.kv_layout in (KV_DENSE, KV_PAGED)


def _per_head_descales(params, shapes) -> dict[str, int]:
  """The present per-head descales' ranks by name: 2 for [B, Hkv], 1 for [Hkv], 0 per tensor
  ([1]: attention.py passes [Hkv] and per-tensor scales unbroadcast, see HeadDescale)."""
  spec = params["spec"]
  names = ("v_descale",) if spec.qk_blockscaled else ("q_descale", "k_descale", "v_descale")
  ranks = {}
  for name, shape in zip(_attn_names(params), shapes):
    if name in names:
      ranks[name] = len(shape) if len(shape) == 2 or shape[0] == spec.num_kv_heads else 0
  return ranks


def _attn_factors(spec, descales):
  h = _heads(spec.num_heads // spec.num_kv_heads)
  q_rows = "n" if spec.varlen_q else "b s"
  pages = "p" if spec.token_pool else "p r"
  kv = {KV_DENSE: "b t k", KV_VARLEN: "m k", KV_PAGED: f"{pages} k"}[spec.kv_layout]
  k, v = ((f"{pages} (k i) w",) * 2) if spec.kv_buffer else (f"{kv} d", f"{kv} e")
  per_name = {"q": f"{q_rows} {h} d", "k": k, "v": v, "cu_seqlens_q": "c",
              "cu_seqlens_k": "c", "seqused_k": "b", "page_table": "b x", "sinks": h}
  if spec.qk_blockscaled:   # block scales: q's and K's factors (a fused buffer's K view: paged)
    per_name["q_descale"], per_name["k_descale"] = f"{q_rows} {h} f", f"{kv} f"
  per_name.update({name: ("o", "k", "b k")[rank] for name, rank in descales.items()})
  lse = f"{h} n" if spec.varlen_q else f"b {h} s"
  return per_name, [f"{q_rows} {h} e", lse]


def _attn_sizes(spec) -> dict[str, int]:
  """Sizes Shardy cannot infer: a fused buffer's "(k i)" pair factor, and k, which with GQA q
  "(k g)" appears in compound factors only."""
  return {"k": spec.num_kv_heads, "i": 2} if spec.kv_buffer else {}


def _attn_replicated(spec) -> list[str]:
  replicated = ["s", "n", "t", "m", "p", "r", "x", "c", "d", "e", "i", "w", "f", "o"]
  if not _attn_batch_split(spec):
    replicated.append("b")
  return replicated


def _attn_rule(params, shapes):
  spec = params["spec"]
  per_name, results = _attn_factors(spec, _per_head_descales(params, shapes))
  return _rule([per_name[n] for n in _attn_names(params)], results, _attn_replicated(spec),
               spec.num_heads // spec.num_kv_heads, **_attn_sizes(spec))


def _attn_plan(params, mesh, arg_shapes):
  spec = params["spec"]
  q, k = arg_shapes[0], arg_shapes[1]
  heads = _pick(mesh, (_dim_axes(q, -2), _dim_axes(k, -2)), (spec.num_kv_heads,))
  batch = ()
  if _attn_batch_split(spec):
    candidates = [_dim_axes(q, 0)]
    if spec.kv_layout == KV_DENSE:
      candidates.append(_dim_axes(k, 0))
    batch = _pick(mesh, candidates, (spec.batch,), taken=heads)
  return _Plan(heads=heads, batch=batch)


def _attn_shardings(params, mesh, plan, shapes):
  spec = params["spec"]
  h, b = _entry(plan.heads), _entry(plan.batch)
  q = P(None, h, None) if spec.varlen_q else P(b, None, h, None)
  kv = {KV_DENSE: P(b, None, h, None), KV_VARLEN: P(None, h, None),
        KV_PAGED: P(None, h, None) if spec.token_pool else P(None, None, h, None)}[spec.kv_layout]
  per_name = {"q": q, "k": kv, "v": kv, "cu_seqlens_q": P(None), "cu_seqlens_k": P(None),
              "seqused_k": P(b), "page_table": P(b, None), "sinks": P(h)}
  if spec.qk_blockscaled:   # block scales split as q and k (a fused buffer's K view as a pool)
    per_name["q_descale"], per_name["k_descale"] = q, kv
  per_name.update({name: (P(None), P(h), P(b, h))[rank]
                   for name, rank in _per_head_descales(params, shapes).items()})
  lse = P(h, None) if spec.varlen_q else P(b, h, None)
  return [per_name[n] for n in _attn_names(params)], [q, lse]


def _attn_local_params(params, mesh, plan):
  spec = params["spec"]
  nh, nb = _mesh_size(mesh, plan.heads), _mesh_size(mesh, plan.batch)
  local = dataclasses.replace(spec, batch=spec.batch // nb, num_heads=spec.num_heads // nh,
                              num_kv_heads=spec.num_kv_heads // nh)
  return {**params, "spec": local}


_ATTENTION_RULES = _OpRules(_attn_select, _attn_restore, _attn_rule, _attn_plan,
                            _attn_shardings, _attn_local_params)


def partition_attention(prim: Primitive, abstract_eval: Callable) -> Primitive:
  """Makes the attention primitive shardable; returns its per-device twin, on which the caller
  registers the native and reference lowerings."""
  return _partitioned(prim, abstract_eval, _ATTENTION_RULES)


# The backward takes the forward's operands, then out, lse, dout, dlse, and returns dq, dk, dv:
# out/dout shard like the output, lse/dlse like the lse, the gradients like q, k, v.
_BWD_EXTRA = ("out", "lse", "dout", "dlse")


def _attn_bwd_select(params, args):
  n = 3 + len(_ATTN_OPTIONAL)
  return _attn_select(params, args[:n]) + tuple(args[n:])


def _attn_bwd_restore(params, ops):
  n = len(ops) - len(_BWD_EXTRA)
  return _attn_restore(params, ops[:n]) + list(ops[n:])


def _attn_bwd_rule(params, shapes):
  spec = params["spec"]
  per_name, (out, lse) = _attn_factors(spec, _per_head_descales(params, shapes))
  per_name.update(out=out, dout=out, lse=lse, dlse=lse)
  names = _attn_names(params) + list(_BWD_EXTRA)
  return _rule([per_name[n] for n in names], [per_name[n] for n in ("q", "k", "v")],
               _attn_replicated(spec), spec.num_heads // spec.num_kv_heads, **_attn_sizes(spec))


def _attn_bwd_shardings(params, mesh, plan, shapes):
  args, (out, lse) = _attn_shardings(params, mesh, plan, shapes)
  return args + [out, lse, out, lse], args[:3]


_ATTENTION_BWD_RULES = _OpRules(_attn_bwd_select, _attn_bwd_restore, _attn_bwd_rule, _attn_plan,
                                _attn_bwd_shardings, _attn_local_params)


def partition_attention_bwd(prim: Primitive, abstract_eval: Callable) -> Primitive:
  """As partition_attention, for the backward primitive."""
  return _partitioned(prim, abstract_eval, _ATTENTION_BWD_RULES)


# --------------------------------------------------------------------------------------------
# rope_pool_fused
# --------------------------------------------------------------------------------------------
# Operands q, k, v, positions, slots, inv_freq, kv_scales, then k_pool and v_pool or one fused
# kv_buffer. Factors: t tokens, i frequencies, j k's and v's scales of an fp8 pool ([2, Hkv]; z the
# empty operand without one), n slots (or pages), r page size, k KV heads, g group, d head_dim,
# e the buffer's padded head dim, c = 2 (K and V of one head, adjacent on the buffer's head axis),
# u a packing axis of size 1. The buffer's head axis is (k c): split over k it hands each device
# whole KV heads, K and V together.


def _kv_buffer_factors(spec):
  """The fused buffer's factor string and the index of the dimension that carries k, or None when
  its head axis cannot be split with k (a 5-D packing other than 1 or 2: kept whole)."""
  if spec.kv_buffer_ndim == 3:
    return "n (k c) e", 1
  if spec.kv_buffer_ndim == 4:
    return "n r (k c) e", 2
  if spec.kv_buffer_packing == 1:
    return "n r (k c) u e", 2
  if spec.kv_buffer_packing == 2:   # [pages, page_size, Hkv, 2, Dp]: K and V on the packing axis
    return "n r k c e", 2
  return "n r b2 b3 e", None


def _rope_rule(params, shapes):
  spec = params["spec"]
  g = spec.num_qo_heads // spec.num_kv_heads
  h = _heads(g)
  flat = [f"t {h} d", "t k d", "t k d", "t", "t", "i", "j k" if spec.kv_scaled else "z"]
  if spec.kv_buffer_ndim:
    buf, head_dim = _kv_buffer_factors(spec)
    operands, results = flat + [buf], [f"t {h} d", "t k d", buf]
    replicated = ["t", "i", "j", "z", "n", "r", "c", "u", "d", "e", "b2", "b3"] + \
        ([] if head_dim is not None else ["k", "g"])
  else:
    operands = flat + ["n k d", "n k d"]
    results = [f"t {h} d", "t k d", "n k d", "n k d"]
    replicated = ["t", "i", "j", "z", "n", "d"]
  rule, kwargs = _rule(operands, results, replicated, g)
  if "(k c)" in rule:   # c's size is given only where it shares a dimension with k
    kwargs["c"] = 2
  return rule, kwargs


def _rope_pool_head_dim(spec):
  """The head axis of the pool operand (7): 1 for k_pool, the buffer's k dimension, or None."""
  return _kv_buffer_factors(spec)[1] if spec.kv_buffer_ndim else 1


def _rope_plan(params, mesh, arg_shapes):
  spec = params["spec"]
  pool_dim = _rope_pool_head_dim(spec)
  if pool_dim is None:
    return _Plan(heads=(), batch=())
  candidates = [_dim_axes(arg_shapes[0], 1), _dim_axes(arg_shapes[1], 1),
                _dim_axes(arg_shapes[7], pool_dim)]   # q, k and pool head axes
  return _Plan(heads=_pick(mesh, candidates, (spec.num_kv_heads,)), batch=())


def _rope_shardings(params, mesh, plan, shapes):
  spec = params["spec"]
  heads = P(None, _entry(plan.heads), None)
  scales = P(None, _entry(plan.heads)) if spec.kv_scaled else P(None)
  flat = [heads, heads, heads, P(None), P(None), P(None), scales]
  if spec.kv_buffer_ndim:
    pool_dim = _rope_pool_head_dim(spec)
    buffer = P(*[_entry(plan.heads) if i == pool_dim else None
                 for i in range(spec.kv_buffer_ndim)])
    return flat + [buffer], [heads, heads, buffer]
  return flat + [heads, heads], [heads] * 4


def _rope_local_params(params, mesh, plan):
  spec = params["spec"]
  n = _mesh_size(mesh, plan.heads)
  local = dataclasses.replace(spec, num_qo_heads=spec.num_qo_heads // n,
                              num_kv_heads=spec.num_kv_heads // n)
  return {**params, "spec": local}


_ROPE_RULES = _OpRules(lambda params, args: tuple(args), lambda params, ops: list(ops),
                       _rope_rule, _rope_plan, _rope_shardings, _rope_local_params)


def partition_rope_pool(prim: Primitive, abstract_eval: Callable) -> Primitive:
  """Makes the rope_pool primitive shardable over KV heads; returns its per-device twin (which
  keeps the pool aliasing of the native lowering)."""
  return _partitioned(prim, abstract_eval, _ROPE_RULES)
