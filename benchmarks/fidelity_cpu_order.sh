#!/usr/bin/env bash
# The workflow's runs of a study beside plain DeepSpeed loops of the same run specs
# (benchmarks/raw_deepspeed.py) on this machine's CPU, repeat by repeat in alternating order:
# even repeats run the workflow first, odd ones the plain loop, so that an order effect (what the
# first loop leaves the machine: a disk's blocks, caches, a flush) shows apart from the harness.
#   bash benchmarks/fidelity_cpu_order.sh [STUDY_YAML]    (default config/studies/fidelity-cpu-nvme.yaml)
#   python benchmarks/fidelity_table.py results           the pairs, which ran first, per path
# The plain loops' JSON lines go to <results>/device-logs/raw-deepspeed/, where
# fidelity_table.py reads them beside the records; the workflow's run uses the study's steps,
# the plain loop the same warm-up and measured steps (read from the run spec).
set -euo pipefail
cd "$(dirname "$0")/.."
study=${1:-config/studies/fidelity-cpu-nvme.yaml}
py=${PYTHON:-.venv/bin/python}
export PATH="$(dirname "$py"):$PATH"
plan() { "$py" -c "from offload_study.planning.plan import Plan; p = Plan('$study'); print($1)"; }
res=$(plan p.results_dir)
cores=$(nproc)

workflow() { # workflow SCENARIO REPEAT
  "$py" -m snakemake --cores "$cores" "$res/$1/rep$2/metrics.json" --config study_file="$study" \
    >"$res/device-logs/workflow.$1.rep$2.log" 2>&1
  echo "workflow $1 rep$2 done $(date -u +%T)"
}

plain() { # plain SCENARIO REPEAT
  local spec=$res/configs/$1.run.json out=$res/device-logs/raw-deepspeed/$1.rep$2.json
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=$cores "$py" -m torch.distributed.run --nnodes 1 \
    --nproc_per_node 1 --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) \
    benchmarks/raw_deepspeed.py --spec "$spec" --out "$out" >"${out%.json}.log" 2>&1
  echo "plain loop $1 rep$2 done $(date -u +%T)"
}

"$py" -m snakemake --cores "$cores" plan --config study_file="$study" >/dev/null
mkdir -p "$res/device-logs/raw-deepspeed"
for k in $(plan "*p.repeats"); do
  for s in $(plan "*p.scenarios"); do
    if [ $((k % 2)) -eq 1 ]; then plain "$s" "$k" && workflow "$s" "$k"; else workflow "$s" "$k" && plain "$s" "$k"; fi
  done
done
