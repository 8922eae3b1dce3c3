"""The sanity table: each check fires on a constructed case and stays silent on a clean one; the
committed H200 records get the accumulation flag where the 1-repeat study measured it, and the
re-measured study (adaptive, 3 interleaved repeats) does not."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from builders import H200_REMEASURED, h200_summary, make_record, run_collect_cli

from offload_study.analysis import collect as C
from offload_study.analysis import sanity
from offload_study.core import contracts


def flags_of(paths, **kw) -> dict[str, list[str]]:
    """scenario -> names of the checks that fired."""
    _, s = C.collect(paths, n_boot=kw.pop("n_boot", 400), **kw)
    return {r["scenario"]: [n for n in r["flags"].split(";") if n] for _, r in s.iterrows()}


def clean_study(root: Path) -> list[Path]:
    """No offload at gas 1 and 8 (faster with more accumulation), offload slower than its
    pair, two repeats each, quiet steps: nothing to flag."""
    paths = []
    for k in range(2):
        paths += [
            make_record(root, "base-gas1", k, gas=1, tokens_per_s=1000, seed=k),
            make_record(root, "base-gas8", k, gas=8, tokens_per_s=1050, seed=10 + k),
            make_record(
                root,
                "off-gas8",
                k,
                gas=8,
                tokens_per_s=700,
                offload_optimizer="cpu",
                seed=20 + k,
                extra={"gpu_mem_cap_gib": 40.0},
            ),
        ]
    return paths


def test_a_clean_study_has_no_flag(tmp_path):
    assert flags_of(clean_study(tmp_path)) == {"base-gas1": [], "base-gas8": [], "off-gas8": []}


def test_accumulation_slower_per_token_fires_on_the_slower_no_offload_scenario(tmp_path):
    paths = [
        make_record(tmp_path, "base-gas1", gas=1, tokens_per_s=1000),
        make_record(tmp_path, "base-gas8", gas=8, tokens_per_s=800),
        make_record(tmp_path, "off-gas1", gas=1, tokens_per_s=400, offload_optimizer="cpu"),
        make_record(tmp_path, "off-gas8", gas=8, tokens_per_s=300, offload_optimizer="cpu"),
    ]
    flags = flags_of(paths)
    assert "accumulation-slower-per-token" in flags["base-gas8"]
    assert "accumulation-slower-per-token" not in flags["base-gas1"]  # the faster one
    assert "accumulation-slower-per-token" not in flags["off-gas8"]  # offload: not this check


def test_accumulation_compares_only_the_same_gpus_and_micro_batch(tmp_path):
    paths = [
        make_record(tmp_path, "base-gas1", gas=1, tokens_per_s=1000),
        make_record(
            tmp_path, "base-gas8-2gpu", gas=8, tokens_per_s=800, world_size=2, gpus_per_node=2
        ),
    ]
    assert flags_of(paths)["base-gas8-2gpu"] == []


def test_offload_faster_than_its_pair_fires(tmp_path):
    paths = [make_record(tmp_path, "base", k, tokens_per_s=1000, seed=k) for k in range(2)]
    paths += [
        make_record(tmp_path, "off", k, tokens_per_s=1300, offload_param="cpu", seed=5 + k)
        for k in range(2)
    ]
    assert flags_of(paths) == {"base": [], "off": ["offload-faster-than-pair"]}


def test_gpu_over_cap_fires_on_a_run_above_its_cap(tmp_path):
    capped = {"gpu_mem_cap_gib": 20.0}  # peak_gpu_gib 30 -> 32 GiB reserved
    paths = [
        make_record(tmp_path, "capped", extra=capped),
        make_record(tmp_path, "roomy", extra={"gpu_mem_cap_gib": 40.0}),
    ]
    flags = flags_of(paths)
    assert flags == {"capped": ["gpu-over-cap"], "roomy": []}


def test_ci_target_missed_from_the_runs(tmp_path):
    paths = [make_record(tmp_path, "missed", k, extra={"ci_target_met": k == 0}) for k in (0, 1)]
    paths += [make_record(tmp_path, "met", k, extra={"ci_target_met": True}) for k in (0, 1)]
    _, s = C.collect(paths, n_boot=200)
    s = s.set_index("scenario")
    assert s.loc["missed", "flags"] == "ci-target-missed" and s.loc["met", "flags"] == ""
    assert json.loads(s.loc["missed", "flag_details"]) == {
        "ci-target-missed": "rep 1: stopped before the CI target"
    }


def test_ci_target_missed_falls_back_to_the_summary_ci(tmp_path):
    paths = [
        make_record(tmp_path, "noisy", step_noise=0.4),
        make_record(tmp_path, "quiet", step_noise=0.005),
        make_record(tmp_path, "no-steps", steps=False),
    ]
    flags = flags_of(paths)
    assert flags == {"noisy": ["ci-target-missed"], "quiet": [], "no-steps": ["ci-target-missed"]}


def test_non_finite_loss_fires(tmp_path):
    paths = [make_record(tmp_path, "nan-loss", step_loss=math.nan), make_record(tmp_path, "fine")]
    assert flags_of(paths) == {"nan-loss": ["non-finite-loss"], "fine": []}


def test_many_skipped_steps_fires_above_its_tolerance(tmp_path):
    paths = [
        make_record(tmp_path, "many", extra={"skipped_steps_measured": 2}),  # 2 of 8
        make_record(tmp_path, "few", extra={"skipped_steps_measured": 0}),
    ]
    assert flags_of(paths) == {"many": ["many-skipped-steps"], "few": []}


def test_the_table_is_data():
    names = [c.name for c in sanity.CHECKS]
    assert len(set(names)) == len(names)
    assert all(c.meaning and c.tolerance_text and c.tolerance >= 0 for c in sanity.CHECKS)
    # the fields the checks read are the metrics contract's (a rename would silence a check)
    assert {sanity.CI_TARGET_MET, sanity.SKIPPED_MEASURED} <= set(contracts.METRICS_FIELDS)


def test_flags_round_trip_through_summary_csv(tmp_path):
    paths = [make_record(tmp_path, "nan-loss", step_loss=math.nan), make_record(tmp_path, "fine")]
    out = tmp_path / "out"
    assert run_collect_cli(paths, out) == 0
    s = pd.read_csv(out / "summary.csv").set_index("scenario")
    (flag,) = sanity.parse_flags(s.loc["nan-loss", "flags"], s.loc["nan-loss", "flag_details"])
    assert flag["name"] == "non-finite-loss" and flag["meaning"] == sanity.MEANINGS[flag["name"]]
    assert "8 measured step(s)" in flag["detail"]
    assert sanity.parse_flags(s.loc["fine", "flags"], s.loc["fine", "flag_details"]) == []


def with_step_times(metrics: Path, times: list[float], stop_reason: str | None = None) -> Path:
    """The record's measured steps replaced by ``times`` (s), in order; its stop reason set."""
    rows = ["step,phase,step_time_s,tokens_per_s,samples_per_s,loss"]
    rows += [f"{i},measured,{t},{1000 / t},{1 / t},9" for i, t in enumerate(times)]
    (metrics.parent / "steps.csv").write_text("\n".join(rows) + "\n")
    m = json.loads(metrics.read_text())
    metrics.write_text(json.dumps({**m, "stop_reason": stop_reason}))
    return metrics


