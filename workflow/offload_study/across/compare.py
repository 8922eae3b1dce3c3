"""Cross-cluster comparison of bundles: the same scenarios side by side, and what differs.

CLI::

    python -m offload_study.across.compare --out reports/compare/<name>.html A.tar.gz B.tar.gz ...

Each bundle (:mod:`offload_study.across.bundle`) is checked, extracted to a temp folder and its records
collected again with :func:`offload_study.analysis.collect.collect` (the same statistics on every side,
whatever version of the workflow made the bundle). The first bundle is the reference: every
other cluster's tokens/s is given as a multiple of it, with a bootstrap CI over both sides'
repeats and steps.

The **comparability check** is one table of facts (:data:`FACTS`), ReFrame style: each fact is
read from the records (metrics.json, provenance.json) or the plan, has a meaning and a relative
tolerance, and is of one of two kinds. A *workload* fact (model, dtype, batch, offload, ...)
that differs makes a scenario a different experiment: it gets the reason instead of a number. A
*platform* fact (GPU model, driver, CUDA, torch, DeepSpeed, cores granted, host memory, and each
rate of the clusters' calibration.json: matmul, CPU Adam, copies, disk) that differs is what may explain the difference in
speed, and is listed beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from jinja2 import Environment

from offload_study.across import bundle
from offload_study.analysis import collect, sanity
from offload_study.analysis.report import html as pages
from offload_study.analysis.report import views
from offload_study.core import contracts, devices, layout
from offload_study.core import verdict as verdict_rule

N_BOOT = 2000
MAX_REPEATS = 1000  # a bundle's plan.json asking for more is not a study's
WORKLOAD, PLATFORM = "workload", "platform"
#: DeepSpeed 0.19.5 changed pin_memory's default and ZeRO-3's gradient copy to CPU (notes).
DS_BEHAVIOUR_CHANGE = (0, 19, 5)
#: Step-time parts shown side by side (backward_inner and backward_allreduce are parts of backward).
BREAKDOWN_PARTS = [k for k in contracts.BREAKDOWN_KEYS if not k.startswith("backward_")]
PART_NAMES = {k: "optimizer step" if k == "step" else k.replace("_", " ") for k in BREAKDOWN_PARTS}
CALIBRATION_TOLERANCE = 0.2  # calibrations repeat within a few %; 20 % is a real difference


@dataclass(frozen=True)
class Fact:
    """One thing two runs must share (workload) or may differ in (platform)."""

    name: str
    kind: str  # WORKLOAD | PLATFORM
    meaning: str
    source: str  # "metrics" (runs table) | "provenance" (provenance.json) | "plan" (plan.json)
    key: str
    tolerance: float = 0.0  # relative, for numbers: values closer than this count as equal
    show: Callable = str


def plain(v):
    """NaN/NA -> None, numpy scalars -> Python values (tables mix them; pages compare them)."""
    if v is None or (not isinstance(v, (list, dict, str)) and pd.isna(v)):
        return None
    return v.item() if hasattr(v, "item") else v


FACTS = [
    Fact("model", WORKLOAD, "architecture (transformers config) and source", "plan", "model"),
    Fact("parameters", WORKLOAD, "model size as built", "metrics", "model_params",
         show=views.short_count),
    Fact("dtype", WORKLOAD, "precision of weights and compute", "metrics", "dtype"),
    Fact("sequence length", WORKLOAD, "tokens per sample", "metrics", "seq_len"),
    Fact("micro-batch", WORKLOAD, "samples per rank per step", "metrics", "micro_batch"),
    Fact("gradient accumulation", WORKLOAD, "micro-steps per optimizer step", "metrics",
         "gradient_accumulation_steps"),
    Fact("global batch", WORKLOAD, "samples per optimizer step", "metrics", "global_batch"),
    Fact("world size", WORKLOAD, "ranks (GPUs)", "metrics", "world_size"),
    Fact("optimizer offload", WORKLOAD, "where optimizer states live", "metrics",
         "offload_optimizer"),
    Fact("parameter offload", WORKLOAD, "where parameters live", "metrics", "offload_param"),
    Fact("gradient checkpointing", WORKLOAD, "activations recomputed", "metrics",
         "gradient_checkpointing"),
    Fact("GPU memory of the scenario", WORKLOAD, "the card the scenario stands for (GiB)",
         "metrics", "gpu_mem_gb"),
    Fact("GPU model", PLATFORM, "the accelerator", "provenance", "gpu_model",
         show=lambda v: devices.card_name(v) or str(v)),
    Fact("NVIDIA driver", PLATFORM, "driver version", "provenance", "gpu_driver"),
    Fact("CUDA", PLATFORM, "CUDA version torch was built with", "provenance", "cuda_version"),
    Fact("torch", PLATFORM, "torch version", "metrics", "torch_version"),
    Fact("DeepSpeed", PLATFORM, "DeepSpeed version (0.19.5 changed offload defaults)",
         "metrics", "deepspeed_version"),
    Fact("transformers", PLATFORM, "transformers version", "provenance", "transformers_version"),
    Fact("CPU model", PLATFORM, "host CPU (CPU Adam, pinned copies)", "provenance", "cpu_model"),
    Fact("cores granted", PLATFORM, "cores the run could use (CPU Adam threads)", "provenance",
         "cores_granted"),
    Fact("host memory", PLATFORM, "RAM of the host", "provenance", "ram_total_bytes",
         tolerance=0.05, show=views.fmt_bytes),
]  # fmt: skip


# --------------------------------------------------------------------------- one side
@dataclass(frozen=True)
class Side:
    """One bundle's study on its cluster, collected again from the bundle's records."""

    label: str  # the cluster's name (made unique among the sides)
    bundle: bundle.Bundle
    plan: dict
    runs: pd.DataFrame
    summary: pd.DataFrame
    calibration: dict  # rate -> value of calibration.json ({} when not calibrated)
    draws: dict  # scenario -> bootstrap draws of its median tokens/s (ok runs)
    provenance: dict  # record_dir -> its provenance.json ({} when unreadable)

    def scenarios(self) -> list[str]:
        return [str(s["name"]) for s in self.plan.get("scenarios") or []]

    def row(self, scenario: str) -> views.Row:
        rows = self.summary[self.summary["scenario"] == scenario].to_dict("records")
        return views.Row({k: plain(v) for k, v in rows[0].items()}) if rows else views.Row()


def load_side(b: bundle.Bundle, label: str, seed: int = 0, n_boot: int = N_BOOT) -> Side:
    """Collect one extracted bundle's records again (plan scenarios x repeats, as collect does)."""
    plan = _plan(b)
    paths = [
        Path(layout.record_dir(b.study_dir, s["name"], k)) / contracts.METRICS_FILE
        for s in plan["scenarios"]
        for k in range(plan["repeats"])
    ]
    runs, summary = collect.collect(paths, baseline=plan.get("baseline"), n_boot=n_boot)
    provenance = {rd: collect.read_provenance(rd) or {} for rd in runs["record_dir"]}
    draws = _draws(runs, seed, n_boot)
    return Side(label, b, plan, runs, summary, calibration_rates(b), draws, provenance)


