#!/usr/bin/env bash
# The whole measurement on the nvidia-h200 machine (1 GPU), driven from the device `run` tool:
#   run(command="bash benchmarks/device/run_h200.sh a", carry=[".whl"])        ~8-9 min
#   run(command="bash benchmarks/device/run_h200.sh nvme", carry=[".whl"])     ~4-5 min
# Stages (first argument; default full):
#   smoke  install + versions + op builds + one 1-step run of model A (no offload, ~2.5 min)
#   a      config/studies/h200-1gpu.yaml (model A, 7 runs) + raw-DeepSpeed fidelity loop
#   nvme   config/studies/h200-1gpu-nvme.yaml (model B, 4 runs incl. NVMe), then
#          config/studies/default-gpu.yaml (the default study's GPU variant, 4 runs)
#   method config/studies/h200-1gpu-method.yaml (3 long fixed runs, ~4 min) + fp16 overflow log
#   full   a then nvme (does NOT fit in one 10-min call: what runs past the deadline is cut)
# Everything is time-boxed against a deadline (DEADLINE_S, default 570 s after start) and the
# results are packed into $OUT after every stage, so a call stopped at its limit still returns
# what finished. Needs .whl/ (benchmarks/device/make_wheels.sh) carried along.
set -uo pipefail
STAGE=${1:-full}
NAME=run_h200
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 570


snake() { # snake STUDY_YAML [targets...]   (targets first: --config takes several values)
  local study=$1
  shift
  python3 -m snakemake "$@" --cores "$CORES" --scheduler greedy --resources gpu=1 \
    --set-resources train:gpu=1 --keep-going --rerun-incomplete --config study_file="$study"
}

raw() { # raw SPEC OUTJSON
  OMP_NUM_THREADS=$CORES python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 1 \
    --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) \
    benchmarks/raw_deepspeed.py --spec "$1" --out "$2" >"${2%.json}.log" 2>&1
  local rc=$?
  tail -1 "$2" 2>/dev/null | cut -c1-200
  return $rc
}

fidelity() { # fidelity RESULTS_DIR RAW_DIR -> $OUT/fidelity.json
  python3 - "$1" "$2" "$OUT/fidelity.json" <<'EOF'
import json, pathlib, sys
res, raw_dir, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
rows = []
for r in sorted(raw_dir.glob("*.json")):
    raw = json.loads(r.read_text())
    mp = res / raw["scenario"] / "rep0" / "metrics.json"
    wf = json.loads(mp.read_text()) if mp.exists() else {}
    w, x = wf.get("tokens_per_s"), raw.get("tokens_per_s")
    rows.append({"scenario": raw["scenario"], "workflow_tokens_per_s": w, "raw_tokens_per_s": x,
                 "ratio": (w / x) if w and x else None, "target": 0.98,
                 "workflow_step_time_s_median": wf.get("step_time_s"),
                 "raw_step_time_s_median": raw.get("step_time_s_median"),
                 "workflow_outcome": wf.get("outcome"), "raw_step_times_s": raw.get("step_times_s")})
json.dump(rows, open(out, "w"), indent=2)
print(f"{'scenario':28s} {'workflow tok/s':>15s} {'raw tok/s':>12s} {'ratio':>7s}")
for x in rows:
    f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"
    print(f"{x['scenario']:28s} {f(x['workflow_tokens_per_s'], '15.1f')} "
          f"{f(x['raw_tokens_per_s'], '12.1f')} {f(x['ratio'], '7.3f')}")
EOF
}


pack() { # everything that must come back, <= 8 files in $OUT
  local t=$(date +%s)
  tar -czf "$OUT/results.tar.gz" --exclude='*/archive/*' $(ls -d "$RES_A" "$RES_B" "$RES_C" "$RES_M" \
    "reports/${RES_A#results/}" "reports/${RES_B#results/}" "reports/${RES_C#results/}" .snakemake/log 2>/dev/null)
  tar -czf "$OUT/extra.tar.gz" -C /tmp logs $(cd /tmp && ls -d raw smoke overflow 2>/dev/null)
  say "packed $(du -sh "$OUT/results.tar.gz" | cut -f1) into \$OUT ($(($(date +%s) - t)) s)"
}

summary() {
  echo
  echo "==================== summary ($STAGE, $(elapsed) s) ===================="
  printf '%s\n' "${SUMMARY[@]}"
  for d in "$RES_A" "$RES_B" "$RES_C" "$RES_M"; do
    [ -d "$d" ] && { echo "-- $d"; table "$d"; }
  done
  if [ -d /tmp/raw/a ]; then
    echo "-- fidelity (workflow / raw tokens/s, target >= 0.98)"
    fidelity "$RES_A" /tmp/raw/a
  fi
  pack
}
trap summary EXIT
export -f elapsed say left versions build_ops snake raw fidelity table overflow_fixture

