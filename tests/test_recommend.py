"""`snakemake recommend` (offload_study.prediction.recommend): the candidate grid, the checkpoint's choice, and
a real search on CPU that must pick the faster of two runs whose difference is forced (slow)."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import SMALL_LLAMA, place_calibration, with_clusters

from offload_study import engines
from offload_study.core.contracts import Prediction, read_json
from offload_study.core.study import StudyError, load_cluster, load_schema, load_study
from offload_study.planning import candidates
from offload_study.planning.plan import Plan
from offload_study.prediction import recommend, shared

REPO_ROOT = Path(__file__).resolve().parents[1]
DS, FSDP2 = "deepspeed", "fsdp2"


def study(**recommend_block) -> dict:
    return {
        "study": "rec-test",
        "cluster": "local-cpu",
        "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64,
        "dtype": "bf16",
        "global_batch": 8,
        "micro_batch": 2,
        "gradient_checkpointing": False,
        "steps": 6,
        "warmup_steps": 2,
        "timeout_min": 15,
        "recommend": {"gpu_mem_gb": 40, "gpus_per_node": 1, "cpu_mem_gb": 16, **recommend_block},
        "scenarios": [
            {"name": "ref", "gpus_per_node": 1, "offload_optimizer": "cpu", "predict_only": True}
        ],
    }


def local_cpu() -> dict:
    return load_cluster("local-cpu")


def test_every_grid_entry_of_the_registry_is_one_of_the_schemas_offload_modes():
    """An engine folder's grid entries are the offload modes a study's grid names (a new
    folder's entry outside them would never be tried: this says so)."""
    grid = load_schema("study")["properties"]["recommend"]["properties"]["grid"]["properties"]
    enum = grid["offload"]["items"]["enum"]
    assert candidates.MODES == tuple(enum)
    found = candidates.entries()
    assert found and all(entry.mode in enum for entry in found), [
        (e.engine.name, e.path.name, e.keys) for e in found if e.mode not in enum
    ]
    assert len({e.base for e in found}) == len(found)  # distinct names
    grid = load_schema("study")["properties"]["recommend"]["properties"]["grid"]["properties"]
    assert grid["engine"]["items"]["enum"] == list(engines.names())


def test_the_grid_becomes_capped_candidate_scenarios():
    grid = {
        "engine": [DS],
        "offload": ["optimizer", "zenflow"],
        "offload_optimizer_ratio": [0.5, 1.0],
        "micro_batch": [1, 2],
        "zero": {"reduce_bucket_size": ["5e8"]},
    }
    found = candidates.candidates(load_study(study(grid=grid)), local_cpu())
    opt = f"rec-{DS}-cpu-none"
    assert [c["name"] for c in found] == [
        f"{base}__mb-{mb}__rbs-5e8"
        for base in (opt, f"{opt}__ratio-0.5", f"{opt}-zenflow")
        for mb in (1, 2)
    ]
    assert {c["gpu_mem_gb"] for c in found} == {40} and {c["engine"] for c in found} == {DS}
    assert found[2]["offload_optimizer_ratio"] == 0.5 and found[4]["zenflow"] == {}
    assert found[0]["zero"] == {"reduce_bucket_size": 500_000_000}  # YAML's '5e8' made a number
    assert found[0]["label"] == "ZeRO-3 — optimizer offload to the CPU"
    assert found[4]["label"] == "ZeRO-3 — optimizer offload to the CPU with ZenFlow"
    with_them = candidates.with_candidates(load_study(study(grid=grid)), local_cpu())
    assert [s["name"] for s in with_them["scenarios"]][1:] == [c["name"] for c in found]
    space = recommend.space(Plan(study(grid=grid)))  # the plan has them, with their groups
    assert space["candidates"][f"{opt}__ratio-0.5__mb-2__rbs-5e8"] == {
        "engine": DS,
        "group": f"{opt}__ratio-0.5",
        "capped": True,
    }  # the budget caps each
    assert {c["group"] for c in space["candidates"].values()} == {
        opt,
        f"{opt}__ratio-0.5",
        f"{opt}-zenflow",
    }
    assert space["references"] == []  # the only own scenario is predict-only
    assert space["max_measured"] == 4 and space["top_n"] is None


def test_a_grid_that_names_no_engine_searches_every_engine():
    """Each engine contributes its offload paths (the registry's grids); one that cannot run on
    the cluster is left out with its engine's reason; an engine without a ZeRO block is searched
    without the grid's ZeRO knobs."""
    grid = {
        "offload": ["none", "optimizer", "optimizer+param"],
        "micro_batch": [2, 4],
        "zero": {"reduce_bucket_size": [5e8, 2e8]},
    }
    found, left_out = candidates.grid(load_study(study(grid=grid)), local_cpu())
    by_engine: dict[str, set] = {}
    for c in found:
        by_engine.setdefault(c.engine, set()).add(c.scenario["name"])
    assert set(by_engine) == set(engines.names()) >= {DS, FSDP2}
    assert by_engine[FSDP2] == {
        f"rec-{FSDP2}-{path}__mb-{mb}" for mb in (2, 4) for path in ("none", "cpu-offload-policy")
    }
    assert len(by_engine[DS]) == 3 * 2 * 2  # none, optimizer, optimizer+param x mb x bucket
    labels = {c.scenario["label"] for c in found if c.engine == FSDP2}
    assert labels == {
        "FSDP2 — no offload",
        "FSDP2 — parameters, gradients and optimizer states "
        "offloaded to the CPU together (CPUOffloadPolicy)",
    }
    # every path registered is picked up: FSDP2's optimizer-only offload needs a CUDA GPU
    (out,) = left_out
    assert out["engine"] == FSDP2 and out["label"].startswith("FSDP2 — optimizer offload")
    assert "needs a CUDA GPU" in out["why"]
    only = {**grid, "engine": [FSDP2]}
    only_found, _ = candidates.grid(load_study(study(grid=only)), local_cpu())
    assert {c.engine for c in only_found} == {FSDP2}
    plan = Plan(study(grid=grid))  # admitted as a study: every candidate its engine takes
    space = recommend.space(plan)
    assert {c["engine"] for c in space["candidates"].values()} == {DS, FSDP2}
    assert space["left_out"] == left_out


def test_a_candidate_this_machine_leaves_out_is_named_with_the_engines_reason():
    """A search's files from a machine where a path could run name a candidate this one leaves
    out: the error the workflow raises for it says why, in the engine's words."""
    plan = Plan(study(grid={"offload": ["none", "optimizer"], "micro_batch": [2]}))
    why = candidates.why_not_here(plan.study, plan.cluster, f"rec-{FSDP2}-cpu-optimizer__mb-2")
    assert why.startswith("this machine leaves FSDP2 — optimizer offload") and "CUDA GPU" in why
    assert candidates.why_not_here(plan.study, plan.cluster, "rec-nothing__mb-2") is None
    assert candidates.why_not_here(plan.study, plan.cluster, "ref") is None


@pytest.mark.refuses_bad_input
def test_a_grid_too_large_or_a_clashing_name_is_refused():
    big = {
        "engine": [DS],
        "micro_batch": list(range(1, 9)),
        "offload": ["optimizer", "optimizer+param"],
    }
    with pytest.raises(StudyError, match="recommend.grid: 16 candidates, more than recommend.max"):
        candidates.with_candidates(load_study(study(grid=big, max_candidates=10)), local_cpu())
    clash = study(grid={"engine": [DS], "offload": ["optimizer"]})
    clash["scenarios"].append({"name": f"rec-{DS}-cpu-none__mb-2", "gpus_per_node": 1})
    with pytest.raises(StudyError, match=f"'rec-{DS}-cpu-none__mb-2': the prefix 'rec-' is "):
        candidates.with_candidates(load_study(clash), local_cpu())
    typo = study(grid={"engine": [DS], "zero": {"reduce_bucket_sise": [5e8]}})
    with pytest.raises(StudyError, match="recommend.grid.zero.reduce_bucket_sise: "):
        candidates.with_candidates(load_study(typo), local_cpu())


def _prediction(
    name: str, tps: float, feasible: bool = True, gpu_gib: float = 30, band: float | None = None
) -> Prediction:
    fields = {f.name: None for f in dataclasses.fields(Prediction)}
    return Prediction(
        **{
            **fields,
            "scenario": name,
            "predict_only": False,
            "force": False,
            "world_size": 1,
            "tokens_per_s": tps,
            "feasible": feasible,
            "gpu_gib": gpu_gib,
            "gpu_budget_gib": 40,
            "step_time_band": band,
            "reason": None if feasible else "GPU 50 GiB > 40 GiB",
        }
    )


def a_space(
    groups: dict[str, str],
    max_measured=10,
    top_n=None,
    rounds=2,
    engine=DS,
    references=("ref",),
    band=None,
) -> dict:
    """space.json of candidates name -> group (all of one engine unless the group says
    'engine:group')."""
    cands = {}
    for name, group in groups.items():
        eng, _, grp = group.rpartition(":")
        cands[name] = {"engine": eng or engine, "group": grp, "capped": True}
    return {
        "max_measured": max_measured,
        "top_n": top_n,
        "rounds": rounds,
        "step_time_band": band,
        "references": list(references),
        "candidates": cands,
    }


def test_the_checkpoint_measures_the_best_of_each_mode_first():
    space = a_space(
        {"a1": "opt", "a2": "opt", "b1": "opt-r0.5", "c1": "zenflow", "c2": "zenflow"},
        max_measured=3,
        band=0.5,
    )
    preds = {
        "a1": _prediction("a1", 900),
        "a2": _prediction("a2", 800),
        "b1": _prediction("b1", 700),
        "c1": _prediction("c1", 1000, feasible=False),
        "c2": _prediction("c2", 600),
    }
    chosen = recommend.select(space, preds)  # ±50 %: at least 600 tokens/s, all of them
    assert chosen["measure"] == ["a1", "b1", "c2", "ref"]  # a2 beats b1 and c2, but a1 is opt too
    why = {r["scenario"]: r["why"] for r in chosen["candidates"]}
    assert why["c1"] == "predicted not to fit: GPU 50 GiB > 40 GiB"
    assert why["a2"] == (
        "not measured: predicted 800 tokens/s, rank 2: within the study's ±50 % step-time band "
        "(recommend.step_time_band) of the best predicted (900 tokens/s), but the budget, "
        "recommend.max_measured (3), was spent on those ranked before it (the best of each engine first, then of each offload "
        "mode)"
    )


def test_a_candidate_with_no_predicted_speed_says_why_and_is_not_called_slower():
    space = a_space({"a1": "opt", "s1": "super"}, band=0.5)
    refused = dataclasses.replace(
        _prediction("s1", None),
        note="DeepSpeed refuses SuperOffload here; SuperOffload: CPU Adam in a worker",
    )
    chosen = recommend.select(space, {"a1": _prediction("a1", 900), "s1": refused})
    assert chosen["measure"] == ["a1", "ref"]
    why = {r["scenario"]: r["why"] for r in chosen["candidates"]}
    assert why["s1"] == (
        "not measured: no speed predicted (DeepSpeed refuses SuperOffload here; SuperOffload: "
        "CPU Adam in a worker), rank 2: ranked after every candidate with a predicted speed"
    )


def test_the_best_of_each_engine_is_measured_before_another_mode_of_one_engine():
    """Three DeepSpeed modes predicted faster than FSDP2's one: with room for two, FSDP2's
    best is measured beside DeepSpeed's, not DeepSpeed's second mode."""
    groups = {"ds-a": "deepspeed:opt", "ds-b": "deepspeed:r0.8", "ds-c": "deepspeed:super"}
    groups["fsdp-a"] = "fsdp2:policy"
    speeds = {"ds-a": 1000, "ds-b": 990, "ds-c": 980, "fsdp-a": 900}
    preds = {n: _prediction(n, tps, band=0.25) for n, tps in speeds.items()}
    round0 = recommend.select(a_space(groups, max_measured=2), preds)
    assert round0["measure"] == ["ds-a", "fsdp-a", "ref"]
    rows = {r["scenario"]: r for r in round0["candidates"]}
    assert rows["ds-b"]["in_band"] and rows["ds-b"]["round"] is None


def test_every_candidate_within_the_band_is_measured_up_to_the_budget():
    """The band of the best predicted one's step time (here ±25 %: at least 1000 / 1.25 = 800
    tokens/s) decides which may be the fastest; max_measured how many of them are measured, the
    best of each engine first, then of each offload path."""
    groups = {
        "ds-a-mb4": "deepspeed:opt",
        "ds-a-mb8": "deepspeed:opt",
        "fsdp-none-mb4": "fsdp2:none",
        "fsdp-policy-mb8": "fsdp2:policy",
        "ds-b-mb8": "deepspeed:optparam",
        "fsdp-none-mb8": "fsdp2:none",
    }
    speeds = {
        "ds-a-mb4": 1000,
        "ds-a-mb8": 900,
        "fsdp-none-mb4": 850,
        "fsdp-policy-mb8": 820,
        "ds-b-mb8": 790,
        "fsdp-none-mb8": 2000,
    }
    preds = {n: _prediction(n, tps, band=0.25) for n, tps in speeds.items()}
    preds["fsdp-none-mb8"] = _prediction("fsdp-none-mb8", 2000, feasible=False)
    round0 = recommend.select(a_space(groups, max_measured=3), preds)
    assert round0["measure"] == ["ds-a-mb4", "fsdp-none-mb4", "fsdp-policy-mb8", "ref"]
    rows = {r["scenario"]: r for r in round0["candidates"]}
    assert [n for n, r in rows.items() if r.get("in_band")] == [
        "ds-a-mb4",
        "ds-a-mb8",
        "fsdp-none-mb4",
        "fsdp-policy-mb8",
    ]
    assert rows["ds-b-mb8"]["why"] == (
        "not measured: predicted 790 tokens/s, rank 5: slower than the best predicted "
        "(1,000 tokens/s) by more than the model's ±25 % step-time error"
    )
    assert rows["ds-a-mb8"]["why"].endswith(
        "recommend.max_measured (3), was spent on those "
        "ranked before it (the best of each engine first, "
        "then of each offload mode)"
    )
    assert rows["fsdp-none-mb4"]["why"] == (
        "measured in round 0 (predicted 850 tokens/s, rank 3: within the model's ±25 % "
        "step-time error of the best predicted (1,000 tokens/s))"
    )
    (band,) = round0["bands"]
    assert band["best"] == "ds-a-mb4" and band["floor_tokens_per_s"] == 800
    assert (band["in_band"], band["chosen"], band["limited_by"]) == (4, 3, "max_measured")
    # a larger budget measures the whole band, never one below it
    assert recommend.select(a_space(groups, max_measured=10), preds)["measure"] == [
        "ds-a-mb4",
        "fsdp-none-mb4",
        "fsdp-policy-mb8",
        "ds-a-mb8",
        "ref",
    ]
    # the study's own band (step_time_band) over the model's: 12 % keeps 1000 and 900 only, and
    # the budget left measures FSDP2's best predicted, which the band leaves out (the prediction
    # errs most between engines)
    narrow = recommend.select(a_space(groups, band=0.12), preds)
    assert narrow["measure"] == ["ds-a-mb4", "ds-a-mb8", "fsdp-none-mb4", "ref"]
    assert narrow["bands"][0]["engine_best"] == 1
    assert {r["scenario"]: r for r in narrow["candidates"]}["fsdp-none-mb4"]["why"] == (
        "measured in round 0 (predicted 850 tokens/s, rank 3: slower than the best predicted "
        "(1,000 tokens/s) by more than the study's ±12 % step-time band "
        "(recommend.step_time_band); the best predicted of its engine, measured since the "
        "prediction errs most between engines)"
    )
    # never beyond the budget: with one candidate to measure, the band's best alone
    assert recommend.select(a_space(groups, band=0.12, max_measured=1), preds)["measure"] == [
        "ds-a-mb4",
        "ref",
    ]
    # top_n caps a round, and the budget is over the whole search
    assert recommend.select(a_space(groups, max_measured=3, top_n=2), preds)["measure"] == [
        "ds-a-mb4",
        "fsdp-none-mb4",
        "ref",
    ]


def test_memory_is_judged_as_the_gate_judges_it_reserved_with_the_context_as_the_cap_counts_it():
    row = dataclasses.replace(
        _prediction("a", 1000, gpu_gib=30.0),
        gpu_reserved_gib=41.0,
        gpu_reserved_with_context_gib=41.5,
    )
    capped = recommend._row("a", {"engine": DS, "group": "g", "capped": True}, row)
    whole = recommend._row("a", {"engine": DS, "group": "g", "capped": False}, row)
    assert capped["predicted_gpu_reserved_gib"] == 41.0 and capped["over_budget"]
    assert whole["predicted_gpu_reserved_gib"] == 41.5
    older = dataclasses.replace(row, gpu_reserved_gib=None)  # plan.csv's one reserved column
    from_csv = recommend._row("a", {"engine": DS, "group": "g", "capped": True}, older)
    context = shared.ACCELERATOR_FITS["cuda"].cuda_context_gib
    assert from_csv["predicted_gpu_reserved_gib"] == pytest.approx(41.5 - context)


def test_a_candidate_predicted_over_its_budget_is_measured_after_those_under_it():
    # 43 GiB of a 40 GiB budget is feasible (within the model's memory error) but likelier to OOM
    space = a_space(
        {"fast-over": "opt-r0.5", "mid": "opt-r0.6", "slow": "opt-r0.7"},
        max_measured=2,
        references=(),
    )
    preds = {
        "fast-over": _prediction("fast-over", 1000, gpu_gib=43.4),
        "mid": _prediction("mid", 900, gpu_gib=38.8),
        "slow": _prediction("slow", 800, gpu_gib=32.8),
    }
    chosen = recommend.select(space, preds)
    assert chosen["measure"] == ["mid", "slow"]
    why = {r["scenario"]: r["why"] for r in chosen["candidates"]}
    assert why["fast-over"].startswith(
        "not measured: predicted 1,000 tokens/s, 43.4 GiB: over "
        "the budget within the model's error, rank 3: "
    )
    preds["mid"] = _prediction("mid", 900, gpu_gib=41)  # over too: speed decides among them
    assert recommend.select(space, preds)["measure"] == ["slow", "fast-over"]


def _record(tmp_path: Path, scenario: str, outcome: str, tps: float | None = None) -> str:
    path = tmp_path / scenario / "rep0" / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps({"scenario": scenario, "repeat": 0, "outcome": outcome, "tokens_per_s": tps})
    )
    return str(path)


