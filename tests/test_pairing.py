"""Paired relative speed: each scenario against the no-offload scenario with its settings, run
for run on one machine (records written by builders.make_record)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from builders import DRIFT, by_name, drifting_pair, make_record, run_collect_cli, set_provenance

from offload_study.analysis import collect as C
from offload_study.analysis.report import predicted
from offload_study.core import contracts


def test_paired_ratio_cancels_drift_that_the_unpaired_ratio_carries(tmp_path):
    _, s = C.collect(drifting_pair(tmp_path), n_boot=1000)
    off = by_name(s).loc["off"]
    assert (off["pair"], off["pair_kind"], off["paired_repeats"]) == ("base", "same-settings", 3)
    assert off["paired_ratio"] == pytest.approx(0.5, rel=0.02)
    lo, hi = off["paired_ratio_ci_low"], off["paired_ratio_ci_high"]
    assert lo <= 0.5 <= hi
    paired_width = hi - lo
    unpaired_width = off["relative_speed_ci_high"] - off["relative_speed_ci_low"]
    assert paired_width < unpaired_width / 3, (paired_width, unpaired_width)
    assert "3 pair(s) by repeat" in off["pair_note"]


def test_a_no_offload_scenario_is_its_own_reference(tmp_path):
    _, s = C.collect(drifting_pair(tmp_path), n_boot=200)
    base = by_name(s).loc["base"]
    assert (base["pair"], base["pair_kind"], base["paired_ratio"]) == ("base", "self", 1.0)


def test_repeats_pair_by_index_and_unmatched_ones_are_left_out(tmp_path):
    paths = drifting_pair(tmp_path)
    make_record(tmp_path, "base", 1, outcome="gpu_oom")  # rep 1 of the pair failed
    paths.append(make_record(tmp_path, "off", 3, tokens_per_s=500, offload_optimizer="cpu"))
    _, s = C.collect(paths, n_boot=300)
    off = by_name(s).loc["off"]
    assert off["paired_repeats"] == 2  # rep 0 and 2; rep 1 and 3 have no ok partner
    assert "rep 1, 3 ok in only one of the two" in off["pair_note"]
    assert off["paired_ratio"] == pytest.approx(0.5, rel=0.02)


def test_no_repeat_in_common_gives_no_ratio_and_says_why(tmp_path):
    paths = [
        make_record(tmp_path, "base", 0),
        make_record(tmp_path, "base", 1, outcome="timeout"),
        make_record(tmp_path, "off", 0, outcome="timeout", offload_optimizer="cpu"),
        make_record(tmp_path, "off", 1, offload_optimizer="cpu"),
    ]
    _, s = C.collect(paths, n_boot=100)
    off = by_name(s).loc["off"]
    assert off["pair"] == "base" and math.isnan(off["paired_ratio"])
    assert "0 pair(s) by repeat" in off["pair_note"]


def on_boots(paths: list, boots: dict) -> list:
    """``paths`` with the boot_id of (scenario, repeat) records set from ``boots``."""
    for p in paths:
        key = (p.parents[1].name, int(p.parent.name.removeprefix("rep")))
        if key in boots:
            set_provenance(p, boot_id=boots[key])
    return paths


def test_repeats_run_on_different_machines_are_not_paired(tmp_path):
    """Rep 2 of "off" ran in a later session on another machine, 35 % faster: dividing it by
    rep 2 of "base" would carry the machines' difference into the ratio."""
    paths = drifting_pair(tmp_path)
    make_record(tmp_path, "off", 2, tokens_per_s=500 * DRIFT[2] * 1.35, offload_optimizer="cpu")
    boots = {(scen, k): "machine-1" for scen in ("base", "off") for k in range(3)}
    _, s = C.collect(on_boots(paths, {**boots, ("off", 2): "machine-2"}), n_boot=300)
    off = by_name(s).loc["off"]
    assert off["paired_repeats"] == 2
    assert off["pair_note"].endswith("2 pair(s) by repeat; rep 2 on different machines")
    assert off["paired_ratio"] == pytest.approx(0.5, rel=0.02)
    assert off["paired_ratio_ci_high"] < 0.55  # the faster machine's run is not in the CI
    _, s = C.collect(on_boots(paths, boots), n_boot=300)  # one machine: paired as before
    off = by_name(s).loc["off"]
    assert off["paired_repeats"] == 3 and off["pair_note"].endswith("3 pair(s) by repeat")
    assert off["paired_ratio_ci_high"] == pytest.approx(0.5 * 1.35, rel=0.05)  # rep 2 counts


def test_no_pair_left_on_one_machine_gives_no_ratio(tmp_path):
    paths = [
        make_record(tmp_path, "base", 0),
        make_record(tmp_path, "off", 0, offload_optimizer="cpu"),
    ]
    _, s = C.collect(on_boots(paths, {("base", 0): "m1", ("off", 0): "m2"}), n_boot=100)
    off = by_name(s).loc["off"]
    assert math.isnan(off["paired_ratio"]) and off["paired_repeats"] == 0
    assert "0 pair(s) by repeat; rep 0 on different machines" in off["pair_note"]


