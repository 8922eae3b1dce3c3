"""Same-allocation pairs (study key same_allocation_baseline): the plan gives each offload run a
short run of its no-offload pair, the runner makes it in the same job into <record>/pair/,
collect pairs the run with it repeat by repeat (fast: planned specs and written records; slow:
real DeepSpeed ZeRO-3 on CPU; slurm: one run in a real SLURM job, which two tests judge)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from builders import DRIFT, build_report, by_name, make_record
from conftest import SMALL_LLAMA, make_cluster
from runs import run_runner

from offload_study.analysis import collect as C
from offload_study.core import contracts
from offload_study.core.study import load_study
from offload_study.planning.plan import expand_plan, write_scenario_files
from offload_study.planning.resources import train_resources

PAIR_OPTION = {"enabled": True, "warmup_steps": 1, "steps": 2, "timeout_min": 4}


def scenario(name: str, offload_optimizer: str = "none", **keys) -> dict:
    return {
        "name": name,
        "gpus_per_node": 1,
        "gradient_accumulation_steps": 2,
        "cpu_mem_gb": 64,
        "offload_optimizer": offload_optimizer,
        **keys,
    }


def plan_study(option: dict | None = None, cluster="local-cpu", **study) -> dict:
    """name -> RunSpec of a small study: 'base' (no offload), 'off' (CPU optimizer offload, the
    same settings) and 'off-gas4' (no same-settings pair), planned by the real planner."""
    config = {
        "study": "test",
        "cluster": make_cluster(cluster)["name"],
        "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64,
        "micro_batch": 2,
        "gradient_checkpointing": False,
        "steps": 3,
        "warmup_steps": 1,
        "timeout_min": 5,
        "scenarios": [
            scenario("base"),
            scenario("off", "cpu"),
            scenario("off-gas4", "cpu", gradient_accumulation_steps=4),
        ],
        **({"same_allocation_baseline": option} if option is not None else {}),
        **study,
    }
    runs = expand_plan(load_study(config, source="test study"), make_cluster(cluster))
    return {run.scenario: run for run in runs}


# --------------------------------------------------------------------------- plan
def test_an_offload_run_gets_a_short_run_of_its_same_settings_pair():
    runs = plan_study(PAIR_OPTION)
    pair = runs["off"].pair_spec()
    assert (pair.scenario, pair.offload_optimizer, pair.gradient_accumulation_steps) == (
        "base",
        "none",
        2,
    )
    assert (pair.measure.mode, pair.warmup_steps, pair.steps) == ("fixed", 1, 2)
    assert pair.timeout_s == 240 and not pair.strict and pair.same_allocation_pair is None
    assert runs["base"].same_allocation_pair is None  # it offloads nothing: its own reference
    assert runs["off-gas4"].same_allocation_pair is None  # no no-offload run with its gas
    # the job's time limit holds the pair run too (SLURM must not kill it)
    cluster = make_cluster("local-cpu")
    assert runs["off"].job_timeout_s == 300 + 240
    extra = (
        train_resources(runs["off"], cluster)["runtime"]
        - train_resources(runs["off-gas4"], cluster)["runtime"]
    )
    assert extra >= 4


def test_the_option_off_plans_the_run_specs_it_planned_before():
    default, off = plan_study(), plan_study({"enabled": False, "steps": 9})
    for name, run in default.items():
        assert "same_allocation_pair" not in run.to_dict()
        assert run.to_dict() == off[name].to_dict()
        assert run.job_timeout_s == run.timeout_s
    # a spec written without the key reads back as one without a pair run
    spec = contracts.RunSpec.from_dict(default["off"].to_dict())
    assert spec.pair_spec() is None


def test_an_unknown_option_key_is_refused_by_name():
    with pytest.raises(Exception, match="same_allocation_baseline"):
        plan_study({"enabled": True, "stepz": 3})


# --------------------------------------------------------------------------- collect
def nest_pair(root: Path, run_metrics: Path, pair: str, repeat: int, **record) -> None:
    """Write a pair record (builders.make_record in a scratch root) and move it into the
    run's record as its same-allocation pair (<record>/pair/)."""
    scratch = make_record(root / "scratch", pair, repeat, **record).parent
    shutil.move(scratch, run_metrics.parent / contracts.PAIR_DIR)


def drifting_allocations(root: Path, pair_outcome: str = "ok", nodes=DRIFT) -> list[Path]:
    """'base' and 'off' runs in separate allocations: repeat k of 'off' ran on a node of speed
    NODE[k], together with its short 'base' pair run; 'base''s own runs all landed on one
    fast node. Only the same-allocation pairs see the node each 'off' run had."""
    paths = []
    for k, node in enumerate(nodes):
        paths.append(make_record(root, "base", k, tokens_per_s=1000.0, seed=k))
        off = make_record(
            root, "off", k, tokens_per_s=500.0 * node, offload_optimizer="cpu", seed=10 + k
        )
        nest_pair(
            root, off, "base", k, tokens_per_s=1000.0 * node, seed=20 + k, outcome=pair_outcome
        )
        paths.append(off)
    return paths


