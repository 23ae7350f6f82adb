"""Same-run regression check: this tree's build against a baseline build, benchmark by benchmark.

Each command runs in its own process once per build and round, the two builds alternating
(base, new, base, new, ...), so both see the same machine state. The scripts are this tree's
(paths from its root, e.g. tools/default_paths.py, which uses only API every build has); each
build comes first on PYTHONPATH in its own runs. The figure of every SUMMARY line (the first
number after the colon: TFLOP/s or GB/s) is compared across builds by its median over rounds.

  python3 tools/bench_vs_baseline.py --base-site /tmp/base --new-site /tmp/new --rounds 2 \
      "tools/default_paths.py --batches 3"

prints one table row per SUMMARY key and a last line `SUMMARY vs-baseline: worst ...`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict

_FIGURE = re.compile(r"^SUMMARY (.*?): \D*?([0-9.]+)")


def run(site: str, command: str, log: str) -> dict[str, float]:
  """Runs `command` (a script of this tree + its arguments) with `site` first on the path;
  {summary key: figure}."""
  script, *args = shlex.split(command)
  env = dict(os.environ, PYTHONPATH=site + os.pathsep + os.environ.get("PYTHONPATH", ""))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, os.path.join(root, script), *args],
                        env=env, cwd="/tmp", capture_output=True, text=True)
  with open(log, "a") as f:
    f.write(f"### {site} {command} (exit {proc.returncode})\n{proc.stdout}{proc.stderr}\n")
  if site and os.listdir(site) and os.path.realpath(site) not in proc.stdout:
    raise SystemExit(f"bench_vs_baseline: {command} did not import jax_sgl from {site}; see {log}")
  figures = {}
  for line in proc.stdout.splitlines():
    m = _FIGURE.match(line)
    if m:
      figures[m.group(1)] = float(m.group(2))
  return figures


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base-site", required=True, help="the baseline build's install dir")
  parser.add_argument("--new-site", required=True,
                      help="this tree's build's install dir (an empty one: the installed build)")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--log", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                    "bench_vs_baseline.log"))
  parser.add_argument("commands", nargs="+", help="script + its arguments, quoted")
  args = parser.parse_args()
  figures: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
  for command in args.commands:
    for _ in range(args.rounds):
      for side, site in (("base", args.base_site), ("new", args.new_site)):
        for key, value in run(site, command, args.log).items():
          figures[key][side].append(value)
  worst = None
  print(f"{'benchmark (jax_sgl figure)':<78} {'base':>8} {'new':>8} {'new/base':>9}")
  for key, sides in figures.items():
    if not sides["base"] or not sides["new"]:
      print(f"{key:<78} {'-':>8} {'-':>8}  missing on one side")
      continue
    base, new = statistics.median(sides["base"]), statistics.median(sides["new"])
    ratio = new / base if base else float("nan")
    print(f"{key:<78} {base:8.0f} {new:8.0f} {ratio:8.3f}x")
    if worst is None or abs(ratio - 1) > abs(worst[1] - 1):
      worst = (key, ratio)
  if worst:
    print(f"SUMMARY vs-baseline: {len(figures)} figures, worst {worst[1]:.3f}x ({worst[0]})")


if __name__ == "__main__":
  main()
