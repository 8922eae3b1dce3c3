"""Check a study's measured numbers against references (config/references/*.yaml), ReFrame style.

CLI::

    python -m offload_study.across.check --summary results/<cluster>/<study>/summary.csv \
        --plan results/<cluster>/<study>/plan.json [--references config/references] [--out check.json]
    python -m offload_study.across.check --bundle bundles/<study>--<cluster>.tar.gz [...]

A reference (schema ``schemas/references.schema.yaml``) is an expected value of one summary
column for one scenario, with a lower and an upper tolerance as fractions of the value; it
applies to any cluster, to one device model or to one cluster, and the most specific one wins.
Prints one verdict per scenario, judged by the one band rule (core.verdict.band: the whole
95 % CI inside the band passes, wholly outside fails, across an edge is inconclusive), and exits 1
when a referenced scenario failed, was inconclusive or measured nothing: a gate passes only what
reproduces, so a cluster's CI can run a small study and fail on a regression; 2 on a bad
reference file (one error naming the file and key, before anything is compared).
:func:`verdicts` is the function the report uses.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from offload_study.across import bundle, compare
from offload_study.analysis import collect
from offload_study.analysis.report import views
from offload_study.core import contracts, verdict
from offload_study.core.layout import REFERENCES_DIR
from offload_study.core.references import Reference, format_number, load_references
from offload_study.core.study import StudyError

PASS, FAIL, INCONCLUSIVE, MISSING, NO_REFERENCE = (
    "pass",
    "fail",
    verdict.INCONCLUSIVE,
    "missing",
    "no reference",
)
FAILING = (FAIL, INCONCLUSIVE, MISSING)
#: the band rule's verdict -> check's status
STATUS = {
    verdict.REPRODUCED: PASS,
    verdict.NOT_REPRODUCED: FAIL,
    verdict.INCONCLUSIVE: INCONCLUSIVE,
    verdict.NOT_MEASURED: MISSING,
}


@dataclass(frozen=True)
class Verdict:
    scenario: str
    status: str  # PASS | FAIL | INCONCLUSIVE | MISSING | NO_REFERENCE
    metric: str | None = None
    measured: float | None = None
    ci: tuple[float | None, float | None] = (None, None)
    reference: Reference | None = None
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status in FAILING

    def line(self) -> str:
        ref = self.reference
        head = f"{self.status.upper():<12} {self.scenario}"
        if ref is None:
            return f"{head}: {self.message}"
        ci = (
            f" [{format_number(self.ci[0])} to {format_number(self.ci[1])}]"
            if self.ci[0] is not None
            else ""
        )
        text = f"{head}: {self.metric} {format_number(self.measured)}{ci}, reference {ref.band()}"
        return text + (f" — {self.message}" if self.message else "") + f" ({Path(ref.file).name})"


def judge(scenario: str, row: views.Row, ref: Reference) -> Verdict:
    """One scenario's measured value and its CI against its reference's band (pure), by the
    band rule of core.verdict."""
    measured = row[ref.metric]
    ci = (row[f"{ref.metric}_ci_low"], row[f"{ref.metric}_ci_high"])
    found = {"scenario": scenario, "metric": ref.metric, "reference": ref, "ci": ci}
    lo, hi = ref.bounds
    status = STATUS[verdict.band(measured, *ci, lo, hi)]
    if status == MISSING:
        why = f"nothing measured ({row['outcomes'] or 'no run record'})"
        return Verdict(status=MISSING, message=why, **found)
    measured = float(measured)
    outside = "below" if lo is not None and measured < lo else None
    outside = outside or ("above" if hi is not None and measured > hi else None)
    off = f"{100 * (measured / ref.value - 1):+.1f}% of the reference"
    notes = {
        PASS: ref.note,
        FAIL: f"{off}, {outside} its band",
        INCONCLUSIVE: f"{off}; inconclusive: the 95% CI crosses an edge of the band",
    }
    notes = [notes[status]]
    if row["flags"]:  # the summary's sanity flags: the number may not mean what it seems
        notes.append(f"flagged: {row['flags']}")
    message = "; ".join(n for n in notes if n)
    return Verdict(status=status, measured=measured, message=message, **found)


def verdicts(summary: pd.DataFrame, plan: dict, references: Sequence[Reference]) -> list[Verdict]:
    """One verdict per scenario of the plan (and per referenced metric), in plan order; then a
    MISSING verdict for each reference naming a scenario that the study does not have."""
    rows = _rows(summary)
    study, cluster = plan.get("study"), plan.get("cluster")
    devices = {str(r["device_name"]) for r in rows.values() if r["device_name"]}
    usable = [r for r in references if r.applies(study, cluster, devices)]
    planned = [str(s["name"]) for s in plan.get("scenarios") or []] or list(rows)
    out = []
    for scenario in planned:
        chosen = _most_specific([r for r in usable if r.scenario == scenario])
        if not chosen:
            out.append(Verdict(scenario, NO_REFERENCE, message="no reference"))
        out += [judge(scenario, rows.get(scenario, views.Row()), r) for r in chosen]
    for r in usable:
        if r.scenario not in planned:
            why = f"reference for scenario {r.scenario!r}, which study {study!r} does not have"
            out.append(Verdict(r.scenario, MISSING, metric=r.metric, reference=r, message=why))
    return out


def _rows(summary: pd.DataFrame) -> dict[str, views.Row]:
    if summary.empty or "scenario" not in summary:
        return {}
    return {
        str(r["scenario"]): views.Row({k: compare.plain(v) for k, v in r.items()})
        for r in summary.to_dict("records")
    }


def _most_specific(refs: list[Reference]) -> list[Reference]:
    """Per metric, the reference of the highest specificity (cluster > gpu_model > any)."""
    best: dict[str, Reference] = {}
    for r in refs:
        if r.metric not in best or r.specificity > best[r.metric].specificity:
            best[r.metric] = r
    return list(best.values())


def verdict_record(v: Verdict) -> dict:
    """A verdict as plain JSON data (check.json)."""
    d = dataclasses.asdict(v)
    d["reference"] = dataclasses.asdict(v.reference) if v.reference else None
    return d


# --------------------------------------------------------------------------- CLI
def _inputs(a) -> tuple[pd.DataFrame, dict]:
    """(summary, plan) from the files or from a bundle (collected again, as compare does)."""
    if a.bundle:
        with bundle.opened([a.bundle]) as (b,):
            side = compare.load_side(b, b.manifest.cluster)
            return side.summary, side.plan
    if not (a.summary and a.plan):
        raise StudyError("give --summary and --plan, or --bundle")
    plan = contracts.read_json(a.plan)
    return collect.read_table(a.summary), plan


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.across.check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--summary", help="summary.csv of the study (collect)")
    ap.add_argument("--plan", help="plan.json of the study")
    ap.add_argument("--bundle", help="check a bundle instead of --summary/--plan")
    ap.add_argument("--references", default=str(REFERENCES_DIR), help="folder of *.yaml")
    ap.add_argument("--out", help="write the verdicts as JSON here")
    a = ap.parse_args(argv)
    try:
        refs = load_references(a.references)
        summary, plan = _inputs(a)
    except (StudyError, bundle.BundleError, OSError, ValueError) as e:
        print(f"check: {e}")
        return 2
    found = verdicts(summary, plan, refs)
    print(
        f"check: study {plan.get('study')} on cluster {plan.get('cluster')}, references {a.references}"
    )
    for v in found:
        print(f"  {v.line()}")
    failed = [v for v in found if v.failed]
    statuses = (PASS, FAIL, INCONCLUSIVE, MISSING, NO_REFERENCE)
    counts = {s: sum(v.status == s for v in found) for s in statuses}
    print(
        "check: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + (" -> FAILED" if failed else " -> ok")
    )
    if a.out:
        contracts.write_json(
            a.out,
            {
                "study": plan.get("study"),
                "cluster": plan.get("cluster"),
                "passed": not failed,
                "verdicts": [verdict_record(v) for v in found],
            },
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