def _plan(b: bundle.Bundle) -> dict:
    """The bundle's plan.json; its scenario names make paths, so they must be plain names."""
    try:
        plan = contracts.read_json(b.study_dir / "plan.json")
        names = [s["name"] for s in plan["scenarios"]]
        repeats = plan["repeats"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise bundle.BundleError(f"{b.path}: plan.json unreadable: {e!r}") from e
    bad = [n for n in names if not bundle.valid_name(n)]
    if bad or not (isinstance(repeats, int) and 1 <= repeats <= MAX_REPEATS):
        what = f"scenario name {bad[0]!r}" if bad else f"repeats {repeats!r}"
        raise bundle.BundleError(f"{b.path}: plan.json: {what} is not valid")
    return plan


def _draws(runs: pd.DataFrame, seed: int, n_boot: int) -> dict[str, np.ndarray]:
    ok = runs[runs["outcome"] == "ok"] if len(runs) else runs
    out = {}
    for i, (scenario, g) in enumerate(ok.groupby("scenario", sort=False)):
        steps = [collect.read_step_speeds(rd) for rd in g["record_dir"]]
        _, out[scenario], _ = collect.bootstrap_median(
            g["tokens_per_s"].tolist(), steps, n_boot=n_boot, seed=seed + i
        )
    return out


def calibration_rates(b: bundle.Bundle) -> dict[str, float]:
    """The rates of the bundle's calibration.json (contracts.Calibration), by name."""
    if b.calibration is None:
        return {}
    try:
        cal = contracts.read_calibration(b.calibration).to_dict()
    except (OSError, ValueError) as e:  # StudyError is a ValueError
        raise bundle.BundleError(f"{b.path}: calibration.json: {e}") from e
    return {k: float(v) for k, v in cal.items() if k != "schema_version" and views.isnum(v)}


def fact_values(side: Side, scenario: str | None, fact: Fact) -> list:
    """The distinct values of ``fact`` over the runs of ``scenario`` (all scenarios: None)."""
    if fact.source == "plan":
        value = side.plan.get(fact.key)
        return [json.dumps(value, sort_keys=True)] if value is not None else []
    runs = side.runs if scenario is None else side.runs[side.runs["scenario"] == scenario]
    if fact.source == "metrics":
        raw = runs[fact.key].tolist() if fact.key in runs else []
    else:
        raw = [side.provenance.get(rd, {}).get(fact.key) for rd in runs["record_dir"]]
    return sorted({plain(v) for v in raw} - {None}, key=str)


def show_values(side: Side, fact: Fact, values: list) -> str:
    if fact.source == "plan" and values:
        return views.model_name(json.loads(values[0]), side.plan.get("model_params"))
    return " | ".join(fact.show(v) for v in values) if values else "—"


def same(a: list, b: list, tolerance: float = 0.0) -> bool:
    """Whether two value lists agree (an unknown side agrees with anything: nothing to flag)."""
    if not a or not b or a == b:
        return True
    if tolerance and len(a) == len(b) == 1 and all(views.isnum(v) for v in a + b):
        x, y = float(a[0]), float(b[0])
        return abs(x - y) <= tolerance * max(abs(x), abs(y))
    return False


# --------------------------------------------------------------------------- comparing
def differences(sides: Sequence[Side], scenario: str | None, kind: str) -> list[dict]:
    """Facts of ``kind`` whose values differ between the reference side and another side."""
    out = []
    for fact in (f for f in FACTS if f.kind == kind):
        values = [fact_values(s, scenario, fact) for s in sides]
        if not all(same(values[0], v, fact.tolerance) for v in values[1:]):
            shown = [show_values(s, fact, v) for s, v in zip(sides, values, strict=True)]
            out.append({"fact": fact.name, "meaning": fact.meaning, "values": shown})
    return out


def calibration_differences(sides: Sequence[Side]) -> tuple[list[dict], list[str]]:
    """Calibration numbers that differ by more than CALIBRATION_TOLERANCE, and notes."""
    have = [s for s in sides if s.calibration]
    notes = []
    if have and len(have) < len(sides):
        missing = ", ".join(s.label for s in sides if not s.calibration)
        notes.append(f"no calibration.json in the bundle of {missing}: bandwidths not compared")
    if len(have) < len(sides) or not have:
        return [], notes
    out = []
    for key in sorted(set.intersection(*(set(s.calibration) for s in sides))):
        values = [[s.calibration[key]] for s in sides]
        if not all(same(values[0], v, CALIBRATION_TOLERANCE) for v in values[1:]):
            shown = [views.fmt(v[0], 2) for v in values]
            out.append(
                {
                    "fact": f"calibration {key}",
                    "meaning": "measured on the cluster",
                    "values": shown,
                }
            )
    return out, notes


def _version(text) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(text))
    return tuple(int(x) for x in m.groups()) if m else None


