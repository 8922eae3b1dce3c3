"""The report's "predicted before it ran" section: plan.csv beside what was measured.

:func:`predicted_view` turns the plan's predictions (plan.csv, read through
:func:`offload_study.core.contracts.read_predictions`; plan.json says where it is) and collect's
summary into the plain data of ``templates/_predicted.html.j2``: each scenario's predicted peak
GPU memory, host memory, step time and tokens/s beside the measured ones with the error of each,
DeepSpeed's own estimator beside them, each offload overhead against its physical bound
("PCIe 0.10 s of 1.24 s overhead"), the bound by the same parts (:func:`bound_text`), and the predict-only scenarios, labelled as
predictions. Missing numbers are None.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from offload_study.analysis import collect
from offload_study.analysis.report.views import isnum
from offload_study.core.contracts import (
    Prediction,
    no_offload_pairs,
    offloads_nothing,
    read_predictions,
)

#: The parts of a predicted step an offload adds, by their physical bound.
BOUNDS = (("pcie_s", "PCIe"), ("optimizer_s", "CPU Adam"), ("nvme_s", "NVMe"))


def _pair(predicted, measured) -> dict:
    measured = float(measured) if isnum(measured) else None
    error = predicted / measured - 1 if predicted is not None and measured else None
    return {"predicted": predicted, "measured": measured, "error": error}


def reference_of(name: str, planned: dict[str, dict]) -> str | None:
    """The other scenario without offload that ``name`` is compared with: its first no-offload
    pair in the plan (contracts.no_offload_pairs, collect's rule); None if none is."""
    pairs = no_offload_pairs(planned[name], planned.values())
    return next((s["name"] for s in pairs if s["name"] != name), None)


def overhead_text(
    row: Prediction,
    ref: Prediction | None,
    planned: dict,
    measured: dict,
    labels: dict[str, str] | None = None,
) -> str | None:
    """An offload's cost against its physical bounds: the step time over that of the same setup
    without offload (measured when both ran, else predicted; with no such scenario, over the
    predicted compute of this one), beside the PCIe, CPU Adam and NVMe times the model gives.
    Parts that add up to more than the whole overlap in time, and the text says so."""
    setup = planned.get(row.scenario) or {}
    if row.step_time_s is None or offloads_nothing(
        setup.get("offload_optimizer"), setup.get("offload_param")
    ):
        return None
    seconds = [(name, v) for key, name in BOUNDS if (v := getattr(row, key)) > 0.005]
    parts = [f"{name} {v:.2g} s" for name, v in seconds]
    mine, theirs = measured.get(row.scenario), measured.get(ref.scenario) if ref else None
    ref_label = (labels or {}).get(ref.scenario, ref.scenario) if ref else None
    if ref and isnum(mine) and isnum(theirs):
        total, of = float(mine) - float(theirs), f"measured overhead over {ref_label}"
    elif ref and ref.step_time_s is not None:
        total, of = row.step_time_s - ref.step_time_s, f"predicted overhead over {ref_label}"
    else:
        total, of = row.step_time_s - row.compute_s, "predicted overhead over its compute"
    if len(parts) > 1 and sum(v for _, v in seconds) > total:
        return f"{' and '.join(parts)}, which overlap: together more than the {total:.2g} s {of}"
    return f"{' + '.join(parts) or 'no transfer'} of {total:.2g} s {of}"


def bound_text(p: Prediction) -> str | None:
    """The bound as the largest part of the predicted step, with its seconds, from the same
    parts as :func:`overhead_text` ('compute 21.27 s of 30.23 s'): the model's rule
    (offload_study.prediction.shared.StepTime.bound); compute, dispatch and interconnect overlap in plan.csv's compute_s."""
    if p.bound is None or p.step_time_s is None:
        return p.bound
    key, name = next(((k, n) for k, n in BOUNDS if k == f"{p.bound}_s"), ("compute_s", p.bound))
    part = getattr(p, key)
    return f"{name} {part:.3g} s of {p.step_time_s:.3g} s" if part is not None else name


def _row(p: Prediction, m: dict, label: str | None, overhead: str | None) -> dict:
    return {
        "scenario": p.scenario,
        "label": label or p.scenario,
        "predict_only": p.predict_only,
        "feasible": p.feasible,
        "force": p.force,
        "reason": p.reason,
        "bound": bound_text(p),
        "outcome": m.get("status"),
        "gpu": _pair(p.gpu_gib, m.get("peak_gpu_allocated_gib")),
        "ds_gpu": _pair(p.ds_gpu_gib, m.get("peak_gpu_allocated_gib")),
        "host": _pair(p.host_gib, collect.host_memory_gib(m)),
        "step": _pair(p.step_time_s, m.get("step_time_s")),
        "tokens": _pair(p.tokens_per_s, m.get("tokens_per_s")),
        "gpu_hours": p.gpu_hours,
        "overhead": overhead,
    }


def predicted_view(
    plan: dict, summary: pd.DataFrame, labels: dict[str, str] | None = None
) -> dict | None:
    """The section's data; None when the plan predicted nothing (no plan.csv). ``labels``:
    each scenario's name on the page."""
    prediction = plan.get("prediction") or {}
    path = prediction.get("plan_csv")
    if not path or not Path(path).is_file():
        return None
    rows = read_predictions(path)
    measured = {}
    if "scenario" in summary:
        measured = {r["scenario"]: r for r in summary.to_dict("records")}
    planned = {s["name"]: s for s in [*plan.get("scenarios", []), *plan.get("predict_only", [])]}
    steps = {name: m.get("step_time_s") for name, m in measured.items()}
    views = []
    for p in rows.values():
        ref = rows.get(reference_of(p.scenario, planned) or "") if p.scenario in planned else None
        overhead = overhead_text(p, ref, planned, steps, labels)
        label = (labels or {}).get(p.scenario) or planned.get(p.scenario, {}).get("label")
        views.append(_row(p, measured.get(p.scenario, {}), label, overhead))
    return {
        "rows": [v for v in views if not v["predict_only"]],
        "predict_only": [v for v in views if v["predict_only"]],
        "gpu_hours": prediction.get("predicted_gpu_hours"),
        "calibration": prediction.get("calibration"),
        "calibration_source": prediction.get("calibration_source"),
    }
