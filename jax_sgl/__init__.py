"""jax_sgl: fused RoPE + paged-KV write and flash attention for JAX, as XLA FFI custom calls.

  q_rot, k_rot, k_pool, v_pool = jax_sgl.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool)
  out = jax_sgl.attention(q, k_pool, v_pool, page_table=..., seqused_k=..., causal=True)

Native kernels: C++ on the CPU, CUDA on NVIDIA GPUs (when built with nvcc). Other platforms lower
to the pure-JAX reference in `jax_sgl.reference`, with a warning.
"""

from jax_sgl import reference
from jax_sgl._registration import CPU_TARGETS, CUDA_TARGETS, attention_backend_info
from jax_sgl.attention import attention
from jax_sgl.rope_pool import rope_pool_fused

__version__ = "0.1.0"

__all__ = ["attention", "rope_pool_fused", "reference", "attention_backend_info", "CPU_TARGETS",
           "CUDA_TARGETS"]
