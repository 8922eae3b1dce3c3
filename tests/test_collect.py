"""Tests of offload_study.analysis.collect (records written by builders.make_record, which
follows docs/design.md)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
from builders import (
    CLUSTER,
    STUDY,
    make_record,
    run_collect_cli,
    seed_like_records,
    set_provenance,
)

from offload_study.analysis import collect as C
from offload_study.core import contracts


# --------------------------------------------------------------------------- tests
def test_read_record_missing_and_corrupt(tmp_path):
    missing = tmp_path / "results" / "c" / "s" / "scenA" / "rep3" / "metrics.json"
    r = C.read_record(missing)
    assert r["outcome"] == "missing"
    assert r["scenario"] == "scenA" and r["repeat"] == 3
    bad = make_record(tmp_path, "scenB")
    bad.write_text("{not json")
    r = C.read_record(bad)
    assert r["outcome"] == "error" and "corrupt" in r["error_excerpt"]
    bad.write_text("[1, 2]")
    assert C.read_record(bad)["outcome"] == "error"


def test_missing_record_takes_setup_from_run_spec(tmp_path):
    cfg = tmp_path / "results" / CLUSTER / STUDY / "configs"
    cfg.mkdir(parents=True)
    (cfg / "scenX.run.json").write_text(
        json.dumps({"scenario": "scenX", "label": "X", "offload_optimizer": "cpu", "world_size": 4})
    )
    r = C.read_record(tmp_path / "results" / CLUSTER / STUDY / "scenX" / "rep0" / "metrics.json")
    assert r["outcome"] == "missing" and r["label"] == "X" and r["offload_optimizer"] == "cpu"


def test_every_run_names_the_machine_it_ran_on(tmp_path):
    booted = set_provenance(make_record(tmp_path, "a", 0), boot_id="1b2c-boot")
    same, other = make_record(tmp_path, "a", 1), make_record(tmp_path, "a", 2)
    set_provenance(other, platform="Linux-6.1.18.44-fc-v973-gpu-x86_64")  # another VM, name "vm"
    runs = C.build_runs([C.read_record(p) for p in (booted, same, other)])
    assert runs["machine"].iloc[0] == "boot:1b2c-boot"
    old = C.read_record(make_record(tmp_path, "b", 1))["machine"]  # no boot_id: a fingerprint
    assert runs["machine"].iloc[1] == old and re.fullmatch(r"fp:[0-9a-f]{12}", old)
    assert runs["machine"].iloc[2] != old
    # git_commit tells code apart, not machines: one machine runs several commits
    assert C.read_record(set_provenance(same, git_commit="cafe"))["machine"] == old
    (other.parent / contracts.PROVENANCE_FILE).unlink()
    assert C.read_record(other)["machine"] is None
    missing = C.read_record(tmp_path / "results" / "c" / "s" / "x" / "rep0" / "metrics.json")
    assert missing["outcome"] == "missing" and missing["machine"] is None
    assert set(C.MACHINE_FIELDS) <= set(contracts.PROVENANCE_FIELDS)


def test_flatten_breakdown_and_sweep(tmp_path):
    p = make_record(tmp_path, "s-sw1", sweep={"reduce_bucket_size": 5e8, "gas": 8})
    r = C.read_record(p)
    assert r["breakdown_ms.forward"] == 100.0
    assert math.isnan(r["breakdown_ms.optimizer_swap_in"])
    assert r["sweep.reduce_bucket_size"] == 5e8
    assert json.loads(r["sweep"]) == {"gas": 8, "reduce_bucket_size": 5e8}
    assert r["record_dir"] == str(p.parent)


def test_collect_seed_like(tmp_path):
    paths = seed_like_records(tmp_path)
    paths.append(tmp_path / "results" / CLUSTER / STUDY / "zero3-8gpu" / "rep9" / "metrics.json")
    runs, summary = C.collect(paths, n_boot=500)
    assert len(runs) == len(paths)
    assert set(runs["outcome"]) == {"ok", "host_oom", "missing"}
    assert list(summary["scenario"]) == [
        "zero3-8gpu",
        "zero3-offload-4gpu",
        "zero3-offload-2gpu",
        "zero3-nvme",
    ]
    s = summary.set_index("scenario")
    assert s.loc["zero3-8gpu", "is_baseline"]
    assert s.loc["zero3-8gpu", "relative_speed"] == pytest.approx(1.0)
    assert s.loc["zero3-offload-4gpu", "relative_speed"] == pytest.approx(0.35, rel=0.05)
    lo, hi = s.loc["zero3-offload-4gpu", ["relative_speed_ci_low", "relative_speed_ci_high"]]
    assert lo <= s.loc["zero3-offload-4gpu", "relative_speed"] <= hi
    assert s.loc["zero3-8gpu", "n_missing"] == 1 and s.loc["zero3-8gpu", "status"] == "partial"
    assert s.loc["zero3-nvme", "status"] == "failed"
    assert math.isnan(s.loc["zero3-nvme", "relative_speed"])
    assert "host memory" in s.loc["zero3-nvme", "error_excerpt"]
    t = s.loc["zero3-8gpu"]
    assert t["tokens_per_s_ci_low"] < t["tokens_per_s"] < t["tokens_per_s_ci_high"]
    assert t["ci_method"] == "repeats+steps"
    assert s.loc["zero3-offload-2gpu", "host_peak_rss_gib_per_node_max"] == 450
    assert s.loc["zero3-offload-2gpu", "peak_gpu_allocated_gib"] == 60


def test_cli_writes_outputs(tmp_path):
    paths = seed_like_records(tmp_path)
    out = tmp_path / "out"
    rc = run_collect_cli(paths, out, n_boot=200)
    assert rc == 0
    runs = pd.read_parquet(out / "runs.parquet")
    assert len(runs) == 7 and "breakdown_ms.forward" in runs
    assert len(pd.read_csv(out / "runs.csv")) == 7
    summary = pd.read_csv(out / "summary.csv")
    assert summary["baseline"].iloc[0] == "zero3-8gpu"


def test_configured_baseline(tmp_path):
    paths = seed_like_records(tmp_path)
    _, s = C.collect(paths, baseline="zero3-offload-2gpu", n_boot=100)
    s = s.set_index("scenario")
    assert s.loc["zero3-offload-2gpu", "relative_speed"] == pytest.approx(1.0)
    assert s.loc["zero3-8gpu", "relative_speed"] == pytest.approx(5.0)


def test_baseline_failed_gives_nan_with_reason(tmp_path):
    p = [
        make_record(tmp_path, "base", outcome="gpu_oom"),
        make_record(tmp_path, "off", offload_optimizer="cpu", tokens_per_s=300),
    ]
    _, s = C.collect(p, n_boot=100)
    assert s["relative_speed"].isna().all()
    assert "no ok run" in s["relative_speed_note"].iloc[0]
    assert "gpu_oom" in s["relative_speed_note"].iloc[0]


def test_missing_baseline(tmp_path):
    p = [make_record(tmp_path, "off", offload_optimizer="cpu")]
    _, s = C.collect(p, n_boot=100)
    assert s["baseline"].isna().all() and s["relative_speed"].isna().all()
    assert "no baseline" in s["relative_speed_note"].iloc[0]
    _, s = C.collect(p, baseline="nonexistent", n_boot=100)
    assert "no run" in s["relative_speed_note"].iloc[0]


def test_single_run_uses_step_spread(tmp_path):
    p = [make_record(tmp_path, "only", step_noise=0.05)]
    _, s = C.collect(p, n_boot=500)
    r = s.iloc[0]
    assert r["ci_method"] == "steps"
    assert r["tokens_per_s_ci_low"] < r["tokens_per_s_ci_high"]
    assert r["relative_speed"] == pytest.approx(1.0)


def test_single_run_without_steps_has_no_ci(tmp_path):
    p = [make_record(tmp_path, "only", steps=False)]
    _, s = C.collect(p, n_boot=100)
    assert s.iloc[0]["ci_method"] == "none" and math.isnan(s.iloc[0]["tokens_per_s_ci_low"])


def test_all_failed_and_empty(tmp_path):
    p = [make_record(tmp_path, "a", outcome="timeout"), make_record(tmp_path, "b", outcome="error")]
    runs, s = C.collect(p, n_boot=50)
    assert (s["status"] == "failed").all() and s["tokens_per_s"].isna().all()
    runs, s = C.collect([], n_boot=50)
    assert runs.empty and s.empty


def test_summarize_pure_with_nans():
    runs = C.build_runs(
        [
            {
                "scenario": "a",
                "outcome": "ok",
                "tokens_per_s": 100.0,
                "offload_optimizer": "none",
                "offload_param": "none",
                "record_dir": "x",
            },
            {
                "scenario": "a",
                "outcome": "ok",
                "tokens_per_s": None,
                "offload_optimizer": "none",
                "offload_param": "none",
                "record_dir": "y",
            },
            {
                "scenario": "b",
                "outcome": "ok",
                "tokens_per_s": 50.0,
                "offload_optimizer": "cpu",
                "offload_param": "none",
                "record_dir": "z",
            },
        ]
    )
    steps = {"z": np.array([45.0, 50.0, 55.0, np.nan])}
    s = C.summarize(runs, steps, n_boot=200).set_index("scenario")
    assert s.loc["a", "tokens_per_s"] == 100.0
    assert s.loc["b", "relative_speed"] == pytest.approx(0.5)
    assert s.loc["b", "ci_method"] == "steps"


def test_host_memory_is_the_process_trees_else_the_ranks_own():
    """A record with the process trees (a worker process counted) shows the trees; one from
    before them shows the ranks' own peaks."""
    tree = {
        "host_peak_tree_gib": 9.5,
        "host_peak_tree_gib_per_node": [9.5],
        "host_peak_tree_gib_per_rank": [9.5],
        "host_tree_measure": "rss+uss",
    }
    rows = [
        {"scenario": "superoffload", "outcome": "ok", "host_peak_rss_gib": 6.0, **tree},
        {"scenario": "older", "outcome": "ok", "host_peak_rss_gib": 7.0},
    ]
    runs = C.build_runs([C.flatten_record(r) for r in rows])
    assert runs["host_peak_tree_gib_per_node"].iloc[0] == "[9.5]"  # a list column: JSON text
    assert [C.host_memory_gib(r) for r in runs.to_dict("records")] == [9.5, 7.0]
    s = C.summarize(runs, n_boot=50).set_index("scenario")
    assert s.loc["superoffload", "host_peak_tree_gib_per_node_max"] == 9.5
    assert [C.host_memory_gib(s.loc[n]) for n in ("superoffload", "older")] == [9.5, 7.0]
    assert C.host_memory_gib({}) is None


