"""jax_sgl ops under sharded jit on 8 virtual CPU devices (issue 5).

The cases live in sharding_cases.py and run in one subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, so this pytest session keeps its single
device; each case is reported as its own test, under Shardy (jax's default partitioner) and under
GSPMD. Every case checks the sharded result against the unsharded one; the supported shardings
also check that the compiled HLO has no collective, that donated pools are consumed and not
copied, and the output shardings.
"""

import functools
import os
import subprocess
import sys

import pytest

CASES_SCRIPT = os.path.join(os.path.dirname(__file__), "sharding_cases.py")
CASE_NAMES = [
    "attention_dense_batch_and_heads",
    "attention_dense_heads_over_both_axes_softcap_window",
    "attention_dense_fp8_descale",
    "attention_dense_fp8_descale_shapes",
    "attention_dense_blockscaled_batch_and_heads",
    "attention_dense_grad_batch_and_heads",
    "attention_dense_sinks_batch_and_heads",
    "attention_dense_sinks_grad_heads",
    "attention_varlen_grad_heads",
    "attention_varlen_heads",
    "attention_paged_decode_batch_and_heads",
    "attention_paged_blockscaled_decode_batch_and_heads",
    "attention_token_pool_varlen_q_heads",
    "attention_kv_buffer_decode_batch_and_heads",
    "attention_kv_buffer_token_pool_varlen_q_heads",
    "attention_unsupported_shardings_are_resharded",
    "rope_pool_kv_heads_donated",
    "rope_pool_gqa_partial_rotary_interleaved_heads_over_both_axes",
    "rope_pool_token_sharding_is_resharded",
    "rope_pool_kv_buffer_heads_donated",
    "rope_pool_kv_buffer_replicated_donated",
    "layer_rope_then_paged_attention_heads",
    "layer_rope_into_fp8_pool_then_paged_attention_heads",
]


@functools.lru_cache(maxsize=None)
def _run(partitioner: str) -> dict[str, str]:
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                    " --xla_force_host_platform_device_count=8").strip(),
             JAX_PLATFORMS="cpu")
  argv = [sys.executable, CASES_SCRIPT] + (["--gspmd"] if partitioner == "gspmd" else [])
  proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
  if proc.returncode == 2:
    pytest.skip(f"the subprocess did not get 8 CPU devices: {proc.stdout.strip()}")
  results = {}
  for line in proc.stdout.splitlines():
    status, _, rest = line.partition(" ")
    if status in ("PASS", "FAIL"):
      name, _, why = rest.partition(": ")
      results[name] = why if status == "FAIL" else ""
  if not results:
    pytest.fail(f"sharding_cases.py reported nothing (rc {proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return results


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_sharded_case(name, partitioner):
  results = _run(partitioner)
  assert name in results, f"case {name} did not run; ran: {sorted(results)}"
  assert results[name] == "", results[name]


def test_every_case_is_listed():
  assert sorted(_run("shardy")) == sorted(CASE_NAMES)