# ---------------------------------------------------------------- stages
STUDY_A=${STUDY_A:-config/studies/h200-1gpu.yaml}
STUDY_B=${STUDY_B:-config/studies/h200-1gpu-nvme.yaml}
STUDY_C=${STUDY_C:-config/studies/default-gpu.yaml}
RES_A=results/h200-1gpu/h200-1gpu RES_B=results/h200-1gpu/h200-1gpu-nvme
RES_C=results/h200-1gpu/default-gpu
STUDY_M=config/studies/h200-1gpu-method.yaml RES_M=results/h200-1gpu/h200-1gpu-method
setup
timed versions 150 versions
res=$(python3 -c "from offload_study.planning.plan import Plan
print(Plan('$STUDY_A').results_dir, Plan('$STUDY_B').results_dir)") && read -r RES_A RES_B <<<"$res"
say "studies: $STUDY_A -> $RES_A, $STUDY_B -> $RES_B"

case $STAGE in
smoke)
  timed ops "${OPS_S:-240}" build_ops cpu_adam fused_adam async_io
  timed plan_a 120 snake $STUDY_A plan
  python3 - "$RES_A" <<'EOF'
import json
import sys
s = json.load(open(sys.argv[1] + "/configs/zero3__gas-1.run.json")); s.update(steps=1, warmup_steps=0, scenario="smoke")
json.dump(s, open("/tmp/smoke.run.json", "w"), indent=1)
EOF
  timed smoke_run 180 python3 -m offload_study.training.runner --spec /tmp/smoke.run.json --repeat 0 \
    --outdir /tmp/smoke/rep0
  cat /tmp/smoke/rep0/metrics.json 2>/dev/null | head -60
  ;;
a | full)
  timed ops "${OPS_S:-240}" build_ops cpu_adam fused_adam $([ "$STAGE" = full ] && echo async_io)
  timed plan_a 120 snake $STUDY_A plan
  mkdir -p /tmp/raw/a
  # fidelity reference first (short runs; the workflow's gas-8 runs are the long ones)
  for s in zero3__gas-1 offload-opt__gas-1; do
    timed "raw $s" 150 raw $RES_A/configs/$s.run.json /tmp/raw/a/$s.json
  done
  # gas-1 runs and the OOM run first, then the rest (collect + report)
  timed "study a (gas 1, oom)" 330 snake $STUDY_A \
    $RES_A/{zero3,offload-opt,offload-opt-param}__gas-1/rep0/metrics.json \
    $RES_A/zero3-40gb-oom/rep0/metrics.json
  timed "study a (rest)" 400 snake $STUDY_A
  fidelity $RES_A /tmp/raw/a
  pack
  ;;&
nvme | full)
  [ "$STAGE" = nvme ] && timed ops "${OPS_S:-240}" build_ops cpu_adam fused_adam async_io
  timed plan_b 120 snake $STUDY_B plan
  timed "study nvme" 420 snake $STUDY_B
  # the default study's GPU variant: the four scenario kinds with a small model
  timed "study default-gpu" 240 snake $STUDY_C
  # finish study A when an earlier call was cut (its records are still on a warm machine)
  [ "${FINISH_A:-0}" = 1 ] && timed "study a (finish)" 200 snake $STUDY_A
  ;;
fid)
  # fidelity, interleaved: raw, workflow runner, raw, runner (warm-up 3, 8 measured steps)
  mkdir -p /tmp/fid /tmp/raw/fid
  for s in zero3__gas-1 offload-opt__gas-1; do
    python3 -c "import json,sys; s=json.load(open(sys.argv[1])); s.update(warmup_steps=3, steps=8); json.dump(s, open(sys.argv[2], 'w'))" $RES_A/configs/$s.run.json /tmp/fid/$s.run.json
    for k in 1 2; do
      timed "raw $s #$k" 120 raw /tmp/fid/$s.run.json /tmp/raw/fid/$s.$k.json
      timed "workflow $s #$k" 120 python3 -m offload_study.training.runner --spec /tmp/fid/$s.run.json --repeat $k --outdir /tmp/fid/$s/rep$k
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); w=json.load(open(sys.argv[2])); print('FID', sys.argv[3], r['tokens_per_s'], w['tokens_per_s'], w['tokens_per_s']/r['tokens_per_s'])" /tmp/raw/fid/$s.$k.json /tmp/fid/$s/rep$k/metrics.json $s.$k
    done
  done
  tar -czf "$OUT/fid.tar.gz" -C /tmp fid raw/fid
  ;;
method)
  # the measurement method's benchmark (config/studies/h200-1gpu-method.yaml: 3 long fixed runs of
  # model A at gas 1; benchmarks/adaptive_vs_fixed.py replays the adaptive stop over them), then the
  # fp16 overflow log (tests' fixture)
  timed ops "${OPS_S:-240}" build_ops cpu_adam fused_adam
  timed overflow 80 overflow_fixture h200-1gpu
  timed plan_m 120 snake $STUDY_M plan
  timed "study method" 330 snake $STUDY_M $RES_M/{zero3,offload-opt,offload-opt-param}/rep0/metrics.json
  ;;
a) ;;
*) echo "unknown stage $STAGE (smoke | a | nvme | full | method)"; exit 2 ;;
esac
