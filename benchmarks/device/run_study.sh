#!/usr/bin/env bash
# Studies through the workflow on a device machine (any kind), one after the other, time-boxed:
#   run(command="STUDIES='config/studies/modes-h200.yaml' CALIBRATE=h200-1gpu \
#                bash benchmarks/device/run_study.sh", carry=[".whl"])
# STUDIES   space-separated STUDY_YAML[:TARGETS] (TARGETS: comma-separated Snakemake targets, e.g.
#           "recommend" or one repeat's metrics.json files; default: all of the study)
# RAW_FSDP2 space-separated fsdp2 scenarios of the first study: after the studies, the plain FSDP2
#           loop (benchmarks/raw_fsdp2.py, 3 warm-up + 8 steps) on each one's run spec, the
#           fidelity reference; its JSON lines and workflow/raw ratios come back in extra.tar.gz.
# RAW_DEEPSPEED the same for DeepSpeed scenarios (benchmarks/raw_deepspeed.py), with PAIRED=1.
# PAIRED=1 the first study's runs one at a time instead of all at once: repeat by repeat, each
#           scenario in study order (the study's interleaved run order), and each one named in
#           RAW_FSDP2 followed at once by its plain loop on the same repeat, so a workflow run and
#           its plain loop run minutes apart on one machine; then collect and report
#           (PAIRED_REPEATS="1": those repeats only, e.g. one a call when a call holds one;
#           PAIRED_SCENARIOS="a b": those scenarios only). Every study of STUDIES is run so. A
#           plain loop whose JSON line is newer than its workflow record is not run again, so a
#           call repeated after a deadline continues where the last one stopped (nor, where it ran
#           first, one whose workflow run the deadline cut).
# PAIRED_ORDER=alternate: odd repeats run the plain loop first, then the workflow's run (even
#           repeats, and the default, the workflow first), so that what the first of two loops
#           leaves the machine (a disk's allocated blocks, a flush under way) does not always
#           favour the same one; the plain loop's JSON line stamps its start, and
#           benchmarks/fidelity_table.py says which ran first.
# RAW_WARMUP, RAW_STEPS the plain loops' warm-up and measured steps (default 3 and 8);
# RAW_LIMIT_S a plain loop's time limit (default 150 s; an NVMe loop of a 1B model needs more).
# OPS       the DeepSpeed ops built ahead (default: cpu_adam fused_adam; "" for FSDP2 alone).
# CALIBRATE_AT "CLUSTER:STUDY_YAML ...": after the studies, measure CLUSTER's calibration at the sizes
#           and shapes of STUDY's runs (calibrate --study) into results/CLUSTER/calibration.at-<study>.json,
#           beside (not instead of) the calibration the plans used; it comes back with the records.
# SEED=1   a fresh machine continues a study whose records were committed: each study's
#           docs/results/<cluster>/<study> is copied into its empty results folder first (plans,
#           configs, the search's rounds and every record; not its logs or cut runs), so only
#           what is missing runs (the device's results/ do not outlive the machine).
# CLUSTER  run every study of STUDIES on this cluster instead of its own (snakemake --config
#           cluster=...): config/clusters/CLUSTER.yaml, on the device or written by the command.
# GPU      stop at once unless nvidia-smi names this GPU (e.g. GPU=H200: a call for one kind can
#           be served by another, and its records would land in the other card's studies).
# CALIBRATE CLUSTER: first measure that cluster's calibration (python -m offload_study.prediction.calibrate,
#           CUDA path, the cores of one GPU's share) into results/CLUSTER/calibration.json.
# Records and Snakemake's state live outside the carried tree (/tmp/dev), so a later call on the
# same warm machine continues what a call cut at its deadline left (--rerun-incomplete redoes a
# half-written run; the archive keeps a copy of it; a run the deadline cancelled is moved to
# <results>/cancelled-by-deadline/ and run again). Every call packs the records into $OUT.
set -uo pipefail
NAME=run_study
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 560
STUDIES=${STUDIES:?STUDIES=study.yaml[:target] ...}
if [ -n "${GPU:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | grep -q "$GPU"; then
  say "no $GPU here ($(nvidia-smi -L 2>&1 | head -1)); nothing run"
  exit 3
fi

snake() { # snake STUDY_YAML [targets...]
  local study=$1
  shift
  python3 -m snakemake "$@" --cores "$CORES" --scheduler greedy --keep-going \
    --rerun-incomplete --config study_file="$study" ${CLUSTER:+cluster="$CLUSTER"}
}

plan_of() { # plan_of STUDY_YAML ATTRIBUTE: the Plan's attribute, on CLUSTER where one is given
  python3 - "$1" "$2" "${CLUSTER:-}" <<'PY'
import sys
from offload_study.planning.plan import Plan
from offload_study.planning.studyfile import study_config
path, attribute, cluster = sys.argv[1:]
study, source = study_config({"study_file": path, **({"cluster": cluster} if cluster else {})})
value = getattr(Plan(study, source=source), attribute)
print(*(value if isinstance(value, (list, tuple)) else [value]))
PY
}

results_dir() { plan_of "$1" results_dir; }

keep_outside() { # results/, reports/ and .snakemake/ survive a re-carried tree
  local d
  for d in results reports .snakemake; do
    [ -L $d ] && continue
    mkdir -p /tmp/dev/$d
    [ -d $d ] && cp -a $d/. /tmp/dev/$d/ && rm -rf $d
    ln -s /tmp/dev/$d $d
  done
}

requeue_cancelled() { # a run cut by the last call's deadline is run again: its record aside
  local rec dir dest
  for rec in $(grep -l '"outcome": "cancelled"' results/*/*/*/rep*/metrics.json 2>/dev/null); do
    dir=${rec%/metrics.json}
    dest="${dir%/*/*}/cancelled-by-deadline/$(basename "${dir%/*}").${dir##*/}.$(date +%s)"
    mkdir -p "${dest%/*}" && mv "$dir" "$dest" && say "re-run $dir (cancelled record -> $dest)"
  done
}

seed_committed() { # SEED=1: a study's committed records (docs/results/...) continued, not re-run
  local item res
  for item in $STUDIES; do
    res=$(results_dir "${item%%:*}") || continue
    [ -d "docs/$res" ] && [ ! -f "$res/plan.json" ] || continue
    mkdir -p "$res"
    (cd "docs/$res" && tar -cf - --exclude=device-logs --exclude=cancelled-by-deadline \
      --exclude=README.md --exclude='*predicted-before-the-runs*' --exclude='runs.*' \
      --exclude=summary.csv .) | tar -xf - -C "$res"
    # one time, newer than the carried tree: Snakemake keeps what is there (no input newer than
    # its output) and runs what is missing; a second ahead, since touch -d drops the fraction
    # and a tree file written in this second would count as newer
    find "$res" -exec touch -d "@$(($(date +%s) + 1))" {} +
    say "seeded $res from docs/$res"
  done
}

pack() {
  local dirs=() item res
  for item in $STUDIES; do
    res=$(results_dir "${item%%:*}" 2>/dev/null) && dirs+=("$res" "reports/${res#results/}")
  done
  # shellcheck disable=SC2046
  tar -czhf "$OUT/results.tar.gz" --exclude='*/archive/*' $(ls -d "${dirs[@]}" \
    results/*/calibration*.json .snakemake/log 2>/dev/null)
  tar -czf "$OUT/extra.tar.gz" -C /tmp logs $(cd /tmp && ls -d raw 2>/dev/null)
}

raw_loop() { # raw_loop ENGINE RESULTS_DIR SCENARIO [REPEAT]: the plain loop, its JSON line in /tmp/raw
  local rep=${4:-0} out=/tmp/raw/$1/$3.rep${4:-0}.json
  mkdir -p "/tmp/raw/$1"
  OMP_NUM_THREADS=$CORES python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 1 \
    --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) "benchmarks/raw_$1.py" \
    --spec "$2/configs/$3.run.json" --out "$out" --warmup "${RAW_WARMUP:-3}" \
    --steps "${RAW_STEPS:-8}" >"${out%.json}.log" 2>&1
}

ratio_line() { # ratio_line ENGINE RESULTS_DIR SCENARIO [REPEAT]: workflow / plain tok/s of a pair
  local rep=${4:-0} out=/tmp/raw/$1/$3.rep${4:-0}.json
  [ -f "$out" ] && [ -f "$2/$3/rep$rep/metrics.json" ] || return 0
  python3 - "$out" "$2/$3/rep$rep/metrics.json" <<'PY'
import json, sys
raw, wf = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
print(f"FIDELITY {raw['scenario']}: workflow {wf['tokens_per_s']:.1f} tok/s, raw "
      f"{raw['tokens_per_s']:.1f} tok/s, ratio {wf['tokens_per_s'] / raw['tokens_per_s']:.3f}")
PY
}

raw_done() { # raw_done RESULTS_DIR SCENARIO REPEAT: its plain loop ran after its workflow run
  local rec=$1/$2/rep$3/metrics.json json
  for json in /tmp/raw/*/"$2.rep$3.json"; do
    [ -f "$json" ] && [ -f "$rec" ] && [ "$json" -nt "$rec" ] && say "raw $2 rep$3: done before" && return 0
  done
  return 1
}

raw_line() { # raw_line SCENARIO REPEAT: a plain loop of it ran on this machine
  local json
  for json in /tmp/raw/*/"$1.rep$2.json"; do
    [ -f "$json" ] && say "raw $1 rep$2: ran before, its workflow run still to come" && return 0
  done
  return 1
}

raw_fsdp2() { raw_loop fsdp2 "$@" && ratio_line fsdp2 "$@"; }  # outside PAIRED: after the studies

plain_loop() { # plain_loop RESULTS_DIR SCENARIO REPEAT: its plain loop, if RAW_* names it
  local engine
  for engine in fsdp2 deepspeed; do
    local named=RAW_${engine^^}
    [[ " ${!named:-} " == *" $2 "* ]] || continue
    timed "raw $2 rep$3" "${RAW_LIMIT_S:-150}" raw_loop "$engine" "$@"
    ratio_line "$engine" "$@"
  done
}

plain_first() { # plain_first REPEAT: this repeat runs its plain loops before the workflow
  [ "${PAIRED_ORDER:-}" = alternate ] && [ $(($1 % 2)) -eq 1 ]
}

paired() { # paired STUDY_YAML: runs one at a time, each fsdp2 one of RAW_FSDP2 beside its plain loop
  local study=$1 res k s
  res=$(results_dir "$study")
  timed "plan $study" 300 snake "$study" plan || return
  for k in ${PAIRED_REPEATS:-$(plan_of "$study" repeats)}; do
    for s in $(plan_of "$study" scenarios); do
      [ -n "${PAIRED_SCENARIOS:-}" ] && [[ " $PAIRED_SCENARIOS " != *" $s "* ]] && continue
      if plain_first "$k"; then
        # a record already there had its plain loop before it, and a plain loop whose workflow
        # run a deadline cut still comes first (a call after a deadline, on the same machine)
        [ -f "$res/$s/rep$k/metrics.json" ] || raw_line "$s" "$k" || plain_loop "$res" "$s" "$k"
        timed "$s rep$k" 300 snake "$study" "$res/$s/rep$k/metrics.json"
        ratio_line fsdp2 "$res" "$s" "$k"
        ratio_line deepspeed "$res" "$s" "$k"
        continue
      fi
      timed "$s rep$k" 300 snake "$study" "$res/$s/rep$k/metrics.json"
      raw_done "$res" "$s" "$k" || plain_loop "$res" "$s" "$k"
    done
  done
  [ -z "${PAIRED_REPEATS:-}" ] && timed "collect and report $study" 300 snake "$study"
}

summary() {
  echo
  echo "==================== summary ($(elapsed) s) ===================="
  printf '%s\n' "${SUMMARY[@]}"
  local item res
  for item in $STUDIES; do
    res=$(results_dir "${item%%:*}" 2>/dev/null) && [ -d "$res" ] && { echo "-- $res"; table "$res"; }
  done
  pack
}
trap summary EXIT
export -f elapsed say left snake plan_of versions build_ops table raw_loop raw_done raw_line raw_fsdp2 \
  ratio_line plain_loop plain_first paired

keep_outside
requeue_cancelled
setup
[ -n "${SEED:-}" ] && seed_committed
timed versions 60 versions
# shellcheck disable=SC2086
[ -n "${OPS-cpu_adam fused_adam}" ] && timed ops 240 build_ops ${OPS-cpu_adam fused_adam}
if [ -n "${CALIBRATE:-}" ] && [ ! -f "results/$CALIBRATE/calibration.json" ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  timed calibrate 180 python3 -m offload_study.prediction.calibrate --cluster "$CALIBRATE" \
    --cores $((CORES / (gpus > 0 ? gpus : 1))) --out "results/$CALIBRATE/calibration.json"
  cat "results/$CALIBRATE/calibration.json"
fi
first=${STUDIES%% *}
if [ -n "${PAIRED:-}" ]; then
  for item in $STUDIES; do paired "${item%%:*}"; done
  STUDIES_LEFT=
else
  STUDIES_LEFT=$STUDIES
fi
for item in $STUDIES_LEFT; do
  study=${item%%:*} target=
  [[ $item == *:* ]] && target=${item#*:}
  # shellcheck disable=SC2086
  timed "$study ${target:-all}" 600 snake "$study" ${target//,/ }
done
[ -n "${PAIRED:-}" ] && RAW_FSDP2=
for s in ${RAW_FSDP2:-}; do
  timed "raw_fsdp2 $s" 120 raw_fsdp2 "$(results_dir "${first%%:*}")" "$s"
done
for at in ${CALIBRATE_AT:-}; do
  cluster=${at%%:*} study=${at#*:}
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  out="results/$cluster/calibration.at-$(basename "${study%.yaml}").json"
  timed "calibrate at $study" 300 python3 -m offload_study.prediction.calibrate --cluster "$cluster" \
    --cores $((CORES / (gpus > 0 ? gpus : 1))) --study "$study" --out "$out" && cat "$out"
done