def _two_gpu_40g_space(top_n=2, rounds=2):
    """The shape of recommend-h200-2gpu-40g: predicted 38.8 and 38.4 GiB ran out
    of 40 GiB, the next ones (32.8-33.9 GiB) fit."""
    preds = {
        "r06-mb8": (9885, 38.8),
        "r05-mb4": (9755, 38.4),
        "r07-mb8": (9586, 32.8),
        "r06-mb4": (9535, 33.9),
        "r08-mb8": (9373, 28.3),
        "r05-mb8": (10122, 43.4),
    }
    space = a_space({n: "opt-r0." + n[2] for n in preds}, top_n=top_n, rounds=rounds)
    return space, {n: _prediction(n, tps, gpu_gib=gib) for n, (tps, gib) in preds.items()}


def test_a_second_round_skips_candidates_at_least_as_large_as_one_that_ran_out(tmp_path):
    space, preds = _two_gpu_40g_space()
    round0 = recommend.select(space, preds)
    assert round0["measure"] == ["r06-mb8", "r05-mb4", "ref"]
    records = [
        _record(tmp_path, "r06-mb8", "gpu_oom"),
        _record(tmp_path, "r05-mb4", "gpu_oom"),
        _record(tmp_path, "ref", "ok", 14966.0),
    ]
    round1 = recommend.next_round(space, round0, records)
    # best of each mode first among those predicted below 38.4 GiB; the reference is not redone
    assert round1["measure"] == ["r07-mb8", "r06-mb4"] and round1["ended"] is None
    why = {r["scenario"]: r["why"] for r in round1["candidates"]}
    assert why["r05-mb8"] == (
        "not measured: predicted 43.4 GiB, not below 38.4 GiB of a "
        "candidate that ran out of GPU memory"
    )
    assert (
        why["r06-mb8"]
        == "measured in round 0 (predicted 9,885 tokens/s, rank 1: the best predicted)"
    )
    assert (
        why["r07-mb8"]
        == "measured in round 1 (predicted 9,586 tokens/s, rank 3: the best predicted)"
    )
    assert [b["best"] for b in round1["bands"]] == ["r06-mb8", "r07-mb8"]
    records += [
        _record(tmp_path, "r07-mb8", "ok", 12329.0),
        _record(tmp_path, "r06-mb4", "gpu_oom"),
    ]
    round2 = recommend.next_round({**space, "rounds": 5}, round1, records)
    assert round2["measure"] == [] and round2["ended"] == "a candidate ran ok: r07-mb8"


