"""Shared pytest setup: GPU tests (marked `gpu` / `multigpu` / `blackwell`) skip cleanly without
the CUDA device they need; with JAX_SGL_FAILED_LOG set, each failure's test id and error line is
appended to that file as it happens (a GPU run cut by its time limit never prints pytest's summary);
in a build trimmed to fewer portable head dims (JAX_SGL_ATTN_HEAD_DIMS, the device's quick builds),
a call the build left out is reported as a skip naming it, not a failure (in a full build it fails).
JAX_SGL_TEST_SHARD=i/n keeps the i-th of n fixed shards of the collected tests (by a hash of the
test id), so a suite longer than one device call runs as n calls that together cover it once.
"""

import os
import zlib

import jax
import pytest

_failed_log = None


def pytest_configure(config):
  global _failed_log
  # Under pytest-xdist the controller sees every worker's reports: only it writes.
  if not hasattr(config, "workerinput"):
    _failed_log = os.environ.get("JAX_SGL_FAILED_LOG") or None


def pytest_runtest_logreport(report):
  if _failed_log and report.failed:
    crash = getattr(report.longrepr, "reprcrash", None)
    why = crash.message.splitlines()[0][:300] if crash is not None and crash.message else ""
    with open(_failed_log, "a") as f:
      f.write(f"{report.nodeid} ({report.when}): {why}\n")


# The error a CUDA call raises when the build left out its head dim (ffi/cuda/attention).
_LEFT_OUT = "this build left out the CUDA"
_ALL_PORTABLE_HEAD_DIMS = [64, 96, 128, 192, 256]   # cmake/cuda.cmake JAX_SGL_ATTN_HEAD_DIMS


def _trimmed_build() -> bool:
  import jax_sgl
  info = jax_sgl.attention_backend_info()
  return bool(info["cuda"]) and info["kernels"]["portable"]["head_dims"] != _ALL_PORTABLE_HEAD_DIMS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if (report.when == "call" and report.failed and call.excinfo is not None
      and _LEFT_OUT in str(call.excinfo.value) and _trimmed_build()):
    report.outcome = "skipped"
    why = str(call.excinfo.value).split("\n")[0][:200]
    report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: trimmed build: {why}")


def _num_cuda_devices() -> int:
  try:
    return len(jax.devices("cuda"))
  except RuntimeError:
    return 0


def _cuda_major() -> int:
  """The compute capability major of the first CUDA device, 0 without one."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return 0
  cc = getattr(devices[0], "compute_capability", "") if devices else ""
  return int(cc.split(".")[0]) if cc else 0


def _keep_shard(config, items):
  shard = os.environ.get("JAX_SGL_TEST_SHARD")
  if not shard:
    return
  index, count = (int(x) for x in shard.split("/"))
  if not 0 <= index < count:
    raise pytest.UsageError(f"JAX_SGL_TEST_SHARD={shard}: expected i/n with 0 <= i < n")
  mine = [zlib.crc32(i.nodeid.encode()) % count == index for i in items]
  config.hook.pytest_deselected(items=[i for i, m in zip(items, mine) if not m])
  items[:] = [i for i, m in zip(items, mine) if m]


def pytest_collection_modifyitems(config, items):
  _keep_shard(config, items)
  n = _num_cuda_devices()
  skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.devices('cuda') is empty)")
  skip_multi = pytest.mark.skip(reason="needs 2+ NVIDIA GPUs")
  skip_blackwell = pytest.mark.skip(reason="needs a compute capability 10.x (Blackwell) GPU")
  blackwell = _cuda_major() == 10 if any("blackwell" in i.keywords for i in items) else False
  for item in items:
    if "gpu" in item.keywords and n == 0:
      item.add_marker(skip_gpu)
    if "multigpu" in item.keywords and n < 2:
      item.add_marker(skip_multi)
    if "blackwell" in item.keywords and not blackwell:
      item.add_marker(skip_blackwell)
