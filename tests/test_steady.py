"""Numbers you can trust: steady-state detection, adaptive stop, skipped (fp16 overflow) steps.

Unit tests of offload_study.training.steady on synthetic series, of the plan's measure keys, of metrics and
of DeepSpeed's skipped-step log lines (a real H200 log; overflow lines from DeepSpeed's own loss
scaler); slow tests with real DeepSpeed on CPU (an engine whose step overflows, an adaptive run).
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_LLAMA, make_cluster, make_spec
from runs import load_record, make_run, run_runner

from offload_study.admission.admit import admitted_runs
from offload_study.core import contracts
from offload_study.core.contracts import STOP_REASONS, RankStats, StepRow
from offload_study.core.study import StudyError, load_study
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.training import logparse, metrics, steady
from offload_study.training.supervise import Supervision

FIXTURES = Path(__file__).parent / "fixtures"


def measure(**keys) -> contracts.MeasureSpec:
    """The study schema's measure defaults (adaptive), with ``keys`` replacing some."""
    study = load_study(
        {
            "study": "s",
            "cluster": "local-cpu",
            "model": {"preset": "tiny-llama"},
            "scenarios": [{"name": "a", "gpus_per_node": 1}],
        }
    )
    return contracts.MeasureSpec(**{"mode": "adaptive", **study["measure"], **keys})


def track(times, skipped=None, spec=None, **keys):
    """Feed a Tracker step by step as the harness does; (phases, stop reason, tracker)."""
    spec = spec or dataclasses.replace(make_spec(), measure=measure(**keys))
    tracker, phases, decision = steady.Tracker(spec), [], None
    skipped = skipped or [False] * len(times)
    for seconds, skip in zip(times, skipped, strict=True):
        phases.append(tracker.phase)
        decision = tracker.observe(seconds, skip)
        if decision.stop:
            break
    return phases, decision.stop, tracker


def noise(n: int, cv: float, seed: int = 0, level: float = 1.0) -> list[float]:
    return list(level * (1 + cv * np.random.default_rng(seed).standard_normal(n)))


# --------------------------------------------------------------------------- CI of the median
def test_order_statistic_rank_is_the_widest_index_with_95_percent_coverage():
    assert [steady.order_statistic_rank(n) for n in range(1, 6)] == [None] * 5
    assert steady.order_statistic_rank(6) == 1 and steady.order_statistic_rank(10) == 2
    for n in range(6, 80):
        j = steady.order_statistic_rank(n)

        def coverage(j, n=n):
            return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n

        assert coverage(j) >= 0.95 > coverage(j + 1)


def test_median_ci_brackets_the_median_and_is_deterministic():
    times = noise(40, 0.05)
    ci = steady.median_ci(times)
    assert ci.lo <= ci.median <= ci.hi and ci == steady.median_ci(list(reversed(times)))
    assert ci.half_pct == pytest.approx(100 * (ci.hi - ci.lo) / 2 / ci.median)
    assert steady.median_ci(times[:5]) is None
    # narrower with more steps of the same noise
    assert steady.median_ci(noise(400, 0.05)).half_pct < ci.half_pct


# --------------------------------------------------------------------------- warm-up detector
def test_slow_start_ends_once_the_slow_steps_leave_the_windows():
    times = [5.0, 3.0, 2.0] + noise(30, 0.01)
    phases, _, tracker = track(times, max_steps=10)
    # step 8: windows [3..5] (one slow step, median ~1) and [6..8]; at 6 and 7 the earlier
    # window's median is still a slow step
    assert phases.count("warmup") == 8 and tracker.warmup_settled
    # medians: a single slow first step does not hold the warm-up up
    assert track([5.0] + noise(30, 0.01), max_steps=10)[0].count("warmup") == 6


def test_step_change_restarts_the_settling():
    times = [1.0] * 4 + [2.0] * 30
    phases, _, tracker = track(times, max_steps=10)
    # i=9 is the first step whose two windows (4..6, 7..9) both sit at the new level
    assert phases.count("warmup") == 9 and tracker.warmup_settled
    assert all(t == 2.0 for t, p in zip(times, phases, strict=False) if p == "measured")