def test_the_search_ends_when_its_rounds_or_its_budget_are_spent_or_nothing_is_left(tmp_path):
    space, preds = _two_gpu_40g_space(top_n=2, rounds=1)
    round0 = recommend.select(space, preds)
    failed = [_record(tmp_path, n, "gpu_oom") for n in ("r06-mb8", "r05-mb4")]
    assert recommend.next_round(space, round0, failed)["ended"] == "recommend.rounds (1) spent"
    spent = {**space, "rounds": 3, "max_measured": 2}
    assert (
        recommend.next_round(spent, round0, failed)["ended"] == "recommend.max_measured (2) spent"
    )
    space["top_n"] = 6  # round 0 measures every candidate: none is left for round 1
    round0 = recommend.select(space, preds)
    space["rounds"] = 3
    ended = recommend.next_round(space, round0, failed)["ended"]
    assert ended == "no candidate left to try"


def test_the_rounds_are_read_up_to_the_first_that_measures_nothing(tmp_path):
    measures = [["a", "ref"], ["b"], [], ["never asked"]]
    asked = []

    def get_round(r):
        asked.append(r)
        path = tmp_path / f"selected.round{r}.json"
        path.write_text(json.dumps({"round": r, "measure": measures[r]}))
        return str(path)

    rounds = recommend.search_rounds(get_round)
    assert asked == [0, 1, 2] and rounds[-1].endswith("selected.round2.json")
    records = [rec for sel in rounds for rec in recommend.selected_records(sel, "R", [0])]
    assert records == ["R/a/rep0/metrics.json", "R/ref/rep0/metrics.json", "R/b/rep0/metrics.json"]


