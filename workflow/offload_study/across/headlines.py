"""The landing page's list of published pages: every report and recommend page under
reports/<cluster>/<study>/ (core.layout), each with a one-line headline (cluster, model, and the
verdict or the winner) read from the study's records.

A page's records are the study's results folder (results/<cluster>/<study>, layout.study_dir)
or, for a committed page, the copy committed under docs/results/ whose plan.json names the same
study and cluster (a folder named "...superseded..." loses to any other). Without records the
page is still listed, its headline saying so.

The verdict: the seed rows' verdicts (analysis.report.seed, the report's first block) where the
study carries a published table; else the fastest scenario against the baseline, worded by the
one verdict rule (core.verdict.speed). Each entry also says what the study is for (its plan's
``purpose``: a result to use, or a check of the project's own method) and when its page was
rendered (the page's ``rendered`` meta tag).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from offload_study.analysis import collect
from offload_study.analysis.report import html, seed, views
from offload_study.analysis.report import recommend as recommend_view
from offload_study.core import contracts, layout, references, verdict

#: Where committed records lie (docs/results/<cluster>/<study>, by convention; found by plan.json).
PUBLISHED_RECORDS = Path("docs/results")
PAGES = {"report.html": "report", "recommend.html": "recommend"}
#: How a page says when it was rendered (templates: report.html.j2, the recommend page).
RENDERED = re.compile(r'<meta name="rendered" content="([^"]+)"')
#: A study's purpose (the study schema's ``purpose``) when its plan does not say.
DEFAULT_PURPOSE = "result"


def local_pages(reports_root: str | Path, index: str | Path, root: str | Path = ".") -> list[dict]:
    """One entry per reports/<cluster>/<study>/{report,recommend}.html, sorted by cluster and
    study: its link from ``index`` and its headline."""
    reports, out = Path(reports_root), []
    for name, kind in PAGES.items():
        for page in reports.glob(f"*/*/{name}"):
            cluster, study = page.parent.parent.name, page.parent.name
            if cluster in ("site", "compare"):  # the site's own folders (layout)
                continue
            records = records_of(cluster, study, Path(root))
            out.append(
                {
                    "cluster": cluster,
                    "study": study,
                    "kind": kind,
                    "href": html.href(page, index),
                    "page": page,
                    "headline": headline(kind, records),
                    "purpose": purpose(records),
                    "rendered": rendered(page),
                }
            )
    return sorted(out, key=lambda e: (e["cluster"], e["study"], e["kind"]))


def purpose(records: Path | None) -> str:
    """The study's purpose as its plan says (older plans: a result)."""
    if records is None:
        return DEFAULT_PURPOSE
    return contracts.read_json(records / layout.PLAN_JSON).get("purpose") or DEFAULT_PURPOSE


def rendered(page: Path) -> str | None:
    """When the page was rendered, as it says; None for a page that does not."""
    found = RENDERED.search(page.read_text(encoding="utf-8", errors="replace")[:4096])
    return found.group(1) if found else None


def records_of(
    cluster: str, study: str, root: Path = Path("."), published_only: bool = False
) -> Path | None:
    """The records folder of a study on a cluster: results/<cluster>/<study> (unless
    ``published_only``), else the copy committed under docs/results/: the folder of that name
    (a study's second run is committed beside its first under a name of its own, and its page
    under the same name), else the one whose plan names the study; None when none is found."""
    own = root / layout.study_dir(cluster, study)
    if not published_only and (own / layout.PLAN_JSON).is_file():
        return own
    named = root / PUBLISHED_RECORDS / cluster / study
    if (named / layout.PLAN_JSON).is_file():
        return named
    found = []
    for plan_path in (root / PUBLISHED_RECORDS).glob(f"**/{layout.PLAN_JSON}"):
        plan = contracts.read_json(plan_path)
        if plan.get("study") == study and plan.get("cluster") == cluster:
            found.append(plan_path.parent)
    found.sort(key=lambda d: ("superseded" in d.name, len(d.parts), str(d)))
    return found[0] if found else None


