#!/usr/bin/env bash
# Nsight Compute over the attention cases of tools/ncu_attention.py (jax_sgl and cuDNN, one
# process per case), on the device machine after tools/gpu_check.sh installed the package.
# Writes one CSV per case into $OUT/ncu/ as each case finishes (a call cut short by its time limit
# keeps the cases done) and prints each case's per-kernel summary as it goes.
#   NCU_CASES   cases to profile (default: every <what>-<impl> of the script)
#   NCU_KERNEL  regex over demangled kernel names, template arguments included (default
#               Flash|sdpa|cudnn: the attention kernels; FA3's are cutlass::device_kernel<
#               flash::FlashAttn...>), e.g.
#               FlashBwd|sdpa|cudnn to skip our forward in a fwdbwd case
#   NCU_SOURCE  1: instead, sample warp stalls per SASS instruction (SourceCounters) of the first
#               kernel matching NCU_KERNEL in each case, and write the source page as
#               <case>.sass.csv (instruction, samples, stall reasons per line) and the details
#               page as <case>.csv into a fresh /tmp/ncu_source.*, packed after each case as
#               $OUT/ncu/source.tar.xz (one file: the device returns at most 8 a call); for the
#               backward's main kernel name it (NCU_KERNEL=FlashBwdSm90Kernel: FlashBwd matches
#               the preprocess kernel first); `tools/ncu_attention.py hot` reads one, `roles` two
#               side by side (producer / consumer code, the consumers' stalls as time)
#   NCU_COUNT   profile only the first N launches that match NCU_KERNEL (a fwd+bwd case ran each
#               of its kernels 11 times in its range, session 24)
#   NCU_REPLAY  ncu's --replay-mode (default kernel; application reruns the whole case per pass:
#               no memory save / restore, slow with many sections)
#   NCU_QUICK   1: the SpeedOfLight section alone (each kernel's time and throughputs in a few
#               replay passes), for the time split of a whole call over its kernels
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/gpu_check}"
PY="${PYTHON:-python3}"
dir="$OUT/ncu"
mkdir -p "$dir"
cases="${NCU_CASES:-fwd4k-jax_sgl fwd4k-cudnn fwd4kc-jax_sgl fwd4kc-cudnn fwdbwd4k-jax_sgl fwdbwd4k-cudnn decode32k-jax_sgl decode32k-cudnn}"
cd /tmp  # the installed package, not the source tree
# Buffers allocated as needed, not JAX's preallocated pool (75% of the GPU): a kernel replay saves
# and restores the memory a kernel can write, and under the pool the dQ-accumulating backward
# failed to profile ("Failed to profile FlashBwdSm90Kernel", session 24, H200).
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
# Source pages of this run only: a warm machine keeps /tmp from the calls before.
[ "${NCU_SOURCE:-0}" = 1 ] && src="$(mktemp -d /tmp/ncu_source.XXXXXX)"
for c in $cases; do
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    # One launch is enough: the sampler sees every warp of the kernel's ~4k CTAs.
    ncu --clock-control none --profile-from-start off --set none --section SourceCounters \
        --section WarpStateStats --launch-count 1 -f -o "$src/$c" \
        --kernel-name-base demangled --kernel-name "regex:${NCU_KERNEL:-Flash|sdpa|cudnn}" \
        "$PY" "$REPO/tools/ncu_attention.py" run "$c" > "$src/$c.log" 2>&1 \
      || echo "ncu $c failed: $(tail -2 "$src/$c.log")"
    ncu --import "$src/$c.ncu-rep" --page source --csv --print-source sass \
      > "$src/$c.sass.csv" 2>> "$src/$c.log" || echo "ncu source page of $c failed"
    ncu --import "$src/$c.ncu-rep" --page details --csv > "$src/$c.csv" 2>> "$src/$c.log"
    rm -f "$src/$c.ncu-rep"  # large; the source page and the stall details are kept
    tar cJf "$dir/source.tar.xz" -C "$src" .
    continue
  fi
  # Clocks stay as the machine sets them (METHOD.md); sections give time, throughputs, issue
  # activity, occupancy and launch shape; the metrics, stall cycles per issue by reason and the
  # tensor pipes' share, and the L2 read sectors / requests from the SMs and across the L2
  # partitions (ltcfabric) with their hits, against DRAM sectors read: the MemoryWorkloadAnalysis
  # tables do not reach the CSV. Only the attention kernels are profiled (not XLA's fusions).
  if [ "${NCU_QUICK:-0}" = 1 ]; then
    sections=(--section SpeedOfLight)
  else
    sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats
      --section InstructionStats
      --metrics "regex:^(smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__pipe_tensor_op.*_cycles_active\.avg\.pct_of_peak_sustained_active|lts__t_(sectors|requests)_srcunit_(tex|ltcfabric)_op_read(_lookup_hit|_lookup_miss)?\.sum|dram__sectors_read\.sum)$")
  fi
  count=()
  [ -n "${NCU_COUNT:-}" ] && count=(--launch-count "$NCU_COUNT")
  ncu --clock-control none --profile-from-start off --replay-mode "${NCU_REPLAY:-kernel}" \
      --csv --page details "${sections[@]}" "${count[@]}" \
      --kernel-name-base demangled --kernel-name "regex:${NCU_KERNEL:-Flash|sdpa|cudnn}" \
      "$PY" "$REPO/tools/ncu_attention.py" run "$c" > "$dir/$c.csv" 2> "$dir/$c.err" \
    || echo "ncu $c failed: $(tail -2 "$dir/$c.err")"
  "$PY" "$REPO/tools/ncu_attention.py" summary "$dir/$c.csv"
done