def test_pure_noise_settles_at_the_first_possible_step():
    phases, _, _ = track(noise(40, 0.01), max_steps=10)
    assert phases.count("warmup") == 6  # 2 x settle_window
    phases, _, _ = track(noise(40, 0.01), max_steps=10, min_warmup_steps=8)
    assert phases.count("warmup") == 8


def test_warmup_that_never_settles_is_cut_at_its_budget():
    times = [1.1**i for i in range(40)]  # 10 % slower every step
    phases, _, tracker = track(times, max_warmup_steps=12, max_steps=10)
    assert phases.count("warmup") == 12 and tracker.warmup_settled is False


def test_warmup_waits_for_the_loss_scale_to_settle():
    times = noise(40, 0.01)
    skipped = [False] * 40
    skipped[4] = True  # step 5 overflowed: steps 6, 7, 8 must run clean first
    phases, _, _ = track(times, skipped, max_steps=10)
    assert phases.count("warmup") == 8


# --------------------------------------------------------------------------- adaptive stop
def test_quiet_steps_stop_on_the_ci_target_at_min_steps():
    phases, stop, tracker = track(noise(100, 0.01))
    assert stop == "target_met" and phases.count("measured") == 10  # min_steps
    assert steady.median_ci(tracker.times["measured"]).half_pct <= 2.0


def test_noisy_steps_stop_on_the_step_budget_or_the_time_budget():
    phases, stop, _ = track(noise(400, 0.5, level=10), max_steps=20)
    assert (stop, phases.count("measured")) == ("max_steps", 20)
    phases, stop, _ = track(noise(400, 0.5, level=10), max_measure_s=100)
    measured = [
        t for t, p in zip(noise(400, 0.5, level=10), phases, strict=False) if p == "measured"
    ]
    assert stop == "max_time" and sum(measured) >= 100 > sum(measured[:-1])


def test_steps_too_noisy_for_the_target_stop_early_as_target_unreachable():
    """+-10 % per step: the 2 % target would need ~hundreds of steps; after 2 x min_steps timed
    steps the projection says so, and the run stops instead of spending its budget."""
    phases, stop, tracker = track(noise(400, 0.10))
    assert stop == "target_unreachable" and 20 <= phases.count("measured") < 60  # not 200
    assert steady.median_ci(tracker.times["measured"]).half_pct > 2.0


def test_a_target_within_reach_is_not_given_up():
    """+-5 % per step: the projection fits the budget, the run goes on until the CI is there."""
    phases, stop, tracker = track(noise(400, 0.05))
    assert stop == "target_met" and phases.count("measured") > 20
    assert steady.median_ci(tracker.times["measured"]).half_pct <= 2.0


def test_skipped_measured_steps_are_counted_but_not_timed():
    times = noise(100, 0.01)
    skipped = [i % 2 == 1 for i in range(100)]  # from step 2 on, every other step skipped
    skipped[:6] = [False] * 6
    phases, stop, tracker = track(times, skipped)
    assert stop == "target_met" and phases.count("measured") in (19, 20)
    assert sum(not s for s in tracker.skipped["measured"]) == 10  # min_steps timed steps


def test_fixed_mode_runs_exactly_its_steps():
    spec = make_spec(steps=5, warmup_steps=2)
    assert spec.measure.mode == "fixed"
    phases, stop, tracker = track(noise(50, 0.3), spec=spec)
    assert phases == ["warmup"] * 2 + ["measured"] * 5 and stop == "fixed" and tracker.budget == 7
    phases, stop, _ = track(noise(50, 0.3), spec=make_spec(steps=3, warmup_steps=0))
    assert phases == ["measured"] * 3 and stop == "fixed"