@pytest.mark.refuses_bad_input
def test_recommend_on_a_study_without_the_block_says_so(tmp_path):
    path = tmp_path / "plain.yaml"
    plain = study()
    del plain["recommend"]
    plain["scenarios"][0]["predict_only"] = False
    path.write_text(yaml.safe_dump(plain))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO_ROOT / "Snakefile"),
            "-d",
            str(with_clusters(tmp_path)),
            "--config",
            f"study_file={path}",
            "-n",
            "recommend",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "recommend: study 'rec-test' has no recommend block" in result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.alone  # its margin's CI is a timing: in CI, under the other workers' load, the
# paired CI of a 5x difference once straddled 1 ("inconclusive"); run alone it is [4.5, 6.1]
def test_recommend_picks_the_faster_of_two_real_runs(tmp_path, cpu_calibration):
    """Micro-batch 1 (8 micro-steps per optimizer step) against micro-batch 8 (one) at the same
    global batch: on CPU the tiny model's per-micro-step overhead makes micro-batch 1 several
    times slower. The search must measure both (a band wide enough to hold both predictions,
    max_measured 2) and recommend the faster. FSDP2's optimizer-only offload is left out: it
    needs a CUDA GPU."""
    path = tmp_path / "study.yaml"
    path.write_text(
        yaml.safe_dump(
            study(
                max_measured=2,
                step_time_band=10.0,
                grid={"offload": ["optimizer"], "micro_batch": [1, 8]},
            )
        )
    )
    place_calibration(tmp_path, "local-cpu", cpu_calibration)  # measured once per session
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO_ROOT / "Snakefile"),
        "-d",
        str(with_clusters(tmp_path)),
        "--config",
        f"study_file={path}",
        "--cores",
        "2",
        "recommend",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stderr[-3000:]
    terminal = result.stderr
    out = tmp_path / "results/local-cpu/rec-test"
    names = [f"rec-{DS}-cpu-none__mb-{mb}" for mb in (1, 8)]
    measured = read_json(out / "recommend/selected.round0.json")["measure"]
    assert sorted(measured) == names  # both candidates: both within the band
    speed = {name: read_json(out / name / "rep0/metrics.json")["tokens_per_s"] for name in names}
    faster = max(speed, key=speed.get)
    result = read_json(out / "recommend/recommendation.json")
    assert result["winner"] == faster and result["runner_up"] == min(speed, key=speed.get)
    assert result["tokens_per_s"] == pytest.approx(speed[faster], rel=0.02)
    assert result["margin"]["verdict"] == "faster" and result["margin"]["ci_low"] > 1
    (loser,) = result["others"]  # the paired CI, wholly below 1, words it "slower"
    assert loser["why"].startswith("slower: ") and "of the winner (95% CI" in loser["why"]
    assert result["device_time"]["runs"] == 2 and result["device_time"]["device_minutes"] > 0
    assert result["rounds"] == 1 and result["search_ended"].startswith("a candidate ran ok: ")
    assert json.loads((out / "recommend/recommended.ds_config.json").read_text()) == json.loads(
        (out / f"configs/{faster}.json").read_text()
    )
    page = (tmp_path / "reports/local-cpu/rec-test/recommend.html").read_text()
    words = f"ZeRO-3 — optimizer offload to the CPU; micro-batch {faster.rsplit('-', 1)[1]}"
    assert f"<strong>{words}</strong>" in page and f"rec-{DS}" not in page
    # the terminal's answer in the page's words, never a candidate's id
    said = [ln for ln in terminal.splitlines() if ln.startswith("recommend: use ")]
    assert len(said) == 1 and words in said[0] and f"rec-{DS}" not in said[0], said
    assert "needs a CUDA GPU" in page  # FSDP2's optimizer-only offload, left out


