"""How long planning takes as sweeps grow: Plan() in-process and `snakemake -n` end to end.

    python benchmarks/plan_scaling.py [--sizes 4 100 1000]

Prints one line per size: runs, Plan() seconds, `snakemake -n` seconds. Target (docs): a
1000-run study plans in a few seconds, so `snakemake -n` stays interactive.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from offload_study.plan import Plan
from offload_study.study import REPO_ROOT


def study_with_runs(runs: int) -> dict:
    study = yaml.safe_load((REPO_ROOT / "config/config.yaml").read_text())
    study["study"] = f"bench-{runs}"
    values = [int(5e7) * (i + 1) for i in range(max(1, runs // 4))]
    for scenario in study["scenarios"]:
        scenario["sweep"] = {"reduce_bucket_size": values}
    return study


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 100, 1000])
    args = parser.parse_args()
    print(f"{'runs':>6} {'Plan() s':>9} {'snakemake -n s':>15}")
    for size in args.sizes:
        study = study_with_runs(size)
        start = time.perf_counter()
        plan = Plan(study)
        plan_s = time.perf_counter() - start
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
            yaml.safe_dump(study, fh)
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "-n", "--forceall", "--configfile", fh.name],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        )
        dry_s = time.perf_counter() - start
        Path(fh.name).unlink()
        if result.returncode:
            print(result.stderr[-2000:], file=sys.stderr)
            return 1
        print(f"{len(plan.runs):>6} {plan_s:>9.3f} {dry_s:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
