#!/usr/bin/env bash
# Where torch's reserved GPU memory goes beyond the allocated peak (for the reserved-memory
# prediction), on the nvidia-h200 machine:
#   run(command="bash benchmarks/device/run_allocator.sh", carry=[".whl"])       ~8 min
# The plain loop of each spec's engine (benchmarks/raw_deepspeed.py, raw_fsdp2.py) on committed run specs, each under torch's
# default caching allocator and under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, in
# alternation (one process per run: the allocator is configured when CUDA starts). Each result
# line holds the allocated and reserved peaks and the allocator's own account of its slack
# (inactive split blocks, segments, retries). SPECS overrides the list (run.json paths; each
# one's DeepSpeed config is the .json beside it); STEPS / WARMUP the loop's length; CONFS the
# allocator settings (space-separated, "default" for none); OPS the DeepSpeed ops built first
# (default "cpu_adam fused_adam"; add async_io for an NVMe spec); TRACE=1 also records every allocator
# event of each run (--memory-trace, in allocator.tar.gz), e.g. FSDP2's torchao optimizer
# offload at accumulation 4 (its reserved slack shrinks against accumulation 1: docs/benchmarks.md)
#   run(command="TRACE=1 CONFS=default STEPS=2 WARMUP=1 \
#     SPECS='$R/engines-h200-cpu-optimizer/configs/fsdp2-cpu-optimizer-gas4.run.json \
#     $R/engines-h200-cpu-optimizer/configs/fsdp2-cpu-optimizer.run.json' \
#     bash benchmarks/device/run_allocator.sh", carry=[".whl"])   (R=docs/results/h200-1gpu)
set -uo pipefail
NAME=run_allocator
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 560
R=docs/results/h200-1gpu
SPECS=${SPECS:-"$R/sweep-h200-1gpu-24g/configs/optparam__mb-8__rbs-5e8.run.json
$R/model-a/configs/zero3__gas-1.run.json
$R/sweep-h200-1gpu-24g/configs/opt__mb-4__rbs-5e7.run.json"}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
read -r -a CONFS <<<"${CONFS:-default expandable_segments:True}"
TRACE=${TRACE:-0}

one() { # one SPEC CONF OUT: the plain loop of the spec's engine
  local trace=() loop=(benchmarks/raw_deepspeed.py --ds-config "${1%.run.json}.json")
  [ "$TRACE" = 1 ] && trace=(--memory-trace "${3%.json}.trace.jsonl.gz")
  python3 -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["engine"] != "fsdp2")' "$1" &&
    loop=(benchmarks/raw_fsdp2.py)
  local conf=$2
  [ "$conf" = default ] && conf=
  env ${conf:+PYTORCH_CUDA_ALLOC_CONF=$conf} OMP_NUM_THREADS=$CORES python3 -m torch.distributed.run \
    --nnodes 1 --nproc_per_node 1 --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) \
    "${loop[@]}" --spec "$1" --steps "$STEPS" --warmup "$WARMUP" --out "$3" "${trace[@]}" \
    >"${3%.json}.log" 2>&1
}
export -f one versions build_ops
export STEPS WARMUP TRACE

show() { # show OUT: one line of what matters here
  python3 - "$1" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read())
a, res = r["peak_gpu_allocated_gib"], r["peak_gpu_reserved_gib"]
al = r["allocator"]
print(f"RESULT {r['scenario']:28s} conf={r['pytorch_cuda_alloc_conf'] or 'default':26s} "
      f"alloc={a:6.2f} reserved={res:6.2f} slack={res - a:5.2f} ({100 * (res - a) / a:3.0f}%) "
      f"inactive_split={al['inactive_split_peak_gib']:5.2f} segments={al['segments_peak']} "
      f"retries={al['num_alloc_retries']} step={r['step_time_s_median']:.3f}s "
      f"steps={[round(t, 3) for t in r['step_times_s']]}")
EOF
}

trap 'tar -czf "$OUT/allocator.tar.gz" -C /tmp raw-allocator 2>/dev/null; printf "%s\n" "${SUMMARY[@]}"' EXIT
setup
timed versions 60 versions
read -r -a OPS <<<"${OPS:-cpu_adam fused_adam}" # async_io too for an NVMe spec
timed ops 240 build_ops "${OPS[@]}"
mkdir -p /tmp/raw-allocator
i=0
for spec in $SPECS; do
  for conf in "${CONFS[@]}"; do
    i=$((i + 1))
    kind=default
    [ "$conf" != default ] && kind=expandable
    out=/tmp/raw-allocator/$i-$(basename "${spec%.run.json}")-$kind.json
    timed "$(basename "$spec") $conf" 150 one "$spec" "$conf" "$out" && show "$out"
    [ -s "$out" ] || tail -5 "${out%.json}.log"
  done
done
