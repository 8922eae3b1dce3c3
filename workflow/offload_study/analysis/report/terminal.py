"""What the terminal shows when a run of the workflow ends (the Snakefile's ``onsuccess:``):
the study's headline table and the report's path (Snakemake prints the full log's after it).

Short on purpose: one line per scenario (its speed against the baseline worded by the one
verdict rule, its peak GPU and host memory), at most MAX_ROWS of them; the report has the rest.
A run that made no summary yet (``snakemake plan``) prints the paths only.
"""

from __future__ import annotations

from pathlib import Path

from offload_study.analysis import collect
from offload_study.analysis.report import views
from offload_study.core import contracts, layout, verdict

MAX_ROWS = 20
COLUMNS = ("scenario", "tokens/s", "speed vs baseline [95% CI]", "GPU GiB/GPU", "host GiB/node")


def headline_rows(summary_csv: Path, plan_json: Path) -> list[tuple[str, ...]]:
    """One row per scenario, as the report's headline table orders them."""
    summary = collect.read_table(summary_csv)
    plan = contracts.read_json(plan_json) if plan_json.is_file() else {}
    baseline = None
    if "baseline" in summary and summary["baseline"].notna().any():
        baseline = str(summary["baseline"].dropna().iloc[0])
    rows = []
    for v in views.scenario_views(summary, plan, baseline or plan.get("baseline")):
        ci = (v["relative_speed"], v["relative_speed_ci_low"], v["relative_speed_ci_high"])
        if v["is_baseline"]:
            speed = "baseline"
        elif views.isnum(ci[0]):
            speed = f"{verdict.ratio_text(*ci)} {verdict.speed(*ci)}"
        else:
            speed = v["outcomes"] or "—"
        rows.append(
            (
                str(v["plot_label"]),
                views.fmt(v["tokens_per_s"], 0),
                speed,
                views.fmt(v["peak_gpu_allocated_gib"], 1),
                views.fmt(v["host_memory_gib"], 1),
            )
        )
    return rows


def table_text(rows: list[tuple[str, ...]]) -> str:
    """Plain columns, the first left-aligned, the numbers right-aligned."""
    shown = [COLUMNS, *rows[:MAX_ROWS]]
    widths = [max(len(r[i]) for r in shown) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(_cell(c, w, i) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in shown
    ]
    if len(rows) > MAX_ROWS:
        lines.append(f"... and {len(rows) - MAX_ROWS} more scenarios: see the report")
    return "\n".join(lines)


def _cell(text: str, width: int, column: int) -> str:
    return text.ljust(width) if column == 0 else text.rjust(width)


def summary_text(results_dir: str, report_html: str) -> str:
    """The block printed at the end of a run."""
    out = []
    summary = Path(results_dir) / layout.SUMMARY_CSV
    if summary.is_file():
        out.append(table_text(headline_rows(summary, Path(results_dir) / layout.PLAN_JSON)))
    if Path(report_html).is_file():
        out.append(f"report: {report_html}")
    return "\n".join(out)
