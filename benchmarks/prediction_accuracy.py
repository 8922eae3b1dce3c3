"""How well the plan's predictions (offload_study.prediction.predict) match measured runs.

    python benchmarks/prediction_accuracy.py [--bands-out workflow/offload_study/data/error_bands.json] \
        [--gpu-calibration CLUSTER=PATH] [--cpu-study-dir results/local-cpu/default-cpu \
        --cpu-study config/config.yaml --cpu-calibration results/local-cpu/calibration.json]

Every committed GPU record (docs/results: the H200 studies) and, when given, the records of a
CPU study run here: each record's study is planned again with the real planner, its scenario's
run spec checked against the record's own setup (micro-batch, accumulation, offloads, GPUs,
sequence, dtype), and the prediction made from the DeepSpeed config the run used and the
cluster's calibration (config/calibration/<cluster>.json for the H200 machines).

Leaving one MODEL out (the headline): a model is its shape (hidden, layers, heads, key/value
heads, FFN, vocab: shared.model_shape), and every record of the judged model, whichever study
holds it, leaves the fit. The fitted constants (each engine's efficiency and dispatch per layer,
FSDP2's runtime memory, the reserved slack weights and the CUDA context) are refitted without it
(:func:`fit_constants` per fold of offload_study.prediction.accuracy.folds), and the ranking's
predicted speeds use the same fold's constants, never the shipped ones. What is not fitted is
the same in every fold and printed as such (FIXED_BY_DESIGN): the reserved causes and the
step's parts, the calibrations, DeepSpeed's measured runtime, the device optimizer rate.

A record the study no longer plans (a recommend candidate of an older search) is predicted
from the run spec it ran with (its configs/<scenario>.run.json). A host figure measured before
the workflow summed a rank's process tree is not judged where the run kept memory in another
process (:data:`HOST_NOT_COMPARABLE`).

Per engine, per offload path (in words) and overall against the targets: step time within 10 %
on >= 80 % of the ok records; GPU memory allocated within 3 % on >= 95 %; torch's reserved peak
(without the CUDA context) within 8 % on >= 90 %; host memory per node within 10 % on >= 95 %;
of the pairs of configs of one model in one study measured more than 15 % apart, >= 90 % ordered
right. Per study: the same errors, and Kendall tau. The pure computations are
offload_study.prediction.accuracy; this script gathers records and prints.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from offload_study import engines  # noqa: E402
from offload_study.analysis import collect
from offload_study.core import units
from offload_study.core.contracts import (
    read_calibration,
    read_json,
    read_run_spec,
    write_calibration,
)
from offload_study.engines.deepspeed import model as ds_model  # noqa: E402
from offload_study.engines.fsdp2 import model as fsdp2_model  # noqa: E402
from offload_study.planning.plan import Plan
from offload_study.planning.studyfile import STUDY_FILE_KEY, study_config
from offload_study.prediction import (
    accuracy,
    catalog,
    predict,
    shared,  # noqa: E402
)

REPO_ROOT = Path(__file__).resolve().parents[1]  # this checkout

#: the tolerance of each quantity, and (pairs) the share of clear pairs ordered right
TARGETS = {"step": 0.10, "gpu": 0.03, "reserved": 0.08, "host": 0.10, "pairs": 0.90}
#: the share of ok records each quantity's tolerance must hold for
SHARES = {"step": 0.80, "gpu": 0.95, "reserved": 0.90, "host": 0.95}
#: two configs are clearly different when one measured more than this much faster
CLEAR_APART = 0.15
#: the quantities by name, in the order printed
QUANTITIES = {
    "step": "step time",
    "gpu": "GPU allocated",
    "reserved": "GPU reserved",
    "host": "host per node",
}
#: what no fold refits: the same for every model judged, so no record chose it
FIXED_BY_DESIGN = (
    "the reserved causes (shared.RESERVED_CAUSES: named from allocator traces of traced runs, "
    "docs/results/h200-1gpu/allocator-traces-*) and each engine's step parts are fixed by "
    "design, not selected from these records; only their weights are fitted, inside each fold "
    "(a cause no record of the other models has weighs 0 there)",
    "not fitted on records: the calibrations (probes on the machine), DeepSpeed's runtime "
    "memory (measured by benchmarks/raw_deepspeed.py), the device optimizer rate, the grids "
    "the step fit searches",
)
#: committed record folder -> the study that made it
GPU_RECORDS = {
    "docs/results/h200-1gpu/model-a": "config/studies/h200-1gpu.yaml",
    "docs/results/h200-1gpu/model-b-nvme": "config/studies/h200-1gpu-nvme.yaml",
    "docs/results/default-gpu": "config/studies/default-gpu.yaml",
    "docs/results/h200-2gpu/seed-2gpu": "config/studies/seed-2gpu.yaml",
    # two engines: ZeRO-3 and FSDP2, no offload and CPU offload, model A
    "docs/results/h200-1gpu/engines-h200": "config/studies/engines-h200.yaml",
    # the newer offload modes: partial offload, SuperOffload, ZenFlow, pin_memory off
    "docs/results/h200-1gpu/modes-h200": "config/studies/modes-h200.yaml",
    "docs/results/h200-1gpu/recommend-h200-1gpu-16g": "config/studies/recommend-h200-1gpu-16g.yaml",
    "docs/results/h200-1gpu/sweep-h200-1gpu-24g": "config/studies/sweep-h200-1gpu-24g.yaml",
    # the two engines again with model C: FSDP2's own time per layer, judged out of sample
    "docs/results/h200-1gpu/engines-h200-model-c": "config/studies/engines-h200-model-c.yaml",
    # half of Llama-2-7B on one H200, fp16 and bf16 (host memory at the 7B's per-rank size)
    "docs/results/h200-1gpu/host-h200-half7b-fp16": "config/studies/host-h200-half7b-fp16.yaml",
    "docs/results/h200-1gpu/host-h200-half7b-bf16": "config/studies/host-h200-half7b-bf16.yaml",
    # model D (2.3B, grouped-query attention, vocab 50304): measured after the reserved weights
    # were fitted: their held-out check
    "docs/results/h200-1gpu/holdout-h200-model-d": "config/studies/holdout-h200-model-d.yaml",
    # model E (1.59B, vocab 49,152, grouped-query attention), 20 GB cap: measured after the
    # committed constants were fitted, over two leases, each calibrated
    "docs/results/h200-1gpu/lease-h200-model-e": "config/studies/lease-h200-model-e.yaml",
    # FSDP2's three offload paths on model A, the optimizer alone through torchao at gas 1 and 4
    "docs/results/h200-1gpu/engines-h200-cpu-optimizer": "config/studies/engines-h200-cpu-optimizer.yaml",
    # model F (0.68B: 48 narrow layers), every engine x offload path
    "docs/results/h200-1gpu/engines-h200-model-f": "config/studies/engines-h200-model-f.yaml",
    # ZeRO-3 without offload on model A, three runs each beside a plain DeepSpeed loop
    "docs/results/h200-1gpu/fidelity-h200-zero3": "config/studies/fidelity-h200-zero3.yaml",
    # SuperOffload at DeepSpeed's defaults and plain optimizer offload, model A (its process tree)
    "docs/results/h200-1gpu/superoffload-launch-h200": "config/studies/superoffload-launch-h200.yaml",
    # model A's parameter, partial and NVMe offload, FSDP2's CPUOffloadPolicy and SuperOffload,
    # each beside a plain loop
    "docs/results/h200-1gpu/fidelity-h200-modes": "config/studies/fidelity-h200-modes.yaml",
    # model H (0.5B: 64 layers of hidden 768), 12 GiB cap, both engines' offload paths: measured
    # after its plan was committed
    "docs/results/h200-1gpu/sweep-h200-model-h-12g": "config/studies/sweep-h200-model-h-12g.yaml",
    # one H100, under the calibration the device measured before the plans (shipped as
    # config/calibration/h100-1gpu.json): model H's grid, every config, and a user's search of it
    "docs/results/h100-1gpu/sweep-h100-model-h-12g": "config/studies/sweep-h100-model-h-12g.yaml",
    "docs/results/h100-1gpu/recommend-h100-model-h-12g": "config/studies/recommend-h100-model-h-12g.yaml",
    # the same search again from a clean results folder, on the machine that ran the sweep's
    # later repeats
    "docs/results/h100-1gpu/recommend-h100-model-h-12g-again": "config/studies/recommend-h100-model-h-12g.yaml",
    # SuperOffload on model A with its worker's memory counted, then paired with plain loops
    "docs/results/h100-1gpu/superoffload-host-h200-16g": "config/studies/superoffload-host-h200-16g.yaml",
    "docs/results/h100-1gpu/fidelity-h100-superoffload": "config/studies/fidelity-h100-superoffload.yaml",
    # model A's shape at half its depth, NVMe and FSDP2, pairs in both orders
    "docs/results/h100-1gpu/fidelity-h100-order": "config/studies/fidelity-h100-order.yaml",
    # model A's search at 16 GiB across both engines, on the H100
    "docs/results/h100-1gpu/recommend-h200-1gpu-16g": "config/studies/recommend-h200-1gpu-16g.yaml",
    # two models none of the fits had seen, measured after their plans were committed: a Qwen2
    # (the records' only architecture other than Llama) and model G (wide layers, GQA)
    "docs/results/h100-1gpu/holdout-h200-qwen2": "config/studies/holdout-h200-qwen2.yaml",
    "docs/results/h100-1gpu/holdout-h200-model-g": "config/studies/holdout-h200-model-g.yaml",
    # model I (Llama 3's vocabulary, tied embeddings), measured after its plan was committed
    "docs/results/h100-1gpu/holdout-h100-model-i": "config/studies/holdout-h100-model-i.yaml",
    # ZeRO-3 without offload on model A, six runs each beside a plain DeepSpeed loop
    "docs/results/h100-1gpu/fidelity-h100-zero3": "config/studies/fidelity-h100-zero3.yaml",
    # FSDP2's optimizer-only offload (torchao) on model A, four runs each beside a plain loop
    "docs/results/h100-1gpu/fidelity-h100-cpu-optimizer": "config/studies/fidelity-h100-cpu-optimizer.yaml",
}
SAME = (
    "micro_batch",
    "gradient_accumulation_steps",
    "offload_optimizer",
    "offload_param",
    "world_size",
    "seq_len",
    "dtype",
)
#: record folder -> {calibration measured on a lease that measured records of it: those
#: records ("<config>/rep<N>"), or EVERY_RECORD}: the "lease's own" calibrations, compared
#: with the shipped one on the same records
EVERY_RECORD = ("*",)
_MODEL_E = "docs/results/h200-1gpu/lease-h200-model-e"
LEASE_CALIBRATIONS = {
    "docs/results/h200-1gpu/sweep-h200-1gpu-24g": {
        "docs/results/h200-1gpu/sweep-h200-1gpu-24g/calibration.2026-12-01.json": EVERY_RECORD,
    },
    # the machine was given back between two device calls, so the records span two leases (their
    # finished_at says which); each lease's calibration by the workflow's job
    _MODEL_E: {
        f"{_MODEL_E}/calibration.lease-1.json": (
            "opt__mb-8/rep0",
            "opt__mb-4/rep0",
            "opt-r0.7__mb-4/rep0",
        ),
        f"{_MODEL_E}/calibration.lease-2.json": (
            "opt__mb-8/rep1",
            "opt__mb-4/rep1",
            "optparam__mb-8/rep0",
            "optparam__mb-4/rep0",
        ),
    },
}
#: records whose host figure cannot be judged, and why: measured before the workflow summed a
#: rank's process tree, so it holds the rank alone, while the run kept memory in another process
HOST_NOT_COMPARABLE = {
    "recommend-h200-1gpu-16g/rec-super__mb-8__rbs-5e8": (
        "the rank's own RSS, without SuperOffload's optimizer worker (it holds the Adam moments)"
    ),
}
#: (record folder, plain DeepSpeed loops of its configs on a later lease: raw_deepspeed.py
#: --phase-times outputs, that lease's calibration): benchmarks/device/run_step_phases.sh
RAW_LOOPS = [
    (
        _MODEL_E,
        f"{_MODEL_E}/step-phases-lease-{n}/phases-*.json",
        f"{_MODEL_E}/step-phases-lease-{n}/calibration.at-lease-h200-model-e.json",
    )
    for n in (3, 4)
]
GIB = units.gib_to_bytes(1)


def _speed_ci(m: dict) -> tuple[float, float]:
    """The measured tokens/s interval from the step-time CI (the step time itself without one)."""
    tokens = m["global_batch"] * m["seq_len"]
    lo, hi = m.get("step_time_s_ci_lo"), m.get("step_time_s_ci_hi")
    step = m["step_time_s"]
    return tokens / (hi or step), tokens / (lo or step)


def record_rows(
    record_dir: Path,
    study: Path,
    calibration: Path,
    cluster_dir: Path = REPO_ROOT / "config" / "clusters",
) -> list[dict]:
    """One row per record of ``record_dir``: what was measured and what is predicted."""
    plan = record_plan(record_dir, study, cluster_dir)
    cal = read_calibration(calibration)
    label = study_label(record_dir, study, plan)
    rows = []
    for metrics in sorted(record_dir.glob("*/rep*/metrics.json")):
        m = collect.read_record(metrics)
        spec = plan.by_name.get(m["scenario"]) or _run_spec_of(record_dir, m["scenario"])
        if spec is None or any(getattr(spec, k) != m[k] for k in SAME):
            print(f"skipped {metrics}: the study no longer plans this setup", file=sys.stderr)
            continue
        ds_config = read_json(record_dir / "configs" / f"{m['scenario']}.json")
        rows.append(_row(record_dir, m, spec, ds_config, cal, read_json(metrics)))
        rows[-1]["machine"] = _machine(metrics)
        rows[-1]["study"] = label
    return rows


def record_plan(record_dir: Path, study: Path, cluster_dir: Path | None = None) -> Plan:
    """``study``'s plan on the cluster its records in ``record_dir`` ran on (their plan.json):
    a study run on another cluster (``--config cluster=...``, an H200 study on an H100) is
    predicted with that cluster's file and calibration, not the one its study file names."""
    plan_json = record_dir / "plan.json"
    ran_on = read_json(plan_json).get("cluster") if plan_json.exists() else None
    config, source = study_config(
        {STUDY_FILE_KEY: str(study), **({"cluster": ran_on} if ran_on else {})}
    )
    return Plan(config, cluster_dir=cluster_dir, source=source)