@pytest.mark.slow
def test_a_search_whose_first_round_fails_measures_a_second(tmp_path, cpu_calibration):
    """ZenFlow and SuperOffload both fail on CPU with DeepSpeed 0.19.8 (ZenFlow at the first
    forward of a model with an embedding, SuperOffload at init: it needs CUDA). With top_n 1,
    round 0 measures the better predicted; it fails, so round 1 measures the other; it fails
    too and the two rounds are spent: no winner, and the page says why each lost."""
    path = tmp_path / "study.yaml"
    block = {
        "top_n": 1,
        "rounds": 2,
        "grid": {"offload": ["zenflow", "super_offload"], "micro_batch": [8]},
    }
    path.write_text(yaml.safe_dump(study(**block)))
    place_calibration(tmp_path, "local-cpu", cpu_calibration)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO_ROOT / "Snakefile"),
        "-d",
        str(with_clusters(tmp_path)),
        "--config",
        f"study_file={path}",
        "--cores",
        "2",
        "recommend",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "results/local-cpu/rec-test"
    rounds = [read_json(out / f"recommend/selected.round{r}.json") for r in range(3)]
    first, second = rounds[0]["measure"], rounds[1]["measure"]
    assert len(first) == len(second) == 1 and {*first, *second} == {
        f"rec-{DS}-cpu-none-zenflow__mb-8",
        f"rec-{DS}-cpu-none-super__mb-8",
    }
    assert rounds[2]["measure"] == [] and rounds[2]["ended"] == "recommend.rounds (2) spent"
    rec = read_json(out / "recommend/recommendation.json")
    assert rec["winner"] is None and rec["rounds"] == 2 and rec["device_time"]["runs"] == 2
    whys = {o["scenario"]: o["why"] for o in rec["others"]}
    assert all(whys[n].startswith("outcome ") for n in (*first, *second)), whys
    assert (
        "recommend.rounds (2) spent"
        in (tmp_path / "reports/local-cpu/rec-test/recommend.html").read_text()
    )


