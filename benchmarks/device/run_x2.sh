#!/usr/bin/env bash
# The seed's 2-GPU study on the nvidia-h200-x2 machine (2 x H200), driven from the device `run`
# tool, through the workflow itself (snakemake, one run record per scenario x repeat):
#   run(kind="nvidia-h200-x2", command="bash benchmarks/device/run_x2.sh", carry=[".whl"])
# A gas-16 step of the 7B takes tens of seconds, so the study does not fit one 10-minute call:
# each call installs what is missing, builds the ops once per machine, then runs the records
# still missing in QUEUE order (repeat 0 of every scenario first, so drift hits every scenario
# alike), starting one only when its estimate fits before the deadline. Records stay on a warm
# machine between calls, and every call packs them into $OUT; after a lost machine, unpack the
# last results.tar.gz into the tree and carry "results" along.
#   REPS="0 1"  repeats to run; ONLY="scenario ..."  run only these scenarios.
#   CALIBRATE=1 first measure the cluster's calibration (python -m offload_study.prediction.calibrate, CUDA
#               path, 16 cores = one rank's share) into results/h200-2gpu/calibration.json.
#   OVERFLOW=1  also capture an fp16 overflow log (tiny model, initial loss scale 2^32) at the end.
set -uo pipefail
NAME=run_x2
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 560

STUDY=${STUDY:-config/studies/seed-2gpu.yaml}
RES=results/h200-2gpu/seed-2gpu
# scenario:estimated seconds (start-up + 2 warm-up + 3 measured steps), in run order
# (the measured run times of repeat 0: 145, 249, 217, 143, 135, 143 s)
EST=(zero3-2gpu:150 offload-2gpu-80gb:255 offload-opt-2gpu-80gb:222
  offload-2gpu-80gb-gas4:148 offload-opt-2gpu-80gb-gas4:140 zero3-2gpu-80gb:148)
REPS=${REPS:-0 1}

snake() { # snake [targets...]
  python3 -m snakemake "$@" --cores "$CORES" --scheduler greedy --keep-going \
    --rerun-incomplete --config study_file="$STUDY"
}

# A record that exists and was not cancelled (e.g. cut by an earlier call's deadline) is kept.
done_record() {
  local m=$1/metrics.json
  [ -f "$m" ] && ! grep -q '"outcome": "cancelled"' "$m"
}

run_queue() {
  local rep item scen est dir
  for rep in $REPS; do
    for item in "${EST[@]}"; do
      scen=${item%%:*} est=${item##*:} dir=$RES/$scen/rep$rep
      done_record "$dir" && continue
      [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $scen "* ]] && continue
      if (($(elapsed) + est + 15 > DEADLINE_S)); then
        say "-- $scen rep$rep needs ~${est}s, $((DEADLINE_S - $(elapsed)))s left: next call"
        continue
      fi
      [ -d "$dir" ] && rm -rf "$dir" # a cancelled half: redo (the archive keeps a copy)
      timed "$scen rep$rep" $((est + 120)) snake "$dir/metrics.json"
      pack
    done
  done
}

pack() {
  tar -czhf "$OUT/results.tar.gz" $(ls -d "$RES" results/h200-2gpu/calibration.json .snakemake/log 2>/dev/null)
  tar -czf "$OUT/extra.tar.gz" -C /tmp logs $(cd /tmp && ls -d overflow 2>/dev/null)
}

summary() {
  echo
  echo "==================== summary ($(elapsed) s) ===================="
  printf '%s\n' "${SUMMARY[@]}"
  [ -d "$RES" ] && table "$RES"
  pack
}
trap summary EXIT
export -f elapsed say left versions build_ops snake overflow_fixture
export STUDY

# Records and Snakemake's state live outside the carried tree, so that carrying the tree again
# (a later call) never replaces what an earlier call measured on this machine.
keep_outside() {
  local d
  for d in results .snakemake; do
    [ -L $d ] && continue
    mkdir -p /tmp/x2/$d
    [ -d $d ] && cp -a $d/. /tmp/x2/$d/ && rm -rf $d
    ln -s /tmp/x2/$d $d
  done
}

keep_outside
setup
timed versions 60 versions
timed ops 240 build_ops cpu_adam fused_adam
if [ "${CALIBRATE:-0}" = 1 ]; then
  timed calibrate 150 python3 -m offload_study.prediction.calibrate --cluster h200-2gpu --cores 16 \
    --out results/h200-2gpu/calibration.json
  cat results/h200-2gpu/calibration.json
fi
timed plan 120 snake "$RES/plan.json"
run_queue
if [ "${OVERFLOW:-0}" = 1 ] && (($(elapsed) + 90 < DEADLINE_S)); then
  timed overflow 90 overflow_fixture h200-2gpu
fi