def deepspeed_notes(sides: Sequence[Side]) -> list[str]:
    fact = next(f for f in FACTS if f.key == "deepspeed_version")
    versions = {v for s in sides for v in fact_values(s, None, fact)}
    parsed = [p for p in map(_version, versions) if p]
    if any(p < DS_BEHAVIOUR_CHANGE for p in parsed) and any(
        p >= DS_BEHAVIOUR_CHANGE for p in parsed
    ):
        return [
            "DeepSpeed versions straddle 0.19.5, which changed the offload blocks' pin_memory "
            "default (False → True; this workflow sets it explicitly) and made ZeRO-3's gradient "
            "copy to CPU asynchronous: offload speeds may differ for that reason alone."
        ]
    return []


def _ci(draws: np.ndarray) -> tuple[float | None, float | None]:
    d = draws[np.isfinite(draws)]
    if d.size < 2 or np.ptp(d) == 0:
        return None, None
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(lo), float(hi)


def flags(side: Side, scenario: str) -> list[str]:
    """The summary's sanity flags of a scenario (collect/sanity: the number may mislead)."""
    return sanity.flag_names(side.row(scenario)["flags"])


def blocking(side: Side, scenario: str) -> list[str]:
    """Those of its flags that block a finding (sanity.blocking: implausible, not a caution)."""
    return sanity.blocking(side.row(scenario)["flags"])