def test_the_report_finds_the_recommendation_beside_the_plan(tmp_path):
    """report.html's section and the standalone page render recommendation.json (as decide
    writes it: NaN as null) with the winner, its margin's verdict and why the others lost."""
    from offload_study.analysis.report import recommend as view
    from offload_study.analysis.report.render import _read_plan

    rec = recommend._no_nan(
        {
            "study": "s",
            "cluster": "c",
            "gpu_mem_gb": 16,
            "winner": "rec-opt__mb-4",
            "tokens_per_s": 1000.0,
            "tokens_per_s_ci": [990.0, 1010.0],
            "runner_up": "rec-opt__mb-2",
            "margin": {
                "of": "rec-opt__mb-2",
                "ratio": 1.01,
                "ci_low": 0.99,
                "ci_high": 1.03,
                "pairs": 1,
                "verdict": "no difference shown",
                "note": "1 pair(s) by repeat",
            },
            "vs_references": [
                {
                    "of": "ref",
                    "ratio": float("nan"),
                    "ci_low": float("nan"),
                    "ci_high": float("nan"),
                    "pairs": 0,
                    "verdict": "no pair",
                    "note": "",
                }
            ],
            "others": [
                {
                    "scenario": "rec-super__mb-4",
                    "kind": "candidate",
                    "measured": True,
                    "why": "no ok run: outcome error: SuperOffload only supports NVIDIA CUDA GPUs",
                }
            ],
            "device_time": {"runs": 3, "wall_s": 90.0, "device_minutes": 1.5},
        }
    )
    (tmp_path / "recommend").mkdir()
    (tmp_path / "recommend/recommendation.json").write_text(json.dumps(rec))
    (tmp_path / "plan.json").write_text(json.dumps({"study": "s"}))
    beside = _read_plan(str(tmp_path / "plan.json"))["recommendation"]
    assert {k: beside[k] for k in rec if k != "others"} == {
        k: v for k, v in rec.items() if k != "others"
    }
    # a plan without the scenario: its name in words still (a candidate's, from its name)
    assert beside["names"]["rec-opt__mb-4"] == "CPU optimizer offload; micro-batch 4"
    (why,) = [o["why"] for o in beside["others"]]
    assert why == "no ok run: failed with an error: SuperOffload only supports NVIDIA CUDA GPUs"
    view.write_page(rec, tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert "CPU optimizer offload; micro-batch 4" in page and "rec-opt__mb-4" not in page
    assert "no difference shown" in page and "SuperOffload only" in page
    assert "NaN" not in page and "1.5 device-minutes" in page
    # the terminal's line: the answer in the same words, and where the page is
    line = view.terminal_line(rec, "reports/c/s/recommend.html", tmp_path)
    assert line == (
        "recommend: use CPU optimizer offload; micro-batch 4 at 1,000 tokens/s measured; "
        "the page: reports/c/s/recommend.html"
    )
    assert view.terminal_line({**rec, "winner": None}, "p.html", tmp_path) == (
        "recommend: no candidate ran ok within the budget; why each lost: p.html"
    )


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        ("", None),
        ("ci-target-missed", None),  # a caution: its CI ranks it
        ("ci-target-missed;loss-parity", "flagged loss-parity"),
        ("offload-faster-than-pair", "flagged offload-faster-than-pair"),
    ],
)
def test_only_an_implausible_flag_disqualifies_a_measured_candidate(flags, reason):
    row = pd.Series({"tokens_per_s": 1000.0, "gpu_mem_gb": 16, "flags": flags})
    assert recommend.row_state(row, budget=16) == reason


@pytest.mark.parametrize(
    ("cap", "reason"),
    [
        (None, "not held to the GPU-memory budget: it ran without a cap (a reference)"),
        (40, "not held to the GPU-memory budget: capped at 40 GiB (a reference)"),
        (16, None),
    ],
)
def test_a_reference_beyond_the_budget_says_whether_it_ran_capped(cap, reason):
    """An uncapped reference is not said to be above the budget: its memory was not held to it."""
    row = pd.Series({"tokens_per_s": 1000.0, "gpu_mem_gb": cap, "flags": ""})
    assert recommend.row_state(row, budget=16) == reason


@pytest.mark.parametrize(
    ("why", "page"),
    [
        (
            "not held to the GPU-memory budget: it ran without a cap (a reference): 2,238 "
            "tokens/s = 38.2% of the winner (95% CI 34.1%–53.2%), slower",
            "not held to the GPU-memory budget: it ran without a cap (a reference): 2,238 "
            "tokens/s, 38% [34%–53%] of the winner (slower)",
        ),
        (
            "slower: 4,031 tokens/s = 86.9% of the winner (95% CI 66.4%–94.1%)",
            "slower: 4,031 tokens/s, 87% [66%–94%] of the winner (slower)",
        ),
    ],
)
def test_the_page_words_a_ratio_to_the_winner_and_its_verdict_once(why, page):
    from offload_study.analysis.report.recommend import why_words

    assert why_words(why) == page


def winner_study(root: Path, peak_gpu_gib: float) -> Path:
    """A study folder whose winner rec-opt__mb-4 ran twice (records by builders.make_record),
    with its DeepSpeed config and plan beside them, as decide leaves them."""
    from builders import CLUSTER, STUDY, make_record, set_provenance

    for rep in (0, 1):
        metrics = make_record(
            root,
            "rec-opt__mb-4",
            rep,
            offload_optimizer="cpu",
            peak_gpu_gib=peak_gpu_gib + rep,
            host_rss_gib=50.0 + rep,
        )
        set_provenance(metrics, gpu_driver="550.54.15", cuda_version="12.4", git_dirty=True)
    study_dir = root / "results" / CLUSTER / STUDY
    (study_dir / "configs").mkdir()
    (study_dir / "configs" / "rec-opt__mb-4.json").write_text(json.dumps({"train_batch_size": 32}))
    scenarios = [{"name": "rec-opt__mb-4", "gpu_mem_gb": 16, "cpu_mem_gb": 64}]
    (study_dir / "plan.json").write_text(json.dumps({"study": STUDY, "scenarios": scenarios}))
    return study_dir


def a_recommendation(margin_ci=(1.05, 1.15)) -> dict:
    return {
        "study": "s",
        "cluster": "c",
        "gpu_mem_gb": 16,
        "winner": "rec-opt__mb-4",
        "tokens_per_s": 1000.0,
        "tokens_per_s_ci": [990.0, 1010.0],
        "runner_up": "rec-opt__mb-2",
        "margin": {
            "of": "rec-opt__mb-2",
            "ratio": 1.1,
            "ci_low": margin_ci[0],
            "ci_high": margin_ci[1],
            "pairs": 2,
            "verdict": "beyond CI",
            "note": "",
        },
        "vs_references": [
            {
                "of": "ref",
                "ratio": 0.9,
                "ci_low": 0.5,
                "ci_high": 1.6,
                "pairs": 2,
                "verdict": "within noise",
                "note": "",
            }
        ],
        "others": [
            {
                "scenario": "rec-opt__mb-2",
                "kind": "candidate",
                "measured": True,
                "why": "slower: 909 tokens/s",
            }
        ],
        "device_time": {"runs": 4, "wall_s": 120.0, "device_minutes": 2.0},
    }


def cell(page: str, element_id: str) -> str:
    start = page.index(">", page.index(f'id="{element_id}"')) + 1
    return " ".join(re.sub(r"<[^>]+>", "", page[start : page.index("</t", start)]).split())