def study_label(record_dir: Path, study: Path, plan: Plan) -> str:
    """The records' study by name, and by cluster where they ran on another than the study file
    names: an H200 study's H100 records are judged apart (their pairs, their summary lines)."""
    named = study_config({STUDY_FILE_KEY: str(study)})[0].get("cluster")
    ran_on = plan.cluster["name"]
    return record_dir.name if ran_on == named else f"{record_dir.name} on {ran_on}"


def _run_spec_of(record_dir: Path, scenario: str):
    """The run spec a record ran with (configs/<scenario>.run.json) where the study no longer
    plans its name (a recommend candidate of an older search), else None."""
    path = record_dir / "configs" / f"{scenario}.run.json"
    return read_run_spec(path) if path.exists() else None


def _machine(metrics: Path) -> str | None:
    """The machine a record ran on, as one boot of it (provenance.json ``boot_id``)."""
    provenance = metrics.parent / "provenance.json"
    return read_json(provenance).get("boot_id") if provenance.is_file() else None


def _host_measured(record_dir: Path, m: dict) -> float | None:
    """The record's host GiB per node, None where :data:`HOST_NOT_COMPARABLE` says why not."""
    if f"{record_dir.name}/{m['scenario']}" in HOST_NOT_COMPARABLE:
        return None
    return collect.host_memory_gib(m)


