"""The report's first block: "seed vs this cluster", one row per row of a published table.

A study carries a published table through its scenarios' ``reference`` (study schema: the seed's
``speed_pct`` of each configuration). The seed's figures are shares of one run's *total*
throughput: its 100 % row (ZeRO-3 on 8 GPUs, no offload). :func:`seed_view` puts this cluster's
figure on that same basis for every row, says how it was obtained, and judges it against the
reference's tolerance band (config/references/*.yaml) with the one band rule
(:func:`offload_study.core.verdict.band`):

- measured: both the row and the 100 % row ran here (the summary's bootstrap CI when the 100 %
  row is the study baseline, else the ratio of the two tokens/s CIs, widest case);
- measured over a predicted baseline: the row ran, the 100 % row needs more GPUs than this
  cluster has and is plan.csv's prediction, with the prediction's error band
  (:func:`prediction_error`: workflow/offload_study/data/error_bands.json, calibrated or uncalibrated);
- predicted: the row did not run here either; labelled, with the error band, and judged "not
  measured" (a prediction reproduces nothing); what the prediction says of the band is worded
  as a prediction (:func:`offload_study.core.verdict.predicted`).
- not measured: no figure at all, or a figure flagged implausible (analysis.sanity).

The per-GPU reading is a different quantity; it gets one sentence of its own (``per_gpu``).
Pure functions over the scenario views, the plan's predictions and the references.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from offload_study.analysis.report import words
from offload_study.analysis.report.views import Row, fmt_sig, isnum
from offload_study.core import verdict
from offload_study.prediction import error_bands

#: Where the prediction's error band comes from: tokens/s measured / predicted = step predicted
#: / measured, so the band is ±p of the predicted tokens/s, p the step-time band of the plan's case
#: (calibrated or uncalibrated) in workflow/offload_study/data/error_bands.json.
PREDICTION_ERROR_SOURCE = "workflow/offload_study/data/error_bands.json"


def prediction_error(plan: dict) -> tuple[float | None, str]:
    """(step-time band, "calibrated"/"uncalibrated") of the plan's predictions."""
    calibrated = error_bands.plan_is_calibrated(plan.get("prediction"))
    return error_bands.bands(calibrated)["step_time"], error_bands.label(calibrated)


#: The band where no reference file gives one: the seed reference's own tolerance
#: (config/references/seed.yaml explains it).
DEFAULT_TOLERANCE = 0.25

MEASURED, PREDICTED, OVER_PREDICTED = (
    "measured",
    "predicted",
    "measured over a predicted baseline",
)


def _tokens(name: str, views: dict[str, Row], predictions: dict, error: float) -> tuple | None:
    """(tokens/s, CI low, CI high, how) of one scenario: measured when it ran and is not
    flagged implausible, else plan.csv's prediction with its error band; None when neither."""
    v = views.get(name)
    if v is not None and isnum(v["tokens_per_s"]) and not v["blocking"]:
        lo, hi = v["tokens_per_s_ci_low"], v["tokens_per_s_ci_high"]
        tps = float(v["tokens_per_s"])
        return tps, (lo if isnum(lo) else tps), (hi if isnum(hi) else tps), MEASURED
    p = predictions.get(name)
    if p is not None and isnum(p.tokens_per_s) and p.tokens_per_s > 0:
        tps = float(p.tokens_per_s)
        # a band of 100 % or more bounds no slowdown: the run may be any slower
        return tps, tps * max(0.0, 1 - error), tps * (1 + error), PREDICTED
    return None


def share(row: tuple, basis: tuple, same_study_ci: tuple | None = None) -> tuple:
    """(share, CI low, CI high, how) of a row's tokens/s over the basis's. The CI is the widest
    the two intervals allow, unless ``same_study_ci`` (the summary's paired bootstrap of a
    measured row over a measured study baseline) is given."""
    tps, lo, hi, how = row
    b_tps, b_lo, b_hi, b_how = basis
    value = tps / b_tps
    # a basis that may be any slower (lo 0) bounds no share from above
    ci = (lo / b_hi, hi / b_lo if b_lo > 0 else math.inf)
    if how == MEASURED and b_how == MEASURED:
        return value, *(same_study_ci or ci), MEASURED
    return value, *ci, (OVER_PREDICTED if how == MEASURED else PREDICTED)


def _band(name: str, reference: dict, references: Sequence) -> tuple[float, float, str]:
    """(low, high, where the band comes from) of a row's relative speed."""
    studies = {str(reference.get("source") or "seed")}
    for r in references:
        if r.scenario == name and r.metric == "relative_speed" and r.study in studies:
            lo, hi = r.bounds
            return lo, hi, f"{r.file}: {r.band()}"
    value = float(reference["speed_pct"]) / 100
    lo, hi = value * (1 - DEFAULT_TOLERANCE), value * (1 + DEFAULT_TOLERANCE)
    return lo, hi, f"no reference file names it: ±{100 * DEFAULT_TOLERANCE:g} %"


