#!/usr/bin/env bash
# Re-collect and re-render a committed study from its records (docs/results/...), with this
# checkout's collect and report, without re-running anything:
#   bash benchmarks/rerender.sh docs/results/h200-2gpu/seed-2gpu reports/h200-2gpu/seed-2gpu
# Every metrics.json the plan expects is collected (a missing repeat becomes a "missing" row).
set -euo pipefail
study_dir=${1:?study folder with plan.json and <scenario>/rep<k>/}
report_dir=${2:?report folder, e.g. reports/<cluster>/<study>}
py=${PYTHON:-python}
mapfile -t metrics < <("$py" - "$study_dir" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
plan = json.loads((d / "plan.json").read_text())
for s in plan["scenarios"]:
    for k in range(int(plan.get("repeats", 1))):
        print(d / s["name"] / f"rep{k}" / "metrics.json")
PY
)
baseline=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1])).get('baseline') or '')" "$study_dir/plan.json")
"$py" -m offload_study.analysis.collect --baseline "$baseline" --runs-csv "$study_dir/runs.csv" \
  --runs-parquet "$study_dir/runs.parquet" --summary-csv "$study_dir/summary.csv" "${metrics[@]}"
"$py" -m offload_study.analysis.report --runs "$study_dir/runs.csv" --summary "$study_dir/summary.csv" \
  --plan "$study_dir/plan.json" --out "$report_dir/report.html" --figures-dir "$report_dir/figures"
echo "$report_dir/report.html"