@pytest.mark.parametrize(
    "times,stop,fires",
    [
        ([28.1, 31.8, 36.0], "fixed", True),  # seed-2gpu's rep 1: still climbing at the cap
        ([12.5, 10.9, 10.2], "max_steps", True),  # falling counts too
        ([28.1, 31.8, 36.0], "target_met", False),  # the CI target stopped it: its choice
        ([2.0, 2.1, 1.9, 2.0, 2.05, 1.95], "max_steps", False),  # quiet
        ([0.36, 0.29, 0.38, 0.36, 0.59, 0.29], "max_steps", False),  # one slow step: no trend
        ([2.0, 2.02, 2.04, 2.06, 2.08], "max_time", False),  # a trend of 4 %: below tolerance
    ],
)
def test_not_steady_fires_on_a_step_time_still_moving_at_the_cap(tmp_path, times, stop, fires):
    paths = [with_step_times(make_record(tmp_path, "run"), times, stop)]
    assert ("not-steady" in flags_of(paths)["run"]) is fires


def test_the_drift_is_the_lines_change_over_the_median():
    change, r2 = sanity.drift([10.0, 11.0, 12.0])
    assert change == pytest.approx(2 / 11) and r2 == pytest.approx(1.0)
    assert sanity.drift([5.0, 5.0, 5.0]) == (0.0, 0.0) and sanity.drift([1.0, 2.0]) == (0.0, 0.0)


