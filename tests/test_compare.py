"""Cross-cluster comparison of the real bundles of conftest's cross_cluster (cores granted: 2
against 1)."""

from __future__ import annotations

import dataclasses
import math
import re

import pandas as pd
import pytest
from builders import XC_STUDY as STUDY

from offload_study.across import bundle, compare
from offload_study.analysis import collect
from offload_study.core import contracts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sides(cross_cluster):  # noqa: F811 - the imported fixture
    """(cpu-a side, cpu-b side), collected again from the extracted bundles."""
    paths = [cross_cluster.bundles[c] for c in ("cpu-a", "cpu-b")]
    with bundle.opened(paths) as bundles:
        yield [compare.load_side(b, b.manifest.cluster, seed=i) for i, b in enumerate(bundles)]


def bundled_summary(cross_cluster, cluster: str) -> pd.DataFrame:  # noqa: F811
    """The summary.csv the cluster itself collected (what the bundle carries)."""
    return collect.read_table(cross_cluster.root / bundle.study_dir(cluster, STUDY) / "summary.csv")


def test_compare_cli_puts_the_clusters_side_by_side(cross_cluster, tmp_path, capsys):  # noqa: F811
    a, b = cross_cluster.bundles["cpu-a"], cross_cluster.bundles["cpu-b"]
    out = tmp_path / "reports" / "compare" / f"{bundle.compare_name([a, b])}.html"
    assert compare.main(["--out", str(out), str(a), str(b)]) == 0
    printed = capsys.readouterr().out
    assert "cpu-b:" in printed and "the tokens/s of cpu-a" in printed
    assert "cores granted (2 vs 1)" in printed
    html = out.read_text()
    assert "default-src 'none'" in html and "<script" not in html
    for cluster in ("cpu-a", "cpu-b"):
        summary = bundled_summary(cross_cluster, cluster)
        for scenario in ("zero3", "offload-opt"):
            tps = summary.loc[summary["scenario"] == scenario, "tokens_per_s"].item()
            assert f"{tps:,.0f}" in html, (cluster, scenario)
    links = re.findall(r'class="bundle" href="([^"]+)"', html)
    assert [(out.parent / link).resolve() for link in links] == [a.resolve(), b.resolve()]


def test_values_are_the_bundles_own_and_the_ratio_has_a_ci(cross_cluster, sides):  # noqa: F811
    view = compare.comparison(sides)
    assert [r["name"] for r in view["rows"]] == ["zero3", "offload-opt"]
    for row in view["rows"]:
        measured = []
        for cell, cluster in zip(row["cells"], ("cpu-a", "cpu-b"), strict=True):
            own = bundled_summary(cross_cluster, cluster).set_index("scenario").loc[row["name"]]
            assert cell["tokens_per_s"] == pytest.approx(own["tokens_per_s"])
            assert cell["relative_speed"] == pytest.approx(own["relative_speed"])
            measured.append(cell["tokens_per_s"])
        (against,) = row["against"]
        assert against["reason"] is None
        assert against["value"] == pytest.approx(measured[1] / measured[0])
        assert against["ci_low"] < against["value"] < against["ci_high"]
        assert row["workload"] == []
        assert {d["fact"]: d["values"] for d in row["platform"]} == {"cores granted": ["2", "1"]}
    (line,) = view["verdicts"]
    ratios = [r["against"][0]["value"] for r in view["rows"]]
    assert f"{math.sqrt(ratios[0] * ratios[1]):.2f}×" in line


def test_comparability_table_flags_what_differs(sides):
    facts = {f["fact"]: f for f in compare.comparison(sides)["facts"]}
    assert facts["cores granted"]["differs"] and facts["cores granted"]["values"] == ["2", "1"]
    for same in ("model", "dtype", "global batch", "DeepSpeed", "torch", "CPU model"):
        assert not facts[same]["differs"], same
        assert facts[same]["values"][0] == facts[same]["values"][1] != "—"
    assert {f.name for f in compare.FACTS} >= {
        "GPU model",
        "NVIDIA driver",
        "CUDA",
        "torch",
        "DeepSpeed",
        "cores granted",
        "host memory",
        "dtype",
        "model",
        "global batch",
        "micro-batch",
    }


def with_runs(side: compare.Side, scenario: str, **values) -> compare.Side:
    runs = side.runs.copy()
    for key, value in values.items():
        runs.loc[runs["scenario"] == scenario, key] = value
    return dataclasses.replace(side, runs=runs)


def test_a_workload_difference_gives_the_reason_instead_of_a_number(sides):
    a, b = sides
    row = compare.scenario_row([a, with_runs(b, "offload-opt", dtype="fp16")], "offload-opt")
    (against,) = row["against"]
    assert "value" not in against
    assert against["reason"] == "not the same experiment: dtype differs (bf16 vs fp16)"
    assert [d["fact"] for d in row["workload"]] == ["dtype"]
    other = compare.scenario_row([a, with_runs(b, "offload-opt", dtype="fp16")], "zero3")
    assert other["against"][0]["reason"] is None  # only the changed scenario loses its number


