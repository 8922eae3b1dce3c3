"""Render the report: views and figures into templates/report.html.j2, and the CLI.

CLI::

    python -m offload_study.analysis.report --runs runs.csv --summary summary.csv --plan plan.json \
        --out reports/<cluster>/<study>/report.html --figures-dir reports/<cluster>/<study>/figures \
        [--other-cluster-summary other/summary.csv ...]

The HTML has no external reference at all: CSS inline, figures as base64 PNG, DeepSpeed configs as
data: URI downloads, and a Content-Security-Policy that forbids any fetch. Figures are also written
to --figures-dir under fixed names (figures.FIGURES) so Snakemake outputs always exist.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from offload_study.analysis import collect
from offload_study.analysis.report import (
    engines,
    figures,
    html,
    origin,
    predicted,
    seed,
    usethis,
    views,
)
from offload_study.analysis.report import recommend as recommend_view
from offload_study.core import contracts, layout, references

#: The site's legend (reports/index.html, across.site) from a page at reports/<cluster>/<study>/:
#: what the verdict words, CIs, units and flags mean is said there once, not on every page.
LEGEND_HREF = "../../index.html#legend"
#: Verdict lines shown on load; a study with more folds them (the tradeoff table has each
#: scenario too): a page opens on at most ~1,200 words.
MAX_VERDICT_LINES = 8


def baseline_of(summary: pd.DataFrame, plan: dict) -> tuple[str | None, str | None]:
    """(baseline scenario, why there is no relative speed or None). Collect chose the baseline
    (contracts.choose_baseline); the plan's choice stands in when nothing was collected."""
    baseline = note = None
    if "baseline" in summary and summary["baseline"].notna().any():
        baseline = str(summary["baseline"].dropna().iloc[0])
    if "relative_speed_note" in summary:
        notes = summary["relative_speed_note"].dropna().astype(str)
        note = next((n for n in notes if n.startswith(("no baseline", "baseline '"))), None)
    return baseline or plan.get("baseline") or None, note


def _predictions(plan: dict) -> dict:
    """The plan's predictions by scenario (plan.csv), read once per page; {} without it."""
    path = (plan.get("prediction") or {}).get("plan_csv")
    return contracts.read_predictions(path) if path and Path(path).is_file() else {}


def _bound_of(predictions: dict, scenario: str | None) -> str | None:
    """The predicted bound of ``scenario``'s step in words (None where not predicted)."""
    prediction = predictions.get(scenario) if scenario else None
    return predicted.bound_text(prediction) if prediction else None


def _versions() -> dict:
    import jinja2
    import matplotlib
    import seaborn

    from offload_study import __version__

    return {
        "offload-study": __version__,
        "python": platform.python_version(),
        "pandas": pd.__version__,
        "seaborn": seaborn.__version__,
        "matplotlib": matplotlib.__version__,
        "jinja2": jinja2.__version__,
    }