def test_the_paired_ratio_divides_by_the_pair_run_of_the_same_allocation(tmp_path):
    runs, s = C.collect(drifting_allocations(tmp_path), n_boot=1000)
    off = by_name(s).loc["off"]
    assert (off["pair"], off["pair_kind"], off["pairing"]) == (
        "base",
        "same-settings",
        "same allocation",
    )
    assert off["paired_ratio"] == pytest.approx(0.5, rel=0.02)
    assert off["paired_ratio_ci_low"] <= 0.5 <= off["paired_ratio_ci_high"]
    assert off["paired_ratio_ci_high"] - off["paired_ratio_ci_low"] < 0.05
    assert off["paired_repeats"] == 3 and "run in the same job" in off["pair_note"]
    # the pair scenario's own runs (another node) would have carried the node drift
    rel = off["relative_speed_ci_high"] - off["relative_speed_ci_low"]
    assert rel > 0.2, rel
    assert by_name(s).loc["base", "pairing"] is None or pd_isna(by_name(s).loc["base", "pairing"])
    made = runs[runs["scenario"] == "off"]
    assert list(made["same_allocation_pair_outcome"]) == ["ok"] * 3
    assert made["same_allocation_pair_dir"].map(lambda d: Path(d).name).eq("pair").all()


def pd_isna(value) -> bool:
    return value != value  # NaN after a CSV round trip


def test_failed_pair_runs_fall_back_to_the_pair_scenario_and_say_so(tmp_path):
    _, s = C.collect(drifting_allocations(tmp_path, pair_outcome="gpu_oom"), n_boot=200)
    off = by_name(s).loc["off"]
    assert (off["pair"], off["pairing"], off["paired_repeats"]) == ("base", "pair scenario", 3)
    assert "no same-allocation pair run ok (gpu_oom:3)" in off["pair_note"]


def test_records_without_pair_runs_give_the_tables_they_gave_before(tmp_path):
    paths = [make_record(tmp_path, "base", k, seed=k) for k in range(2)]
    paths += [
        make_record(tmp_path, "off", k, tokens_per_s=500.0, offload_optimizer="cpu", seed=9 + k)
        for k in range(2)
    ]
    runs, s = C.collect(paths, n_boot=100)
    assert not set(C.SAME_ALLOCATION_COLUMNS) & set(runs.columns)
    assert by_name(s).loc["off", "pairing"] == "pair scenario"


def test_the_report_labels_a_same_allocation_ratio(tmp_path):
    # nodes within 2 %: no ci-target-missed flag, so the verdict line states the ratio too
    html, _, _ = build_report(tmp_path, drifting_allocations(tmp_path, nodes=(1.0, 0.98, 1.02)))
    assert "ZeRO-3 base, same settings, same allocation" in html  # the pair column
    assert "of its no-offload pair, ZeRO-3 base (same settings, same allocation)" in html


# --------------------------------------------------------------------------- real runs
def write_configs(tmp_path: Path, runs: dict, name: str, **changes) -> tuple[Path, Path]:
    """configs/<name>.{json,run.json} as the plan rule writes them (``changes``: keys of its
    pair run replaced, e.g. a budget it cannot fit); returns (run spec path, record folder)."""
    run = runs[name]
    if changes:
        run = run.__class__.from_dict(
            {**run.to_dict(), "same_allocation_pair": {**run.same_allocation_pair, **changes}}
        )
    spec_path = tmp_path / "configs" / f"{name}.run.json"
    write_scenario_files(run, str(tmp_path / "configs" / f"{name}.json"), str(spec_path))
    return spec_path, tmp_path / "results" / "local-cpu" / "test" / name / "rep0"


def assert_complete(record: Path) -> dict:
    for name in ("metrics.json", "steps.csv", "provenance.json", "logs/launcher.log"):
        assert (record / name).is_file(), record / name
    assert not list(record.parent.glob(f"{record.name}.tmp-*")), "temp record left behind"
    metrics = contracts.read_json(record / "metrics.json")
    assert contracts.schema_problems(metrics, contracts.metrics_schema()) == []
    return metrics


@pytest.mark.slow
def test_a_pair_run_that_does_not_fit_leaves_the_run_ok(tmp_path):
    # the pair run forced into a host budget it cannot fit: host_oom, in its own record only;
    # the run is strict, yet the runner exits 0 (the pair never fails the run)
    runs = plan_study(PAIR_OPTION, strict=True)
    spec_path, outdir = write_configs(tmp_path, runs, "off", cpu_mem_gb=0.15, force=True)
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stdout + res.stderr
    assert assert_complete(outdir)["outcome"] == "ok"
    pair = assert_complete(outdir / "pair")
    assert pair["outcome"] == "host_oom" and "host memory budget" in pair["error_excerpt"]
    runs_table, s = C.collect([outdir / "metrics.json"], n_boot=100)
    assert list(runs_table["same_allocation_pair_outcome"]) == ["host_oom"]
    assert by_name(s).loc["off", "pairing"] is None or pd_isna(by_name(s).loc["off", "pairing"])
    assert pd_isna(by_name(s).loc["off", "paired_ratio"])


