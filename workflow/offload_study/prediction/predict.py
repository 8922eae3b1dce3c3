"""Predict before you spend: memory and step time of every run before anything runs.

The front door of the prediction: each run is predicted by its engine's model
(``engines/<name>/model.py``, asked through the engine registry), over its run spec, its
engine's config and the cluster's calibration; what the engines share (the model's shape, the
activations, the allocator's slack, the constants per accelerator kind) is
:mod:`offload_study.prediction.shared`. This module makes the plan.csv row of a run (memory,
the engine's own estimate, step time, GPU-hours), judges it against the run's budgets
(:func:`refusal`, the one feasibility gate) and prices the run's job.

**Feasibility** (:func:`refusal`): a run is refused only when a prediction passes its budget by
more than the model's own measured error (:data:`MARGINS`, docs/benchmarks.md "prediction
accuracy"), so a run that would just fit still runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from offload_study import engines
from offload_study.core import units
from offload_study.core.contracts import (
    Calibration,
    Prediction,
    RunSpec,
    plan_csv_of,
    read_json,
    read_predictions,
)
from offload_study.prediction.shared import (
    ACCELERATOR_FITS,
    AcceleratorFit,
    Memory,
    StepTime,
    allocator_slack_bytes,
    model_shape,
    shape_note,
)

#: How far a prediction may pass its budget before the run is refused: the largest error the
#: model showed against measured runs (benchmarks/prediction_accuracy.py), rounded up.
#: The GPU check is on the reserved prediction: its out-of-sample errors reach -10 % and +12 %
#: (docs/benchmarks.md, "Reserved memory: the slack by cause").
MARGINS = {"gpu": 0.20, "host": 0.20, "nvme": 0.10}


def gpu_reserved_bytes(
    spec: RunSpec, memory: Memory | None, ds_config: dict, fit: AcceleratorFit | None = None
) -> int | None:
    """Peak GPU memory a run holds, per GPU: torch's reserved peak (the allocated peak, the
    blocks of known size beyond it (the engine model's ``known_reserved_bytes``) and the allocator's
    slack, :func:`reserved_features` weighted by the fitted ``reserved_slack``), which is what a
    per-process cap limits, plus the CUDA context. None off a GPU."""
    if memory is None or spec.accelerator != "cuda":
        return None
    fit = fit or ACCELERATOR_FITS["cuda"]
    slack = allocator_slack_bytes(fit.reserved_slack, reserved_features(spec, ds_config))
    context = units.gib_to_bytes(fit.cuda_context_gib)
    known = engines.of(spec).model.known_reserved_bytes(spec, ds_config)
    return int(sum(memory.gpu.values()) + known + slack + context)


def capped(spec: RunSpec) -> bool:
    """The harness caps the process (training.probes.gpu_cap_bytes): the scenario stands for a
    card smaller than the cluster's. The cap then limits torch's reserved memory, not the CUDA
    context."""
    want, card = spec.gpu_mem_bytes, spec.cluster_gpu_mem_bytes
    return bool(want and (card is None or want < card))


def reserved_peak_bytes(spec: RunSpec, wanted_bytes: float) -> float:
    """torch's reserved peak a run shows, bytes, when its allocator would hold ``wanted_bytes``
    (without the CUDA context): never more than a cap. Under
    ``set_per_process_memory_fraction`` an allocation that would pass the cap fails inside the
    allocator, which then frees its cached blocks and tries again before it raises an OOM
    (torch's CUDACachingAllocator: ``alloc_block``, ``release_cached_blocks``), so a capped run
    that fits stops at the cap. What a run needs stays ``wanted_bytes`` (the gate's
    :func:`need_gib`): the cached blocks freed there are re-made later, at a cost in time."""
    return min(wanted_bytes, spec.gpu_mem_bytes) if capped(spec) else wanted_bytes


def gpu_need_gib(spec: RunSpec, row: Prediction) -> float | None:
    """What the GPU budget must hold: the reserved prediction, the CUDA context counted as the
    cap counts it (:func:`need_gib`)."""
    return need_gib(row, capped(spec))


def need_gib(row: Prediction, is_capped: bool) -> float | None:
    """The reserved prediction without the CUDA context when a cap stands for the card (the cap
    does not count it), with it when the run has the whole card; the allocated one for a plan
    older than the reserved columns. The feasibility gate and recommend's ranking both use it."""
    with_context = row.gpu_reserved_with_context_gib
    if not is_capped and with_context is not None:
        return with_context
    if is_capped and row.gpu_reserved_gib is not None:
        return row.gpu_reserved_gib
    if is_capped and with_context is not None:  # a plan.csv with the one reserved column
        return with_context - ACCELERATOR_FITS["cuda"].cuda_context_gib
    return row.gpu_gib


def predict_memory(spec: RunSpec, config: dict, cal: Calibration | None = None) -> Memory | None:
    """The memory prediction of a run by its engine's model (None when the model's shape is
    unknown); ``cal`` gives the host runtime its machine measured."""
    return engines.of(spec).model.predict_memory(spec, config, cal)


def reserved_features(spec: RunSpec, config: dict) -> tuple[float, ...]:
    """The size of each of :data:`~offload_study.prediction.shared.RESERVED_CAUSES` for a run, bytes, by its engine's model (0
    for a cause that is not its engine's or mode's)."""
    return engines.of(spec).model.reserved_features(spec, config)


def step_time(spec: RunSpec, config: dict, cal: Calibration) -> StepTime | None:
    """The predicted optimizer-step time of a run by its engine's model (None when the model's
    shape is unknown or its mode cannot run on the cluster's accelerator)."""
    return engines.of(spec).model.step_time(spec, config, cal)


# --------------------------------------------------------------------------- plan rows, gate
def budget_bytes(spec: RunSpec) -> dict[str, int | None]:
    """What the run may use, in bytes: per GPU (the card it stands for, else the cluster's; none
    on a CPU cluster), host memory per node (cpu_mem_gb), NVMe per node (nvme_capacity_gb)."""
    gpu = spec.gpu_mem_bytes or spec.cluster_gpu_mem_bytes
    return {
        "gpu": gpu if spec.accelerator == "cuda" else None,
        "host": spec.cpu_mem_bytes,
        "nvme": spec.nvme_capacity_bytes if spec.uses_nvme else None,
    }


def budget_gib(spec: RunSpec) -> dict[str, float | None]:
    """:func:`budget_bytes` in GiB, as plan.csv states them (6 digits: the GiB the keys gave,
    less the whole-byte rounding)."""
    return {
        k: _rounded(units.bytes_to_gib(v), 6) if v else None for k, v in budget_bytes(spec).items()
    }


def refusal(spec: RunSpec, row: Prediction) -> str | None:
    """Why the run must not be launched (None: launch it): the one feasibility gate, used by the
    plan (plan.csv's ``feasible``/``reason``) and by the runner before it launches anything.

    Refuses only when a prediction passes its budget by more than the model's error
    (:data:`MARGINS`), and never a run with ``force: true``. The GPU check is on the reserved
    prediction (:func:`gpu_need_gib`): a cap limits torch's reserved memory, not what is
    allocated.
    """
    if spec.force:
        return None
    checks = [
        ("gpu", gpu_need_gib(spec, row), row.gpu_budget_gib, "GiB per GPU"),
        ("host", row.host_gib, row.host_budget_gib, "GiB of host memory per node"),
        ("nvme", row.nvme_gib, row.nvme_budget_gib, "GiB of NVMe per node"),
    ]
    for key, need, have, unit in checks:
        if need is not None and have is not None and need > have * (1 + MARGINS[key]):
            return (
                f"needs {need:.1f} {unit}, has {have:.3g} (predicted, more than the model's "
                f"{MARGINS[key]:.0%} error over the budget; force: true runs it anyway)"
            )
    return None


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def run_seconds(spec: RunSpec, step_s: float) -> float:
    """Wall seconds of one run: start-up plus its steps; in the adaptive measure mode the most
    it may take (every warm-up step, then max_steps or max_measure_s, whichever ends first)."""
    shape = model_shape(spec)
    fit = ACCELERATOR_FITS[spec.accelerator]
    billions = (shape.params if shape else spec.model_params or 0) / 1e9
    offloaded = spec.offload_optimizer != "none" or spec.offload_param != "none"
    startup = fit.startup_s + fit.startup_s_per_billion * billions * (1 if offloaded else 0.25)
    if spec.steps is not None and spec.warmup_steps is not None:
        return startup + (spec.warmup_steps + spec.steps) * step_s
    m = spec.measure
    return startup + m.max_warmup_steps * step_s + min(m.max_steps * step_s, m.max_measure_s)


def job_seconds(spec: RunSpec, step_s: float, cal: Calibration) -> float:
    """Wall seconds of the run's job: the run, and its same-allocation pair run when the study
    makes one (study key same_allocation_baseline; the pair is priced with its own step)."""
    pair = spec.pair_spec()
    if pair is None:
        return run_seconds(spec, step_s)
    pair_step = step_time(pair, engines.of(pair).build_config(pair), cal).total
    return run_seconds(spec, step_s) + run_seconds(pair, pair_step)


def _times(times: StepTime | None) -> dict:
    keys = ("compute_s", "pcie_s", "optimizer_s", "nvme_s", "comm_s")
    return {k: _rounded(getattr(times, k), 4) if times else None for k in keys}


def predict(
    spec: RunSpec,
    config: dict,
    cal: Calibration | None,
    repeats: int = 1,
    with_own_estimate: bool = False,
) -> Prediction:
    """The plan.csv row of a run: memory, the engine's own estimate where it has one
    (``with_own_estimate``: DeepSpeed's estimator, columns ``ds_*``), step time and GPU-hours
    (``cal`` given), and the verdict of :func:`refusal`."""
    model = engines.of(spec).model
    memory = model.predict_memory(spec, config, cal)
    times = model.step_time(spec, config, cal) if cal else None
    ds = model.own_estimate(spec) if with_own_estimate else None
    limit, step = budget_gib(spec), (times.total if times else None)
    reserved = gpu_reserved_bytes(spec, memory, config)
    reserved_gib = units.bytes_to_gib(reserved) if reserved is not None else None
    context_gib = ACCELERATOR_FITS["cuda"].cuda_context_gib
    job_s = job_seconds(spec, step, cal) if step else None
    row = Prediction(
        scenario=spec.scenario,
        predict_only=spec.predict_only,
        force=spec.force,
        world_size=spec.world_size,
        gpu_gib=_rounded(memory.gpu_gib) if memory and spec.accelerator == "cuda" else None,
        gpu_budget_gib=limit["gpu"],
        gpu_reserved_gib=_rounded(reserved_gib - context_gib) if reserved_gib else None,
        gpu_reserved_with_context_gib=_rounded(reserved_gib),
        host_gib=_rounded(memory.host_gib) if memory else None,
        host_budget_gib=_rounded(limit["host"]),
        nvme_gib=_rounded(memory.nvme_gib) if memory and memory.nvme else None,
        nvme_budget_gib=limit["nvme"],
        ds_gpu_gib=_rounded(ds[0]) if ds and spec.accelerator == "cuda" else None,
        ds_host_gib=_rounded(ds[1]) if ds else None,
        step_time_s=_rounded(step, 4),
        tokens_per_s=_rounded(spec.global_batch * spec.seq_len / step, 1) if step else None,
        **_times(times),
        bound=times.bound if times else None,
        gpu_hours=_rounded(repeats * spec.world_size * job_s / 3600, 4) if step else None,
        feasible=True,
        reason=None,
        note="; ".join(n for n in (shape_note(spec), model.note(spec, config, cal)) if n) or None,
    )
    reason = refusal(spec, row)
    return dataclasses.replace(row, feasible=reason is None, reason=reason)


def summarize(rows: list[Prediction], calibration: str | None, cal: Calibration | None) -> dict:
    """What plan.json says of plan.csv: GPU-hours of what will train, what will not and why."""
    trained = [r for r in rows if not r.predict_only and r.feasible]
    hours = sum(r.gpu_hours for r in trained if r.gpu_hours is not None)
    refused = [f"{r.scenario} ({r.reason})" for r in rows if not r.feasible and not r.predict_only]
    only = [r.scenario for r in rows if r.predict_only]
    unknown = [r.scenario for r in trained if r.gpu_hours is None]
    line = (
        f"plan: {len(trained)} scenario(s) to train, predicted {hours:.3g} GPU-hours"
        + (f" (not predicted: {', '.join(unknown)})" if unknown else "")
        + (f"; infeasible, not launched: {'; '.join(refused)}" if refused else "")
        + (f"; predict-only: {', '.join(only)}" if only else "")
        + (f"; calibration {calibration}: {cal.source}" if cal else "; no calibration")
    )
    return {
        "predicted_gpu_hours": round(hours, 4),
        "infeasible": [r.scenario for r in rows if not r.feasible and not r.predict_only],
        "predict_only": only,
        "calibration": calibration,
        "calibration_source": cal.source if cal else None,
        "summary": line,
    }


def launch_prediction(spec: RunSpec, outdir: str | Path) -> Prediction | None:
    """The prediction the runner's gate judges (offload_study.admission.admit.at_launch): the
    plan's row for the run (plan.csv of the study the record ``outdir`` belongs to), else the
    same memory prediction made here (a run started outside the workflow). None when the
    DeepSpeed config cannot be read (launching it then records the config error)."""
    plan_csv = plan_csv_of(Path(outdir))
    row = read_predictions(plan_csv).get(spec.scenario) if plan_csv.is_file() else None
    if row is None:
        try:
            row = predict(spec, read_json(spec.ds_config), None)
        except (OSError, TypeError, ValueError):
            return None
    return row