def _row(record_dir, m, spec, ds_config, cal, raw) -> dict:
    memory = predict.predict_memory(spec, ds_config, cal)
    times = predict.step_time(spec, ds_config, cal)
    ds = ds_model.own_estimate(spec)
    cuda = spec.accelerator == "cuda"
    low, high = _speed_ci(m) if m.get("step_time_s") else (None, None)
    return {
        "study": record_dir.name,
        "config": m["scenario"],
        "engine": spec.engine,
        "model": model_key(spec),
        "model_words": model_words(spec),
        "params": spec.model_params or getattr(shared.model_shape(spec), "params", None),
        "mode": f"{engines.label(spec.engine)}, {offload_words(spec, ds_config)}",
        "tokens": m["global_batch"] * m["seq_len"],
        "record": f"{record_dir.name}/{m['scenario']}/rep{m['repeat']}",
        "setup": _setup(spec, ds_config),
        "kind": "GPU" if cuda else "CPU",
        "outcome": m["outcome"],
        "offload": f"{spec.offload_optimizer}/{spec.offload_param}",
        "gpu": (memory.gpu_gib if cuda else None, m["peak_gpu_allocated_gib"]),
        "ds_gpu": (ds[0] if cuda and ds else None, m["peak_gpu_allocated_gib"]),  # fsdp2: none
        "host": (memory.host_gib, _host_measured(record_dir, m)),
        "step": (times.total if times else None, m["step_time_s"]),
        "speed": (
            m["global_batch"] * m["seq_len"] / times.total if times else None,
            m.get("tokens_per_s"),
            low,
            high,
        ),
        "bound": times.bound if times else None,
        # torch's reserved peak and nvml's used memory, bytes (None on a CPU or an old record)
        "reserved_measured": raw.get("peak_gpu_reserved_gib")
        and units.gib_to_bytes(raw["peak_gpu_reserved_gib"]),
        "nvml_measured": raw.get("nvml_used_gib") and units.gib_to_bytes(raw["nvml_used_gib"]),
        "features": predict.reserved_features(spec, ds_config) if cuda else None,
        "parts": _parts(spec, times) if cuda and times else None,
        # predicted host bytes per node less the runtime of its ranks (FSDP2: refitted per study)
        "host_base": sum(memory.host.values())
        - spec.gpus_per_node * units.gib_to_bytes(_runtime_gib(spec)),
        "ranks": spec.gpus_per_node,
        "allocated_bytes": sum(memory.gpu.values()) if cuda else None,
        "spec": spec,
        # reserved beyond the allocated peak by blocks of known size (not fitted)
        "known_reserved_bytes": ds_model.known_reserved_bytes(spec, ds_config),
        # DeepSpeed's step timer (ms per step in metrics.json) and its prediction, seconds
        "step_timer": (
            ds_model.optimizer_step_seconds(spec, ds_config, cal),
            (raw.get("breakdown_ms") or {}).get("step") and raw["breakdown_ms"]["step"] / 1e3,
        ),
        # the verdict without force (the 40 GiB OOM run is forced on purpose)
        "feasible": predict.predict(replace(spec, force=False), ds_config, cal).feasible,
    }


def model_key(spec) -> tuple:
    """A model by its shape, whatever study holds it: (hidden, layers, heads, key/value heads,
    FFN, vocab); its parameter count where the shape is unknown."""
    shape = shared.model_shape(spec)
    if shape is None:
        return ("parameters", spec.model_params)
    return (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn, shape.vocab)


def model_words(spec) -> str:
    """'1.35B: hidden 2048, 24 layers, 16 heads (16 key/value), FFN 5504, vocab 32,000'."""
    shape = shared.model_shape(spec)
    params = spec.model_params or (shape.params if shape else 0)  # a spec may give only the shape
    key, size = model_key(spec), f"{params / 1e9:.2f}B"
    if key[0] == "parameters":
        return f"{size} (shape unknown)"
    hidden, layers, heads, kv_heads, ffn, vocab = key
    return (
        f"{size}: hidden {hidden}, {layers} layers, {heads} heads ({kv_heads} key/value), "
        f"FFN {ffn}, vocab {vocab:,}"
    )


def offload_words(spec, config: dict) -> str:
    """The run's offload path in words (its engine's own label) and DeepSpeed's mode on it."""
    path = engines.of(spec).path(spec.offload_optimizer, spec.offload_param)
    words = path.label if path else f"offload {spec.offload_optimizer}/{spec.offload_param}"
    k = ds_model.knobs(config)  # an FSDP2 config holds none of ZeRO's keys: no mode
    if k.super_offload:
        return f"SuperOffload, {words}"
    if k.zenflow is not None:
        return f"ZenFlow, {words}"
    return f"partial {words} (a ratio below 1)" if k.ratio < 1 else words


