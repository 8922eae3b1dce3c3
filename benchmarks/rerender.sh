#!/usr/bin/env bash
# Re-collect and re-render committed pages from their records (docs/results/...), with this
# checkout's collect and report, without re-running anything.
#   bash benchmarks/rerender.sh                    every page under reports/ with records, then
#                                                  the site's index (reports/index.html)
#   bash benchmarks/rerender.sh docs/results/h200-2gpu/seed-2gpu reports/h200-2gpu/seed-2gpu
#                                                  one study's report.html
#   bash benchmarks/rerender.sh docs/results/h200-2gpu/recommend-h200-2gpu-40g \
#        reports/h200-2gpu/recommend-h200-2gpu-40g recommend    one search's recommend.html
# Every metrics.json the plan expects is collected (a missing repeat becomes a "missing" row).
set -euo pipefail
py=${PYTHON:-python}

report() {  # <records folder> <report folder>
  local study_dir=$1 report_dir=$2
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
  local baseline
  baseline=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1])).get('baseline') or '')" "$study_dir/plan.json")
  "$py" -m offload_study.analysis.collect --baseline "$baseline" --runs-csv "$study_dir/runs.csv" \
    --runs-parquet "$study_dir/runs.parquet" --summary-csv "$study_dir/summary.csv" "${metrics[@]}"
  "$py" -m offload_study.analysis.report --runs "$study_dir/runs.csv" --summary "$study_dir/summary.csv" \
    --plan "$study_dir/plan.json" --out "$report_dir/report.html" --figures-dir "$report_dir/figures"
}

recommend() {  # <records folder> <page folder>
  "$py" -m offload_study.analysis.report.recommend --study-dir "$1" --out "$2/recommend.html"
}

if [ $# -ge 2 ]; then
  case ${3:-report} in
    report) report "$1" "$2" ;;
    recommend) recommend "$1" "$2" ;;
    *) echo "usage: $0 [<records folder> <page folder> [report|recommend]]" >&2; exit 2 ;;
  esac
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: $0 [<records folder> <page folder> [report|recommend]]" >&2; exit 2; }
while IFS=$'\t' read -r kind records page; do
  "$kind" "$records" "$(dirname "$page")"
done < <("$py" -m offload_study.across.headlines reports)
"$py" -m offload_study.across.site --index reports/index.html --site-dir reports/site --reports-root reports
