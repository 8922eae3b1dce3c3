"""The report's "seed vs this cluster" block (offload_study.analysis.report.seed): real summary
tables collected from small run records, plan.csv predictions written and read back, and the
seed's reference file."""

from __future__ import annotations

import math
import re

import pytest
from builders import make_record, run_collect_cli

from offload_study.analysis import collect as C
from offload_study.analysis.report import seed, views
from offload_study.analysis.report.render import render
from offload_study.core import contracts, references
from offload_study.prediction import error_bands

REFS = references.load_references()  # config/references/seed.yaml: the seed's bands
OFFLOAD = {"offload_optimizer": "cpu", "offload_param": "cpu", "cpu_mem_gb": 512}
SEED_ROWS = {  # scenario -> (seed %, GPUs), the seed's table
    "zero3-8gpu-40gb": (100, 8),
    "offload-4gpu-40gb": (35, 4),
    "offload-2gpu-80gb": (20, 2),
}


def prediction(name: str, tokens_per_s: float, world_size: int) -> contracts.Prediction:
    empty = {f: None for f in contracts.PREDICTION_COLUMNS}
    return contracts.Prediction(
        **{
            **empty,
            "scenario": name,
            "predict_only": True,
            "force": False,
            "world_size": world_size,
            "tokens_per_s": tokens_per_s,
            "feasible": True,
        }
    )


def plan_of(names_run: list[str], baseline: str) -> dict:
    scenarios, predict_only = [], []
    for name, (pct, gpus) in SEED_ROWS.items():
        s = {
            "name": name,
            "label": name,
            "gpus_per_node": gpus,
            "reference": {"speed_pct": pct, "gpu_memory": f"{80 if gpus == 2 else 40}GB × {gpus}"},
        }
        (scenarios if name in names_run else predict_only).append(s)
    return {
        "study": "seed",
        "baseline": baseline,
        "scenarios": scenarios,
        "predict_only": predict_only,  # predicted with the shipped calibration
        "prediction": {"calibration": "config/calibration/h200-2gpu.json"},
    }


def summary_views(tmp_path, speeds: dict[str, float], baseline: str, noise: float = 0.02):
    """Collect 3 repeats of each scenario in ``speeds`` (tokens/s) and return (plan, views)."""
    paths = []
    for name, tps in speeds.items():
        gpus = SEED_ROWS[name][1]
        kw = OFFLOAD if name.startswith("offload") else {}
        for k in range(3):
            paths.append(
                make_record(
                    tmp_path,
                    name,
                    k,
                    tokens_per_s=tps,
                    world_size=gpus,
                    gpus_per_node=gpus,
                    step_noise=noise,
                    seed=k,
                    **kw,
                )
            )
    out = tmp_path / "out"
    assert run_collect_cli(paths, out, baseline) == 0
    summary = C.read_table(out / "summary.csv")
    plan = plan_of(list(speeds), baseline)
    return plan, views.scenario_views(summary, plan, baseline)


def by_scenario(view: dict) -> dict:
    return {r["scenario"]: r for r in view["rows"]}


def test_an_8gpu_cluster_measures_every_row_against_its_own_baseline(tmp_path):
    speeds = {"zero3-8gpu-40gb": 10000.0, "offload-4gpu-40gb": 3500.0, "offload-2gpu-80gb": 900.0}
    plan, vs = summary_views(tmp_path, speeds, "zero3-8gpu-40gb")
    view = seed.seed_view(plan, vs, {}, REFS, "zero3-8gpu-40gb")
    rows = by_scenario(view)
    assert [r["seed_pct"] for r in view["rows"]] == [100, 35, 20]  # the seed's order
    assert all(r["how"] == "measured" for r in view["rows"])
    base = rows["zero3-8gpu-40gb"]
    assert (base["share"], base["ci"], base["verdict"]) == (1.0, (1.0, 1.0), "reproduced")
    four = rows["offload-4gpu-40gb"]  # the summary's bootstrap CI over the study baseline
    summary_row = next(v for v in vs if v["scenario"] == "offload-4gpu-40gb")
    assert four["ci"] == (
        summary_row["relative_speed_ci_low"],
        summary_row["relative_speed_ci_high"],
    )
    assert abs(four["share"] - 0.35) < 0.02 and four["verdict"] == "reproduced"
    two = rows["offload-2gpu-80gb"]  # 9 %: wholly below the band 15-25 %
    assert two["ci"][1] < 0.15 and two["verdict"] == "not reproduced"
    assert view["per_gpu"].startswith("Per GPU, a different quantity")
    assert (
        "offload-2gpu-80gb does 450 tokens/s per GPU, 36% of the 8-GPU run's per-GPU"
        in (view["per_gpu"])
    )