def test_missing_and_failed_scenarios_say_why(sides):
    a, b = sides
    plan = {**b.plan, "scenarios": [s for s in b.plan["scenarios"] if s["name"] != "zero3"]}
    row = compare.scenario_row([a, dataclasses.replace(b, plan=plan)], "zero3")
    assert row["against"][0]["reason"] == "not in the study on cpu-b"
    summary = b.summary.copy()
    failed = summary["scenario"] == "offload-opt"
    summary.loc[failed, ["tokens_per_s", "outcomes"]] = [math.nan, "gpu_oom:1"]
    row = compare.scenario_row([a, dataclasses.replace(b, summary=summary)], "offload-opt")
    assert row["against"][0]["reason"] == "no successful run on cpu-b (gpu_oom:1)"


def test_deepspeed_versions_across_0_19_5_are_explained(sides):
    a, b = sides
    assert compare.deepspeed_notes(sides) == []
    old = with_runs(a, "zero3", deepspeed_version="0.19.4")
    old = with_runs(old, "offload-opt", deepspeed_version="0.19.4")
    (note,) = compare.deepspeed_notes([old, b])
    assert "0.19.5" in note and "pin_memory" in note
    platform = compare.differences([old, b], None, compare.PLATFORM)
    (ds,) = [d for d in platform if d["fact"] == "DeepSpeed"]
    assert ds["values"] == ["0.19.4", b.runs["deepspeed_version"].iloc[0]]


def test_calibrations_that_differ_are_listed(sides):
    a, b = sides
    assert compare.calibration_differences(sides) == ([], [])  # neither bundle is calibrated
    rates = {"matmul_tflops": 0.09, "cpu_adam_params_per_s": 2.3e8, "disk_write_gb_s": 1.0}
    slower = {**rates, "cpu_adam_params_per_s": 1.1e8, "disk_write_gb_s": 1.1}
    diffs, notes = compare.calibration_differences(
        [dataclasses.replace(a, calibration=rates), dataclasses.replace(b, calibration=slower)]
    )
    assert [d["fact"] for d in diffs] == ["calibration cpu_adam_params_per_s"] and notes == []
    _, notes = compare.calibration_differences([dataclasses.replace(a, calibration=rates), b])
    assert notes == ["no calibration.json in the bundle of cpu-b: bandwidths not compared"]


def test_a_bundle_carries_the_clusters_calibration(cross_cluster, tmp_path):  # noqa: F811
    """The shipped/measured calibration.json travels in the bundle and compare reads its rates."""
    root = tmp_path / "tree"
    study = root / bundle.study_dir("cpu-a", STUDY)
    study.mkdir(parents=True)
    (study / "plan.json").write_bytes(
        (cross_cluster.root / bundle.study_dir("cpu-a", STUDY) / "plan.json").read_bytes()
    )
    cal = contracts.Calibration(
        cluster="cpu-a",
        accelerator="cpu",
        source="test",
        matmul_tflops=0.09,
        matmul_dtype="bf16",
        cpu_adam_params_per_s=2.3e8,
        cpu_adam_threads=2,
    )
    contracts.write_calibration(root / bundle.calibration_path("cpu-a"), cal)
    bundle.create(root, "cpu-a", STUDY, tmp_path / "c.tar.gz")
    b = bundle.extract(tmp_path / "c.tar.gz", tmp_path / "x")
    assert b.manifest.calibration == bundle.calibration_path("cpu-a")
    assert compare.calibration_rates(b) == {
        "matmul_tflops": 0.09,
        "cpu_adam_params_per_s": 2.3e8,
        "cpu_adam_threads": 2.0,
    }


def with_flags(side: compare.Side, flags: str) -> compare.Side:
    return dataclasses.replace(side, summary=side.summary.assign(flags=flags))


def test_an_implausible_flag_blocks_the_ratio_and_a_caution_does_not(sides):
    """The rule on the real bundles, through the page (tests/test_compare_flags.py: the cases)."""
    a, b = sides
    links = {s.bundle.name: s.bundle.name for s in sides}
    clean = compare.comparison([with_flags(a, ""), with_flags(b, "")])
    assert "not a finding" not in clean["verdicts"][0]
    assert all(r["against"][0]["flags"] == [] for r in clean["rows"])
    caution = compare.comparison([with_flags(a, ""), with_flags(b, "ci-target-missed")])
    assert "not a finding" not in caution["verdicts"][0]
    assert "caution: ci-target-missed" in caution["verdicts"][0]
    html = compare.render(caution, links)
    assert "caution: ci-target-missed" in html and "flagged: not a finding" not in html
    flagged = compare.comparison([with_flags(a, ""), with_flags(b, "gpu-over-cap")])
    assert "flagged (gpu-over-cap): not a finding" in flagged["verdicts"][0]
    assert flagged["rows"][0]["cells"][1]["flags"] == ["gpu-over-cap"]
    assert "flagged: not a finding" in compare.render(flagged, links)
    row = flagged["rows"][0]["against"][0]
    straddles = row["ci_low"] <= 1 <= row["ci_high"]
    assert (row["verdict"] in ("no difference shown", "inconclusive")) == straddles
    assert row["verdict"] in compare.render(clean, links)