def headline(kind: str, records: Path | None) -> str:
    """'<model> · <verdict or winner>' (the page's row names its cluster)."""
    if records is None:
        return "no records found for this page (results/ or docs/results/)"
    plan = contracts.read_json(records / layout.PLAN_JSON)
    model = views.model_name(plan.get("model"), plan.get("model_params"))
    if kind == "recommend":
        return f"{model} · {winner_line(records)}"
    return f"{model} · {verdict_line(records, plan)}"


def winner_line(records: Path) -> str:
    """'winner <its settings in words>: 19,900 [18,500–20,600] tokens/s within 16 GiB per GPU'."""
    rec = recommend_view.beside(records / layout.PLAN_JSON)
    if rec is None:
        return "no recommendation.json"
    if not rec.get("winner"):
        return f"no config ran ok within {rec['gpu_mem_gb']:g} GiB per GPU"
    plan = contracts.read_json(records / layout.PLAN_JSON)
    name = recommend_view.scenario_words(plan, rec["winner"])
    ci = rec.get("tokens_per_s_ci") or (None, None)
    return (
        f"winner {name}: {views.fmt_ci(rec['tokens_per_s'], *ci)} tokens/s within "
        f"{rec['gpu_mem_gb']:g} GiB per GPU"
    )


def verdict_line(records: Path, plan: dict) -> str:
    """The seed rows' verdicts where the study has a published table, else the fastest
    scenario against the baseline; 'no run collected' without summary.csv."""
    path = records / layout.SUMMARY_CSV
    if not path.is_file():
        return "no run collected"
    summary = collect.read_table(path)
    baseline = (
        next(iter(summary["baseline"].dropna().astype(str)), None)
        if "baseline" in summary
        else None
    )
    scenarios = views.scenario_views(summary, plan, baseline or plan.get("baseline"))
    beside = records / layout.PLAN_CSV
    predictions = contracts.read_predictions(beside) if beside.is_file() else {}
    table = seed.seed_view(plan, scenarios, predictions, references.published_or_none(), baseline)
    if table:
        return "seed " + " · ".join(f"{r['seed_pct']:g}%: {r['verdict']}" for r in table["rows"])
    return fastest_line(scenarios)


def fastest_line(scenarios: list) -> str:
    """The fastest scenario in words: '<scenario>: 74% [68%–82%] of baseline speed (slower)'
    when one beats the baseline or none is shown slower; the baseline itself, with the runner-up,
    when every other scenario is slower than it; the baseline's speed when nothing else was
    measured against it."""
    base = next((v for v in scenarios if v["is_baseline"] and views.isnum(v["tokens_per_s"])), None)
    rated = [
        v
        for v in scenarios
        if not v["is_baseline"] and not v["blocking"] and views.isnum(v["relative_speed"])
    ]
    if not rated:
        if base is None:
            return "no scenario measured against a baseline"
        speed = views.tokens_text(base)
        return f"{base['plot_label']}: {speed} tokens/s; nothing else measured beside it"
    v = max(rated, key=lambda v: float(v["relative_speed"]))
    ci = (v["relative_speed"], v["relative_speed_ci_low"], v["relative_speed_ci_high"])
    ratio, word = verdict.ratio_text(*ci), verdict.speed(*ci)
    if base is not None and word == verdict.SLOWER:
        return (
            f"fastest: the baseline, {base['plot_label']} ({views.tokens_text(base)} tokens/s); "
            f"next: {v['plot_label']}, {ratio} of its speed ({word})"
        )
    return f"fastest: {v['plot_label']}, {ratio} of baseline speed ({word})"


def committed_pages(
    reports_root: str | Path, root: str | Path = "."
) -> list[tuple[str, Path, Path]]:
    """(kind, records folder, page) of every page under reports_root whose records are found:
    what benchmarks/rerender.sh re-renders."""
    out = []
    for name, kind in PAGES.items():
        for page in sorted(Path(reports_root).glob(f"*/*/{name}")):
            cluster, study = page.parent.parent.name, page.parent.name
            records = records_of(cluster, study, Path(root))
            if records is not None and cluster not in ("site", "compare"):
                out.append((kind, records, page))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.across.headlines",
        description="List every page under a reports folder with its "
        "records: kind, records folder, page (tab-separated).",
    )
    ap.add_argument("reports_root", help="reports/")
    a = ap.parse_args(argv)
    for kind, records, page in committed_pages(a.reports_root):
        print(f"{kind}\t{records}\t{page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
