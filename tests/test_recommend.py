"""`snakemake recommend` (offload_study.prediction.recommend): the candidate grid, the checkpoint's choice, and
a real search on CPU that must pick the faster of two runs whose difference is forced (slow)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import SMALL_LLAMA, place_calibration, with_clusters

from offload_study.core.contracts import Prediction, read_json
from offload_study.core.study import StudyError, load_schema, load_study
from offload_study.planning import candidates
from offload_study.planning.plan import Plan
from offload_study.prediction import recommend

REPO_ROOT = Path(__file__).resolve().parents[1]


def study(**recommend_block) -> dict:
    return {
        "study": "rec-test", "cluster": "local-cpu", "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64, "dtype": "bf16", "global_batch": 8, "micro_batch": 2,
        "gradient_checkpointing": False, "steps": 6, "warmup_steps": 2, "timeout_min": 15,
        "recommend": {"gpu_mem_gb": 40, "gpus_per_node": 1, "cpu_mem_gb": 16, **recommend_block},
        "scenarios": [{"name": "ref", "gpus_per_node": 1, "offload_optimizer": "cpu",
                       "predict_only": True}],
    }  # fmt: skip


def test_offload_modes_are_the_schemas_enum():
    grid = load_schema("study")["properties"]["recommend"]["properties"]["grid"]["properties"]
    assert list(candidates.OFFLOAD_MODES) == grid["offload"]["items"]["enum"]


def test_the_grid_becomes_capped_candidate_scenarios():
    grid = {"offload": ["optimizer", "zenflow"], "offload_optimizer_ratio": [0.5, 1.0],
            "micro_batch": [1, 2], "zero": {"reduce_bucket_size": ["5e8"]}}  # fmt: skip
    found = candidates.candidates(load_study(study(grid=grid)))
    assert [c["name"] for c in found] == [
        f"rec-{mode}__mb-{mb}__rbs-5e8" for mode in ("opt", "opt-r0.5", "zenflow") for mb in (1, 2)
    ]
    assert {c["gpu_mem_gb"] for c in found} == {40}
    assert found[2]["offload_optimizer_ratio"] == 0.5 and found[4]["zenflow"] == {}
    assert found[0]["zero"] == {"reduce_bucket_size": 500_000_000}  # YAML's '5e8' made a number
    with_them = candidates.with_candidates(load_study(study(grid=grid)))
    assert [s["name"] for s in with_them["scenarios"]][1:] == [c["name"] for c in found]
    space = recommend.space(Plan(study(grid=grid)))  # the plan has them, with their modes
    assert space["candidates"]["rec-opt-r0.5__mb-2__rbs-5e8"] == "opt-r0.5"
    assert set(space["candidates"].values()) == {"opt", "opt-r0.5", "zenflow"}
    assert space["references"] == []  # the only own scenario is predict-only


@pytest.mark.refuses_bad_input
def test_a_grid_too_large_or_a_clashing_name_is_refused():
    big = {"micro_batch": list(range(1, 9)), "offload": ["optimizer", "optimizer+param"]}
    with pytest.raises(StudyError, match="recommend.grid: 16 candidates, more than recommend.max"):
        candidates.with_candidates(load_study(study(grid=big, max_candidates=10)))
    clash = study()
    clash["scenarios"].append({"name": "rec-opt__mb-2", "gpus_per_node": 1})
    with pytest.raises(StudyError, match="'rec-opt__mb-2': the prefix 'rec-' is recommend's"):
        candidates.with_candidates(load_study(clash))


def _prediction(name: str, tps: float, feasible: bool = True, gpu_gib: float = 30) -> Prediction:
    fields = {f.name: None for f in dataclasses.fields(Prediction)}
    return Prediction(**{**fields, "scenario": name, "predict_only": False, "force": False,
                         "world_size": 1, "tokens_per_s": tps, "feasible": feasible,
                         "gpu_gib": gpu_gib, "gpu_budget_gib": 40,
                         "reason": None if feasible else "GPU 50 GiB > 40 GiB"})  # fmt: skip


def test_the_checkpoint_measures_the_best_of_each_mode_first():
    space = {"top_n": 3, "references": ["ref"],
             "candidates": {"a1": "opt", "a2": "opt", "b1": "opt-r0.5", "c1": "zenflow",
                            "c2": "zenflow"}}  # fmt: skip
    preds = {"a1": _prediction("a1", 900), "a2": _prediction("a2", 800),
             "b1": _prediction("b1", 700), "c1": _prediction("c1", 1000, feasible=False),
             "c2": _prediction("c2", 600)}  # fmt: skip
    chosen = recommend.select(space, preds)
    assert chosen["measure"] == ["a1", "b1", "c2", "ref"]  # a2 beats b1 and c2, but a1 is opt too
    why = {r["scenario"]: r["why"] for r in chosen["candidates"]}
    assert why["c1"] == "predicted not to fit: GPU 50 GiB > 40 GiB"
    assert why["a2"] == "not measured: predicted 800 tokens/s, rank 2, below the top 3"


def test_a_candidate_predicted_over_its_budget_is_measured_after_those_under_it():
    # 43 GiB of a 40 GiB budget is feasible (within the model's 10 % error) but likelier to OOM
    space = {"top_n": 2, "references": [],
             "candidates": {"fast-over": "opt-r0.5", "mid": "opt-r0.6", "slow": "opt-r0.7"}}  # fmt: skip
    preds = {"fast-over": _prediction("fast-over", 1000, gpu_gib=43.4),
             "mid": _prediction("mid", 900, gpu_gib=38.8),
             "slow": _prediction("slow", 800, gpu_gib=32.8)}  # fmt: skip
    chosen = recommend.select(space, preds)
    assert chosen["measure"] == ["mid", "slow"]
    why = {r["scenario"]: r["why"] for r in chosen["candidates"]}
    assert why["fast-over"] == ("not measured: predicted 1,000 tokens/s, 43.4 GiB: over the budget "
                                "within the model's error, rank 3, below the top 2")  # fmt: skip
    preds["mid"] = _prediction("mid", 900, gpu_gib=41)  # over too: speed decides among them
    assert recommend.select(space, preds)["measure"] == ["slow", "fast-over"]


def _record(tmp_path: Path, scenario: str, outcome: str, tps: float | None = None) -> str:
    path = tmp_path / scenario / "rep0" / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"scenario": scenario, "repeat": 0, "outcome": outcome,
                                "tokens_per_s": tps}))  # fmt: skip
    return str(path)


def _two_gpu_40g_space(top_n=2, rounds=2):
    """The shape of recommend-h200-2gpu-40g: predicted 38.8 and 38.4 GiB ran out
    of 40 GiB, the next ones (32.8-33.9 GiB) fit."""
    preds = {"r06-mb8": (9885, 38.8), "r05-mb4": (9755, 38.4), "r07-mb8": (9586, 32.8),
             "r06-mb4": (9535, 33.9), "r08-mb8": (9373, 28.3), "r05-mb8": (10122, 43.4)}  # fmt: skip
    space = {"top_n": top_n, "rounds": rounds, "references": ["ref"],
             "candidates": {n: "opt-r0." + n[2] for n in preds}}  # fmt: skip
    return space, {n: _prediction(n, tps, gpu_gib=gib) for n, (tps, gib) in preds.items()}


def test_a_second_round_skips_candidates_at_least_as_large_as_one_that_ran_out(tmp_path):
    space, preds = _two_gpu_40g_space()
    round0 = recommend.select(space, preds)
    assert round0["measure"] == ["r06-mb8", "r05-mb4", "ref"]
    records = [_record(tmp_path, "r06-mb8", "gpu_oom"), _record(tmp_path, "r05-mb4", "gpu_oom"),
               _record(tmp_path, "ref", "ok", 14966.0)]  # fmt: skip
    round1 = recommend.next_round(space, round0, records)
    # best of each mode first among those predicted below 38.4 GiB; the reference is not redone
    assert round1["measure"] == ["r07-mb8", "r06-mb4"] and round1["ended"] is None
    why = {r["scenario"]: r["why"] for r in round1["candidates"]}
    assert why["r05-mb8"] == ("not measured: predicted 43.4 GiB, not below 38.4 GiB of a "
                              "candidate that ran out of GPU memory")  # fmt: skip
    assert why["r06-mb8"] == "measured in round 0 (predicted 9,885 tokens/s, rank 1)"
    assert why["r07-mb8"] == "measured in round 1 (predicted 9,586 tokens/s, rank 3)"
    records += [_record(tmp_path, "r07-mb8", "ok", 12329.0),
                _record(tmp_path, "r06-mb4", "gpu_oom")]  # fmt: skip
    round2 = recommend.next_round({**space, "rounds": 5}, round1, records)
    assert round2["measure"] == [] and round2["ended"] == "a candidate ran ok: r07-mb8"


def test_the_search_ends_when_its_rounds_are_spent_or_nothing_is_left(tmp_path):
    space, preds = _two_gpu_40g_space(top_n=2, rounds=1)
    round0 = recommend.select(space, preds)
    failed = [_record(tmp_path, n, "gpu_oom") for n in ("r06-mb8", "r05-mb4")]
    assert recommend.next_round(space, round0, failed)["ended"] == "recommend.rounds (1) spent"
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
        [sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "-d", str(with_clusters(tmp_path)),
         "--config", f"study_file={path}", "-n", "recommend"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "recommend: study 'rec-test' has no recommend block" in result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.alone  # its margin's CI is a timing: in CI, under the other workers' load, the
# paired CI of a 5x difference once straddled 1 ("inconclusive"); run alone it is [4.5, 6.1]
def test_recommend_picks_the_faster_of_two_real_runs(tmp_path, cpu_calibration):
    """Micro-batch 1 (8 micro-steps per optimizer step) against micro-batch 8 (one) at the same
    global batch: on CPU the tiny model's per-micro-step overhead makes micro-batch 1 several
    times slower. The search must measure both (top_n 2) and recommend the faster."""
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study(top_n=2, grid={"offload": ["optimizer"],
                                                        "micro_batch": [1, 8]})))  # fmt: skip
    place_calibration(tmp_path, "local-cpu", cpu_calibration)  # measured once per session
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "-d",
           str(with_clusters(tmp_path)), "--config", f"study_file={path}", "--cores", "2", "recommend"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "results/local-cpu/rec-test"
    measured = read_json(out / "recommend/selected.round0.json")["measure"]
    assert sorted(measured) == ["rec-opt__mb-1", "rec-opt__mb-8"]  # top_n 2 of 2 candidates
    speed = {name: read_json(out / name / "rep0/metrics.json")["tokens_per_s"]
             for name in ("rec-opt__mb-1", "rec-opt__mb-8")}  # fmt: skip
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
    assert faster in (tmp_path / "reports/local-cpu/rec-test/recommend.html").read_text()


@pytest.mark.slow
def test_a_search_whose_first_round_fails_measures_a_second(tmp_path, cpu_calibration):
    """ZenFlow and SuperOffload both fail on CPU with DeepSpeed 0.19.8 (ZenFlow at the first
    forward of a model with an embedding, SuperOffload at init: it needs CUDA). With top_n 1,
    round 0 measures the better predicted; it fails, so round 1 measures the other; it fails
    too and the two rounds are spent: no winner, and the page says why each lost."""
    path = tmp_path / "study.yaml"
    block = {"top_n": 1, "rounds": 2, "grid": {"offload": ["zenflow", "super_offload"],
                                               "micro_batch": [8]}}  # fmt: skip
    path.write_text(yaml.safe_dump(study(**block)))
    place_calibration(tmp_path, "local-cpu", cpu_calibration)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "-d",
           str(with_clusters(tmp_path)), "--config", f"study_file={path}", "--cores", "2", "recommend"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "results/local-cpu/rec-test"
    rounds = [read_json(out / f"recommend/selected.round{r}.json") for r in range(3)]
    first, second = rounds[0]["measure"], rounds[1]["measure"]
    assert len(first) == len(second) == 1 and {*first, *second} == {
        "rec-zenflow__mb-8", "rec-super__mb-8"}  # fmt: skip
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

    rec = recommend._no_nan({
        "study": "s", "cluster": "c", "gpu_mem_gb": 16, "winner": "rec-opt__mb-4",
        "tokens_per_s": 1000.0, "tokens_per_s_ci": [990.0, 1010.0], "runner_up": "rec-opt__mb-2",
        "margin": {"of": "rec-opt__mb-2", "ratio": 1.01, "ci_low": 0.99, "ci_high": 1.03,
                   "pairs": 1, "verdict": "no difference shown", "note": "1 pair(s) by repeat"},
        "vs_references": [{"of": "ref", "ratio": float("nan"), "ci_low": float("nan"),
                           "ci_high": float("nan"), "pairs": 0, "verdict": "no pair", "note": ""}],
        "others": [{"scenario": "rec-super__mb-4", "kind": "candidate", "measured": True,
                    "why": "no ok run: outcome error: SuperOffload only supports NVIDIA CUDA GPUs"}],
        "device_time": {"runs": 3, "wall_s": 90.0, "device_minutes": 1.5},
    })  # fmt: skip
    (tmp_path / "recommend").mkdir()
    (tmp_path / "recommend/recommendation.json").write_text(json.dumps(rec))
    (tmp_path / "plan.json").write_text(json.dumps({"study": "s"}))
    beside = _read_plan(str(tmp_path / "plan.json"))["recommendation"]
    assert {k: beside[k] for k in rec if k != "others"} == {k: v for k, v in rec.items()
                                                            if k != "others"}  # fmt: skip
    # a plan without the scenario: its name in words still (a candidate's, from its name)
    assert beside["names"]["rec-opt__mb-4"] == "CPU optimizer offload; micro-batch 4"
    (why,) = [o["why"] for o in beside["others"]]
    assert why == "no ok run: failed with an error: SuperOffload only supports NVIDIA CUDA GPUs"
    view.write_page(rec, tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert "CPU optimizer offload; micro-batch 4" in page and "rec-opt__mb-4" not in page
    assert "no difference shown" in page and "SuperOffload only" in page
    assert "NaN" not in page and "1.5 device-minutes" in page


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
    assert recommend._row_state(row, budget=16) == reason


def winner_study(root: Path, peak_gpu_gib: float) -> Path:
    """A study folder whose winner rec-opt__mb-4 ran twice (records by builders.make_record),
    with its DeepSpeed config and plan beside them, as decide leaves them."""
    from builders import CLUSTER, STUDY, make_record, set_provenance

    for rep in (0, 1):
        metrics = make_record(root, "rec-opt__mb-4", rep, offload_optimizer="cpu",
                              peak_gpu_gib=peak_gpu_gib + rep, host_rss_gib=50.0 + rep)  # fmt: skip
        set_provenance(metrics, gpu_driver="550.54.15", cuda_version="12.4", git_dirty=True)
    study_dir = root / "results" / CLUSTER / STUDY
    (study_dir / "configs").mkdir()
    (study_dir / "configs" / "rec-opt__mb-4.json").write_text(json.dumps({"train_batch_size": 32}))
    scenarios = [{"name": "rec-opt__mb-4", "gpu_mem_gb": 16, "cpu_mem_gb": 64}]
    (study_dir / "plan.json").write_text(json.dumps({"study": STUDY, "scenarios": scenarios}))
    return study_dir


def a_recommendation(margin_ci=(1.05, 1.15)) -> dict:
    return {
        "study": "s", "cluster": "c", "gpu_mem_gb": 16, "winner": "rec-opt__mb-4",
        "tokens_per_s": 1000.0, "tokens_per_s_ci": [990.0, 1010.0], "runner_up": "rec-opt__mb-2",
        "margin": {"of": "rec-opt__mb-2", "ratio": 1.1, "ci_low": margin_ci[0],
                   "ci_high": margin_ci[1], "pairs": 2, "verdict": "beyond CI", "note": ""},
        "vs_references": [{"of": "ref", "ratio": 0.9, "ci_low": 0.5, "ci_high": 1.6, "pairs": 2,
                           "verdict": "within noise", "note": ""}],
        "others": [{"scenario": "rec-opt__mb-2", "kind": "candidate", "measured": True,
                    "why": "slower: 909 tokens/s"}],
        "device_time": {"runs": 4, "wall_s": 120.0, "device_minutes": 2.0},
    }  # fmt: skip


def cell(page: str, element_id: str) -> str:
    import re

    start = page.index(">", page.index(f'id="{element_id}"')) + 1
    return " ".join(re.sub(r"<[^>]+>", "", page[start : page.index("</t", start)]).split())


def test_the_recommend_page_shows_budget_memory_config_and_provenance(tmp_path):
    """The page states the budget and that the winner kept to it (its largest peak of two
    runs), carries its DeepSpeed config inline and as a data: download, the why-not of each
    other candidate, and the winner's provenance (GPU, driver, CUDA runtime, torch, DeepSpeed,
    commit); ratios are worded by the one verdict rule."""
    import base64
    import re

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
    uri = re.search(r'download="recommended.ds_config.json" href="data:application/json;base64,'
                    r'([^"]+)"', page)  # fmt: skip
    assert json.loads(base64.b64decode(uri.group(1))) == {"train_batch_size": 32}
    assert "&#34;train_batch_size&#34;: 32" in page  # inline too
    assert "slower: 909 tokens/s" in page
    prov = page[page.index('id="recommend-provenance"') :]
    for value in ("NVIDIA H200", "550.54.15", "12.4", "2.5.1", "deepspeed 0.16.4",
                  "deadbeef with uncommitted changes"):  # fmt: skip
        assert f"<code>{value}</code>" in prov, value
    # the winner's plan names it in words; its runs ran from a dirty tree, and the page says so
    assert "CPU optimizer offload; micro-batch 4" in page and 'id="dirty"' in page
    assert "Re-run the search: <code>snakemake --cores all recommend" in page
    assert "beyond CI" not in page and "within noise" not in page
    assert "faster" in cell(page, "recommend-verdict") and "inconclusive" in page


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