def ratio(side: Side, ref: Side, scenario: str) -> dict:
    """tokens/s of ``side`` as a multiple of the reference side's, with its bootstrap CI, whether
    its verdict (core.verdict.speed: faster, slower, no difference shown or inconclusive),
    the sanity flags of either side and those that block."""
    mine, theirs = side.row(scenario)["tokens_per_s"], ref.row(scenario)["tokens_per_s"]
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = _ci(side.draws[scenario] / ref.draws[scenario])
    return {
        "value": mine / theirs,
        "ci_low": lo,
        "ci_high": hi,
        "verdict": verdict_rule.speed(mine / theirs, lo, hi),
        "flags": sorted(set(flags(ref, scenario) + flags(side, scenario))),
        "blocking": sorted(set(blocking(ref, scenario) + blocking(side, scenario))),
    }


def why_not(side: Side, ref: Side, scenario: str, blocking: list[dict]) -> str | None:
    """Why ``scenario`` on ``side`` gets no number against the reference side (None: it does)."""
    for s in (ref, side):
        if scenario not in s.scenarios():
            return f"not in the study on {s.label}"
        row = s.row(scenario)
        if row["tokens_per_s"] is None:
            return f"no successful run on {s.label} ({row['outcomes'] or 'no record'})"
    if blocking:
        d = blocking[0]
        return f"not the same experiment: {d['fact']} differs ({' vs '.join(d['values'])})"
    return None


def _cell(side: Side, scenario: str) -> dict:
    row = side.row(scenario)
    parts = {k: row[f"breakdown_ms.{k}"] for k in BREAKDOWN_PARTS}
    return {
        "label": side.label,
        "present": scenario in side.scenarios(),
        "status": row["status"] or "not run",
        "outcomes": row["outcomes"] or "no record",
        "tokens_per_s": row["tokens_per_s"],
        "ci": (row["tokens_per_s_ci_low"], row["tokens_per_s_ci_high"]),
        "relative_speed": row["relative_speed"],
        "relative_ci": (row["relative_speed_ci_low"], row["relative_speed_ci_high"]),
        "step_ms": 1000 * row["step_time_s"] if row["step_time_s"] is not None else None,
        "flags": flags(side, scenario),
        "blocking": blocking(side, scenario),
        "breakdown": parts,
    }


def scenario_row(sides: Sequence[Side], scenario: str) -> dict:
    """One scenario: each side's numbers, each other side's ratio to the reference (or why not),
    and the platform facts in which its runs differ."""
    ref = sides[0]
    blocking = differences(sides, scenario, WORKLOAD)
    against = []
    for side in sides[1:]:
        reason = why_not(side, ref, scenario, differences([ref, side], scenario, WORKLOAD))
        against.append(
            {
                "label": side.label,
                "reason": reason,
                **(ratio(side, ref, scenario) if reason is None else {}),
            }
        )
    labels = [s.row(scenario)["label"] for s in sides if s.row(scenario)["label"]]
    return {
        "name": scenario,
        "label": labels[0] if labels else scenario,
        "cells": [_cell(s, scenario) for s in sides],
        "against": against,
        "workload": blocking,
        "platform": differences(sides, scenario, PLATFORM),
        "largest_change": [largest_change(ref, s, scenario) for s in sides[1:]],
    }


def largest_change(ref: Side, side: Side, scenario: str) -> str | None:
    """The step-time part that moved most between the reference and ``side`` (ms): the 'why'."""
    a, b = _cell(ref, scenario)["breakdown"], _cell(side, scenario)["breakdown"]
    moved = [
        (abs(b[k] - a[k]), k) for k in BREAKDOWN_PARTS if a[k] is not None and b[k] is not None
    ]
    if not moved:
        return None
    _, part = max(moved)
    return f"{PART_NAMES[part]} {views.fmt(a[part])} → {views.fmt(b[part])} ms"