def test_bootstrap_median_hierarchical():
    point, draws, method = C.bootstrap_median([10.0, 12.0, 11.0], [[9, 10, 11], [12, 12], None])
    assert point == 11.0 and method == "repeats+steps"
    assert 9 <= np.nanmin(draws) and np.nanmax(draws) <= 12


def test_read_step_speeds_measured_only_and_corrupt(tmp_path):
    d = make_record(tmp_path, "s", n_steps=5).parent
    speeds = C.read_step_speeds(d)
    assert len(speeds) == 5 and (speeds > 500).all()  # the 2 slow warm-up steps are left out
    header = ",".join(contracts.STEPS_COLUMNS[:8])  # a file from before the step's parts
    (d / "steps.csv").write_text(f"{header}\n1,,0.5,10,2,9,0,\n2,,0.5,12,2,9,0,\n3,,0.5,1,2,9,1,\n")
    assert list(C.read_step_speeds(d)) == [10.0, 12.0]  # no row names its phase: all count
    (d / "steps.csv").write_text(  # skipped optimizer steps (fp16 overflow) are not timed
        f"{header}\n1,measured,0.5,10,2,9,0,\n2,measured,0.1,50,9,9,1,1024\n"
    )
    assert list(C.read_step_speeds(d)) == [10.0]
    (d / "steps.csv").write_bytes(b"\xff\xfe\x00garbage")
    assert C.read_step_speeds(d).size == 0
    assert C.read_step_speeds(tmp_path / "nowhere").size == 0


def test_host_memory_takes_the_tree_and_the_ranks_own_peak_where_the_tree_may_miss_one():
    floored = contracts.TREE_FLOORED
    own, tree = 6.0, 1.6  # a model built on the host between two of the tree's samples
    assert C.host_memory_gib({"host_peak_tree_gib": tree, "host_peak_rss_gib": own}) == own
    unfloored = {
        "host_peak_tree_gib": 33.8,
        "host_peak_rss_gib": 22.8,
        "host_tree_measure": "rss+uss",
    }
    assert C.host_memory_gib(unfloored) == 33.8  # the worker's memory counted
    # a floored tree holds the rank's peak already; the own figure may carry the launcher's
    trusted = {
        "host_peak_tree_gib": 2.0,
        "host_peak_rss_gib": 2.6,
        "host_tree_measure": "rss+uss" + floored,
    }
    assert C.host_memory_gib(trusted) == 2.0
    assert C.host_memory_gib({"host_peak_rss_gib": own}) == own
    assert C.host_memory_gib({}) is None
    assert C.host_memory_gib({"host_memory_gib": 3.0, "host_peak_rss_gib": own}) == 3.0