def test_a_2gpu_cluster_measures_over_a_predicted_baseline(tmp_path):
    """The committed seed-2gpu case: the 2-GPU offload row measured, the 8-GPU and 4-GPU rows
    only predicted (plan.csv, written and read back)."""
    plan, vs = summary_views(tmp_path, {"offload-2gpu-80gb": 1000.0}, "offload-2gpu-80gb")
    csv = tmp_path / "plan.csv"
    contracts.write_predictions(
        csv, [prediction("zero3-8gpu-40gb", 5000.0, 8), prediction("offload-4gpu-40gb", 1750.0, 4)]
    )
    view = seed.seed_view(plan, vs, contracts.read_predictions(csv), REFS, "offload-2gpu-80gb")
    rows = by_scenario(view)
    assert view["basis_how"] == "predicted" and view["basis_tokens_per_s"] == 5000.0
    two = rows["offload-2gpu-80gb"]
    assert two["how"] == "measured over a predicted baseline"
    assert abs(two["share"] - 0.20) < 0.01
    # the calibrated step-time band of error_bands.json (x 1/(1+p) to 1/(1-p)) widens the CI
    # past the 15-25 % band's top
    p = error_bands.bands(calibrated=True)["step_time"]
    assert view["error"] == p and view["error_case"] == "calibrated"
    low, high = two["ci"]
    assert low < 0.20 < 0.25 < high and two["verdict"] == "inconclusive"
    four = rows["offload-4gpu-40gb"]
    assert four["how"] == "predicted" and four["verdict"] == "not measured"
    assert four["share"] == 0.35
    assert four["ci"] == pytest.approx((0.35 * (1 - p) / (1 + p), 0.35 * (1 + p) / (1 - p)))
    assert four["predicted_verdict"] == "predicted across the band's edge"
    assert rows["zero3-8gpu-40gb"]["verdict"] == "not measured"  # the basis was not run here
    assert "of the 8-GPU run's predicted per-GPU speed" in view["per_gpu"]
    assert "error_bands.json" in view["error_source"]
    assert view["band_files"] == ["config/references/seed.yaml"]


def test_a_row_that_failed_or_is_flagged_is_not_measured(tmp_path):
    plan, vs = summary_views(tmp_path, {"zero3-8gpu-40gb": 10000.0}, "zero3-8gpu-40gb")
    view = seed.seed_view(plan, vs, {}, REFS, "zero3-8gpu-40gb")
    assert by_scenario(view)["offload-2gpu-80gb"]["verdict"] == "not measured"
    flagged = [views.Row({**v, "blocking": ["gpu-over-cap"]}) for v in vs]
    view = seed.seed_view(plan, flagged, {}, REFS, "zero3-8gpu-40gb")
    assert all(r["verdict"] == "not measured" for r in view["rows"])


def test_no_reference_no_block():
    assert seed.seed_view({"scenarios": [{"name": "a"}]}, [], {}, REFS, "a") is None


def test_the_band_without_a_reference_file_is_the_seed_tolerance():
    lo, hi, source = seed._band("x", {"speed_pct": 20, "source": "elsewhere"}, REFS)
    assert (round(lo, 4), round(hi, 4)) == (0.15, 0.25) and "no reference file" in source


