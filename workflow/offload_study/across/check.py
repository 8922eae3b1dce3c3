"""Check a study's measured numbers against references (config/references/*.yaml), ReFrame style.

CLI::

    python -m offload_study.across.check --summary results/<cluster>/<study>/summary.csv \
        --plan results/<cluster>/<study>/plan.json [--references config/references] [--out check.json]
    python -m offload_study.across.check --bundle bundles/<study>--<cluster>.tar.gz [...]

A reference (schema ``schemas/references.schema.yaml``) is an expected value of one summary
column for one scenario, with a lower and an upper tolerance as fractions of the value; it
applies to any cluster, to one device model or to one cluster, and the most specific one wins.
Prints one verdict per scenario and exits 1 when a referenced scenario measured outside its band
or measured nothing, so a cluster's CI can run a small study and fail on a regression; 2 on a
bad reference file (one error naming the file and key, before anything is compared).
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
from offload_study.core import contracts
from offload_study.core.study import REPO_ROOT, StudyError, load_schema, read_yaml, validate

REFERENCES_DIR = REPO_ROOT / "config" / "references"
_ENTRY = load_schema("references")["properties"]["references"]["items"]
#: Summary columns a reference may name (the schema's enum).
METRICS: list[str] = list(_ENTRY["properties"]["metric"]["enum"])
PASS, FAIL, MISSING, NO_REFERENCE = "pass", "fail", "missing", "no reference"
FAILING = (FAIL, MISSING)


@dataclass(frozen=True)
class Reference:
    """One expected value: ``value`` with tolerances ``lower`` <= 0 <= ``upper`` (fractions)."""

    file: str
    study: str
    scenario: str
    metric: str
    value: float
    lower: float | None
    upper: float | None
    cluster: str | None
    gpu_model: str | None
    note: str
    source: str

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        lo = None if self.lower is None else self.value * (1 + self.lower)
        hi = None if self.upper is None else self.value * (1 + self.upper)
        return lo, hi

    @property
    def specificity(self) -> int:
        return 2 if self.cluster else 1 if self.gpu_model else 0

    def applies(self, study: str, cluster: str, devices: set[str]) -> bool:
        return (
            self.study == study
            and self.cluster in (None, cluster)
            and (self.gpu_model is None or self.gpu_model in devices)
        )

    def band(self) -> str:
        lo, hi = self.bounds
        tol = f"{_tol(self.lower)}/{_tol(self.upper)}"
        return f"{self.value:g} ({tol}: {_num(lo)} to {_num(hi)})"


def _tol(t: float | None) -> str:
    return "unbounded" if t is None else f"{100 * t:+g}%"


def _num(v) -> str:
    return "—" if v is None else f"{v:.4g}"


def load_references(folder: str | Path = REFERENCES_DIR) -> list[Reference]:
    """Every reference of every *.yaml in ``folder``, validated (StudyError names file and key)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StudyError(f"{folder}: no references folder")
    out = []
    for path in sorted(folder.glob("*.yaml")):
        doc = validate(read_yaml(path), "references", str(path))
        for entry in doc["references"]:
            out.append(Reference(file=str(path), study=doc["study"], source=doc["source"], **entry))
    _refuse_duplicates(out)
    return out


def _refuse_duplicates(refs: list[Reference]) -> None:
    seen: dict[tuple, Reference] = {}
    for r in refs:
        key = (r.study, r.scenario, r.metric, r.cluster, r.gpu_model)
        if key in seen:
            raise StudyError(
                f"{r.file}: references: scenario {r.scenario!r} metric {r.metric!r} is also "
                f"given in {seen[key].file} for the same cluster/gpu_model: keep one"
            )
        seen[key] = r


@dataclass(frozen=True)
class Verdict:
    scenario: str
    status: str  # PASS | FAIL | MISSING | NO_REFERENCE
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
        ci = f" [{_num(self.ci[0])} to {_num(self.ci[1])}]" if self.ci[0] is not None else ""
        text = f"{head}: {self.metric} {_num(self.measured)}{ci}, reference {ref.band()}"
        return text + (f" — {self.message}" if self.message else "") + f" ({Path(ref.file).name})"


def judge(scenario: str, row: views.Row, ref: Reference) -> Verdict:
    """One scenario's measured value against its reference (pure)."""
    measured = row[ref.metric]
    ci = (row[f"{ref.metric}_ci_low"], row[f"{ref.metric}_ci_high"])
    found = {"scenario": scenario, "metric": ref.metric, "reference": ref, "ci": ci}
    if not views.isnum(measured):
        why = f"nothing measured ({row['outcomes'] or 'no run record'})"
        return Verdict(status=MISSING, message=why, **found)
    measured = float(measured)
    lo, hi = ref.bounds
    outside = "below" if lo is not None and measured < lo else None
    outside = outside or ("above" if hi is not None and measured > hi else None)
    off = f"{100 * (measured / ref.value - 1):+.1f}% of the reference, {outside} its band"
    notes = [off if outside else ref.note]
    if row["flags"]:  # the summary's sanity flags: the number may not mean what it seems
        notes.append(f"flagged: {row['flags']}")
    message = "; ".join(n for n in notes if n)
    return Verdict(status=FAIL if outside else PASS, measured=measured, message=message, **found)


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
    ap = argparse.ArgumentParser(prog="python -m offload_study.across.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
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
    counts = {s: sum(v.status == s for v in found) for s in (PASS, FAIL, MISSING, NO_REFERENCE)}
    print(
        "check: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + (" -> FAILED" if failed else " -> ok")
    )
    if a.out:
        contracts.write_json(a.out, {"study": plan.get("study"), "cluster": plan.get("cluster"),
                                     "passed": not failed,
                                     "verdicts": [verdict_record(v) for v in found]})  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
