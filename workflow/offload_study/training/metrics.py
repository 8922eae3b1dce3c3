"""metrics.json of one run (schema: ``schemas/metrics.schema.json``) from what the run left.

:func:`compute_metrics` takes one :class:`MetricsInput`; each part of the record (identity,
setup, speed, measurement, memory, breakdown, versions) is its own small function.
"""

from __future__ import annotations

import os
import socket
import statistics
from dataclasses import dataclass

from offload_study import engines
from offload_study.core import devices, units
from offload_study.core.contracts import (
    METRICS_FIELDS,
    TREE_FLOORED,
    RankStats,
    RunSpec,
    StepRow,
    metrics_schema,
    rank_log_name,
    schema_problems,
    sha256_file,
)
from offload_study.training import logparse, steady
from offload_study.training.provenance import engine_versions
from offload_study.training.supervise import Supervision

#: metrics.json keys copied from the run spec as they are (gpu_mem_gb, cpu_mem_gb: GiB, the
#: config keys' unit; offload_study.core.units).
SETUP_KEYS = [
    "nodes",
    "gpus_per_node",
    "world_size",
    "accelerator",
    "micro_batch",
    "gradient_accumulation_steps",
    "global_batch",
    "seq_len",
    "dtype",
    "offload_optimizer",
    "offload_param",
    "gpu_mem_gb",
    "cpu_mem_gb",
    "gradient_checkpointing",
]
SPEED_KEYS = [
    "step_time_s",
    "step_time_s_mean",
    "step_time_s_std",
    "step_time_s_p10",
    "step_time_s_p90",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_gpu",
    "mfu",
]


@dataclass(frozen=True)
class MetricsInput:
    spec: RunSpec
    repeat: int
    supervision: Supervision
    outcome: str
    excerpt: str | None
    steps: list[StepRow]
    stats: dict[int, RankStats]  # rank -> stats of the ranks that wrote them
    logs: dict[str, str]  # log file name -> text
    started_at: str
    finished_at: str

    def first_stat(self, name: str):
        """A value the ranks share (device, versions): rank 0's, else the first rank's that has it."""
        ranks = sorted(self.stats, key=lambda r: (r != 0, r))
        return next((v for r in ranks if (v := getattr(self.stats[r], name)) is not None), None)


def percentile(vals: list[float], q: float) -> float:
    s = sorted(vals)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def gpu_mem_cap_gib(stats: dict[int, RankStats], logs: dict[str, str]) -> float | None:
    """Rank 0's GPU cap: from its stats, else (it died before writing them) from the logs."""
    if 0 in stats:
        return stats[0].gpu_mem_cap_gib
    return logparse.gpu_mem_cap_gib("\n".join(logs.values()))


def peak_tflops(spec: RunSpec, device_name: str | None) -> float | None:
    """The cluster's peak_tflops override, else the table's peak for the GPU torch named, else
    for the cluster's gpu_model (CPU runs: the override only)."""
    if spec.peak_tflops or spec.accelerator != "cuda":
        return devices.peak_tflops(None, spec.peak_tflops)
    return devices.peak_tflops(device_name) or devices.peak_tflops(spec.gpu_model)


def _identity(inp: MetricsInput) -> dict:
    spec = inp.spec
    return {
        "schema_version": 1,
        "study": spec.study,
        "cluster": spec.cluster,
        "scenario": spec.scenario,
        "base_scenario": spec.base_scenario,
        "label": spec.label,
        "sweep": spec.sweep,
        "repeat": int(inp.repeat),
        "outcome": inp.outcome,
        "error_excerpt": inp.excerpt if inp.outcome != "ok" else None,
        "started_at": inp.started_at,
        "finished_at": inp.finished_at,
        "wall_time_s": round(inp.supervision.elapsed, 3),
    }


def _setup(inp: MetricsInput) -> dict:
    setup = {key: getattr(inp.spec, key) for key in SETUP_KEYS}
    setup["model_params"] = inp.first_stat("model_params")
    setup["gpu_mem_cap_gib"] = gpu_mem_cap_gib(inp.stats, inp.logs)
    setup["device_name"] = inp.first_stat("device_name")
    return setup


