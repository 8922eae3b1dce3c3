"""Why the study keeps a config job per scenario: what Snakemake re-runs when one scenario changes.

    python benchmarks/snakemake_masking.py

A dry run of 1,000 runs costs Snakemake about twice a trivial workflow's because each run is two
jobs (docs/benchmarks.md, "The floor of this DAG"). The one-job design behind the target writes
every config in the study-wide plan job and gives each train job `ancient(plan.json)` as its only
input and its run spec as a param, so that a changed scenario re-runs alone. This script builds
that shape with no library code in a temp folder (a summary job whose params are every spec, a
plan job, a train job per spec), runs it, changes one spec, and prints which jobs each of two
invocations runs. With Snakemake 9.27 the first invocation re-plans and trains nothing (a job
below a job that re-runs is not looked at for its own reasons when its only input from there is
ancient: snakemake/snakemake#4166), the second trains the changed one. Then the same with the
study's shape (a config job per spec between the two): the first invocation trains it.

Prints only; exit status 1 when a Snakemake run fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HEAD = """\
SPECS = config["specs"]


rule all:
    input:
        expand("runs/{s}.done", s=SPECS),


rule summary:
    output:
        "summary.json",
    params:
        specs=lambda wc: SPECS,
    shell:
        "echo '{params.specs}' > {output}"


rule plan:
    input:
        "summary.json",
    output:
        "plan.json",
    shell:
        "cp {input} {output}"
"""

ONE_JOB = """
rule train:
    input:
        ancient("plan.json"),
    output:
        "runs/{s}.done",
    params:
        spec=lambda wc: SPECS[wc.s],
    shell:
        "echo {params.spec} > {output}"
"""

CONFIG_JOB = """
rule config:
    output:
        "configs/{s}.json",
    params:
        spec=lambda wc: SPECS[wc.s],
    shell:
        "echo {params.spec} > {output}"


rule train:
    input:
        ancient("plan.json"),
        config="configs/{s}.json",
    output:
        "runs/{s}.done",
    shell:
        "cp {input.config} {output}"
"""


def snakemake(folder: Path, specs: dict) -> list[str]:
    """Run the workflow with these specs; the jobs it ran, by rule (train: which specs)."""
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("runs/*.done")}
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-c1", "--config", f"specs={json.dumps(specs)}"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        sys.exit(f"snakemake failed in {folder}:\n{result.stderr[-3000:]}")
    stats = (
        result.stderr.split("Job stats:")[1].split("total")[0]
        if "Job stats:" in result.stderr
        else ""
    )
    rules = [r for r in re.findall(r"^(\w+)\s+\d+$", stats, re.M) if r not in ("all", "train")]
    trained = sorted(
        p.stem for p in folder.glob("runs/*.done") if before.get(p.name) != p.stat().st_mtime_ns
    )
    return rules + [f"train {name}" for name in trained]


def show(shape: str, rules: str) -> None:
    with tempfile.TemporaryDirectory(prefix="masking-") as tmp:
        folder = Path(tmp)
        (folder / "Snakefile").write_text(HEAD + rules)
        print(f"{shape}:")
        print(f"  first run, specs a=1 b=1: {', '.join(snakemake(folder, {'a': 1, 'b': 1}))}")
        for n in (1, 2):
            ran = snakemake(folder, {"a": 1, "b": 2}) or ["nothing"]
            print(f"  b changed to 2, invocation {n}: {', '.join(ran)}")


def main() -> int:
    show("one job per run (train: ancient(plan.json) and its spec as a param)", ONE_JOB)
    show("a config job per spec (the study's rules)", CONFIG_JOB)
    return 0


if __name__ == "__main__":
    sys.exit(main())
