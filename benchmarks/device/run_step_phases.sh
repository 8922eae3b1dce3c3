#!/usr/bin/env bash
# Where the time of an offloaded ZeRO-3 step goes (for the step-time prediction), on the
# nvidia-h200 machine:
#   run(command="bash benchmarks/device/run_step_phases.sh", carry=[".whl"])       ~9 min
# 1. the calibration at the sweep's sizes (calibrate --study: CPU Adam and the step's host passes
#    at its partition, calibrate.step_passes_at), into $OUT/calibration.at-<study>.json;
# 2. the plain DeepSpeed loop (benchmarks/raw_deepspeed.py --phase-times) on committed run specs:
#    each part of ZeRO-3's optimizer step (raw_deepspeed.PHASES) and each micro-step's forward,
#    backward and step, timed between accelerator synchronizes.
# 3. with PASSES=1, first: the step's host passes laid out as calibrate measures them and as the
#    run holds them (benchmarks/step_passes.py at the sweep's partition), into $OUT/passes.json.
# 4. with PROBE=1, before the runs: calibrate's host-time probe of each engine on the GPU (a tiny
#    Llama of 1 and 3 layers: host seconds per layer's forward and backward), into
#    $OUT/host-probe.json.
# SPECS overrides the list (run.json paths; each one's DeepSpeed config is the .json beside it; empty: none),
# STEPS / WARMUP the loop's length, STUDY the calibration's study (empty: no calibration), e.g.
#   run(command="PASSES=1 STUDY= SPECS=docs/results/h200-1gpu/sweep-h200-1gpu-24g/configs/opt__mb-8__rbs-5e8.run.json bash benchmarks/device/run_step_phases.sh", ...)
set -uo pipefail
NAME=run_step_phases
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 570
R=docs/results/h200-1gpu
SPECS=${SPECS-"$R/sweep-h200-1gpu-24g/configs/optparam__mb-8__rbs-5e8.run.json
$R/sweep-h200-1gpu-24g/configs/opt__mb-8__rbs-5e8.run.json
$R/sweep-h200-1gpu-24g/configs/opt-r0.8__mb-8__rbs-5e8.run.json"}
STUDY=${STUDY-config/studies/sweep-h200-1gpu-24g.yaml}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-2}

one() { # one SPEC OUT
  OMP_NUM_THREADS=$CORES python3 -m torch.distributed.run \
    --nnodes 1 --nproc_per_node 1 --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) \
    benchmarks/raw_deepspeed.py --spec "$1" --ds-config "${1%.run.json}.json" \
    --steps "$STEPS" --warmup "$WARMUP" --phase-times --out "$2" >"${2%.json}.log" 2>&1
}
export -f one versions build_ops
export STEPS WARMUP

trap 'printf "%s\n" "${SUMMARY[@]}"' EXIT
setup
timed versions 60 versions
timed ops 240 build_ops cpu_adam fused_adam
if [ "${PASSES:-0}" = 1 ]; then
  timed "step passes" 240 env OMP_NUM_THREADS="$CORES" python3 benchmarks/step_passes.py \
    --params 1908523520 --sub-group 100000000 --out "$OUT/passes.json"
fi
if [ -n "$STUDY" ]; then
  out="$OUT/calibration.at-$(basename "${STUDY%.yaml}").json"
  timed "calibrate at $STUDY" 200 python3 -m offload_study.prediction.calibrate \
    --cluster h200-1gpu --cores "$CORES" --study "$STUDY" --out "$out" && cat "$out"
fi
if [ "${PROBE:-0}" = 1 ]; then # calibrate's host-time probe on the GPU: host seconds per layer, per engine
  timed "host-time probe" 150 env OMP_NUM_THREADS="$CORES" python3 -m torch.distributed.run \
    --nnodes 1 --nproc_per_node 1 --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) \
    -m offload_study.prediction.calibrate --probe "$OUT/host-probe.json" &&
    cat "$OUT/host-probe.json"
fi
i=0
for spec in $SPECS; do
  i=$((i + 1))
  out=$OUT/phases-$i-$(basename "${spec%.run.json}").json
  timed "$(basename "$spec")" 150 one "$spec" "$out"
  if [ -s "$out" ]; then
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("RESULT", r["scenario"], "step", round(r["step_time_s_median"], 3), {k: round(v, 3) for k, v in r["phase_s_median"].items()})' "$out"
  else
    tail -20 "${out%.json}.log"
  fi
done