def _speed(inp: MetricsInput, n_params: int | None, device_name: str | None) -> dict:
    spec = inp.spec
    measured = [r for r in inp.steps if r.phase == "measured"]
    times = [r.step_time_s for r in measured if r.timed]  # skipped steps do no optimizer work
    speed = dict.fromkeys(SPEED_KEYS)
    peak = peak_tflops(spec, device_name)
    if times:
        med = statistics.median(times)
        tokens_per_s = spec.global_batch * spec.seq_len / med
        speed.update(
            step_time_s=med,
            step_time_s_mean=statistics.fmean(times),
            step_time_s_std=statistics.stdev(times) if len(times) > 1 else 0.0,
            step_time_s_p10=percentile(times, 0.1),
            step_time_s_p90=percentile(times, 0.9),
            tokens_per_s=tokens_per_s,
            samples_per_s=spec.global_batch / med,
        )
        if n_params:
            tf = devices.tflops_per_device(
                n_params, tokens_per_s, spec.world_size, spec.gradient_checkpointing
            )
            speed.update(tflops_per_gpu=tf, mfu=devices.mfu(tf, peak))
    return {
        "steps_measured": len(measured) if inp.steps else None,
        **speed,
        "peak_tflops": peak,
        "loss_first": measured[0].loss if measured else None,
        "loss_last": measured[-1].loss if measured else None,
    }


def _measurement(inp: MetricsInput) -> dict:
    """How the run measured: warm-up, the CI of the median step time (steady.median_ci, the rule
    the harness stopped on), why it stopped, skipped steps by the harness and by DeepSpeed's log."""
    warmup = [r for r in inp.steps if r.phase == "warmup"]
    measured = [r for r in inp.steps if r.phase == "measured"]
    ci = steady.median_ci([r.step_time_s for r in measured if r.timed])
    rank0 = inp.stats.get(0)
    target = inp.spec.measure.target_ci_pct
    return {
        "measure_mode": inp.spec.measure.mode,
        "steps_warmup": len(warmup) if inp.steps else None,
        "warmup_settled": rank0.warmup_settled if rank0 else None,
        "stop_reason": rank0.stop_reason if rank0 else None,
        "step_time_s_ci_lo": ci.lo if ci else None,
        "step_time_s_ci_hi": ci.hi if ci else None,
        "step_time_ci_pct": ci.half_pct if ci else None,
        "ci_target_pct": target,
        "ci_target_met": ci.half_pct <= target if ci else None,
        "skipped_steps_warmup": sum(r.skipped for r in warmup) if inp.steps else None,
        "skipped_steps_measured": sum(r.skipped for r in measured) if inp.steps else None,
        "skipped_steps_ds_log": logparse.ds_skipped_steps(inp.logs.get(rank_log_name(0), "")),
    }


def _gib_max(stats: dict[int, RankStats], name: str) -> float | None:
    vals = [v for s in stats.values() if (v := getattr(s, name)) is not None]
    return units.bytes_to_gib(max(vals)) if vals else None


def _memory(inp: MetricsInput) -> dict:
    """GPU peaks (max over ranks), host memory per rank and per node (each rank's own, and its
    process tree's: :func:`_host_trees`), NVMe peak."""
    stats, rank_peaks, world = inp.stats, inp.supervision.rank_peaks, inp.spec.world_size
    local = socket.gethostname()
    per_rank, node_of = [], {}
    for r in range(world):
        # the harness' own getrusage peak, else the runner's sampled peak
        own = stats[r].host_peak_rss_bytes if r in stats else None
        v = max(own or 0, rank_peaks.get(r, 0))
        per_rank.append(round(units.bytes_to_gib(v), 4) if v else None)
        node_of[r] = stats[r].host if r in stats else (local if r in rank_peaks else None)
    per_node = _per_node(per_rank, node_of)
    nvme = [s.nvme_bytes_used for s in stats.values() if s.nvme_bytes_used is not None]
    return {
        "peak_gpu_allocated_gib": _gib_max(stats, "peak_gpu_allocated_bytes"),
        "peak_gpu_reserved_gib": _gib_max(stats, "peak_gpu_reserved_bytes"),
        "nvml_used_gib": _gib_max(stats, "nvml_used_bytes"),
        "host_peak_rss_gib_per_rank": per_rank,
        "host_peak_rss_gib_per_node": per_node,
        "host_peak_rss_gib": max(per_node) if per_node else None,
        **_host_trees(stats, world, node_of),
        "nvme_bytes_used": int(sum(nvme)) if nvme else None,
    }


