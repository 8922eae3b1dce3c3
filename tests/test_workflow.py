"""The Snakemake workflow as users drive it: dry runs, lint, README and CI wiring."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload_study import readme_sync
from offload_study.study import REPO_ROOT

SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def snakemake(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def job_counts(output: str) -> dict[str, int]:
    table = output.split("Job stats:")[1].split("total")[0]
    return {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)}


@pytest.mark.parametrize(
    ("args", "expected_train"),
    [((), 4), (("--configfile", "config/studies/seed.yaml"), 4)],
    ids=["default", "seed"],
)
def test_dry_run_plans_one_train_job_per_scenario_and_repeat(args, expected_train):
    result = snakemake("-n", "--forceall", *args)
    assert result.returncode == 0, result.stderr
    counts = job_counts(result.stdout)
    assert counts["train"] == expected_train
    assert counts["deepspeed_config"] == expected_train
    assert counts["report"] == 1 and counts["collect"] == 1


def test_dry_run_counts_repeats_and_sweeps():
    result = snakemake("-n", "--forceall", "--config", "repeats=3")
    assert result.returncode == 0, result.stderr
    assert job_counts(result.stdout)["train"] == 12


def test_invalid_study_is_refused_before_anything_runs():
    result = snakemake("-n", "--config", "global_batch=7")
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "invalid study" in text and "global_batch 7" in text


def test_lint_reports_nothing_serious():
    result = snakemake("--lint")
    text = result.stdout + result.stderr
    assert "Lints for" not in text or "rule" not in text.split("Lints for")[1][:0], text
    assert result.returncode == 0, text


def test_readme_reference_is_in_sync_with_the_schemas():
    readme = (REPO_ROOT / "README.md").read_text()
    assert readme_sync.synced(readme) == readme, "run: python -m offload_study.readme_sync"


def test_readme_has_two_setup_commands_and_ci_calls_the_test_one():
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("## The two commands")[1].split("```bash")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make study", "make test"]
    assert "make test" in (REPO_ROOT / ".ci/run").read_text()
