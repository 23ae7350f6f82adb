"""Which CUDA kernels a program's attention calls would run on a given GPU, asked on any machine.

The function is lowered for CUDA (no GPU needed), and each jax_sgl attention custom call in the
result is planned by the CUDA handlers' own dispatch (ffi/cuda/attention/plan_probe.cc:
FillAttentionParams, then ChooseFwdKernel / ChooseBwdKernel) for a device of the given compute
capability, from the call's operand shapes and attributes. The tests check the dispatch with it
for devices this machine does not have; docs/kernels.md names the kernels.

  >>> cuda_attention_kernels(lambda q, k, v: attention(q, k, v, causal=True), q, k, v,
  ...                        compute_capability=(9, 0))
  [('fwd', 'sm90')]
"""

from __future__ import annotations

import jax
from jax._src.lib.mlir import ir

from jax_sgl._registration import CUDA_TARGETS, _ext
from jax_sgl.attention import BWD_TARGET, TARGET

# MLIR element types of the operands, as numpy names (plan_probe.cc's table).
_ELEMENT_TYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32",
                  "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2",
                  "f8E8M0FNU": "float8_e8m0fnu"}
_FWD_OPERANDS = 11  # q, k, v and the eight optional operands (attention.OPTIONAL)


def cuda_attention_kernels(fn, *args, compute_capability=(9, 0), num_sms=132,
                           **kwargs) -> list[tuple[str, str]]:
  """[(direction, kernel)] for each jax_sgl attention call of `fn(*args, **kwargs)` lowered for
  CUDA, in program order: direction "fwd" or "bwd", kernel a name from docs/kernels.md ("sm90",
  "decode_warp_tma", "portable", "sm90_bwd", ...) or "none: <why>". A backward that CUDA lowers
  to the reference (e.g. head dims above 128 lowered without a local Hopper GPU) has no native
  call, so no "bwd" entry.
  Needs the CUDA build of the extension (the dispatch code is compiled with it)."""
  if not CUDA_TARGETS:
    raise RuntimeError("jax_sgl: cuda_attention_kernels needs the extension built with CUDA")
  major, minor = compute_capability
  lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
  found = []
  for op in _operations(lowered.compiler_ir("stablehlo").body):
    if op.name != "stablehlo.custom_call":
      continue
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target not in (TARGET, BWD_TARGET):
      continue
    backward = target == BWD_TARGET
    operands = [_shape(v.type) for v in op.operands]
    # The planner takes the forward's operands, out and lse: the backward's operands 11 and 12.
    tail = operands[_FWD_OPERANDS:_FWD_OPERANDS + 2] if backward else [
        _shape(r.type) for r in op.results]
    attrs = _attributes(op.attributes["mhlo.backend_config"])
    kernel = _ext.attention_plan(backward, operands[:_FWD_OPERANDS] + tail, attrs, major, minor,
                                 num_sms)
    found.append(("bwd" if backward else "fwd", kernel))
  return found


def _operations(block):
  """Every operation under a block, nested regions included, in order."""
  for op in block.operations:
    op = op.operation
    yield op
    for region in op.regions:
      for inner in region.blocks:
        yield from _operations(inner)


def _shape(t) -> tuple[list[int], str]:
  tensor = ir.RankedTensorType(t)
  return list(tensor.shape), _ELEMENT_TYPES.get(str(tensor.element_type),
                                                str(tensor.element_type))


def _is(attr, cls) -> bool:
  # Newer MLIR bindings return typed attributes (isinstance); older ones, generic ones with a
  # static isinstance test.
  return cls.isinstance(attr) if hasattr(cls, "isinstance") else isinstance(attr, cls)


def _attributes(config) -> dict:
  d = ir.DictAttr(config)
  out = {}
  for i in range(len(d)):
    named = d[i]
    a = named.attr
    if _is(a, ir.BoolAttr):
      out[named.name] = ir.BoolAttr(a).value
    elif _is(a, ir.IntegerAttr):
      out[named.name] = ir.IntegerAttr(a).value
    else:
      out[named.name] = ir.FloatAttr(a).value
  return out