def test_decisions_travel_as_two_ints_and_reasons_are_the_schemas():
    for phase in steady.PHASES:
        for stop in [None, *STOP_REASONS]:
            decision = steady.Decision(phase, stop)
            assert steady.Decision.decode(decision.encode()) == decision
    assert set(STOP_REASONS) == {
        "target_met",
        "max_steps",
        "max_time",
        "target_unreachable",
        "fixed",
    }


# --------------------------------------------------------------------------- plan
def study(scenario_measure=None, **keys) -> dict:
    scenario = {"name": "a", "gpus_per_node": 1, "gradient_accumulation_steps": 1}
    if scenario_measure is not None:
        scenario["measure"] = scenario_measure
    config = {
        "study": "s",
        "cluster": "local-cpu",
        "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64,
        "scenarios": [scenario],
        **keys,
    }
    return load_study(config, source="test study")


def plan_one(**kwargs) -> contracts.RunSpec:
    (run,) = admitted_runs(study(**kwargs), make_cluster())
    return run


def test_mode_is_fixed_when_the_study_sets_steps_else_adaptive():
    run = plan_one(steps=7, warmup_steps=2)
    assert (run.measure.mode, run.steps, run.warmup_steps) == ("fixed", 7, 2)
    run = plan_one()
    assert (run.measure.mode, run.steps, run.warmup_steps) == ("adaptive", None, None)
    assert run.measure.target_ci_pct == 2.0  # the schema's default
    # a scenario's keys replace the study's one by one
    run = plan_one(
        measure={"max_steps": 50, "target_ci_pct": 1}, scenario_measure={"max_steps": 12}
    )
    assert (run.measure.max_steps, run.measure.target_ci_pct) == (12, 1)
    assert plan_one(steps=7, scenario_measure={"mode": "adaptive"}).measure.mode == "adaptive"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"steps": 5, "measure": {"mode": "adaptive"}}, ["steps:", "measure.mode: fixed"]),
        (
            {"scenario_measure": {"mode": "fixed"}},
            ["scenarios[0].measure.mode", "needs the study's steps"],
        ),
        ({"measure": {"min_steps": 20, "max_steps": 10}}, ["measure.min_steps: 20", "max_steps"]),
        (
            {"scenario_measure": {"min_steps": 20}, "measure": {"max_steps": 10}},
            ["scenarios[0].measure.min_steps: 20"],
        ),
        ({"measure": {"max_warmup_steps": 5}}, ["measure.max_warmup_steps: 5", "settle_window"]),
        ({"measure": {"min_warmup_steps": 9, "max_warmup_steps": 8}}, ["measure.min_warmup_steps"]),
        ({"scenario_measure": {"min_steps": 3}}, ["scenarios[0].measure.min_steps", ">= 6"]),
    ],
)
def test_contradicting_measure_keys_are_refused_naming_the_key(kwargs, words):
    with pytest.raises(StudyError) as err:
        plan_one(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_committed_studies_keep_their_fixed_steps():
    from conftest import REPO as REPO_ROOT

    from offload_study.planning.plan import Plan

    fixed = [
        p
        for p in sorted((REPO_ROOT / "config" / "studies").glob("*.yaml"))
        if "steps" in load_study(p)
    ]
    assert len(fixed) >= 4
    for path in fixed:
        raw = load_study(path)
        for run in Plan(path).runs:
            assert (run.measure.mode, run.steps, run.warmup_steps) == (
                "fixed",
                raw["steps"],
                raw["warmup_steps"],
            ), path


# --------------------------------------------------------------------------- metrics
def step_rows(times, skipped, warmup):
    return [
        StepRow(i + 1, "warmup" if i < warmup else "measured", t, 1000 / t, 8 / t, 6.0, int(s), 1.0)
        for i, (t, s) in enumerate(zip(times, skipped, strict=True))
    ]


def metrics_for(spec, steps, stats=None, logs=None, outcome="ok"):
    spec = spec.with_ds_config("no-such-config.json")
    inp = metrics.MetricsInput(
        spec,
        0,
        Supervision(rc=0, elapsed=3.0),
        outcome,
        None,
        steps,
        stats or {},
        logs or {},
        "2026-01-01T00:00:00Z",
        "2026-01-01T00:00:03Z",
    )
    record = metrics.compute_metrics(inp)
    assert metrics.metrics_problems(record) == []
    return record


def test_metrics_leave_skipped_steps_out_of_the_speed_and_count_them():
    spec = make_spec(steps=10, warmup_steps=3)
    times = [9.0, 1.0, 1.0] + [1.0, 1.01, 0.99, 0.1, 1.0, 1.015, 0.985, 0.1, 1.0, 1.0]
    skipped = [False, True, False] + [False] * 3 + [True] + [False] * 3 + [True, False, False]
    stats = {0: RankStats(rank=0, local_rank=0, world_size=1, host="h", pid=1, stop_reason="fixed")}
    m = metrics_for(spec, step_rows(times, skipped, 3), stats)
    assert m["step_time_s"] == 1.0 and m["steps_measured"] == 10 and m["steps_warmup"] == 3
    assert (m["skipped_steps_warmup"], m["skipped_steps_measured"]) == (1, 2)
    ci = steady.median_ci([t for t, s in zip(times[3:], skipped[3:], strict=True) if not s])
    assert (m["step_time_s_ci_lo"], m["step_time_s_ci_hi"]) == (ci.lo, ci.hi)
    assert m["step_time_ci_pct"] == pytest.approx(ci.half_pct) and m["ci_target_met"] is True
    assert (m["measure_mode"], m["stop_reason"], m["ci_target_pct"]) == ("fixed", "fixed", 2.0)
    assert m["skipped_steps_ds_log"] is None and m["warmup_settled"] is None
    # a run that died before its first step: nothing measured, nothing known
    m = metrics_for(spec, [], outcome="error")
    assert m["steps_warmup"] is None and m["step_time_s_ci_lo"] is None
    assert m["ci_target_met"] is None and m["stop_reason"] is None


# --------------------------------------------------------------------------- steps.csv
def test_steps_csv_round_trips_the_new_columns_and_reads_old_files(tmp_path):
    rows = [
        StepRow(1, "warmup", 0.5, 10.0, 1.0, 6.0, 1, 32768.0),
        StepRow(2, "measured", 0.5, 10.0, 1.0, 6.0, 0, None),
    ]
    contracts.write_steps(tmp_path / "steps.csv", rows)
    assert contracts.read_steps(tmp_path / "steps.csv") == rows
    assert [r.timed for r in rows] == [False, True]
    old = "step,phase,step_time_s,tokens_per_s,samples_per_s,loss\n1,measured,0.5,10,1,6\n2,meas"
    (tmp_path / "old.csv").write_text(old)
    assert contracts.read_steps(tmp_path / "old.csv") == [StepRow(1, "measured", 0.5, 10, 1, 6)]


# --------------------------------------------------------------------------- DeepSpeed's log
def test_skip_lines_of_a_real_gpu_log():
    text = (FIXTURES / "ds_gpu_steps.log").read_text()
    progress = logparse.skip_lines(text, "progress")
    assert [(p["step"], p["skipped"]) for p in progress] == [(i, 0) for i in range(6)]
    assert logparse.skip_lines(text, "overflow") == [] and logparse.ds_skipped_steps(text) == 0
    assert logparse.ds_skipped_steps("[harness] rank 0/1") is None
    # the breakdown timers of the same log still parse
    assert logparse.breakdown_ms(text, skip_steps=2)["step"] == pytest.approx(7074.22)


def test_overflow_lines_of_deepspeeds_own_fp16_loss_scaler():
    """The fp16 dynamic loss scaler the seed's config makes (2^16, hysteresis 2), fed two
    overflows: DeepSpeed's own lines (its logger, its line format), parsed back. A whole fp16
    run is not possible here: DeepSpeed's CPU accelerator refuses fp16 without avx512_fp16."""
    import io
    import logging

    import torch
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import get_float16_config
    from deepspeed.utils import logger

    dsconfig.ensure_single_process_comm()
    args = get_float16_config({"fp16": dsconfig.SEED_FP16}).dynamic_loss_scale_args()
    scaler = CreateLossScaler(torch.half, 0, True, args)
    out, level = io.StringIO(), logger.level
    handler = logging.StreamHandler(out)
    handler.setFormatter(logger.handlers[0].formatter)  # DeepSpeed's own line format
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for _ in range(2):
            scaler.update_scale(True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = out.getvalue()
    overflows = logparse.skip_lines(text, "overflow")
    assert [(o["rank"], o["attempted"], o["hysteresis"], o["reduced"]) for o in overflows] == [
        (0, 65536, 2, None),
        (0, 65536, None, 32768),
    ], text
    assert logparse.ds_skipped_steps(text) == 2 and scaler.cur_scale == 32768


def test_a_real_gpu_fp16_overflow_run_is_counted_from_its_log_and_its_steps():
    """tests/fixtures/gpu-fp16-overflow: a whole record captured on an H200 (benchmarks/device/
    lib.sh overflow_fixture: the default GPU study's model, fp16 with an initial loss scale of 2^32,
    6 fixed steps). Every step overflowed: DeepSpeed's log, the harness's steps.csv (engine counter,
    loss scale per step) and metrics.json must agree on 6 skipped steps and a halving scale."""
    record = FIXTURES / "gpu-fp16-overflow"
    text = (record / "logs" / "rank0.log").read_text()
    overflows = logparse.skip_lines(text, "overflow")
    assert len(overflows) == 6 and overflows[0]["hysteresis"] == 2  # the first one uses hysteresis
    assert [o["attempted"] for o in overflows[1:]] == [2**32 >> i for i in range(5)]
    assert logparse.ds_skipped_steps(text) == 6
    rows = contracts.read_steps(record / "steps.csv")
    assert [r.skipped for r in rows] == [1] * 6
    # the scale after each step's update: hysteresis keeps 2^32 once, then it halves every step
    assert [r.loss_scale for r in rows] == pytest.approx(
        [2.0 ** (32 - i) for i in range(6)], rel=1e-5
    )
    m = json.loads((record / "metrics.json").read_text())
    assert m["skipped_steps_measured"] == m["skipped_steps_ds_log"] == 6
    assert m["step_time_s"] is None  # no step did optimizer work: no speed to report
    # The record says "ok" (its runner had no outcome.nothing_timed); the rule judges it an error:
    from offload_study.training import outcome

    stats = {0: RankStats(rank=0, local_rank=0, world_size=1, host="h", pid=1, finished=True)}
    logs = {"rank0.log": text}
    ev = outcome.Evidence(Supervision(rc=0), logs, stats, rows, 1, None)
    verdict, excerpt = outcome.decide(ev)
    assert verdict == "error" and "all 6 measured optimizer steps were skipped" in excerpt


def test_a_run_whose_loss_is_never_finite_is_not_blamed_on_a_loss_scale():
    """A bf16 run (no loss scale) whose every step is skipped because its loss is NaN (a small
    mixture of experts under ZeRO-3 on CPU did this): the error says so, not "fp16"."""
    from offload_study.training import outcome

    rows = [
        contracts.StepRow(i, phase, 0.2, 3000.0, 40.0, float("nan"), skipped=1, loss_scale=1.0)
        for i, phase in enumerate(["warmup", "measured", "measured"], start=1)
    ]
    stats = {0: RankStats(rank=0, local_rank=0, world_size=1, host="h", pid=1, finished=True)}
    ev = outcome.Evidence(Supervision(rc=0), {"rank0.log": ""}, stats, rows, 1, None)
    verdict, excerpt = outcome.decide(ev)
    assert verdict == "error" and excerpt.startswith("the loss was not finite at all 2 measured")
    assert "fp16" not in excerpt


# --------------------------------------------------------------------------- real DeepSpeed
def overflowing_engine(out: str) -> None:
    """(Spawned process.) A real one-rank ZeRO-3 bf16 engine on CPU runs four optimizer steps
    through the harness's one_step; during the third a weight is NaN, so its gradients are
    non-finite and DeepSpeed skips that step (the weight is restored after it)."""
    import types

    import deepspeed

    from offload_study.engines.deepspeed import train as zero3
    from offload_study.training import harness
    from offload_study.training.tokens import Batches

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dsconfig.ensure_single_process_comm()  # its store in memory: no port another test can take
    harness.tee_output(Path(out) / "rank0.log")
    spec = make_spec(scenario={"gpus_per_node": 1, "gradient_accumulation_steps": 1})
    ds_config = dsconfig.build_ds_config(spec)
    # the harness' DeepSpeed engine (its rank stats: no NVMe folder, local rank 0)
    engine = zero3.ZeroEngine(
        spec, ds_config, types.SimpleNamespace(nvme_dir=None, local_rank=0), False
    )
    model = engine.engine.module
    batches, weight, steps = Batches(spec, engine.vocab_size, 0), model.lm_head.weight, []
    for poisoned in (False, False, True, False):
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            saved = weight.data.clone()
            if poisoned:
                weight.data.fill_(float("nan"))
        steps.append(harness.one_step(engine, batches, 1, 1))
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            weight.data.copy_(saved)
    contracts.write_json(Path(out) / "steps.json", [dataclasses.asdict(s) for s in steps])
    # end as the harness does: engine released, process group destroyed (a gloo group left to
    # interpreter teardown once aborted the process after its work: "terminate called without
    # an active exception", exit code -6)
    del engine, model
    import torch

    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_real_overflow_is_counted_by_the_harness_and_by_deepspeeds_log(tmp_path):
    child = multiprocessing.get_context("spawn").Process(
        target=overflowing_engine, args=(str(tmp_path),)
    )
    child.start()
    child.join(timeout=240)
    assert child.exitcode == 0, (tmp_path / "rank0.log").read_text()[-3000:]
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    assert {s["loss_scale"] for s in steps} == {1.0}  # bf16: a static scaler of 1
    assert math.isnan(steps[2]["loss"]) and math.isfinite(steps[3]["loss"])
    text = (tmp_path / "rank0.log").read_text()
    assert [p["skipped"] for p in logparse.skip_lines(text, "progress")] == [0, 0, 0, 1, 1]
    assert len(logparse.skip_lines(text, "overflow")) == 1
    assert logparse.ds_skipped_steps(text) == sum(s["skipped"] for s in steps) == 1


@pytest.mark.slow
@pytest.mark.alone  # its CI target is a timing: other tests' load is its noise
def test_adaptive_run_stops_on_its_ci_target(tmp_path):
    # a generous budget; the target is loose enough for a 2-core machine that other work shares
    adaptive = {
        "mode": "adaptive",
        "target_ci_pct": 15,
        "max_warmup_steps": 12,
        "max_steps": 400,
        "max_measure_s": 120,
    }
    scenario = {"measure": adaptive, "gradient_accumulation_steps": 1}
    spec_path, outdir, spec = make_run(tmp_path, scenario=scenario)
    assert spec.measure.mode == "adaptive" and spec.steps is None
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stdout + res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "ok", m["error_excerpt"]
    assert m["measure_mode"] == "adaptive" and m["stop_reason"] == "target_met"
    assert 10 <= m["steps_measured"] < 400 and m["ci_target_met"]
    assert m["step_time_ci_pct"] <= 15 and m["step_time_s_ci_lo"] <= m["step_time_s"]
    assert 6 <= m["steps_warmup"] <= 12 and m["warmup_settled"] is not None
    assert (
        m["skipped_steps_warmup"] == m["skipped_steps_measured"] == m["skipped_steps_ds_log"] == 0
    )
    phases = [r.phase for r in contracts.read_steps(outdir / "steps.csv")]
    assert phases == ["warmup"] * m["steps_warmup"] + ["measured"] * m["steps_measured"]