def verdict(ref: Side, side: Side, against: list[dict], platform: list[dict]) -> str:
    """One sentence per other cluster: how fast against the reference, over what, and why.

    ``against`` holds the side's entry of every scenario row (ratio or the reason for none).
    Like the report, it states no ratio with a blocking (implausible) flag as a finding, names
    the cautions of those it states, and counts the verdicts of the ratios it states
    (core.verdict.speed).
    """
    found = [a for a in against if a["reason"] is None]
    if not found:
        return f"{side.label}: no scenario can be compared with {ref.label} (reasons below)."
    ratios = [a["value"] for a in found]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    spread = f", {min(ratios):.2f}× to {max(ratios):.2f}×" if len(ratios) > 1 else ""
    text = (
        f"{side.label}: {geo:.2f}× the tokens/s of {ref.label} (geometric mean over "
        f"{views.count_of(len(ratios), 'comparable scenario')}{spread})"
    )
    blocked = sorted({f for a in found for f in a["blocking"]})
    cautions = sorted({f for a in found for f in a["flags"]} - set(blocked))
    if blocked:
        text += f", flagged ({', '.join(blocked)}): not a finding"
    else:
        words = Counter(a["verdict"] for a in found)
        text += " (" + ", ".join(f"{n} {word}" for word, n in words.most_common()) + ")"
    if cautions and not blocked:
        text += f", caution: {', '.join(cautions)}"
    diffs = [f"{d['fact']} ({' vs '.join(d['values'])})" for d in platform]
    return text + (
        f"; what differs: {'; '.join(diffs)}." if diffs else "; no platform fact differs."
    )


def comparison(sides: Sequence[Side]) -> dict:
    """Everything the compare page shows, as plain data."""
    names = list(dict.fromkeys(n for s in sides for n in s.scenarios()))
    rows = [scenario_row(sides, n) for n in names]
    calib, notes = calibration_differences(sides)
    platform = differences(sides, None, PLATFORM) + calib
    differing = {d["fact"] for d in platform + differences(sides, None, WORKLOAD)}
    facts = [
        {
            "fact": f.name,
            "kind": f.kind,
            "meaning": f.meaning,
            "differs": f.name in differing,
            "values": [show_values(s, f, fact_values(s, None, f)) for s in sides],
        }
        for f in FACTS
    ]
    verdicts = [
        verdict(sides[0], side, [r["against"][j] for r in rows], platform)
        for j, side in enumerate(sides[1:])
    ]
    return {
        "sides": sides,
        "rows": rows,
        "facts": facts,
        "calibration": calib,
        "notes": notes + deepspeed_notes(sides),
        "verdicts": verdicts,
        "studies": list(dict.fromkeys(s.plan.get("study") or "?" for s in sides)),
        "counts": [(len(s.runs), int((s.runs["outcome"] == "ok").sum())) for s in sides],
        "parts": PART_NAMES,
    }


def side_labels(bundles: Sequence[bundle.Bundle]) -> list[str]:
    """Each bundle's cluster name; the bundle's name where two bundles share a cluster."""
    clusters = [b.manifest.cluster for b in bundles]
    return [
        c if clusters.count(c) == 1 else f"{c} ({b.name})"
        for c, b in zip(clusters, bundles, strict=True)
    ]


# --------------------------------------------------------------------------- rendering
def html_environment() -> Environment:
    """The report's jinja2 environment (autoescaped, its number filters): the compare and site
    templates sit beside report.html.j2 and render the same way."""
    return pages.environment()


def generated() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def render(view: dict, bundle_links: dict[str, str], index_link: str | None = None) -> str:
    """The compare page of :func:`comparison`'s view; ``bundle_links`` maps each bundle's name
    to the page's (relative) link to it."""
    return (
        html_environment()
        .get_template("compare.html.j2")
        .render(**view, links=bundle_links, index_link=index_link, generated=generated())
    )


def compare_bundles(paths: Sequence[str | Path], out: str | Path, index_link=None) -> dict:
    """Check, extract and compare the bundles; write the page to ``out``; return the view."""
    out = Path(out)
    with bundle.opened(paths) as bundles:
        sides = [
            load_side(b, label, seed=1000 * i)
            for i, (b, label) in enumerate(zip(bundles, side_labels(bundles), strict=True))
        ]
        links = {b.name: pages.href(b.path, out) for b in bundles}
        view = comparison(sides)
        html = render(view, links, index_link)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return view


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.across.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="compare page to write (.html)")
    ap.add_argument("bundles", nargs="+", help="bundles (.tar.gz); the first is the reference")
    a = ap.parse_args(argv)
    if len(a.bundles) < 2:
        ap.error("compare needs at least two bundles")
    try:
        view = compare_bundles(a.bundles, a.out)
    except bundle.BundleError as e:
        print(f"compare: {e}")
        return 1
    print(f"compare: wrote {a.out}")
    for line in view["verdicts"]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
