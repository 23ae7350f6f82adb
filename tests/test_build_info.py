"""What a build says about itself: the Hopper kernels' absence is reported, never silent."""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from jax_sgl import _registration


def test_backend_info_names_why_sm90_is_absent():
  info = jax_sgl.attention_backend_info()
  if not jax_sgl.CUDA_TARGETS or info["kernels"]["sm90_fwd"]["head_dims"]:
    assert info["sm90_absent"] is None
  else:
    assert "JAX_SGL_" in info["sm90_absent"]


@pytest.mark.skipif("jax_sgl_attention_fwd" not in jax_sgl.CUDA_TARGETS,
                    reason="built without CUDA")
def test_missing_sm90_warns_once_on_hopper(monkeypatch):
  """A CUDA build without CuTe, lowered for an H100/H200: one warning naming the fix."""
  monkeypatch.setattr(_registration._ext, "attention_kernels",
                      lambda: {"portable": " 64 128", "sm90_fwd": "", "sm90_bwd": ""})
  monkeypatch.setattr(_registration._ext, "build_info",
                      lambda: {"cuda_archs": "80,90a", "sm90_no_cute": True})
  monkeypatch.setattr(_registration, "_sm90_warned", False)
  hopper = types.SimpleNamespace(compute_capability="9.0")
  real_devices = jax.devices
  monkeypatch.setattr(jax, "devices",
                      lambda backend=None: [hopper] if backend == "cuda" else real_devices(backend))
  assert "nvidia-cutlass" in jax_sgl.attention_backend_info()["sm90_absent"]
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 64)), jnp.bfloat16)
  export = lambda: jax.export.export(
      jax.jit(lambda q: jax_sgl.attention(q, q, q, causal=True)), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("jax_sgl_attention_fwd")])(q)
  with pytest.warns(RuntimeWarning, match="Hopper attention kernels are not in this build"):
    export()
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    jax.clear_caches()
    export()


def test_backend_info_is_short_and_names_the_disabled_families(monkeypatch):
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90_bwd, sm90")
  info = jax_sgl.attention_backend_info()
  assert set(info) == {"cuda", "kernels", "disabled", "sm90_absent"}
  assert info["cuda"] == bool(jax_sgl.CUDA_TARGETS)
  assert info["disabled"] == ["sm90", "sm90_bwd"]
  for family in info["kernels"].values():
    assert set(family) == {"head_dims", "dtypes"}
    assert all(isinstance(d, int) for d in family["head_dims"])


def test_unknown_disable_name_raises_when_lowered(monkeypatch):
  """JAX_SGL_DISABLE is read when a call is lowered: an unknown name fails there, naming the
  valid ones."""
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90,sm91")
  q = jnp.zeros((1, 4, 2, 64), jnp.float32)
  jax.clear_caches()
  with pytest.raises(ValueError, match=r"JAX_SGL_DISABLE: unknown kernel family 'sm91'.*sm90_bwd"):
    jax.jit(lambda q: jax_sgl.attention(q, q, q)).lower(q)
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90,sm90_varlen,sm90_bwd,cuda_bwd")
  out = jax.jit(lambda q: jax_sgl.attention(q, q, q))(q)
  assert out.shape == q.shape