def _setup(spec, ds_config: dict) -> str:
    """What makes two records the same run for a predictor: the engine, the model, the batch,
    the offloads and the whole DeepSpeed config (a study's name and its cap do not)."""
    same = [spec.engine, spec.model_params, *(getattr(spec, k) for k in SAME)]
    digest = hashlib.sha256(json.dumps(ds_config, sort_keys=True).encode()).hexdigest()[:8]
    return "/".join(map(str, same)) + f"/ds-{digest}"


def machine_lines(rows: list[dict], least: int = 3) -> list[str]:
    """How much of the step-time error is the machine's: measured / predicted (model left out)
    of the ok GPU records, by the machine they ran on (machines with ``least`` records or more);
    and, for scale only, how many would be within the target if each machine's median were
    known (in sample: no prediction can know it)."""
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if r["kind"] == "GPU" and r.get("step_error") is not None and r.get("machine"):
            ratios.setdefault(r["machine"], []).append(1 / (1 + r["step_error"]))
    kept = {m: v for m, v in ratios.items() if len(v) >= least}
    if not kept:
        return []
    medians = sorted(statistics.median(v) for v in kept.values())
    records = [x for v in kept.values() for x in v]
    plain = sum(abs(1 / x - 1) <= TARGETS["step"] for x in records)
    scaled = sum(
        abs(statistics.median(v) / x - 1) <= TARGETS["step"] for v in kept.values() for x in v
    )
    return [
        f"GPU step time by machine (provenance boot_id; {len(kept)} machines with >= {least} ok "
        f"records, {len(records)} records): measured / predicted (model left out), median per "
        f"machine {medians[0]:.2f} to {medians[-1]:.2f}; within {TARGETS['step']:.0%}: "
        f"{plain}/{len(records)} as predicted, {scaled}/{len(records)} if each machine's median "
        "were known (in sample, for scale only)"
    ]


def noise_floor_lines(rows: list[dict]) -> list[str]:
    """The step-time target against the records' own spread: the same setup measured again (a
    repeat, another study on another lease) differs, and no one prediction per setup can be
    within the target of records that spread wider than it."""
    ok = [r for r in rows if r["kind"] == "GPU" and r["outcome"] == "ok" and r["step"][1]]
    by_setup: dict[str, list[float]] = {}
    names: dict[str, set[str]] = {}
    for r in ok:
        by_setup.setdefault(r["setup"], []).append(r["step"][1])
        names.setdefault(r["setup"], set()).add(f"{r['study']}/{r['config']}")
    floor = accuracy.noise_floor(by_setup, TARGETS["step"])
    again = sum(len(v) for v in by_setup.values() if len(v) > 1)
    setup, spread = floor.widest
    # the out-of-sample prediction of each record (its error, model left out, applied to what
    # it measured)
    predicted = [
        (r["step"][1] * (1 + r["step_error"]), by_setup[r["setup"]])
        for r in ok
        if r.get("step_error") is not None
    ]
    in_spread = sum(accuracy.within_spread(p, m, TARGETS["step"]) for p, m in predicted)
    return [
        f"GPU step time noise floor: {again} of {floor.records} ok records share their setup "
        f"with another (repeats, other studies' leases); the best one value per setup is within "
        f"{TARGETS['step']:.0%} of {floor.hits}/{floor.records}; widest spread {spread:+.0%} "
        f"({', '.join(sorted(names[setup]))})",
        f"GPU step time against the noise: {in_spread}/{len(predicted)} predictions (model left "
        f"out) within "
        f"{TARGETS['step']:.0%} of the range their setup measured",
    ]


def _parts(spec, times) -> accuracy.StepParts:
    fit = engines.of(spec).model.FITS[spec.accelerator]
    return accuracy.StepParts(
        times.flops_s,
        times.dispatch_s,
        times.comm_s,
        times.pcie_s + times.optimizer_s + times.nvme_s,
        fit.efficiency,
        fit.dispatch_s_per_layer,
        times.device_wait_s,
        times.forward,
    )


