"""`check`: measured numbers of real runs against references, pass and fail as they should."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from builders import XC_STUDY as STUDY
from conftest import REPO as REPO_ROOT

from offload_study.across import bundle, check
from offload_study.analysis import collect
from offload_study.analysis.report.views import Row
from offload_study.core import contracts, references
from offload_study.core.study import StudyError
from offload_study.planning.plan import Plan


def study_files(cross_cluster, cluster: str = "cpu-a") -> tuple[Path, Path]:  # noqa: F811
    """(summary.csv, plan.json) of the study on ``cluster``: what the check rule gets."""
    folder = cross_cluster.root / bundle.study_dir(cluster, STUDY)
    return folder / "summary.csv", folder / "plan.json"


def measured(cross_cluster, scenario: str, metric: str, cluster: str = "cpu-a") -> float:  # noqa: F811
    summary = collect.read_table(study_files(cross_cluster, cluster)[0])
    return float(summary.loc[summary["scenario"] == scenario, metric].item())


def band_holding_ci(cross_cluster, scenario, metric, value, cluster="cpu-a") -> dict:  # noqa: F811
    """lower/upper (relative to ``value``) at least ±50 % and wide enough to hold the measured
    95 % CI: a 3-step CPU run on a busy machine (tests in parallel) can have a CI wider than
    ±50 %; these tests are about the check's rule, not about the machine's noise."""
    low = measured(cross_cluster, scenario, f"{metric}_ci_low", cluster)
    high = measured(cross_cluster, scenario, f"{metric}_ci_high", cluster)
    return {"lower": min(-0.5, low / value - 1.05), "upper": max(0.5, high / value - 0.95)}


def write_refs(folder: Path, refs: list[dict], name: str = "refs", study: str = STUDY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({"study": study, "references": refs}))
    return folder


def run_check(cross_cluster, refs: Path, *extra: str) -> subprocess.CompletedProcess:  # noqa: F811
    summary, plan = study_files(cross_cluster)
    cmd = [
        sys.executable,
        "-m",
        "offload_study.across.check",
        "--summary",
        str(summary),
        "--plan",
        str(plan),
        "--references",
        str(refs),
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_check_passes_within_the_reference_band(cross_cluster, tmp_path):  # noqa: F811
    rel = measured(cross_cluster, "offload-opt", "relative_speed")
    tps = measured(cross_cluster, "zero3", "tokens_per_s")
    refs = write_refs(
        tmp_path / "refs",
        [
            # bands wide enough for the whole CI of a short CPU run (the band rule judges the CI)
            {
                "scenario": "offload-opt",
                "value": rel * 1.05,
                **band_holding_ci(cross_cluster, "offload-opt", "relative_speed", rel * 1.05),
            },
            {
                "scenario": "zero3",
                "metric": "tokens_per_s",
                "value": tps,
                "cluster": "cpu-a",
                **band_holding_ci(cross_cluster, "zero3", "tokens_per_s", tps),
            },
        ],
    )
    res = run_check(cross_cluster, refs, "--out", str(tmp_path / "check.json"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS         offload-opt: relative_speed" in res.stdout
    assert "PASS         zero3: tokens_per_s" in res.stdout
    assert res.stdout.strip().endswith(
        "2 pass, 0 fail, 0 inconclusive, 0 missing, 0 no reference -> ok"
    )
    saved = contracts.read_json(tmp_path / "check.json")
    assert saved["passed"] and [v["status"] for v in saved["verdicts"]] == ["pass", "pass"]


@pytest.mark.slow
def test_check_fails_outside_the_band_and_names_the_scenario(cross_cluster, tmp_path):  # noqa: F811
    tps = measured(cross_cluster, "offload-opt", "tokens_per_s")
    # a 3-step CPU run on a busy machine can have a 95 % CI far wider than the default band,
    # so each reference is placed from the CI, not from the mean, to lie wholly outside it
    ci_high = measured(cross_cluster, "offload-opt", "tokens_per_s_ci_high")
    ci_low = measured(cross_cluster, "offload-opt", "tokens_per_s_ci_low")
    ref = 3 * max(tps, ci_high)
    refs = write_refs(
        tmp_path / "refs",
        [
            # the cluster ran at a third of what it used to: a regression
            {"scenario": "offload-opt", "metric": "tokens_per_s", "value": ref, "lower": -0.5},
        ],
    )
    res = run_check(cross_cluster, refs)
    assert res.returncode == 1, res.stdout + res.stderr
    line = next(x for x in res.stdout.splitlines() if x.strip().startswith("FAIL"))
    off = f"{100 * (tps / ref - 1):+.1f}% of the reference, below its band"
    assert "offload-opt: tokens_per_s" in line and off in line, line
    assert "NO REFERENCE zero3" in res.stdout and "-> FAILED" in res.stdout
    assert ci_low > 0, "the fixture's run measured no usable CI"
    below = min(tps, ci_low) / 3
    above = write_refs(
        tmp_path / "above",
        [
            {"scenario": "offload-opt", "metric": "tokens_per_s", "value": below, "upper": 0.5},
        ],
    )
    res = run_check(cross_cluster, above)
    off = f"{100 * (tps / below - 1):+.1f}% of the reference, above its band"
    assert res.returncode == 1 and off in res.stdout, res.stdout


@pytest.mark.slow
def test_most_specific_reference_wins(cross_cluster, tmp_path):  # noqa: F811
    summary, plan = study_files(cross_cluster)
    tps = measured(cross_cluster, "zero3", "tokens_per_s")
    device = collect.read_table(summary)["device_name"].dropna().iloc[0]
    refs = references.load_references(
        write_refs(
            tmp_path / "refs",
            [
                {"scenario": "zero3", "metric": "tokens_per_s", "value": 100 * tps},  # any cluster
                {
                    "scenario": "zero3",
                    "metric": "tokens_per_s",
                    "value": tps,
                    "gpu_model": device,
                    **band_holding_ci(cross_cluster, "zero3", "tokens_per_s", tps),
                },
                {
                    "scenario": "zero3",
                    "metric": "tokens_per_s",
                    "value": tps / 100,
                    "cluster": "cpu-b",
                },
            ],
        )
    )
    found = check.verdicts(collect.read_table(summary), contracts.read_json(plan), refs)
    zero3 = [v for v in found if v.scenario == "zero3"]
    assert [(v.status, v.reference.gpu_model) for v in zero3] == [("pass", device)]
    other = [r for r in refs if r.gpu_model is None and r.cluster is None]
    (v,) = [
        v
        for v in check.verdicts(collect.read_table(summary), contracts.read_json(plan), other)
        if v.scenario == "zero3"
    ]
    assert v.status == "fail"


@pytest.mark.slow
def test_a_bundle_is_checked_like_the_local_study(cross_cluster, tmp_path):  # noqa: F811
    rel = measured(cross_cluster, "offload-opt", "relative_speed", "cpu-b")
    refs = write_refs(
        tmp_path / "refs",
        [
            {
                "scenario": "offload-opt",
                "value": rel,
                "cluster": "cpu-b",
                **band_holding_ci(cross_cluster, "offload-opt", "relative_speed", rel, "cpu-b"),
            },
            {"scenario": "no-such-scenario", "value": 1.0},
        ],
    )
    cmd = [
        sys.executable,
        "-m",
        "offload_study.across.check",
        "--bundle",
        str(cross_cluster.bundles["cpu-b"]),
        "--references",
        str(refs),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr  # the reference nobody can meet
    assert "PASS         offload-opt: relative_speed" in res.stdout
    assert "MISSING      no-such-scenario" in res.stdout and "does not have" in res.stdout


@pytest.mark.slow
def test_every_reference_metric_is_a_summary_column(cross_cluster):  # noqa: F811
    summary = collect.read_table(study_files(cross_cluster)[0])
    assert set(references.METRICS) <= set(summary.columns)


def test_a_bad_reference_file_is_one_clear_error(tmp_path):
    refs = write_refs(tmp_path / "refs", [{"scenario": "zero3", "value": 1.0, "tolerance": 0.1}])
    with pytest.raises(StudyError, match=r"refs\.yaml: references\[0\]\.tolerance: unknown key"):
        references.load_references(refs)
    refs = write_refs(tmp_path / "neg", [{"scenario": "zero3", "value": 1.0, "lower": 0.1}])
    with pytest.raises(StudyError, match=r"references\[0\]\.lower"):
        references.load_references(refs)
    twice = write_refs(tmp_path / "twice", [{"scenario": "zero3", "value": 1.0}])
    write_refs(twice, [{"scenario": "zero3", "value": 2.0}], name="again")
    with pytest.raises(StudyError, match="also given in"):
        references.load_references(twice)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "offload_study.across.check",
            "--summary",
            "x.csv",
            "--plan",
            "p.json",
            "--references",
            str(refs),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "references[0].lower" in res.stdout


def test_shipped_references_name_scenarios_of_their_study():
    """config/references/*.yaml load, and each names scenarios its study really has."""
    refs = references.load_references()
    assert refs, "the seed's table ships as a reference"
    studies = {}
    for path in sorted((REPO_ROOT / "config" / "studies").glob("*.yaml")):
        studies[yaml.safe_load(path.read_text())["study"]] = path
    for ref in refs:
        plan = Plan(str(studies[ref.study]))
        assert ref.scenario in plan.scenarios, (ref.file, ref.scenario)
    seed = {r.scenario: r.value for r in refs if r.study == "seed"}
    assert seed == {"zero3-8gpu-40gb": 1.0, "offload-4gpu-40gb": 0.35, "offload-2gpu-80gb": 0.2}


def test_judge_is_pure_over_a_summary_row():
    ref = references.Reference(
        file="f.yaml",
        study="s",
        scenario="a",
        metric="relative_speed",
        value=0.35,
        lower=-0.25,
        upper=0.25,
        cluster=None,
        gpu_model=None,
        note="seed",
        source="seed",
    )
    row = Row
    assert check.judge("a", row(relative_speed=0.30), ref).status == check.PASS
    assert check.judge("a", row(relative_speed=0.25), ref).status == check.FAIL
    assert check.judge("a", row(relative_speed=0.44), ref).status == check.FAIL
    missing = check.judge("a", row(relative_speed=None, outcomes="gpu_oom:1"), ref)
    assert missing.status == check.MISSING and "gpu_oom:1" in missing.message
    flagged = check.judge("a", row(relative_speed=0.36, flags="ci-target-missed"), ref)
    assert flagged.status == check.PASS and "flagged: ci-target-missed" in flagged.message
    # the whole CI is judged: inside passes, across an edge is inconclusive (and fails the gate)
    ci = {"relative_speed_ci_low": 0.28, "relative_speed_ci_high": 0.40}
    assert check.judge("a", row(relative_speed=0.34, **ci), ref).status == check.PASS
    edge = check.judge(
        "a", row(relative_speed=0.30, relative_speed_ci_low=0.24, relative_speed_ci_high=0.36), ref
    )
    assert edge.status == check.INCONCLUSIVE and edge.failed and "inconclusive" in edge.message
    below = check.judge(
        "a", row(relative_speed=0.20, relative_speed_ci_low=0.18, relative_speed_ci_high=0.24), ref
    )
    assert below.status == check.FAIL and "below its band" in below.message
