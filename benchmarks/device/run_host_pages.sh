#!/usr/bin/env bash
# FSDP2's CPUOffloadPolicy with gradient accumulation: what its gradient copies into fresh host
# pages cost (the step model's fresh-pages term), on the nvidia-h200 machine:
#   run(command="bash benchmarks/device/run_host_pages.sh", carry=[".whl"])       ~6 min
# 1. benchmarks/host_pages.py on each spec: calibrate's page-fault and copy probes, the copy by
#    size around glibc's mmap threshold, one accumulation micro-step's host work against the
#    model's parts for it;
# 2. the plain FSDP2 loop (benchmarks/raw_fsdp2.py) of each spec under glibc's default malloc,
#    then with one arena, mmap off and the heap never trimmed (MALLOC_ARENA_MAX=1,
#    MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_): every gradient copy then reuses pages the
#    first step faulted in, so the step's difference is what fresh pages cost. One arena: the
#    copies run on autograd's thread, whose own arena maps anything over its 64 MiB heaps
#    whatever mmap's limit. SPECS overrides the specs; STEPS / WARMUP the loop's length;
#    PAGES=0 skips 1.
set -uo pipefail
NAME=run_host_pages
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 560
SPECS=${SPECS:-"docs/results/h100-1gpu/holdout-h100-model-i/configs/fsdp2-offload.run.json
docs/results/h100-1gpu/sweep-h100-model-h-12g/configs/rec-fsdp2-cpu-offload-policy__mb-4.run.json"}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-2}
HEAP="MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776"

loop() { # loop SPEC OUT [ENV...]: the plain FSDP2 loop of SPEC
  local spec=$1 out=$2
  shift 2
  env "$@" OMP_NUM_THREADS=$CORES python3 -m torch.distributed.run --nnodes 1 \
    --nproc_per_node 1 --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) \
    benchmarks/raw_fsdp2.py --spec "$spec" --steps "$STEPS" --warmup "$WARMUP" --out "$out" \
    >"${out%.json}.log" 2>&1
}
export -f loop versions
export STEPS WARMUP

show() { # show OUT MALLOC
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read())
print(f"RESULT {r['scenario']:36s} malloc={sys.argv[2]:9s} step={r['step_time_s_median']:.3f}s "
      f"steps={[round(t, 3) for t in r['step_times_s']]}")
PY
}

trap 'tar -czf "$OUT/host_pages.tar.gz" -C /tmp host-pages 2>/dev/null; printf "%s\n" "${SUMMARY[@]}"' EXIT
setup
timed versions 60 versions
mkdir -p /tmp/host-pages
for spec in $SPECS; do
  [ "${PAGES:-1}" = 0 ] && break
  name=$(basename "${spec%.run.json}")
  timed "pages $name" 120 python3 benchmarks/host_pages.py --spec "$spec" \
    --out "/tmp/host-pages/$name.pages.json"
done
for spec in $SPECS; do
  name=$(basename "${spec%.run.json}")
  for malloc in default one-arena; do
    out=/tmp/host-pages/$name.$malloc.json
    if [ "$malloc" = one-arena ]; then
      # shellcheck disable=SC2086
      timed "loop $name $malloc" 170 loop "$spec" "$out" $HEAP && show "$out" "$malloc"
    else
      timed "loop $name $malloc" 170 loop "$spec" "$out" && show "$out" "$malloc"
    fi
    [ -s "$out" ] || tail -5 "${out%.json}.log"
  done
done
