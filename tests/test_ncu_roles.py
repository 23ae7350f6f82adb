"""tools/ncu_attention.py roles: the split of a warp-specialized kernel's stall samples into its
producer and consumer code, and the consumers' states as time (benchmarks/notes/NOTES_sm90.md,
session 34). A synthetic source page stands in for ncu's."""

import csv
import importlib.util
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "ncu_attention.py"


def load_tool():
  spec = importlib.util.spec_from_file_location("ncu_attention", TOOL)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def write_page(path, lines):
  """lines: (source, samples, instructions, {reason: samples})."""
  reasons = ["stall_wait", "stall_barrier", "stall_long_sb"]
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
            *reasons, "stall_wait (Not Issued)"]
  with open(path, "w", newline="") as f:
    f.write('"Kernel Name","k"\n')
    w = csv.writer(f, quoting=csv.QUOTE_ALL)
    w.writerow(header)
    for i, (source, samples, inst, by_reason) in enumerate(lines):
      w.writerow([f"0x{16 * i:x}", source, samples, f"{inst:,}",
                  *[by_reason.get(r.removeprefix("stall_"), "") for r in reasons], ""])


def test_roles_splits_at_the_producer_and_scales_consumer_states(tmp_path, capsys):
  a, b = tmp_path / "a.sass.csv", tmp_path / "b.sass.csv"
  write_page(a, [("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 30, 1000, {"wait": 30}),
                 ("@!P0 BRA 0x100", 10, 2000, {"long_sb": 10}),
                 ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 8, {}),
                 ("@!P0 BRA 0x200", 500, 5000, {"long_sb": 500})])
  write_page(b, [("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 20, 1000, {"wait": 5,
                                                                              "barrier": 15}),
                 ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 8, {}),
                 ("@!P0 BRA 0x200", 7, 70, {"long_sb": 7})])
  states = load_tool().roles([(str(a), "200"), (str(b), "100")])
  # a: 40 consumer samples over 200 us; the producer's 500 samples do not count.
  assert states[0] == pytest.approx({"wait": 150.0, "long_sb": 50.0})
  assert states[1] == pytest.approx({"wait": 25.0, "barrier": 75.0})
  out = capsys.readouterr().out
  assert "40 samples" in out and "500 samples" in out