# --------------------------------------------------------------------------- severity
@pytest.mark.parametrize(
    "flags,blocks",
    [
        ("", []),
        (None, []),
        (math.nan, []),  # an empty cell read back from summary.csv
        ("ci-target-missed", []),
        ("ci-target-missed;many-skipped-steps", []),
        ("gpu-over-cap", ["gpu-over-cap"]),
        ("ci-target-missed;loss-parity", ["loss-parity"]),  # mixed: the implausible one blocks
        (
            "accumulation-slower-per-token;offload-faster-than-pair;non-finite-loss",
            ["accumulation-slower-per-token", "offload-faster-than-pair", "non-finite-loss"],
        ),
        ("ci-target-missed;a-check-of-another-version", ["a-check-of-another-version"]),
    ],
)
def test_blocking_names_the_flags_that_block_a_finding(flags, blocks):
    assert sanity.blocking(flags) == blocks


def test_severity_is_data_of_each_check():
    """Implausible results block; a missed CI target, many skipped steps, a step time still
    moving or a host figure without its workers only caution."""
    by = {
        sev: {c.name for c in sanity.CHECKS if c.severity == sev}
        for sev in (sanity.IMPLAUSIBLE, sanity.CAUTION)
    }
    assert by[sanity.CAUTION] == {
        "ci-target-missed",
        "many-skipped-steps",
        "not-steady",
        "host-without-workers",
    }
    assert by[sanity.IMPLAUSIBLE] == {c.name for c in sanity.CHECKS} - by[sanity.CAUTION]
    with pytest.raises(ValueError, match="severity 'severe'"):
        dataclasses.replace(sanity.CHECKS[0], severity="severe")


def test_parsed_flags_say_whether_they_block():
    details = json.dumps({"ci-target-missed": "rep 1: stopped", "gpu-over-cap": "33 GiB"})
    parsed = sanity.parse_flags("ci-target-missed;gpu-over-cap", details)
    assert [(f["name"], f["severity"], f["blocks"]) for f in parsed] == [
        ("ci-target-missed", sanity.CAUTION, False),
        ("gpu-over-cap", sanity.IMPLAUSIBLE, True),
    ]
    assert parsed[0]["detail"] == "rep 1: stopped"


# --------------------------------------------------------------------------- real data
def test_the_h200_study_gets_the_accumulation_flag_on_no_offload_gas_8():
    """Committed H200 records: no offload measured 22 % slower per token at gas 8 than at
    gas 1, which accumulation cannot cause; nothing flagged it before."""
    s = h200_summary()
    assert "accumulation-slower-per-token" in s.loc["zero3__gas-8", "flags"].split(";")
    detail = json.loads(s.loc["zero3__gas-8", "flag_details"])["accumulation-slower-per-token"]
    assert "below the 17,638 tokens/s of gas 1 ('zero3__gas-1')" in detail
    for name in ("zero3__gas-1", "offload-opt__gas-8", "offload-opt-param__gas-8"):
        assert "accumulation-slower-per-token" not in s.loc[name, "flags"]


def test_the_remeasured_h200_study_has_no_accumulation_flag():
    """Warm-up until settled and 3 interleaved repeats: gas 8 is within noise of gas 1 (its
    CI spans gas 1's median), so nothing is flagged but the missed 2 % CI target, and one
    repeat of optimizer offload at gas 8 still slowing when its time cap stopped it (4.4 to
    5.1 s)."""
    s = h200_summary(H200_REMEASURED)
    ok = s[s["n_ok"] > 0]
    assert not any("accumulation-slower-per-token" in f for f in ok["flags"])
    cautions = {name: f.split(";") for name, f in ok["flags"].items()}
    assert cautions.pop("offload-opt__gas-8") == ["ci-target-missed", "not-steady"]
    assert all(f == ["ci-target-missed"] for f in cautions.values())
    gas8 = s.loc["zero3__gas-8"]
    assert gas8["relative_speed_ci_low"] < 1 < gas8["relative_speed_ci_high"]


