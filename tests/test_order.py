"""Run order: on one machine the repeats of a study go interleaved (A B C A B C), so that drift
over time hits every scenario alike; the plan computes the order, the train rule's priority
follows it (a dry run shows each job's priority)."""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import REPO as REPO_ROOT
from runs import snakemake

from offload_study.core.study import StudyError, load_schema
from offload_study.planning import plan as P

S, R = ["a", "b", "c"], [0, 1]


def test_interleaved_runs_every_scenario_once_per_round():
    assert P.run_order(S, R, "interleaved") == [
        ("a", 0),
        ("b", 0),
        ("c", 0),
        ("a", 1),
        ("b", 1),
        ("c", 1),
    ]


def test_grouped_runs_a_scenarios_repeats_back_to_back():
    assert P.run_order(S, R, "grouped") == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("b", 1),
        ("c", 0),
        ("c", 1),
    ]


def test_the_orders_are_the_schemas():
    schema = load_schema("study")["properties"]["run_order"]
    assert list(P.RUN_ORDERS) == schema["enum"] and schema["default"] == "interleaved"
    with pytest.raises(StudyError, match="run_order: 'random'"):
        P.run_order(S, R, "random")


def test_a_study_with_an_unknown_order_is_refused():
    with pytest.raises(StudyError, match="run_order"):
        P.Plan({**default_study(), "run_order": "shuffled"})


def default_study() -> dict:
    return yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())


def test_priorities_fall_along_the_order():
    plan = P.Plan({**default_study(), "repeats": 3})
    order = plan.run_order()
    assert plan.study["run_order"] == "interleaved"
    assert len(order) == 3 * len(plan.scenarios)
    prios = [plan.run_priority(s, r) for s, r in order]
    assert prios == sorted(prios, reverse=True) and len(set(prios)) == len(prios)
    assert plan.run_priority("no-such-scenario", 0) == 0


def train_jobs_by_priority(output: str) -> list[tuple[str, int]]:
    """(scenario, repeat) of every train job of a dry run, highest priority first."""
    jobs = []
    for block in output.split("rule train:")[1:]:
        m = re.search(r"wildcards: scenario=([^,\s]+), rep=(\d+)", block)
        p = re.search(r"^\s+priority: (\d+)", block.split("\nrule ")[0], re.M)
        jobs.append((int(p[1]) if p else 0, m[1], int(m[2])))
    return [(s, r) for _, s, r in sorted(jobs, key=lambda j: -j[0])]


@pytest.mark.parametrize("order", ["interleaved", "grouped"])
def test_a_dry_run_starts_the_runs_in_the_study_order(order):
    res = snakemake("-n", "--forceall", "--config", "repeats=2", f"run_order={order}")
    assert res.returncode == 0, res.stderr[-2000:]
    plan = P.Plan({**default_study(), "repeats": 2, "run_order": order})
    assert train_jobs_by_priority(res.stdout) == plan.run_order()


def test_under_slurm_no_order_is_imposed():
    res = snakemake("-n", "--forceall", "--config", "repeats=2", "cluster=example-slurm")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("rule train:") == 8 and "priority:" not in res.stdout
