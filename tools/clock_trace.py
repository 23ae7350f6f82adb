"""Lines up tools/gpu_check.sh's clock trace (GPU_CHECK_CLOCKS=1: clocks.csv, nvidia-smi samples
every 50 ms) with the benchmark batches (batches.csv, benchmarks/timing.py JAX_SGL_BENCH_TRACE)
and prints, per implementation, the SM clock and power sampled during its timed calls: did one
implementation run at other clocks than another in the same comparison?

  python3 tools/clock_trace.py OUT_DIR

One 'SUMMARY ' line per benchmark step and implementation (the batch name, or its part after
" | " in names of the form "<config> | <implementation>": cudnn, sm90, sm80, ...): the
number of samples, median and 10th percentile SM clock, median power, and the share of samples
with the software power cap (clock event reason 0x4) active where the trace has it.
"""

from __future__ import annotations

import collections
import datetime
import statistics
import sys

POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons: software power cap


def stamp(text):
  return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()


def number(text):
  """'1980 MHz' -> 1980.0, '0x0000000000000004' -> 4.0, '[N/A]' -> None."""
  word = text.strip().split(" ")[0]
  try:
    return float(int(word, 16)) if word.startswith("0x") else float(word)
  except ValueError:
    return None


def marks(path):
  """[(time, step name)]: gpu_check's '# <step> start <time>' lines in clocks.csv."""
  rows = []
  for line in open(path):
    words = line.split()
    if line.startswith("# ") and "start" in words and words[-2:] != ["start"]:
      at = words.index("start")
      rows.append((stamp(" ".join(words[at + 1:])), " ".join(words[1:at])))
  return rows


def samples(path):
  """[(time, sm clock MHz, power W, clock event reasons or None)] from clocks.csv."""
  rows = []
  for line in open(path):
    if line.startswith("#") or "," not in line:
      continue
    parts = line.split(",")
    try:
      t = stamp(parts[0])
    except ValueError:
      continue
    clock, power = number(parts[1]), number(parts[2])
    # instant power (column 5) over the averaged one, where the driver gave it
    if len(parts) >= 6 and number(parts[4]) is not None:
      power = number(parts[4])
    reasons = number(parts[5]) if len(parts) >= 6 else None
    rows.append((t, clock, power, reasons))
  return rows


def batches(path):
  """[(timed start, end, name)] from batches.csv (start,timed,end,name; older traces
  start,end,name give the whole batch)."""
  rows = []
  for line in open(path):
    parts = line.rstrip("\n").split(",")
    if len(parts) >= 4:
      rows.append((stamp(parts[1]), stamp(parts[2]), ",".join(parts[3:])))
    elif len(parts) == 3:
      rows.append((stamp(parts[0]), stamp(parts[1]), parts[2]))
  return rows


def main(out):
  clock = samples(f"{out}/clocks.csv")
  steps = marks(f"{out}/clocks.csv")
  per_impl = collections.defaultdict(list)
  for start, end, name in batches(f"{out}/batches.csv"):
    step = next((n for t, n in reversed(steps) if t <= start), "?")
    impl = name.rsplit(" | ", 1)[-1]
    per_impl[f"{step}: {impl}"] += [s for s in clock if start <= s[0] <= end]
  for impl, got in per_impl.items():
    clocks = sorted(s[1] for s in got if s[1] is not None)
    powers = [s[2] for s in got if s[2] is not None]
    if not clocks:
      print(f"SUMMARY clocks {impl}: no samples inside its timed batches")
      continue
    capped = [s[3] for s in got if s[3] is not None]
    cap = (f", power cap in {100 * sum(int(r) & POWER_CAP != 0 for r in capped) / len(capped):.0f}%"
           if capped else "")
    print(f"SUMMARY clocks {impl}: {len(clocks)} samples, SM clock median "
          f"{statistics.median(clocks):.0f} MHz, p10 {clocks[len(clocks) // 10]:.0f} MHz, power "
          f"median {statistics.median(powers):.0f} W{cap}")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else ".")
