"""Shared pytest setup: GPU tests (marked `gpu` / `multigpu` / `blackwell`) skip cleanly without
the device they need."""

import jax
import pytest


def _num_cuda_devices() -> int:
  try:
    return len(jax.devices("cuda"))
  except RuntimeError:
    return 0


def _is_blackwell() -> bool:
  """The first CUDA device is compute capability 10.x, where the sm100 kernels run."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return False
  return bool(devices) and str(getattr(devices[0], "compute_capability", "")).startswith("10.")


def pytest_collection_modifyitems(config, items):
  n = _num_cuda_devices()
  blackwell = n > 0 and _is_blackwell()
  skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.devices('cuda') is empty)")
  skip_multi = pytest.mark.skip(reason="needs 2+ NVIDIA GPUs")
  skip_blackwell = pytest.mark.skip(reason="needs a compute capability 10.x (Blackwell) GPU")
  for item in items:
    if "gpu" in item.keywords and n == 0:
      item.add_marker(skip_gpu)
    if "multigpu" in item.keywords and n < 2:
      item.add_marker(skip_multi)
    if "blackwell" in item.keywords and not blackwell:
      item.add_marker(skip_blackwell)