def test_seed_2gpu_rows_still_climbing_at_the_step_cap_are_not_steady():
    """Committed seed-2gpu records: repeat 1 of CPU optimizer + parameter offload measured
    28.1, 31.8, 36.0 s when the 3-step cap stopped it."""
    study = Path(__file__).resolve().parents[1] / "docs/results/h200-2gpu/seed-2gpu"
    plan = json.loads((study / "plan.json").read_text())
    paths = [
        study / s["name"] / f"rep{k}" / "metrics.json"
        for s in plan["scenarios"]
        for k in range(plan["repeats"])
    ]
    flagged = {name for name, f in flags_of(paths, n_boot=50).items() if "not-steady" in f}
    assert flagged == {"offload-2gpu-80gb", "offload-opt-2gpu-80gb", "offload-2gpu-80gb-gas4"}


@pytest.mark.parametrize("tolerance,fires", [(0.02, True), (0.25, False)])
def test_the_tolerance_decides(tolerance, fires):
    """gas 8's CI reaches 14,307 tokens/s: 19 % below gas 1's 17,638."""
    s = h200_summary().reset_index()
    rows = s.to_dict("records")
    facts = sanity.Facts(
        rows[[r["scenario"] for r in rows].index("zero3__gas-8")], {r["scenario"]: r for r in rows}
    )
    assert (sanity.accumulation_slower(facts, tolerance) is not None) is fires


def test_other_gpu_fires_on_the_runs_a_mixed_partition_put_on_another_card(tmp_path):
    h100 = {"device_name": "NVIDIA H100 80GB HBM3"}
    paths = [make_record(tmp_path, "a", k, seed=k) for k in range(2)]
    paths += [make_record(tmp_path, "b", 0), make_record(tmp_path, "b", 1, extra=h100)]
    paths += [make_record(tmp_path, "c", k, seed=7 + k) for k in range(2)]
    paths += [make_record(tmp_path, "d", 0, extra={"device_name": ""})]  # unnamed: not judged
    _, s = C.collect(paths, n_boot=200)
    s = s.set_index("scenario")
    assert [s.loc[n, "flags"] for n in "abcd"] == ["", "other-gpu", "", ""]
    why = json.loads(s.loc["b", "flag_details"])["other-gpu"]
    assert why.startswith("rep 1 ran on H100") and "5 on H200" in why, why
    assert sanity.blocking(s.loc["b", "flags"]) == ["other-gpu"]


def test_other_gpu_is_silent_on_one_card_named_alike_and_on_runs_without_a_name(tmp_path):
    paths = [
        make_record(tmp_path, "a", 0),
        make_record(tmp_path, "a", 1, extra={"device_name": None}),
        make_record(tmp_path, "a", 2, extra={"device_name": ""}),
    ]
    paths += [make_record(tmp_path, "b", 0, extra={"device_name": "NVIDIA H200 141GB HBM3e"})]
    assert flags_of(paths) == {"a": [], "b": []}


@pytest.mark.parametrize(
    ("worker", "tree", "fires"),
    [
        ({"super_offload": True}, None, True),
        ({"super_offload": True}, 31.0, False),
        ({"super_offload": False}, None, False),
        ({"super_offload": False, "zenflow": {"overlap_step": True}}, None, True),
        ({"super_offload": False, "zenflow": {"overlap_step": False}}, None, False),
    ],
)
def test_host_without_workers_fires_on_a_worker_run_recorded_without_its_tree(
    tmp_path, worker, tree, fires
):
    """A run whose engine says its optimizer ran in a worker process (SuperOffload; ZenFlow
    overlapping the step), recorded before the process tree was sampled: its host figure is
    the rank's own."""
    modes = {"effective": worker, "requested": {}}
    extra = {"modes": modes, "engine": "deepspeed", "host_peak_tree_gib": tree}
    paths = [
        make_record(tmp_path, "super", k, offload_optimizer="cpu", extra=extra) for k in (0, 1)
    ]
    flags = flags_of(paths)["super"]
    assert ("host-without-workers" in flags) is fires, flags


def test_host_without_workers_is_silent_on_an_engine_not_installed_here(tmp_path):
    """Records of an engine this checkout lacks are collected, not refused."""
    extra = {"modes": {"effective": {"super_offload": True}}, "engine": "elsewhere"}
    paths = [make_record(tmp_path, "theirs", k, extra=extra) for k in (0, 1)]
    assert "host-without-workers" not in flags_of(paths)["theirs"]