def _row(s: dict, views: dict, predictions: dict, basis, references, baseline, error) -> dict:
    name, ref = s["name"], s["reference"]
    lo, hi, band_source = _band(name, ref, references)
    v = views.get(name)
    if v is not None:
        label, setup = v["plot_label"], v["gpu_setup"]
    else:  # not measured: the plan's words
        label = words.reader_label(s.get("label") or "", name)
        setup = words.gpu_setup(_gpus(s), s.get("gpu_mem_gb"), None)
    out = {
        "scenario": name,
        "label": label,
        "seed_pct": ref["speed_pct"],
        "setup": setup,
        "band": (lo, hi),
        "band_source": band_source,
        "share": None,
        "ci": (None, None),
        "how": None,
        "cautions": [],
    }
    mine = _tokens(name, views, predictions, error)
    if v is not None and v["blocking"]:
        out["note"] = "flagged implausible: " + ", ".join(f["title"] for f in v["flag_list"])
    elif v is not None:  # a caution leaves the figure standing, said beside it
        out["cautions"] = [
            f"{f['title']}: {f['detail']}" if f["detail"] else f["title"]
            for f in v["row_flags"] or []
            if not f["blocks"]
        ]
    if mine is None or basis is None:
        out["verdict"] = verdict.NOT_MEASURED
        return out
    paired = None
    if name == basis[1]:  # the basis itself: 100 % by definition
        paired = (1.0, 1.0)
    elif basis[1] == baseline and v is not None and isnum(v["relative_speed_ci_low"]):
        paired = (v["relative_speed_ci_low"], v["relative_speed_ci_high"])
    value, ci_lo, ci_hi, how = share(mine, basis[0], paired)
    if name == basis[1]:
        ci_lo, ci_hi = paired
    out.update(share=value, ci=(ci_lo, ci_hi), how=how, tokens_per_s=mine[0])
    judged = verdict.band(value, ci_lo, ci_hi, lo, hi)
    out["verdict"] = verdict.NOT_MEASURED if how == PREDICTED else judged
    if how == PREDICTED and name != basis[1]:  # what the prediction says, in its own words
        out["predicted_verdict"] = verdict.predicted(value, ci_lo, ci_hi, lo, hi)
    return out


def seed_view(
    plan: dict, views: Sequence[Row], predictions: dict, references: Sequence, baseline: str | None
) -> dict | None:
    """The block's data; None when no scenario of the study carries a published speed."""
    planned = [*plan.get("scenarios", []), *plan.get("predict_only", [])]
    rows = [s for s in planned if isnum((s.get("reference") or {}).get("speed_pct"))]
    if not rows:
        return None
    rows.sort(key=lambda s: -float(s["reference"]["speed_pct"]))
    by_name = {v["scenario"]: v for v in views}
    base = next((s for s in rows if float(s["reference"]["speed_pct"]) == 100), None)
    error, case = prediction_error(plan)
    # a band nobody measured: the prediction stands without an interval (judged alone)
    error = error if error is not None else 0.0
    basis_tokens = _tokens(base["name"], by_name, predictions, error) if base else None
    basis = (basis_tokens, base["name"]) if basis_tokens else None
    out = [_row(s, by_name, predictions, basis, references, baseline, error) for s in rows]
    basis_label = None
    if base:
        basis_label = next((r["label"] for r in out if r["scenario"] == base["name"]), None)
    return {
        "rows": out,
        "basis": base["name"] if base else None,
        "basis_label": basis_label,
        "basis_how": basis_tokens[3] if basis_tokens else None,
        "basis_tokens_per_s": basis_tokens[0] if basis_tokens else None,
        "per_gpu": per_gpu_sentence(out, base, basis_tokens, by_name),
        "band_files": sorted({r["band_source"].split(": ")[0] for r in out}),
        "error": error,
        "error_case": case,
        "error_source": f"{PREDICTION_ERROR_SOURCE} ({case} step time)",
    }


def per_gpu_sentence(
    rows: list[dict], base: dict | None, basis: tuple | None, views: dict[str, Row]
) -> str | None:
    """One sentence: the per-GPU reading of the measured rows on fewer GPUs than the basis,
    a different quantity from the seed's total-throughput share."""
    if not base or not basis:
        return None
    base_gpus = _gpus(base)
    parts = []
    for r in rows:
        v = views.get(r["scenario"])
        gpus = v["world_size"] if v is not None else None
        if r["how"] not in (MEASURED, OVER_PREDICTED) or not gpus or gpus == base_gpus:
            continue
        per = r["share"] * base_gpus / gpus
        of = "predicted " if basis[3] == PREDICTED else ""
        parts.append(
            f"{r['label']} does {fmt_sig(r['tokens_per_s'] / gpus)} tokens/s per GPU, "
            f"{100 * per:.0f}% of the {base_gpus}-GPU run's {of}per-GPU speed"
        )
    if not parts:
        return None
    return (
        "Per GPU, a different quantity from the seed's share of total throughput: "
        + "; ".join(parts)
        + "."
    )


def _gpus(s: dict) -> int:
    return int(s.get("nodes") or 1) * int(s.get("gpus_per_node") or 1)