def test_runs_without_provenance_pair_as_before(tmp_path):
    paths = drifting_pair(tmp_path)
    for p in paths:  # records of a runner that wrote none: no machine known
        (p.parent / "provenance.json").unlink()
    _, s = C.collect(paths, n_boot=300)
    off = by_name(s).loc["off"]
    assert off["paired_repeats"] == 3 and off["pair_note"].endswith("3 pair(s) by repeat")
    set_provenance(
        make_record(tmp_path, "off", 1, tokens_per_s=350, offload_optimizer="cpu"), boot_id="m1"
    )
    _, s = C.collect(paths, n_boot=300)  # one side known: kept, and the note says so
    off = by_name(s).loc["off"]
    assert off["paired_repeats"] == 3
    assert "rep 1 paired though the machine of one run is unknown" in off["pair_note"]


def test_other_settings_fall_back_to_the_study_baseline_with_the_reason(tmp_path):
    paths = [
        make_record(tmp_path, "base", gas=4),
        make_record(tmp_path, "off-gas8", gas=8, offload_optimizer="cpu", tokens_per_s=600),
        make_record(tmp_path, "off-2gpu", world_size=2, gpus_per_node=2, offload_param="cpu"),
    ]
    _, s = C.collect(paths, n_boot=100)
    for name in ("off-gas8", "off-2gpu"):
        row = by_name(s).loc[name]
        assert (row["pair"], row["pair_kind"]) == ("base", "study baseline")
        assert "no scenario without offload has its GPUs, micro-batch and gas" in row["pair_note"]
    assert by_name(s).loc["off-gas8", "paired_ratio"] == pytest.approx(0.6, rel=0.05)


def test_a_failed_same_settings_pair_is_named_and_the_baseline_stands_in(tmp_path):
    paths = [
        make_record(tmp_path, "base", gas=1),
        make_record(tmp_path, "nooff-gas8", gas=8, outcome="gpu_oom"),
        make_record(tmp_path, "off-gas8", gas=8, offload_optimizer="cpu"),
    ]
    _, s = C.collect(paths, n_boot=100)
    row = by_name(s).loc["off-gas8"]
    assert (row["pair"], row["pair_kind"]) == ("base", "study baseline")
    assert "its no-offload pair 'nooff-gas8' has no ok run (gpu_oom:1)" in row["pair_note"]


def test_no_pair_at_all(tmp_path):
    paths = [make_record(tmp_path, "off", offload_optimizer="cpu")]
    _, s = C.collect(paths, n_boot=100)
    row = by_name(s).loc["off"]
    assert row["pair_kind"] == "none" and pd.isna(row["pair"]) and math.isnan(row["paired_ratio"])
    assert "no other study baseline with an ok run" in row["pair_note"]


def test_the_pair_with_the_same_card_is_preferred(tmp_path):
    paths = [
        make_record(tmp_path, "base-80", gpu_mem_gb=80),
        make_record(tmp_path, "base-40", gpu_mem_gb=40, tokens_per_s=900),
        make_record(tmp_path, "off-40", gpu_mem_gb=40, offload_optimizer="cpu", tokens_per_s=450),
    ]
    _, s = C.collect(paths, n_boot=100)
    row = by_name(s).loc["off-40"]
    assert row["pair"] == "base-40" and row["paired_ratio"] == pytest.approx(0.5, rel=0.05)


def test_summary_csv_carries_the_pair_columns(tmp_path):
    out = tmp_path / "out"
    assert run_collect_cli(drifting_pair(tmp_path), out, n_boot=100) == 0
    s = pd.read_csv(out / "summary.csv").set_index("scenario")
    assert set(C.PAIR_COLUMNS) <= set(s.columns)
    assert set(s["pair_kind"]) <= set(C.PAIR_KINDS)
    assert s.loc["off", "pair"] == "base"
    assert s.loc["off", "relative_speed"] == pytest.approx(0.5, rel=0.05)  # study baseline too


def test_the_reports_reference_follows_collects_pair_rule():
    """One rule (contracts.no_offload_pairs): the report's predicted overhead is taken over the
    pair collect would choose, the no-offload scenario with the same card first."""
    setup = {
        "nodes": 1,
        "world_size": 8,
        "micro_batch": 4,
        "gradient_accumulation_steps": 4,
        "offload_param": "none",
    }
    planned = {
        name: {"name": name, "gpu_mem_gb": gpu, "offload_optimizer": opt, **setup}
        for name, gpu, opt in [
            ("base-80", 80, "none"),
            ("base-40", 40, "none"),
            ("off-40", 40, "cpu"),
            ("off-gas8", 40, "cpu"),
        ]
    }
    planned["off-gas8"]["gradient_accumulation_steps"] = 8
    pairs = contracts.no_offload_pairs(planned["off-40"], planned.values())
    assert [p["name"] for p in pairs] == ["base-40", "base-80"]
    assert predicted.reference_of("off-40", planned) == "base-40"
    assert predicted.reference_of("base-80", planned) == "base-40"  # never itself
    assert predicted.reference_of("off-gas8", planned) is None  # no pair of its settings
