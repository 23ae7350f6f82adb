"""The demo (the main job) runs end to end and really detects a wrong kernel."""

import jax_sgl
from jax_sgl import demo


def test_demo_passes(capsys):
  assert demo.main(["--steps", "4"]) == 0
  out = capsys.readouterr().out
  assert "native kernels" in out and "OK" in out


def test_demo_fails_on_wrong_attention(monkeypatch, capsys):
  real = jax_sgl.attention
  monkeypatch.setattr(jax_sgl, "attention", lambda *a, **k: real(*a, **k) * 1.05)
  assert demo.main(["--steps", "3"]) == 1
  assert "MISMATCH" in capsys.readouterr().out


def test_demo_sharded_over_heads(capfd):
  """--devices 2: a child process with 2 virtual CPU devices runs the head-sharded model."""
  assert demo.main(["--steps", "3", "--layers", "1", "--devices", "2"]) == 0
  out = capfd.readouterr().out
  assert "heads over 2 devices" in out and "OK" in out