def _step_fit(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Engine -> (efficiency, dispatch s per layer) fitted on each engine's own records in
    ``rows``; an engine ``rows`` hold no record of takes the fit over every engine's records
    (never its shipped constants, which were fitted on every record)."""

    def samples(engine=None):
        return [
            (r["parts"], r["step"][1]) for r in rows if r["parts"] and engine in (None, r["engine"])
        ]

    pooled = accuracy.fit_compute(samples())
    return {
        name: accuracy.fit_compute(samples(name)) if samples(name) else pooled
        for name in engines.names()
    }


def _step_error(row: dict, fits: dict[str, tuple[float, float]]) -> float | None:
    if not row["parts"]:
        return None
    return accuracy.rel_error(row["parts"].total(*fits[row["engine"]]), row["step"][1])


def _runtime_gib(spec) -> float:
    """The runtime memory per rank the prediction used (each engine has its own)."""
    return engines.of(spec).model.FITS[spec.accelerator].runtime_gib


def _runtime_fit(rows: list[dict]) -> dict[str, float | None]:
    """Engine -> runtime bytes per rank fitted on its records in ``rows``; None for DeepSpeed,
    whose runtime is measured (its model's FITS: runtime_gib, runtime_at_init_gib), not fitted.
    FSDP2 does not load DeepSpeed and its ops: its own is fitted, DeepSpeed's measured one
    where ``rows`` hold no FSDP2 record."""
    fsdp2 = [
        (units.gib_to_bytes(r["host"][1]), r["host_base"], r["ranks"])
        for r in rows
        if r["engine"] == "fsdp2" and r["host"][1] is not None
    ]
    measured = units.gib_to_bytes(ds_model.FITS["cuda"].runtime_gib)
    return {"deepspeed": None, "fsdp2": accuracy.fit_runtime(fsdp2) if fsdp2 else measured}


def _host_error(row: dict, runtimes: dict[str, float | None]) -> float | None:
    """The host error with a fitted runtime, or as predicted where the runtime is measured."""
    runtime = runtimes[row["engine"]]
    if runtime is None or row["host"][1] is None:
        return accuracy.rel_error(*row["host"])
    measured = units.gib_to_bytes(row["host"][1])
    return accuracy.rel_error(row["host_base"] + runtime * row["ranks"], measured)


def _reserved_fit(rows: list[dict]) -> tuple[tuple[float, ...], float]:
    """(reserved_slack, CUDA context bytes) fitted on ``rows``."""
    usable = [r for r in rows if r["reserved_measured"] and r["features"]]

    def unexplained(r: dict) -> float:  # what the fitted causes must explain, bytes
        return r["reserved_measured"] - r["allocated_bytes"] - r["known_reserved_bytes"]

    slack = accuracy.fit_reserved(per_setup(usable, unexplained))
    context = accuracy.fit_context(
        [(r["nvml_measured"], r["reserved_measured"]) for r in usable if r["nvml_measured"]]
    )
    return slack, context


def per_setup(rows: list[dict], value) -> list[tuple[tuple[float, ...], float]]:
    """(features, median of ``value`` over its records) once per setup: the reserved peak of a
    setup is the allocator's rules replayed on one allocation sequence, the same in every run of
    it (docs/benchmarks.md, "Reserved is deterministic for most setups"), so its repeats are one
    observation; counted once each, a config run four times does not pull the weights of every
    other model's fold four times as hard."""
    by_setup: dict[str, list[dict]] = {}
    for r in rows:
        by_setup.setdefault(r["setup"], []).append(r)
    return [
        (group[0]["features"], statistics.median(value(r) for r in group))
        for group in by_setup.values()
    ]


def _reserved_bytes(row: dict, slack: tuple[float, ...]) -> float:
    """torch's reserved peak predicted with ``slack`` (without the CUDA context)."""
    slack_bytes = shared.allocator_slack_bytes(slack, row["features"])
    wanted = row["allocated_bytes"] + row["known_reserved_bytes"] + slack_bytes
    return predict.reserved_peak_bytes(row["spec"], wanted)


@dataclass(frozen=True)
class Constants:
    """What the records fit: engine -> (efficiency, dispatch s per layer); engine -> runtime
    bytes per rank (None: measured); the reserved slack weights; the CUDA context, bytes."""

    steps: dict[str, tuple[float, float]]
    runtimes: dict[str, float | None]
    slack: tuple[float, ...]
    context: float


def fit_constants(rows: list[dict]) -> Constants:
    """Every fitted constant, fitted on ``rows`` (ok GPU records) only."""
    return Constants(_step_fit(rows), _runtime_fit(rows), *_reserved_fit(rows))


def add_out_of_sample_errors(rows: list[dict]) -> dict[tuple, Constants]:
    """Each ok GPU row's step, host, reserved (torch's, and nvml's with the CUDA context)
    errors and its predicted speed with the constants fitted leaving its model out: every
    record of that model, whatever study holds it. Returns model -> its fold's constants ({}
    with fewer than two models)."""
    gpu = [r for r in rows if r["kind"] == "GPU" and r["outcome"] == "ok"]
    if len({r["model"] for r in gpu}) < 2:
        return {}
    folds = accuracy.folds(gpu, fit_constants, "model")
    for r in gpu:
        fit = folds[r["model"]]
        r["step_error"] = _step_error(r, fit.steps)
        r["host_error"] = _host_error(r, fit.runtimes)
        if r["reserved_measured"] and r["features"]:
            reserved = _reserved_bytes(r, fit.slack)
            r["reserved_error"] = accuracy.rel_error(reserved, r["reserved_measured"])
            # nvml reads at the end, after memory was freed: below the peak it says nothing
            if r["nvml_measured"] and r["nvml_measured"] >= r["reserved_measured"]:
                r["nvml_error"] = accuracy.rel_error(reserved + fit.context, r["nvml_measured"])
        if r["parts"]:
            r["speed_out"] = r["tokens"] / r["parts"].total(*fit.steps[r["engine"]])
    return folds


def _cell(pair) -> str:
    predicted, measured = pair[:2]
    err = accuracy.rel_error(predicted, measured)
    if predicted is None:
        return "—"
    if err is None:
        return f"{predicted:.2f} / —"
    return f"{predicted:.2f} / {measured:.2f} ({err:+.0%})"


def print_table(rows: list[dict]) -> None:
    print(
        "| record | outcome | offload opt/param | GPU GiB pred / meas | reserved err "
        "(model left out) | DeepSpeed estimator GiB | host GiB | step s | bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        outcome = r["outcome"] if r["feasible"] else f"{r['outcome']} (predicted infeasible)"
        res = r.get("reserved_error")
        print(
            f"| {r['record']} | {outcome} | {r['offload']} | {_cell(r['gpu'])} | "
            f"{'—' if res is None else f'{res:+.0%}'} | {_cell(r['ds_gpu'])} | "
            f"{_cell(r['host'])} | {_cell(r['step'])} | {r['bound']} |"
        )


def errors(rows: list[dict]) -> dict[str, list[float]]:
    """The relative errors of ok records by quantity (step, gpu, reserved, host)."""
    ok = [r for r in rows if r["outcome"] == "ok"]
    out = {
        # out of sample where computed (GPU), else with the constants as committed
        "step": [r.get("step_error", accuracy.rel_error(*r["step"])) for r in ok],
        "gpu": [accuracy.rel_error(*r["gpu"]) for r in ok],
        "reserved": [r.get("reserved_error") for r in ok],
        # a run that failed or was cancelled measured its host memory before its peak
        "host": [r.get("host_error", accuracy.rel_error(*r["host"])) for r in ok],
    }
    return {k: [e for e in v if e is not None] for k, v in out.items()}


def speeds(rows: list[dict]) -> list[accuracy.Speed]:
    """One speed per config of ok records: the mean of its repeats, the union of their CIs."""
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        if r["outcome"] == "ok" and r["speed"][0] and r["speed"][1]:
            by_config.setdefault(r["config"], []).append(r)
    out = []
    for name, rs in sorted(by_config.items()):
        measured = [r["speed"][1] for r in rs]
        predicted = rs[0].get("speed_out", rs[0]["speed"][0])  # the model left out, if fitted
        out.append(
            accuracy.Speed(
                name,
                predicted,
                sum(measured) / len(measured),
                min(r["speed"][2] for r in rs),
                max(r["speed"][3] for r in rs),
            )
        )
    return out


def summary_lines(rows: list[dict], label: str) -> list[str]:
    """Per target: how many ok records meet it and the worst error; pairs and Kendall tau."""
    lines = []
    for key, errs in errors(rows).items():
        if not errs:
            continue
        hits = sum(abs(e) <= TARGETS[key] for e in errs)
        verdict = "met" if hits == len(errs) else "MISSED"
        lines.append(
            f"{label} {QUANTITIES[key]}: {hits}/{len(errs)} within {TARGETS[key]:.0%}, "
            f"worst {max(errs, key=abs):+.1%} -> {verdict}"
        )
    configs = speeds(rows)
    right, total, wrong = accuracy.clear_pairs(configs, CLEAR_APART)
    tau = accuracy.kendall_tau([s.predicted for s in configs], [s.measured for s in configs])
    if total:
        share = right / total
        lines.append(
            f"{label} ranking: {right}/{total} clearly different pairs (> {CLEAR_APART:.0%} "
            f"apart) ordered right "
            f"({share:.0%}, target {TARGETS['pairs']:.0%} -> "
            f"{'met' if share >= TARGETS['pairs'] else 'MISSED'})"
            + (f"; wrong: {', '.join(f'{a} > {b}' for a, b in wrong)}" if wrong else "")
        )
    if tau is not None and len(configs) > 2:
        lines.append(f"{label} Kendall tau over {len(configs)} configs: {tau:+.2f}")
    return lines


def pairs_overall(rows: list[dict]) -> tuple[int, int]:
    """Clearly different pairs ordered right, over the pairs of one model inside each study."""
    pairs = [pair for pair, _ in judged_pairs(rows)]
    return sum(p.right for p in pairs), len(pairs)


def judged_pairs(rows: list[dict]) -> list[tuple[accuracy.Pair, tuple[dict, dict]]]:
    """The clearly different pairs of configs of one model measured in one study (one lease's
    conditions), each with a record of either config (fast, slow)."""
    out = []
    for study, model in sorted({(r["study"], r["model"]) for r in rows}):
        same = [r for r in rows if (r["study"], r["model"]) == (study, model)]
        by_config = {r["config"]: r for r in same}
        for pair in accuracy.judged_pairs(speeds(same), CLEAR_APART):
            out.append((pair, (by_config[pair.fast.name], by_config[pair.slow.name])))
    return out


def models_lines(rows: list[dict]) -> list[str]:
    """The models the GPU records hold, by shape, with their ok records and studies."""
    gpu = [r for r in rows if r["kind"] == "GPU"]
    lines = [f"Models found (by shape): {len({r['model'] for r in gpu})}"]
    params = {r["model"]: r["params"] or 0 for r in gpu}
    for model in sorted(params, key=lambda m: (params[m], str(m))):
        of = [r for r in gpu if r["model"] == model]
        ok = sum(r["outcome"] == "ok" for r in of)
        studies = ", ".join(sorted({r["study"] for r in of}))
        lines.append(f"  {of[0]['model_words']}: {len(of)} records ({ok} ok), in {studies}")
    return lines


def _count(errs: list[float], key: str) -> str:
    if not errs:
        return "—"
    hits = sum(abs(e) <= TARGETS[key] for e in errs)
    return f"{hits}/{len(errs)} (worst {max(errs, key=abs):+.1%})"


def _pairs_cell(pairs: list[accuracy.Pair]) -> str:
    return f"{sum(p.right for p in pairs)}/{len(pairs)}" if pairs else "—"


def headline_lines(rows: list[dict], folds: dict[tuple, Constants]) -> list[str]:
    """Leaving one model out: what fits and what does not, the models, a table per engine and
    offload path, and each target overall (met or MISSED)."""
    ok = [r for r in rows if r["kind"] == "GPU" and r["outcome"] == "ok"]
    pairs = judged_pairs(ok)
    lines = [
        "Leaving one model out: every record of the judged model leaves the fit; each engine's "
        "efficiency and dispatch per layer, FSDP2's runtime memory, the reserved slack weights "
        "and the CUDA context are refitted on the other models' records, and the ranking "
        "predicts with the same constants (never the shipped ones).",
        *(f"The feature choice: {line}." for line in FIXED_BY_DESIGN),
        *models_lines(rows),
        *fold_lines(folds, ok),
        "",
        f"| engine, offload | ok records | step ≤ {TARGETS['step']:.0%} | allocated ≤ "
        f"{TARGETS['gpu']:.0%} | reserved ≤ {TARGETS['reserved']:.0%} | host ≤ "
        f"{TARGETS['host']:.0%} | clear pairs right (involving it) |",
        "|---|---|---|---|---|---|---|",
    ]
    groups = []  # each engine, then its offload paths
    for engine in sorted({r["engine"] for r in ok}):
        groups.append((engines.label(engine), lambda r, e=engine: r["engine"] == e))
        modes = sorted({r["mode"] for r in ok if r["engine"] == engine})
        groups += [(m, lambda r, m=m: r["mode"] == m) for m in modes]
    for label, member in groups:
        errs = errors([r for r in ok if member(r)])
        involving = [p for p, (a, b) in pairs if member(a) or member(b)]
        cells = " | ".join(_count(errs[k], k) for k in QUANTITIES)
        lines.append(f"| {label} | {sum(map(member, ok))} | {cells} | {_pairs_cell(involving)} |")
    return lines + ["", *target_lines(ok, pairs)]


def target_lines(ok: list[dict], pairs: list[tuple[accuracy.Pair, tuple]]) -> list[str]:
    """Each quantity overall against its target share (met or MISSED)."""
    lines = []
    for key, errs in errors(ok).items():
        hits = sum(abs(e) <= TARGETS[key] for e in errs)
        share = hits / len(errs) if errs else 0.0
        lines.append(
            f"GPU model left out, {QUANTITIES[key]}: {hits}/{len(errs)} within "
            f"{TARGETS[key]:.0%} ({share:.1%}, target >= {SHARES[key]:.0%}) -> "
            f"{'met' if share >= SHARES[key] else 'MISSED'}"
        )
    right = sum(p.right for p, _ in pairs)
    share = right / len(pairs) if pairs else 0.0
    wrong = [f"{a['study']}/{p.fast.name} > {p.slow.name}" for p, (a, _) in pairs if not p.right]
    lines.append(
        f"GPU model left out, clear pairs: {right}/{len(pairs)} more than {CLEAR_APART:.0%} "
        f"apart ordered right ({share:.1%}, target >= {TARGETS['pairs']:.0%}) -> "
        f"{'met' if share >= TARGETS['pairs'] else 'MISSED'}"
        + (f"; wrong (measured faster first): {', '.join(wrong)}" if wrong else "")
    )
    nvml = [r["nvml_error"] for r in ok if r.get("nvml_error") is not None]
    lines.append(
        f"GPU model left out, GPU used as nvml reads it (torch's reserved and the CUDA context; "
        f"the records nvml read at or above torch's peak), within {TARGETS['reserved']:.0%}: "
        f"{_count(nvml, 'reserved')}"
    )
    return lines


def fold_lines(folds: dict[tuple, Constants], ok: list[dict]) -> list[str]:
    """The constants each model was judged with."""
    words = {r["model"]: r["model_words"].split(":")[0] for r in ok}
    params = {r["model"]: r["params"] or 0 for r in ok}
    lines = []
    for model, fit in sorted(folds.items(), key=lambda item: (params[item[0]], str(item[0]))):
        steps = ", ".join(
            f"{engines.label(e)} {eff:.2f} / {disp:.4f} s" for e, (eff, disp) in fit.steps.items()
        )
        runtime = fit.runtimes.get("fsdp2")
        lines.append(
            f"  fitted without {words[model]}: efficiency / dispatch per layer {steps}; "
            f"FSDP2 runtime {units.bytes_to_gib(runtime or 0):.2f} GiB; reserved slack "
            f"({', '.join(f'{c:.3g}' for c in fit.slack)}); CUDA context "
            f"{units.bytes_to_gib(fit.context):.3f} GiB"
        )
    return lines


def bands(rows: list[dict], kind: str = "GPU") -> dict:
    """The largest absolute error per quantity over the ok records of ``kind``, every engine's:
    a plan gives one band to the candidates of every engine, and a search compares them."""
    errs = errors([r for r in rows if r["kind"] == kind])
    names = {
        "step": "step_time",
        "gpu": "gpu_allocated",
        "reserved": "gpu_reserved",
        "host": "host",
    }
    return {names[k]: round(accuracy.band(v), 4) for k, v in errs.items() if v}


def calibration_lines(path: Path, label: str = "CPU") -> list[str]:
    """What a measured calibration says of itself: its rates and the spread of their samples
    (offload_study.prediction.calibrate records the range of each measurement)."""
    cal = read_calibration(path)
    spread = cal.provenance.get("spread", {})
    lines = [f"{label} calibration {path}: {cal.source}, {cal.provenance.get('measured_at')}"]
    for key, summary in spread.items():
        lines.append(
            f"  {key}: median {summary['median']:.4g}, range {summary['low']:.4g}-"
            f"{summary['high']:.4g} ({summary['spread_pct']:.0f} %, {summary['samples']} samples)"
        )
    for engine, by_ranks in (cal.layer_host_s or {}).items():
        lines += [
            f"  host s per layer, {engines.label(engine)}, {ranks} rank(s): "
            + ", ".join(f"{k} {costs[k]:.4f}" for k in ("forward", "backward", "rest"))
            for ranks, costs in by_ranks.items()
        ]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-study-dir", type=Path, help="results/<cluster>/<study> of a CPU run")
    ap.add_argument("--cpu-study", type=Path, default=REPO_ROOT / "config" / "config.yaml")
    ap.add_argument(
        "--cpu-calibration", type=Path, help="default: <cpu-study-dir>/../calibration.json"
    )
    ap.add_argument(
        "--gpu-calibration",
        action="append",
        default=[],
        metavar="CLUSTER=PATH",
        help="a GPU cluster's calibration instead of config/calibration/<cluster>.json (e.g. "
        "one measured by `python -m offload_study.prediction.calibrate`); repeatable",
    )
    ap.add_argument("--cpu-cluster-dir", type=Path, default=REPO_ROOT / "config" / "clusters")
    ap.add_argument(
        "--bands-out",
        type=Path,
        metavar="FILE",
        help="write the measured error bands as JSON (config/calibration/"
        "error_bands.json is the one the plan reads)",
    )
    a = ap.parse_args(argv)
    chosen = dict(item.split("=", 1) for item in a.gpu_calibration)
    rows = []
    for folder, study in GPU_RECORDS.items():
        shipped = _shipped(folder)  # config/calibration/<cluster>.json
        rows += record_rows(
            REPO_ROOT / folder, REPO_ROOT / study, Path(chosen.get(shipped.stem, shipped))
        )
    for cluster, path in chosen.items():
        print("\n".join(calibration_lines(Path(path), label=cluster)))
    cal = None
    if a.cpu_study_dir:
        cal = a.cpu_calibration or a.cpu_study_dir.parent / "calibration.json"
        rows += record_rows(a.cpu_study_dir, a.cpu_study, cal, a.cpu_cluster_dir)
    folds = add_out_of_sample_errors(rows)
    print_table(rows)
    print()
    if folds:
        print("\n".join(headline_lines(rows, folds)))
        print()
    print_summaries(rows)
    with tempfile.TemporaryDirectory() as tmp:
        print_lease_calibrations(Path(tmp))
        print_raw_loops(Path(tmp))
    if cal:
        print("\n".join(calibration_lines(cal)))
    if a.bands_out:
        write_bands(a.bands_out, rows, uncalibrated_rows(), argv)
    return 0


def uncalibrated_rows() -> list[dict]:
    """The GPU records predicted as a never-calibrated cluster's plan predicts them: from the GPU
    catalog's values (offload_study.prediction.catalog, CPU Adam at the catalog's default), the
    fitted constants left out of sample as for the calibrated rows."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for folder, study in GPU_RECORDS.items():
            cluster = record_plan(REPO_ROOT / folder, REPO_ROOT / study).cluster
            path = Path(tmp) / f"{cluster['name']}.json"
            write_calibration(path, catalog.catalog_calibration(cluster, "catalog"))
            rows += record_rows(REPO_ROOT / folder, REPO_ROOT / study, path)
    add_out_of_sample_errors(rows)
    return rows


def print_summaries(rows: list[dict]) -> None:
    print(
        "GPU step time, host and reserved memory and the rankings: the model left out (its "
        "fitted constants fitted on the other models' records); CPU and the lease "
        "calibration's lines: constants as committed"
    )
    for kind in ("GPU", "CPU"):
        of_kind = [r for r in rows if r["kind"] == kind]
        for study in sorted({r["study"] for r in of_kind}):
            print("\n".join(summary_lines([r for r in of_kind if r["study"] == study], study)))
        if kind == "CPU" and of_kind:  # the GPU's overall lines lead (headline_lines)
            for line in summary_lines(of_kind, f"{kind} overall")[:4]:  # pairs: within studies
                print(line)
            right, total = pairs_overall(of_kind)
            if total:
                print(
                    f"{kind} overall ranking: {right}/{total} clearly different pairs (> "
                    f"{CLEAR_APART:.0%} apart, within each study) ordered right "
                    f"({right / total:.0%})"
                )
        if kind == "GPU" and of_kind:
            for record, why in HOST_NOT_COMPARABLE.items():
                print(f"host not judged on {record}: {why}")
            print("\n".join(noise_floor_lines(of_kind) + machine_lines(of_kind)))
            print(step_timer_line(of_kind))
    if any(r["kind"] == "GPU" for r in rows):
        print("\n".join(all_records_fit_lines(rows)))


def all_records_fit_lines(rows: list[dict]) -> list[str]:
    """The constants fitted on every ok GPU record (what the shipped ones are), beside them."""
    fit = fit_constants([r for r in rows if r["kind"] == "GPU" and r["outcome"] == "ok"])
    lines = []
    for name, (eff, disp) in fit.steps.items():
        shipped = engines.get(name).model.FITS["cuda"]
        lines.append(
            f"step fit over every GPU record, {name}: efficiency {eff:.3f}, dispatch "
            f"{disp:.4f} s per layer (shipped: {shipped.efficiency}, "
            f"{shipped.dispatch_s_per_layer})"
        )
    ds = ds_model.FITS["cuda"]
    lines.append(
        f"runtime per rank: DeepSpeed's measured, not fitted: {ds.runtime_at_init} GiB at "
        f"initialization, {ds.runtime_gib} in the steps; FSDP2's fitted "
        f"{units.bytes_to_gib(fit.runtimes['fsdp2']):.2f} GiB (shipped: "
        f"{fsdp2_model.FITS['cuda'].runtime_gib})"
    )
    lines.append(
        f"reserved fit over every GPU record: reserved_slack "
        f"({', '.join(f'{c:.4g}' for c in fit.slack)}), CUDA context "
        f"{units.bytes_to_gib(fit.context):.3f} GiB (shipped, shared.RESERVED_FIT: "
        f"{shared.RESERVED_FIT['reserved_slack']}, {shared.RESERVED_FIT['cuda_context_gib']})"
    )
    return lines


def step_timer_line(rows: list[dict]) -> str:
    """DeepSpeed's step timer of the CPU optimizer offload records against the optimizer step
    the calibration alone predicts (ds_model.optimizer_step_seconds: no fitted constant)."""
    pairs = [r["step_timer"] for r in rows if r["outcome"] == "ok" and all(r["step_timer"])]
    errs = [accuracy.rel_error(pred, meas) for pred, meas in pairs]
    if not errs:
        return "GPU optimizer step: no CPU offload record with DeepSpeed's step timer"
    within = sum(abs(e) <= TARGETS["step"] for e in errs)
    return (
        f"GPU optimizer step (DeepSpeed's step timer, CPU offload, predicted from the "
        f"calibration alone): {within}/{len(errs)} within 10%, worst "
        f"{max(errs, key=abs):+.1%}"
    )


def _leased(rows: list[dict], records: tuple[str, ...]) -> list[dict]:
    """The rows of ``records`` ("<config>/rep<N>", or EVERY_RECORD)."""
    if records == EVERY_RECORD:
        return rows
    return [r for r in rows if r["record"].split("/", 1)[1] in records]


def _shipped(folder: str) -> Path:
    """The shipped calibration of the cluster the records of GPU_RECORDS' ``folder`` ran on."""
    plan = record_plan(REPO_ROOT / folder, REPO_ROOT / GPU_RECORDS[folder])
    return REPO_ROOT / "config" / "calibration" / f"{plan.cluster['name']}.json"


def shipped_matmul(path: Path, shipped: Path, tmp: Path) -> Path:
    """A copy of ``path`` with the shipped calibration's matmul rate: isolates that one rate.
    the engines' fitted efficiency is a share of the shipped H200 rate (790 TFLOP/s, a one-off
    8192³ probe on this machine kind); calibrate measures 646-680 at a layer's shapes and 677 at
    8192³ (model E's step-phases-lease-4/), so a lease's own rate scales the FLOPs by that
    ratio whatever the machine did."""
    cal = read_calibration(path)
    out = tmp / f"{path.stem}.shipped-matmul.json"
    write_calibration(out, replace(cal, matmul_tflops=read_calibration(shipped).matmul_tflops))
    return out


#: how a lease's own calibration is applied: as it was measured; with the shipped matmul rate
#: (shipped_matmul); or the shipped calibration instead
VARIANTS = ("as measured", "with the shipped matmul rate", "shipped")


def _variant(variant: str, own: Path, shipped: Path, tmp: Path) -> Path:
    if variant == "shipped":
        return shipped
    return own if variant == "as measured" else shipped_matmul(own, shipped, tmp)


def print_lease_calibrations(tmp: Path) -> None:
    """The records of LEASE_CALIBRATIONS predicted with the calibration measured on their own
    lease (VARIANTS) and with the shipped one, the committed constants all: the whole step, and
    the part the calibration alone predicts (DeepSpeed's step timer); the ranking where one
    lease measured every record."""
    for folder, leases in LEASE_CALIBRATIONS.items():
        study = REPO_ROOT / GPU_RECORDS[folder]
        shipped = _shipped(folder)
        # a ranking compares configs measured on one lease: not over records of several
        wanted = ("step time", "ranking", "Kendall") if len(leases) == 1 else ("step time",)
        names = ", ".join(Path(path).name for path in leases)
        for variant in VARIANTS:
            rows = []
            for path, records in leases.items():
                cal = _variant(variant, REPO_ROOT / path, shipped, tmp)
                rows += _leased(record_rows(REPO_ROOT / folder, study, cal), records)
            label = Path(folder).name + (
                ", shipped calibration" if variant == "shipped" else f", {names} ({variant})"
            )
            print("\n".join(x for x in summary_lines(rows, label) if any(w in x for w in wanted)))
            print(f"{label}: {step_timer_line(rows)}")


def _loop_errors(loop: dict, spec, ds_config: dict, cal) -> str:
    """A plain loop's step and DeepSpeed's step timer against their predictions with ``cal``."""
    step = accuracy.rel_error(
        predict.step_time(spec, ds_config, cal).total, loop["step_time_s_median"]
    )
    timer = accuracy.rel_error(
        ds_model.optimizer_step_seconds(spec, ds_config, cal), loop["phase_s_median"]["step"]
    )
    return f"{step:+.1%} (step timer {timer:+.1%})"


def print_raw_loops(tmp: Path) -> None:
    """RAW_LOOPS: each plain DeepSpeed loop's step against the prediction of its config with
    its lease's calibration (VARIANTS) and the shipped one, DeepSpeed's step timer beside."""
    for folder, pattern, lease in RAW_LOOPS:
        study = REPO_ROOT / GPU_RECORDS[folder]
        plan, shipped = record_plan(REPO_ROOT / folder, study), _shipped(folder)
        cals = {v: read_calibration(_variant(v, REPO_ROOT / lease, shipped, tmp)) for v in VARIANTS}
        for path in sorted(REPO_ROOT.glob(pattern)):
            loop = read_json(path)
            name = loop["scenario"]
            ds_config = read_json(REPO_ROOT / folder / "configs" / f"{name}.json")
            errs = [
                f"{variant} {_loop_errors(loop, plan.by_name[name], ds_config, cal)}"
                for variant, cal in cals.items()
            ]
            print(
                f"{Path(folder).name} raw loop {name} ({Path(lease).parent.name}): "
                f"{loop['step_time_s_median']:.3f} s; " + ", ".join(errs)
            )


def write_bands(path: Path, rows: list[dict], uncalibrated: list[dict], argv) -> None:
    """{"calibrated": {...}, "uncalibrated": {...}, "measured_by": ..., "records": N} (the one
    reader: offload_study.prediction.error_bands): the largest absolute error out of sample of
    each quantity, with the shipped calibrations and with the GPU catalog's values."""
    gpu_ok = [r for r in rows if r["kind"] == "GPU" and r["outcome"] == "ok"]
    command = "python benchmarks/prediction_accuracy.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    out = {
        "calibrated": bands(rows),
        "uncalibrated": bands(uncalibrated),
        "statistic": "largest absolute relative error over the ok GPU records of every engine, the "
        "fitted constants (efficiency, dispatch per layer, reserved slack) fitted leaving the record's "
        "model out (every record of that model, whatever study holds it); the runtime memory "
        "measured, not fitted",
        "calibration": "calibrated: config/calibration/<cluster>.json (shipped); uncalibrated: "
        "the GPU catalog's values (python -m offload_study.prediction.catalog --cpu catalog)",
        "measured_by": command.strip(),
        "records": len(gpu_ok),
    }
    cpu = [r for r in rows if r["kind"] == "CPU" and r["outcome"] == "ok"]
    if cpu:  # the CPU study given (--cpu-study-dir), with its own calibration
        out["cpu"] = {**bands(rows, "CPU"), "records": len(cpu)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"error bands: {path}")


if __name__ == "__main__":
    sys.exit(main())
