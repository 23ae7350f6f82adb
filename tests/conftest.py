"""Shared pytest setup: GPU tests (marked `gpu` / `multigpu`) skip cleanly without a CUDA device."""

import jax
import pytest


def _num_cuda_devices() -> int:
  try:
    return len(jax.devices("cuda"))
  except RuntimeError:
    return 0


def pytest_collection_modifyitems(config, items):
  n = _num_cuda_devices()
  skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.devices('cuda') is empty)")
  skip_multi = pytest.mark.skip(reason="needs 2+ NVIDIA GPUs")
  for item in items:
    if "gpu" in item.keywords and n == 0:
      item.add_marker(skip_gpu)
    if "multigpu" in item.keywords and n < 2:
      item.add_marker(skip_multi)