# --------------------------------------------------------------------------- SLURM
@pytest.fixture(scope="module")
def cluster():
    from slurm_cluster import slurm_fixture_gen

    yield from slurm_fixture_gen(gpus=0, gres_type=None)


@pytest.fixture(scope="module")
def pair_in_slurm_job(cluster, tmp_path_factory) -> tuple[Path, str]:
    """The 'off' run and its same-allocation pair, made by the runner inside one SLURM job:
    (its record folder, the job id). The two tests below judge the one run."""
    tmp_path = tmp_path_factory.mktemp("pair-in-slurm")
    spec_path, outdir = write_configs(tmp_path, plan_study(PAIR_OPTION), "off")
    runner = (
        f"{sys.executable} -m offload_study.training.runner --spec {spec_path} --repeat 0 "
        f"--outdir {outdir}"
    )
    job = cluster.sbatch(
        "--cpus-per-task=2",
        "--mem=4000",
        "-o",
        str(tmp_path / "job.out"),
        "--chdir",
        str(tmp_path),
        "--wrap",
        runner,
    )
    state = cluster.wait_job_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 600)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state == "COMPLETED", out + cluster.logs()
    return outdir, job


@pytest.mark.slurm
@pytest.mark.slow
def test_the_pair_run_is_made_inside_the_run_s_slurm_job(pair_in_slurm_job):
    outdir, job = pair_in_slurm_job
    main, pair = assert_complete(outdir), assert_complete(outdir / "pair")
    assert (main["outcome"], pair["outcome"]) == ("ok", "ok"), main["error_excerpt"]
    jobs = [
        contracts.read_json(d / "provenance.json")["slurm_job_id"]
        for d in (outdir, outdir / "pair")
    ]
    assert jobs == [job, job]
    assert main["slurm_job_id"] == pair["slurm_job_id"] == job


@pytest.mark.slurm
@pytest.mark.slow
def test_the_run_record_holds_the_pair_run_made_in_the_same_job(pair_in_slurm_job):
    outdir, _ = pair_in_slurm_job
    main = assert_complete(outdir)
    pair = assert_complete(outdir / "pair")
    assert main["outcome"] == "ok" and main["steps_measured"] == 3, main["error_excerpt"]
    assert (pair["outcome"], pair["scenario"], pair["repeat"]) == ("ok", "base", 0)
    assert (pair["measure_mode"], pair["steps_measured"]) == ("fixed", 2)
    assert contracts.read_run_spec(outdir / "pair" / "run.json").offload_optimizer == "none"
    assert json.loads((outdir / "pair" / "ds_config.json").read_text())["zero_optimization"]
    prov = [contracts.read_json(d / "provenance.json") for d in (outdir, outdir / "pair")]
    assert prov[0]["host"] == prov[1]["host"]
    assert prov[0]["cores_granted"] == prov[1]["cores_granted"]  # the same cores
    archived = list((outdir.parents[1] / "archive" / "off" / "rep0").glob("*/pair/metrics.json"))
    assert len(archived) == 1  # archived with the run's record, not on its own
    assert not (outdir.parents[1] / "archive" / "base").exists()
    assert "same-allocation pair base: outcome ok" in (outdir / "logs/launcher.log").read_text()
    _, s = C.collect([outdir / "metrics.json"], n_boot=200)
    off = by_name(s).loc["off"]
    assert (off["pair"], off["pairing"], off["paired_repeats"]) == ("base", "same allocation", 1)
    assert off["paired_ratio"] == pytest.approx(main["tokens_per_s"] / pair["tokens_per_s"])


def test_the_plan_prices_the_pair_run_into_the_jobs_gpu_hours(tmp_path):
    """GPU-hours count what the job runs: the run and, with the option on, its pair run."""
    from offload_study.engines.deepspeed.config import build_ds_config
    from offload_study.prediction import predict

    cal = contracts.read_calibration(
        Path(__file__).resolve().parent.parent / "config" / "calibration" / "h200-1gpu.json"
    )
    with_pair = plan_study(PAIR_OPTION, cluster="h200-1gpu")["off"]
    without = plan_study(cluster="h200-1gpu")["off"]
    rows = [predict.predict(s, build_ds_config(s), cal, repeats=3) for s in (with_pair, without)]
    pair = with_pair.pair_spec()
    pair_step = predict.step_time(pair, build_ds_config(pair), cal).total
    extra_hours = 3 * predict.run_seconds(pair, pair_step) / 3600
    assert rows[0].gpu_hours == pytest.approx(rows[1].gpu_hours + extra_hours, abs=2e-4)
    assert extra_hours > 0
