"""DeepSpeed ZeRO-3 (scenario key ``engine: deepspeed``, the default): the seed's production
config plus each scenario's offload (``config``), admission against the installed DeepSpeed
(``admission``), the rank's engine (``train``), and its memory and step-time model (``model``).
"""

from __future__ import annotations

from offload_study import engines
from offload_study.engines.deepspeed import admission, config, model, probe, train
from offload_study.planning import modes

#: The offload paths by the scenario's (offload_optimizer, offload_param), in a reader's words;
#: DeepSpeed's modes (ratio, SuperOffload, ZenFlow) refine the optimizer offload to the CPU.
PATH_LABELS = {
    ("none", "none"): "no offload",
    ("cpu", "none"): "optimizer offload to the CPU",
    ("cpu", "cpu"): "optimizer and parameter offload to the CPU",
    ("nvme", "none"): "optimizer offload to NVMe",
    ("nvme", "cpu"): "optimizer offload to NVMe, parameters to the CPU",
    ("nvme", "nvme"): "optimizer and parameter offload to NVMe",
}


#: What a recommendation tries on each path (scenario keys beyond the path's offload keys; a
#: grid's offload_optimizer_ratio values refine the plain CPU optimizer offload). The NVMe paths
#: are not tried: their speed is the disk's, and their folder each cluster's own.
GRID = {
    ("none", "none"): ({},),
    ("cpu", "none"): (
        {},
        {"zenflow": {}, "label": "optimizer offload to the CPU with ZenFlow"},
        {"super_offload": True, "label": "optimizer offload to the CPU with SuperOffload"},
    ),
    ("cpu", "cpu"): ({},),
}
#: DeepSpeed's modes refine the optimizer offload to the CPU (without parameter offload, as a
#: recommendation tries them)
MODE_PATH = ("cpu", "none")


def _path(devices: tuple[str, str], label: str) -> engines.OffloadPath:
    name = "none" if devices == ("none", "none") else "-".join(devices)
    keys = frozenset(modes.DEEPSPEED_KEYS) if devices == MODE_PATH else frozenset()
    return engines.OffloadPath(
        "deepspeed", name, label, devices, keys=keys, grid=GRID.get(devices, ())
    )


def breakdown(spec, rank0_log: str, steps: list, parts: dict | None) -> dict:
    """DeepSpeed's own wall_clock_breakdown timers, from rank 0's log (one timer line per step:
    the warm-up steps' are skipped)."""
    from offload_study.training import logparse

    warmup = sum(1 for r in steps if r.phase == "warmup")
    return logparse.breakdown_ms(rank0_log, skip_steps=warmup)


def versions(first_stat) -> dict:
    """DeepSpeed's version as the rank reported it, else the one installed here."""
    from importlib import metadata

    try:
        installed = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        installed = None
    version = first_stat("deepspeed_version") or installed
    return {"deepspeed_version": version, "engine_version": version}


def host_workers(effective_modes: dict) -> bool:
    """SuperOffload's CPU Adam runs in a process of its own, holding the Adam moments; so does
    ZenFlow's optimizer when it overlaps the step (DeepSpeed's zenflow_utils spawns it)."""
    zenflow = effective_modes.get("zenflow")
    overlapped = isinstance(zenflow, dict) and bool(zenflow.get("overlap_step"))
    return bool(effective_modes.get("super_offload")) or overlapped


ENGINE = engines.register(
    engines.Engine(
        name=model.ENGINE_NAME,
        label="ZeRO-3",
        summary="DeepSpeed ZeRO-3, the zero and offload keys as DeepSpeed takes them (offload "
        "to the CPU or NVMe; the modes offload_optimizer_ratio, super_offload and zenflow)",
        study_problems=admission.study_problems,
        scenario_problems=admission.scenario_problems,
        config_problem=admission.config_problem,
        ops_needed=admission.ops_needed,
        build_config=config.build_ds_config,
        start_rank=train.start_rank,
        trainer=train.ZeroEngine,
        breakdown=breakdown,
        versions=versions,
        model=model,
        host_probe=probe.host_probe,
        host_workers=host_workers,
        paths=tuple(_path(devices, label) for devices, label in PATH_LABELS.items()),
    )
)