def test_the_recommend_page_shows_budget_memory_config_and_provenance(tmp_path):
    """The page states the budget and that the winner kept to it (its largest peak of two
    runs), carries its DeepSpeed config inline and as a data: download, the why-not of each
    other candidate, and the winner's provenance (GPU, driver, CUDA runtime, torch, DeepSpeed,
    commit); ratios are worded by the one verdict rule."""
    import base64

    from builders import assert_self_contained

    from offload_study.analysis.report import recommend as view

    study_dir = winner_study(tmp_path, peak_gpu_gib=12.0)  # reserved: 13 + 2 = 15 GiB ≤ 16
    view.write_page(a_recommendation(), tmp_path / "page.html", study_dir)
    page = (tmp_path / "page.html").read_text()
    assert_self_contained(page)
    assert "GPU memory ≤ 16 GiB per GPU; host memory ≤ 64 GiB per node" in page
    met = cell(page, "recommend-met")
    assert met.startswith("met — peak GPU memory 13.0 GiB allocated, 15.0 GiB reserved"), met
    assert "peak host memory 51.0 GiB per node" in met
    uri = re.search(
        r'download="recommended.ds_config.json" href="data:application/json;base64,'
        r'([^"]+)"',
        page,
    )
    assert json.loads(base64.b64decode(uri.group(1))) == {"train_batch_size": 32}
    assert "&#34;train_batch_size&#34;: 32" in page  # inline too
    assert "slower: 909 tokens/s" in page
    prov = page[page.index('id="recommend-provenance"') :]
    for value in (
        "H200",  # the card in the GPU catalog's words
        "550.54.15",
        "12.4",
        "2.5.1",
        "deepspeed 0.16.4",
        "deadbeef with uncommitted changes",
    ):
        assert f"<code>{value}</code>" in prov, value
    # the winner's plan names it in words; its runs ran from a dirty tree, and the page says so
    assert "CPU optimizer offload; micro-batch 4" in page and 'id="dirty"' in page
    assert "Re-run the search: <code>snakemake --cores all recommend" in page
    assert "beyond CI" not in page and "within noise" not in page
    assert "faster" in cell(page, "recommend-verdict") and "inconclusive" in page
    # the winner's speed as a share of the runner-up's, not read as "faster by 110 %"
    use_this = cell(page, "use-this")
    assert "faster than the runner-up, CPU optimizer offload; micro-batch 2, at 110%" in use_this
    assert "of its speed" in use_this and ", by " not in use_this
    assert "in one run each" not in use_this  # two pairs: the runs' spread is in the interval


def test_a_margin_from_one_run_each_says_its_interval_is_one_runs_steps(tmp_path):
    from offload_study.analysis.report import recommend as view

    one_run_each = a_recommendation()
    one_run_each["margin"] = {**one_run_each["margin"], "pairs": 1}
    view.write_page(one_run_each, tmp_path / "page.html", winner_study(tmp_path, 12.0))
    use_this = cell((tmp_path / "page.html").read_text(), "use-this")
    assert "at 110% [105%–115%] of its speed, in one run each (the interval spans" in use_this
    assert "repeats: 2" in use_this


def test_a_winner_over_its_budget_is_said_not_to_meet_it(tmp_path):
    from offload_study.analysis.report import recommend as view

    study_dir = winner_study(tmp_path, peak_gpu_gib=15.0)  # reserved 18 GiB > 16
    view.write_page(a_recommendation(), tmp_path / "page.html", study_dir)
    met = cell((tmp_path / "page.html").read_text(), "recommend-met")
    assert met.startswith("not met: the winner's measured peak exceeds the budget"), met
    page_of_nothing = {**a_recommendation(), "winner": None, "margin": None, "vs_references": []}
    view.write_page(page_of_nothing, tmp_path / "none.html", study_dir)
    met = cell((tmp_path / "none.html").read_text(), "recommend-met")
    assert met == "not met: no candidate ran ok within the budget", met


def test_on_cpu_ranks_the_page_counts_ranks_and_sets_no_gpu_budget(tmp_path):
    """A CPU cluster's search: its ranks stand in for GPUs and hold no GPU memory, so the page
    counts ranks and says the search's GPU budget is not enforced there."""
    from offload_study.analysis.report import recommend as view

    study_dir = winner_study(tmp_path, peak_gpu_gib=12.0)
    no_gpu = {"accelerator": "cpu", "peak_gpu_allocated_gib": None, "peak_gpu_reserved_gib": None}
    for metrics in study_dir.glob("rec-opt__mb-4/rep*/metrics.json"):
        metrics.write_text(json.dumps({**json.loads(metrics.read_text()), **no_gpu}))
    view.write_page(a_recommendation(), tmp_path / "page.html", study_dir)
    page = (tmp_path / "page.html").read_text()
    use_this = cell(page, "use-this")
    assert use_this.startswith("Use this on c, ") and ", 1 rank:" in use_this, use_this
    assert "GiB per GPU" not in use_this, use_this
    assert "GPU memory: none on CPU ranks (the search's 16 GiB per GPU is not enforced" in page
    # judged on the host alone: 51 GiB at its peak, within the 64 GiB budget
    met = cell(page, "recommend-met")
    assert met == "met — peak host memory 51.0 GiB per node", met