def _per_node(per_rank: list[float | None], node_of: dict[int, str | None]) -> list[float]:
    nodes = list(dict.fromkeys(n for n in node_of.values() if n is not None))
    return [round(sum(v or 0 for r, v in enumerate(per_rank) if node_of[r] == n), 4) for n in nodes]


def _host_trees(stats: dict[int, RankStats], world: int, node_of: dict) -> dict:
    """The ranks' process trees (each rank and its children, sampled by the harness), per rank
    and per node; the nodes and the run's peak are null unless every rank measured its tree
    (a rank died before its last stats: the report shows the ranks' own figure then)."""
    trees = [stats[r].host_peak_tree_bytes if r in stats else None for r in range(world)]
    per_rank = [round(units.bytes_to_gib(v), 4) if v else None for v in trees]
    per_node = _per_node(per_rank, node_of)
    whole = per_node and None not in per_rank
    measures = {s.host_tree_measure for s in stats.values() if s.host_tree_measure}
    return {
        "host_peak_tree_gib_per_rank": per_rank,
        "host_peak_tree_gib_per_node": per_node if whole else [None] * len(per_node),
        "host_peak_tree_gib": max(per_node) if whole else None,
        "host_tree_measure": _tree_measure(measures),
    }


def _tree_measure(measures: set[str]) -> str | None:
    """The run's tree measure from its ranks': "rss" if any rank summed RSS alone, floored only
    if every rank's tree was (contracts.TREE_FLOORED)."""
    if not measures:
        return None
    base = {m.removesuffix(TREE_FLOORED) for m in measures}
    floored = all(m.endswith(TREE_FLOORED) for m in measures)
    return ("rss" if "rss" in base else "rss+uss") + (TREE_FLOORED if floored else "")


def step_breakdown_ms(steps: list[StepRow]) -> dict | None:
    """Median ms per timed measured step of each part the harness timed (None: no such columns)."""
    timed = [r for r in steps if r.timed and r.forward_s is not None]
    if not timed:
        return None
    return {
        part: round(statistics.median(getattr(r, f"{part}_s") for r in timed) * 1000, 4)
        for part in ("forward", "backward", "optimizer")
    }


def _breakdown(inp: MetricsInput) -> dict:
    """The engine's own timers (``breakdown_ms``: DeepSpeed's from rank 0's log; an engine
    without timers gives the harness's parts) and the harness's parts (steps.csv)."""
    parts = step_breakdown_ms(inp.steps)
    rank0_log = inp.logs.get(rank_log_name(0), "")
    timers = engines.of(inp.spec).breakdown(inp.spec, rank0_log, inp.steps, parts)
    return {"breakdown_ms": timers, "step_breakdown_ms": parts}


def _versions(inp: MetricsInput) -> dict:
    config = inp.spec.ds_config
    return {
        "ds_config_sha256": sha256_file(config, missing_ok=True) if config else None,
        **engine_versions(inp.spec, inp.first_stat),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def _modes(inp: MetricsInput) -> dict:
    """What the run asked for (pin_memory, the modes) and what rank 0's engine used."""
    bound = {str(r): s.bound_cores for r, s in sorted(inp.stats.items()) if s.bound_cores}
    requested = {"pin_memory": inp.spec.pin_memory, **inp.spec.modes}
    return {
        "modes": {
            "requested": requested,
            "effective": inp.stats[0].modes if 0 in inp.stats else None,
            "bound_cores": bound or None,
        }
    }


def compute_metrics(inp: MetricsInput) -> dict:
    """The metrics.json record (keys in the schema's order)."""
    setup = _setup(inp)
    parts = {
        **_identity(inp),
        **setup,
        **_speed(inp, setup["model_params"], setup["device_name"]),
        **_memory(inp),
        **_measurement(inp),
        **_breakdown(inp),
        **_versions(inp),
        **_modes(inp),
    }
    if set(parts) != set(METRICS_FIELDS):
        raise RuntimeError(
            f"metrics keys differ from the schema's: {set(parts) ^ set(METRICS_FIELDS)}"
        )
    return {key: parts[key] for key in METRICS_FIELDS}


def metrics_problems(metrics: dict) -> list[str]:
    return schema_problems(metrics, metrics_schema())