def test_the_report_opens_on_the_seed_block_with_one_verdict_per_seed_row(tmp_path):
    speeds = {"zero3-8gpu-40gb": 10000.0, "offload-2gpu-80gb": 1900.0}
    plan, _ = summary_views(tmp_path, speeds, "zero3-8gpu-40gb")
    out = tmp_path / "out"
    html = render(
        C.read_table(out / "runs.csv"),
        C.read_table(out / "summary.csv"),
        plan,
        tmp_path / "figures",
    )
    assert html.index('id="seed"') < html.index('id="verdict"') < html.index('id="headline"')
    table = html[
        html.index('id="seed-table"') : html.index("</table>", html.index('id="seed-table"'))
    ]
    verdicts = re.findall(r'<span class="v-[a-z-]+">([a-z ]+)</span>', table)
    assert verdicts == ["reproduced", "not measured", "reproduced"]  # 100 %, ~35 %, ~20 %
    assert "Per GPU, a different quantity" in html
    assert "config/references/seed.yaml" in html
    # below the tradeoff table everything sits in a collapsible section, titled once
    rest = html[html.index("</table>", html.index('id="headline-table"')) :]
    assert rest.count("<h2") == rest.count("<summary><h2>") > 3


def test_predicted_seed_rows_carry_the_uncalibrated_band_and_never_say_reproduced(tmp_path):
    """A plan made from the GPU catalog (uncalibrated): the 8- and 4-GPU rows it cannot run are
    predictions with the wider band, worded as predictions, in the page too."""
    plan, vs = summary_views(tmp_path, {"offload-2gpu-80gb": 1000.0}, "offload-2gpu-80gb")
    plan["prediction"] = {"calibration": "x.json", "calibrated": False}
    predictions = {
        "zero3-8gpu-40gb": prediction("zero3-8gpu-40gb", 5000.0, 8),
        "offload-4gpu-40gb": prediction("offload-4gpu-40gb", 1750.0, 4),
    }
    view = seed.seed_view(plan, vs, predictions, REFS, "offload-2gpu-80gb")
    p = error_bands.bands(calibrated=False)["step_time"]
    assert view["error"] == p > error_bands.bands(calibrated=True)["step_time"]
    assert view["error_case"] == "uncalibrated"
    four = by_scenario(view)["offload-4gpu-40gb"]
    assert four["verdict"] == "not measured" and four["predicted_verdict"].startswith("predicted")
    html = render_seed(view)
    row = next(r for r in html.split("<tr>") if "offload-4gpu-40gb" in r)
    assert f"predicted</span> ±{round(100 * p)}%, not measured here" in row
    assert f"(±{round(100 * p)}%, uncalibrated)" in html
    assert not re.search(r">\s*reproduced", row)


def test_a_band_past_100_percent_bounds_no_slowdown_and_the_page_says_so(tmp_path, monkeypatch):
    """An uncalibrated step-time band of 100 % or more bounds a prediction's tokens/s from above
    only: a share over a predicted basis has no upper bound, is judged inconclusive against the
    seed's band, and the table and the figure show it without a negative or infinite figure."""
    from offload_study.analysis.report import figures

    monkeypatch.setattr(seed, "prediction_error", lambda plan: (1.2, "uncalibrated"))
    plan, vs = summary_views(tmp_path, {"offload-2gpu-80gb": 1000.0}, "offload-2gpu-80gb")
    predictions = {
        "zero3-8gpu-40gb": prediction("zero3-8gpu-40gb", 5000.0, 8),
        "offload-4gpu-40gb": prediction("offload-4gpu-40gb", 1750.0, 4),
    }
    view = seed.seed_view(plan, vs, predictions, REFS, "offload-2gpu-80gb")
    rows = by_scenario(view)
    two, four = rows["offload-2gpu-80gb"], rows["offload-4gpu-40gb"]
    assert two["ci"][0] == pytest.approx(0.2 * (1 - 0.02) / 2.2, rel=0.1)
    assert two["ci"][1] == math.inf and two["verdict"] == "inconclusive"
    assert four["ci"] == (0.0, math.inf)
    assert four["predicted_verdict"] == "predicted across the band's edge"
    html = render_seed(view)
    row = next(r for r in html.split("<tr>") if "offload-2gpu-80gb" in r).split("</tr>")[0]
    assert re.search(r"<strong>20% \[\d+%–no upper bound\]</strong>", row), row
    assert figures.plot_seed_share(view, tmp_path / "seed.png")


def render_seed(view: dict) -> str:
    from offload_study.analysis.report import html

    return html.environment().get_template("_seed.html.j2").render(seed=view)
