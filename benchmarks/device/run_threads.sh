#!/usr/bin/env bash
# How a CPU-side offload step's speed, and its spread from one run to the next, depend on the
# threads the rank is given: the plain loop (benchmarks/raw_<engine>.py) of one committed run
# spec, started ROUNDS times at each OMP_NUM_THREADS value of THREADS, interleaved (16 8 16 8
# ...), on one machine; with the CPU topology (lscpu, the cores' thread siblings) first.
#   run(command="bash benchmarks/device/run_threads.sh", carry=[".whl"])          ~6 min
# SPEC     run.json (default: the optimizer-only FSDP2 path on model A, gas 1)
# ENGINE   fsdp2 | deepspeed (the plain loop's engine; default fsdp2)
# THREADS  OMP_NUM_THREADS values (default: "16 8"; "all" is nproc)
# ROUNDS   runs per value (default 4); WARMUP / STEPS each run's (default 3 / 12)
# Each run's JSON comes back in $OUT/threads.tar.gz; a line per run and the spread per value
# are printed.
set -uo pipefail
NAME=run_threads
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 560
SPEC=${SPEC:-docs/results/h200-1gpu/engines-h200-cpu-optimizer/configs/fsdp2-cpu-optimizer.run.json}
ENGINE=${ENGINE:-fsdp2}
THREADS=${THREADS:-16 8}
ROUNDS=${ROUNDS:-4}
RAW=/tmp/raw-threads

one() { # one THREADS ROUND
  local out=$RAW/t$1.r$2.json
  OMP_NUM_THREADS=$1 python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 1 \
    --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) "benchmarks/raw_$ENGINE.py" \
    --spec "$SPEC" --out "$out" --warmup "${WARMUP:-3}" --steps "${STEPS:-12}" \
    >"${out%.json}.log" 2>&1
}
export -f one
export SPEC ENGINE RAW

trap 'printf "%s\n" "${SUMMARY[@]}"; tar -czf "$OUT/threads.tar.gz" -C /tmp raw-threads' EXIT
setup
mkdir -p $RAW
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA|Model name|L3)" || true
echo "thread siblings of cpu0: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>/dev/null)"
for r in $(seq 1 "$ROUNDS"); do
  for t in $THREADS; do
    [ "$t" = all ] && t=$CORES
    timed "threads $t round $r" 150 one "$t" "$r"
  done
done
python3 - "$RAW" <<'PY'
import glob, json, statistics, sys
runs = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/t*.json")):
    d = json.load(open(path))
    threads = path.rsplit("/", 1)[1].split(".")[0][1:]
    runs.setdefault(threads, []).append(d["tokens_per_s"])
    times = " ".join(f"{t:.3f}" for t in d["step_times_s"])
    print(f"{path.rsplit('/', 1)[1]}: {d['tokens_per_s']:.0f} tok/s; steps {times}")
for threads, tps in runs.items():
    spread = (max(tps) - min(tps)) / statistics.median(tps)
    print(f"OMP_NUM_THREADS={threads}: median {statistics.median(tps):.0f} tok/s over {len(tps)}"
          f" runs, range {min(tps):.0f}-{max(tps):.0f} ({100 * spread:.1f} % of the median)")
PY
