"""The newer offload modes and the host knobs of a scenario (issue 15), in one place.

Scenario keys (``schemas/study.schema.yaml``; the schema marks which a sweep may vary with
``x-sweepable`` and which DeepSpeed key each becomes with ``x-deepspeed-key``):

- ``offload_optimizer_ratio`` -> ``zero_optimization.offload_optimizer.ratio`` (ZeRO-3 partial
  optimizer offload, "Twin-Flow"),
- ``super_offload`` -> ``zero_optimization.offload_optimizer.super_offload`` (SuperOffload),
- ``zenflow`` -> ``zero_optimization.zenflow`` (ZenFlow; its keys: the installed ZenFlowConfig's),
- ``pin_memory`` (the offload blocks'; null leaves DeepSpeed's default) and ``bind_cores`` (the
  harness binds each rank to its share of the granted cores).

The plan checks them against the installed DeepSpeed's own config classes (read from source,
like :func:`offload_study.planning.dsconfig.installed_key_names`): a DeepSpeed without a mode refuses the
study naming the key and the version. The harness records what the engine used
(:func:`effective`), metrics.json carries it as ``modes``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

from offload_study.core.study import StrictValidator, load_schema

_SCENARIO = load_schema("study")["properties"]["scenarios"]["items"]["properties"]
#: Scenario keys a sweep may vary besides the batch and ZeRO knobs (the schema's x-sweepable).
SWEEPABLE: tuple[str, ...] = tuple(k for k, v in _SCENARIO.items() if v.get("x-sweepable"))
#: Scenario key -> the DeepSpeed key it becomes (the schema's x-deepspeed-key).
DEEPSPEED_KEYS: dict[str, str] = {
    k: v["x-deepspeed-key"] for k, v in _SCENARIO.items() if "x-deepspeed-key" in v
}
#: The keys of RunSpec.modes (pin_memory keeps its own RunSpec field).
MODE_KEYS: tuple[str, ...] = (*DEEPSPEED_KEYS, "bind_cores")
#: Scenario keys that need the optimizer offloaded to the CPU.
NEEDS_CPU_OPTIMIZER = tuple(DEEPSPEED_KEYS)
#: Set by DeepSpeed at run time; its docstring says users should not set it.
ZENFLOW_INTERNAL = {"steps_per_epoch"}


def deepspeed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


@functools.lru_cache(maxsize=1)
def installed_fields() -> dict[str, set[str]]:
    """DeepSpeed section -> its field names, for the sections the modes use (zenflow: empty when
    the installed DeepSpeed has no ZenFlow)."""
    from offload_study.planning import dsconfig  # dsconfig imports this module

    names = dsconfig.installed_key_names()
    zenflow_src = dsconfig._deepspeed_dir() / "runtime/zenflow/zenflow_config.py"
    zenflow = set()
    if zenflow_src.exists():
        zenflow = set(dsconfig._class_knobs(zenflow_src.read_text(), "ZenFlowConfig"))
    return {  # a ZeRO config naming zenflow without its ZenFlowConfig: no ZenFlow either
        "zero_optimization": names["zero"] - (set() if zenflow else {"zenflow"}),
        "zero_optimization.offload_optimizer": names["offload_optimizer"],
        "zero_optimization.zenflow": zenflow - ZENFLOW_INTERNAL,
    }


def _is_set(key: str, value) -> bool:
    return value not in (None, False) and not (key == "offload_optimizer_ratio" and value == 1)


def _version_errors(key: str, where: str) -> list[str]:
    section, _, field = DEEPSPEED_KEYS[key].rpartition(".")
    if field in installed_fields()[section]:
        return []
    return [
        f"{where}.{key}: the installed DeepSpeed {deepspeed_version()} has no "
        f"{DEEPSPEED_KEYS[key]} (its config classes lack '{field}'); install a DeepSpeed that "
        "has it or remove the key"
    ]


def _zenflow_errors(block: dict, where: str) -> list[str]:
    known = installed_fields()["zero_optimization.zenflow"]
    return [
        f"{where}.zenflow.{key}: not a key of the installed DeepSpeed {deepspeed_version()}'s "
        f"ZenFlowConfig (keys: {', '.join(sorted(known))})"
        for key in block
        if key not in known
    ]


def _sweep_value_errors(scenario: dict, where: str) -> list[str]:
    errors = []
    for knob, values in scenario.get("sweep", {}).items():
        if knob not in SWEEPABLE:
            continue
        validator = StrictValidator(_SCENARIO[knob])  # the study's exact types (1.0 is no int)
        for value in values:
            errors += [f"{where}.sweep.{knob}: {value!r}: {err.message}"
                       for err in validator.iter_errors(value)]  # fmt: skip
    return errors


def check_scenario(scenario: dict, where: str) -> list[str]:
    """Errors for the scenario's mode keys (own and swept): the installed DeepSpeed must have
    them, they need the optimizer offloaded to the CPU, and sweep values must be valid."""
    errors = _sweep_value_errors(scenario, where)
    swept = scenario.get("sweep", {})
    for key in DEEPSPEED_KEYS:
        values = [scenario.get(key), *swept.get(key, [])]
        if not any(_is_set(key, v) for v in values):
            continue
        errors += _version_errors(key, where)
        if scenario["offload_optimizer"] != "cpu":
            errors.append(
                f"{where}.{key}: needs offload_optimizer: cpu (the scenario has "
                f"{scenario['offload_optimizer']!r})"
            )
    if isinstance(scenario.get("zenflow"), dict) and not _version_errors("zenflow", where):
        errors += _zenflow_errors(scenario["zenflow"], where)
    return errors


def resolve(scenario: dict, combo: dict) -> tuple[bool | None, dict]:
    """(pin_memory, RunSpec.modes) of one sweep combo: the combo's values over the scenario's;
    modes keeps only keys away from their default, so a study without them plans as before."""
    values = {key: combo.get(key, scenario.get(key)) for key in (*MODE_KEYS, "pin_memory")}
    modes = {key: values[key] for key in MODE_KEYS if _is_set(key, values[key])}
    return values["pin_memory"], modes


def apply(zero: dict, modes: dict) -> None:
    """Write a run's modes into its zero_optimization block (the offload block exists: the plan
    checked that the optimizer is offloaded to the CPU)."""
    for key, value in modes.items():
        if key not in DEEPSPEED_KEYS:
            continue
        section, _, field = DEEPSPEED_KEYS[key].partition(".")[2].rpartition(".")
        target = zero[section] if section else zero
        target[field] = dict(value) if isinstance(value, dict) else value


# --------------------------------------------------------------------------- in the harness
def bind_cores(modes: dict, local_rank: int, ranks_per_node: int) -> list[int] | None:
    """With bind_cores: pin this process to the local_rank-th of ranks_per_node equal slices of
    the cores it may use; returns the cores (None: not asked to bind)."""
    if not modes.get("bind_cores"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    share = max(1, len(allowed) // max(1, ranks_per_node))
    mine = allowed[local_rank * share : (local_rank + 1) * share]
    mine = mine or [allowed[local_rank % len(allowed)]]  # more ranks than cores: share one
    os.sched_setaffinity(0, mine)
    return mine


def effective(engine) -> dict:
    """What the DeepSpeed engine uses (its public getters, after deepspeed.initialize): the
    offload blocks' pin_memory, ratio, SuperOffload, ZenFlow, the optimizer class, the cores."""
    opt, param = engine.zero_offload_optimizer(), engine.zero_offload_param()
    zenflow = engine.zenflow_config()

    def offloaded(block) -> bool:
        return block is not None and str(getattr(block.device, "value", block.device)) != "none"

    return {
        "pin_memory_optimizer": opt.pin_memory if offloaded(opt) else None,
        "pin_memory_param": param.pin_memory if offloaded(param) else None,
        "offload_optimizer_ratio": float(opt.ratio) if offloaded(opt) else None,
        "super_offload": bool(engine.super_offload()),
        "zenflow": zenflow.model_dump() if zenflow is not None else None,
        "optimizer_class": type(engine.optimizer).__name__,
        "cores": sorted(os.sched_getaffinity(0)),
    }