def render(
    runs: pd.DataFrame,
    summary: pd.DataFrame,
    plan: dict,
    figures_dir: str | Path,
    other_summaries: Sequence[str] = (),
    out: str | Path | None = None,
) -> str:
    """Render the report HTML (writes the figures into figures_dir); ``out``: where the page
    goes (its re-render command names it)."""
    baseline, note = baseline_of(summary, plan)
    scenarios = views.scenario_views(summary, plan, baseline, origin.usable_gib(runs))
    if not scenarios:
        note = "no scenario in the plan and no run collected"
    head, lines = views.verdicts(scenarios, baseline, note)
    predictions = _predictions(plan)
    spread = views.baseline_spread(scenarios, baseline, _bound_of(predictions, baseline))
    head = f"{head} {spread}" if spread else head
    cluster = plan.get("cluster") or (
        str(summary["cluster"].dropna().iloc[0])
        if "cluster" in summary and summary["cluster"].notna().any()
        else "?"
    )
    base_view = next((v for v in scenarios if v["is_baseline"]), None)
    labels = {v["scenario"]: v["plot_label"] for v in scenarios}
    model = views.model_name(plan.get("model"), plan.get("model_params"))
    seed_view = seed.seed_view(
        plan, scenarios, predictions, references.published_or_none(), baseline
    )
    configs = views.config_blocks(scenarios, runs)
    records_dir = plan.get("records_dir")
    rerender = origin.rerender_command(records_dir, out) if out and records_dir else None
    template = html.environment().get_template("report.html.j2")
    return template.render(
        study=plan.get("study") or "?",
        cluster=cluster,
        description=plan.get("description") or "",
        setup_line=views.setup_line(plan, runs, origin.hardware(runs)),
        baseline=baseline,
        baseline_label=base_view["plot_label"] if base_view else None,
        baseline_note=note,
        verdict_head=head,
        verdict_lines=lines,
        seed=seed_view,
        use_this=usethis.use_this(scenarios, cluster, model),
        surprises=usethis.surprises(scenarios),
        downloads={c["name"]: c["files"][0] for c in configs if c["files"]},
        common_cautions=views.common_cautions(scenarios),
        scenarios=scenarios,
        figures=figures.make_figures(runs, scenarios, Path(figures_dir), baseline, seed_view),
        failures=views.failures(runs, scenarios),
        run_rows=views.run_rows(runs, scenarios),
        run_breakdown=[name for name, _ in views.RUN_BREAKDOWN],
        checks=views.sanity_rows(scenarios),
        engines=engines.engines_view(runs, summary),
        predicted=predicted.predicted_view(plan, summary, labels),
        recommend=plan.get("recommendation"),
        blocked_names={v["scenario"] for v in scenarios if v["blocking"]},
        cautioned_names={v["scenario"] for v in scenarios if v["flag_list"] and not v["blocking"]},
        any_skipped=any(views.isnum(v["skipped_steps_measured"]) for v in scenarios),
        provenance=origin.provenance(runs, labels),
        dirty=origin.dirty(runs),
        rerun=origin.rerun_command(
            plan.get("study") or "?", cluster, study_file=plan.get("study_file")
        ),
        rerender=rerender,
        configs=configs,
        legend_href=LEGEND_HREF,
        max_verdict_lines=MAX_VERDICT_LINES,
        others=views.other_clusters(cluster, scenarios, other_summaries),
        n_runs=len(runs),
        n_ok=int((runs["outcome"] == "ok").sum()) if "outcome" in runs else 0,
        versions=_versions(),
        generated=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def _read_plan(path: str) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"report: cannot read the plan {path}: {e}") from e
    if not isinstance(plan, dict):
        raise SystemExit(f"report: {path} is not a plan (a JSON object)")
    # plan.csv lies beside plan.json (contracts.PLAN_CSV): found there also when the study's
    # folder was moved (committed records under docs/results, an unpacked bundle).
    beside = Path(path).with_name(contracts.PLAN_CSV)
    if isinstance(plan.get("prediction"), dict) and beside.is_file():
        plan["prediction"]["plan_csv"] = str(beside)
    # a search's result lies beside it too (rule recommend; report.recommend)
    plan["recommendation"] = recommend_view.beside(path)
    plan["records_dir"] = str(Path(path).parent)
    for scenario in plan.get("scenarios") or []:
        for key in ("ds_config", "run_spec"):
            if scenario.get(key):
                scenario[key] = str(found_beside(scenario[key], Path(path).parent, plan))
    return plan


def found_beside(named: str, records: Path, plan: dict) -> Path:
    """A file the plan names (relative to the working directory that made it), found in the
    records folder when the study's folder was moved (committed records, an unpacked bundle):
    its path under the study's results folder, taken from ``records``; the name as given when
    it lies where the plan says or nowhere."""
    path = Path(named)
    if path.is_file():
        return path
    study = layout.study_dir(plan.get("cluster") or "", plan.get("study") or "")
    try:
        moved = records / path.relative_to(study)
    except ValueError:
        moved = records / layout.CONFIGS_DIR / path.name
    return moved if moved.is_file() else path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.analysis.report", description=__doc__
    )
    ap.add_argument("--runs", required=True, help="runs.csv (or .parquet) from collect")
    ap.add_argument("--summary", required=True, help="summary.csv from collect")
    ap.add_argument("--plan", required=True, help="plan.json (study, scenarios, references)")
    ap.add_argument("--out", required=True, help="report.html to write")
    ap.add_argument("--figures-dir", required=True, help="folder for the PNG figures")
    ap.add_argument(
        "--other-cluster-summary",
        action="append",
        default=[],
        help="summary.csv of the same study on another cluster (repeatable)",
    )
    a = ap.parse_args(argv)
    text = render(
        collect.read_table(a.runs),
        collect.read_table(a.summary),
        _read_plan(a.plan),
        a.figures_dir,
        a.other_cluster_summary,
        a.out,
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"report: wrote {out} ({len(text) // 1024} KiB) and figures in {a.figures_dir}")
    return 0
