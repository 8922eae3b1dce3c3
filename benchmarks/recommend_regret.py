"""Recommend's regret on a held-out sweep: how far the config ``snakemake recommend`` picked lies
from the fastest config that an exhaustive sweep of the same grid measured, and how many runs the
search measured to find it.

    python benchmarks/recommend_regret.py SWEEP_RECORDS RECOMMEND_RECORDS

Both folders are a study's records (``results/<cluster>/<study>`` or their copy under
``docs/results``) of two recommend studies over the same grid: the sweep measures every candidate
predicted to fit, the search measures as a user's would. A config counts for the sweep's best
when its run ended ok within the search's GPU-memory budget (recommend's own rule), so a
reference measured without a cap does not. Prints every config the sweep measured (its speed
and 95 % CI, what the plan predicted), the best of each engine, then the search's pick, its
speed in the sweep and the regret, 1 - pick / best. Deterministic: reads records, a few seconds.

With ``--same-machine`` the sweep is judged by its records measured on the search's machine only
(the runs table's ``machine``, as collect names it: its boot): two machines of one kind differ by
up to 35 % on these host-bound configs, so a sweep whose configs ran on several machines ranks
them by the machines as much as by the configs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offload_study.analysis import collect
from offload_study.analysis.report import words
from offload_study.core.contracts import engine_of, read_json, read_predictions
from offload_study.prediction import recommend


def machine_of(metrics: Path) -> str | None:
    """The machine a record ran on, as collect names it for the runs table (its boot)."""
    return collect.machine_of(collect.read_provenance(metrics.parent))


def machines(records: Path) -> set[str | None]:
    """The machines a study's records ran on."""
    return {machine_of(p) for p in records.glob("*/rep*/metrics.json")}


def measured(records: Path, on: set | None = None) -> tuple[dict, dict, dict]:
    """(scenario -> summary row, scenario -> why it cannot be recommended or None, the search's
    space.json), over the records measured on the machines ``on`` (None: every record)."""
    space = read_json(records / "recommend" / "space.json")
    found = sorted(records.glob("*/rep*/metrics.json"))
    kept = [str(p) for p in found if on is None or machine_of(p) in on]
    _, summary = collect.collect(kept)
    rows = {r["scenario"]: r for _, r in summary.iterrows()}
    state = {n: recommend.row_state(r, space["gpu_mem_gb"]) for n, r in rows.items()}
    return rows, state, space


def config_words(scenario: str, label: str = "") -> str:
    """A config in the pages' words: its label, and the grid's knobs its name carries."""
    knobs = words.sweep_words(scenario, {})
    label = words.reader_label(label, scenario)
    return f"{label}, {knobs}" if knobs else label


def speed(row) -> str:
    low, high = row.get("tokens_per_s_ci_low"), row.get("tokens_per_s_ci_high")
    ci = f" [{low:,.0f}-{high:,.0f}]" if low == low and high == high else ""
    return f"{row['tokens_per_s']:,.0f}{ci}"


def sweep_table(records: Path, rows: dict, state: dict) -> list[str]:
    """One line per config the sweep ran: its engine, measured and predicted speed."""
    plan = read_predictions(records / "plan.csv")
    lines = ["| config | engine | measured tokens/s [95 % CI] | predicted | counts for the best |"]
    lines.append("|---|---|---|---|---|")
    for name in sorted(rows, key=lambda n: -float(rows[n]["tokens_per_s"] or 0)):
        row, p = rows[name], plan.get(name)
        predicted = f"{p.tokens_per_s:,.0f}" if p and p.tokens_per_s else "-"
        shown = speed(row) if float(row["tokens_per_s"] or 0) > 0 else "-"
        lines.append(
            f"| {config_words(name, row['label'])} | {engine_of(row)} | {shown} | {predicted} "
            f"| {'yes' if state[name] is None else state[name]} |"
        )
    return lines


def unmeasured(records: Path, rows: dict) -> list[str]:
    """The configs the sweep chose to measure (its last round) that have no record yet."""
    last = sorted((records / "recommend").glob("selected.round*.json"))[-1]
    chosen = [c["scenario"] for c in read_json(last)["candidates"] if c["round"] is not None]
    return [name for name in chosen if name not in rows]


def judge(search: Path, rows: dict, state: dict, best: str) -> int:
    """The search's page and pick against the sweep's fastest config."""
    rec = read_json(search / "recommend" / "recommendation.json")
    searched, _, space = measured(search)
    pick, runs = rec["winner"], len(set(searched) - set(space["references"]))
    for engine in rec.get("best_of_engines") or []:
        shown = "measured" if engine["measured"] else f"not measured ({engine['why']})"
        config = config_words(engine["scenario"], rows.get(engine["scenario"], {}).get("label", ""))
        print(f"the search's page, best of {engine['engine']}: {config}, {shown}")
    if pick not in rows or state[pick] is not None:
        print(f"the search picked {pick}, which the sweep has no eligible record of")
        return 1
    regret = 1 - float(rows[pick]["tokens_per_s"]) / float(rows[best]["tokens_per_s"])
    print(
        f"the search's pick after {runs} measured candidates (and its references): "
        f"{config_words(pick, rows[pick]['label'])}, {speed(rows[pick])} tokens/s in the sweep; regret {regret:.1%}"
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="the exhaustive sweep's records")
    ap.add_argument("search", type=Path, nargs="?", help="the recommend search's records")
    ap.add_argument(
        "--same-machine",
        action="store_true",
        help="judge the sweep by its records on the search's machine only",
    )
    a = ap.parse_args(argv)
    if a.same_machine and not a.search:
        ap.error("--same-machine needs the search's records")
    on = machines(a.search) if a.same_machine else None
    rows, state, _ = measured(a.sweep, on)
    if on is not None:
        print(
            f"the sweep's records on the search's machine ({', '.join(sorted(map(str, on)))}) only"
        )
    print("\n".join(sweep_table(a.sweep, rows, state)))
    eligible = [n for n in rows if state[n] is None]
    if not eligible:
        print(f"no config of {a.sweep} ran ok within the budget: no regret to measure")
        return 1
    best = max(eligible, key=lambda n: float(rows[n]["tokens_per_s"]))
    print(
        f"\nthe sweep's fastest: {config_words(best, rows[best]['label'])}, {speed(rows[best])} tokens/s"
    )
    missing = unmeasured(a.sweep, rows)
    if missing:
        missing_words = "; ".join(config_words(n) for n in missing)
        print(f"the sweep has no record yet of: {missing_words}. Regret not judged")
        return 1
    return judge(a.search, rows, state, best) if a.search else 0


if __name__ == "__main__":
    sys.exit(main())
