"""benchmarks/recommend_regret.py: the search's pick judged against the sweep's fastest config."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs/results/h200-1gpu/recommend-sweep-h200-1gpu-24g"
MODEL_H = ROOT / "docs/results/h100-1gpu"  # model H's sweep and its two searches, on two machines


def regret(sweep: Path, search: Path, *options: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/recommend_regret.py"),
            *options,
            str(sweep),
            str(search),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def test_a_pick_slower_than_the_sweeps_fastest_has_its_regret_and_run_count(tmp_path):
    search = tmp_path / "search"
    shutil.copytree(RECORDS, search)
    shutil.rmtree(search / "rec-optparam__mb-8__rbs-5e8")  # the search never measured the best
    page = search / "recommend" / "recommendation.json"
    page.write_text(
        json.dumps({**json.loads(page.read_text()), "winner": "rec-opt__mb-8__rbs-5e8"})
    )
    text = regret(RECORDS, search)
    assert "the sweep's fastest: CPU optimizer + parameter offload, micro-batch 8" in text
    # 6,944 / 10,424 tokens/s of the sweep's own records
    assert "after 2 measured candidates" in text and "regret 33.4%" in text


def test_the_sweeps_own_pick_has_no_regret():
    assert "regret 0.0%" in regret(RECORDS, RECORDS)


def test_a_sweep_with_a_config_still_unmeasured_judges_no_regret(tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(RECORDS, sweep)
    shutil.rmtree(sweep / "rec-opt__mb-8__rbs-5e8")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/recommend_regret.py"), str(sweep), str(RECORDS)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert "no record yet of: CPU optimizer offload, micro-batch 8, reduce bucket 5e8" in out.stdout
    assert "regret " not in out.stdout


def test_the_sweep_judged_on_the_searchs_machine_only():
    sweep = MODEL_H / "sweep-h100-model-h-12g"
    # the first search's machine ran each config of the sweep once
    first = regret(sweep, MODEL_H / "recommend-h100-model-h-12g", "--same-machine")
    assert "(CPUOffloadPolicy), micro-batch 8, 12,738" in first and "regret 8.3%" in first
    # the second's ran them all, the four fastest three times: medians of that machine alone
    again = regret(sweep, MODEL_H / "recommend-h100-model-h-12g-again", "--same-machine")
    assert "the sweep's fastest: FSDP2 — no offload, micro-batch 4, 19,441" in again
    assert "regret 0.0%" in again
    # over both machines the medians mix them: 19,050 is no run's speed
    assert "19,050" in regret(sweep, MODEL_H / "recommend-h100-model-h-12g-again")