def test_the_page_names_the_best_config_of_each_engine_and_what_was_measured_why(tmp_path):
    """A search over both engines, decided from records (builders.make_record): the page's
    first screen says which engine, offload and micro-batch won, at what speed and memory; the
    best of each engine beside it in words; what was measured and why (the band)."""
    from builders import make_record

    from offload_study.analysis.report import recommend as view

    ds4, ds8 = f"rec-{DS}-cpu-none__mb-4", f"rec-{DS}-cpu-none__mb-8"
    none4, policy4 = f"rec-{FSDP2}-none__mb-4", f"rec-{FSDP2}-cpu-offload-policy__mb-4"
    space = {
        **a_space(
            {
                ds4: f"{DS}:opt",
                ds8: f"{DS}:opt",
                none4: f"{FSDP2}:none",
                policy4: f"{FSDP2}:policy",
            },
            max_measured=3,
            band=0.25,
            references=(),
        ),
        "study": "s",
        "cluster": "c",
        "gpu_mem_gb": 16,
        "left_out": [
            {
                "engine": FSDP2,
                "label": "FSDP2 — optimizer offload to the CPU",
                "why": "offload_optimizer: needs a CUDA GPU",
            }
        ],
    }
    preds = {
        ds4: _prediction(ds4, 1000, gpu_gib=12),
        ds8: _prediction(ds8, 700, gpu_gib=14),
        none4: _prediction(none4, 1100, gpu_gib=15),
        policy4: _prediction(policy4, 900, gpu_gib=9),
    }
    selected = recommend.select(space, preds)
    assert selected["measure"] == [none4, ds4, policy4]  # 700 < 1100 / 1.25: ds8 is not
    made = {
        ds4: ("ok", 1000.0, DS),
        none4: ("ok", 1300.0, FSDP2),
        policy4: ("gpu_oom", None, FSDP2),
    }
    metrics = [
        str(
            make_record(
                tmp_path,
                name,
                rep,
                outcome=outcome,
                tokens_per_s=tps,
                gpu_mem_gb=16,
                world_size=1,
                gpus_per_node=1,
                peak_gpu_gib=11.0,
                label=name,
                seed=rep,
                extra={"engine": engine},
            )
        )
        for name, (outcome, tps, engine) in made.items()
        for rep in (0, 1)
    ]
    rec = recommend.decide(space, selected, metrics)
    assert rec["winner"] == none4 and rec["winner_engine"] == FSDP2
    assert rec["winner_memory"]["gpu_reserved_gib"] == pytest.approx(13.0)
    best = {b["engine"]: b for b in rec["best_of_engines"]}
    assert list(best)[0] == FSDP2 and best[FSDP2]["winner"]  # the winner's engine first
    assert best[DS]["scenario"] == ds4 and best[DS]["measured"]
    assert best[DS]["tokens_per_s"] == pytest.approx(1000, rel=0.05)
    assert [m["scenario"] for m in rec["measured"]] == [none4, ds4, policy4]  # by rank
    assert rec["selection"]["measured"] == 3 and rec["selection"]["candidates"] == 4
    view.write_page(rec, tmp_path / "page.html")  # no plan: each name in words from the registry
    page = (tmp_path / "page.html").read_text()
    assert "rec-" not in page and "mb-4" not in page
    assert "<strong>FSDP2 — no offload; micro-batch 4</strong>, 1,300 [" in page
    assert "13.0 GiB of GPU memory reserved per GPU" in cell(page, "use-this")
    start = page.index('id="recommend-engines"')
    table = page[start : page.index("</table>", start)]
    rows = [" ".join(re.sub(r"<[^>]+>", " ", r).split()) for r in table.split("<tr>")[2:]]
    assert rows[0].startswith("FSDP2 no offload; micro-batch 4 1,300 measured 13.0 GiB")
    assert rows[0].endswith("the recommendation")
    assert rows[1].startswith("ZeRO-3 optimizer offload to the CPU; micro-batch 4 1,000 measured")
    assert "of the recommendation's speed" in rows[1]
    start = page.index('id="recommend-measured-why">')
    why = html.unescape(page[page.index(">", start) + 1 : page.index("</p>", start)])
    assert why == (
        "3 of 4 candidates measured: the prediction's step time errs by up to ±25 %, so every "
        "feasible candidate predicted within that of the best predicted one (FSDP2 — no "
        "offload; micro-batch 4, 1,100 tokens/s), at least 880 tokens/s, may be the fastest; 3 "
        "were predicted within it."
    )
    assert "ran out of GPU memory" in page and "needs a CUDA GPU" in page


def test_an_engine_the_band_left_out_shows_its_best_prediction_beside_its_reference(tmp_path):
    """Only a reference ran of an engine whose candidates all lay below the band, the budget
    spent on the band: its row shows that reference's measured speed and names the engine's best
    predicted config, not measured, and why, so the reader does not take the reference for the
    engine's best."""
    from builders import make_record

    from offload_study.analysis.report import recommend as view

    fast, slow, ref = f"rec-{FSDP2}-none__mb-4", f"rec-{DS}-cpu-none__mb-8", "zero3-ref"
    space = {
        **a_space(
            {fast: f"{FSDP2}:none", slow: f"{DS}:opt"},
            max_measured=1,
            band=0.25,
            references=(ref,),
        ),
        "reference_engines": {ref: DS},
        "study": "s",
        "cluster": "c",
        "gpu_mem_gb": 16,
    }
    preds = {fast: _prediction(fast, 2000, gpu_gib=12), slow: _prediction(slow, 1200, gpu_gib=12)}
    selected = recommend.select(space, preds)
    assert selected["measure"] == [fast, ref]  # 1,200 < 2,000 / 1.25
    made = {fast: (2100.0, FSDP2), ref: (900.0, DS)}
    metrics = [
        str(
            make_record(
                tmp_path,
                name,
                0,
                tokens_per_s=tps,
                gpu_mem_gb=16,
                world_size=1,
                gpus_per_node=1,
                peak_gpu_gib=11.0,
                label=name,
                extra={"engine": engine},
            )
        )
        for name, (tps, engine) in made.items()
    ]
    rec = recommend.decide(space, selected, metrics)
    best = {b["engine"]: b for b in rec["best_of_engines"]}
    assert best[DS]["scenario"] == ref and best[DS]["measured"]
    assert best[DS]["best_predicted"]["scenario"] == slow
    assert best[FSDP2]["best_predicted"] is None  # its best predicted is the winner, measured
    view.write_page(rec, tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    start = page.index('id="recommend-engines"')
    table = page[start : page.index("</table>", start)]
    rows = [" ".join(re.sub(r"<[^>]+>", " ", r).split()) for r in table.split("<tr>")[2:]]
    assert rows[1].startswith("ZeRO-3 ")
    assert "900 measured" in rows[1]
    assert (
        "; its best predicted config, optimizer offload to the CPU; micro-batch 8, not measured: "
        "predicted 1,200 tokens/s" in html.unescape(rows[1])
    )
    assert "rec-" not in page
