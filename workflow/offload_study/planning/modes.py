"""The newer offload modes and the host knobs of a scenario, in one place.

Scenario keys (``schemas/study.schema.yaml``; the schema marks which a sweep may vary with
``x-sweepable`` and which DeepSpeed key each becomes with ``x-deepspeed-key``):

- ``offload_optimizer_ratio`` -> ``zero_optimization.offload_optimizer.ratio`` (ZeRO-3 partial
  optimizer offload, "Twin-Flow"),
- ``super_offload`` -> ``zero_optimization.offload_optimizer.super_offload`` (SuperOffload),
  and ``cpuadam_cores_perc`` -> its worker's share of the cores,
- ``zenflow`` -> ``zero_optimization.zenflow`` (ZenFlow; its keys: the installed ZenFlowConfig's),
- ``pin_memory`` (the offload blocks'; null leaves DeepSpeed's default) and ``bind_cores`` (the
  harness binds each rank to its share of the granted cores).

Admission checks them against the installed DeepSpeed's own config classes
(:func:`offload_study.engines.deepspeed.config.check_modes`, read where every DeepSpeed class is read):
a DeepSpeed without a mode refuses the study naming the key and the version. The harness records
what the engine used (:func:`effective`), metrics.json carries it as ``modes``.
"""

from __future__ import annotations

import os

from offload_study.core.study import load_schema

#: The schema of a scenario's keys.
SCENARIO_KEYS = load_schema("study")["properties"]["scenarios"]["items"]["properties"]
#: Scenario keys a sweep may vary besides the batch and ZeRO knobs (the schema's x-sweepable).
SWEEPABLE: tuple[str, ...] = tuple(k for k, v in SCENARIO_KEYS.items() if v.get("x-sweepable"))
#: Scenario key -> the DeepSpeed key it becomes (the schema's x-deepspeed-key).
DEEPSPEED_KEYS: dict[str, str] = {
    k: v["x-deepspeed-key"] for k, v in SCENARIO_KEYS.items() if "x-deepspeed-key" in v
}
#: The keys of RunSpec.modes (pin_memory keeps its own RunSpec field).
MODE_KEYS: tuple[str, ...] = (*DEEPSPEED_KEYS, "bind_cores")
#: Scenario keys that need the optimizer offloaded to the CPU.
NEEDS_CPU_OPTIMIZER = tuple(DEEPSPEED_KEYS)
#: Scenario key -> the mode it refines, which must be set with it (the schema's x-needs).
NEEDS: dict[str, str] = {k: v["x-needs"] for k, v in SCENARIO_KEYS.items() if "x-needs" in v}


def is_set(key: str, value) -> bool:
    """A mode value away from its default (ratio 1 offloads the whole optimizer: the default)."""
    return value not in (None, False) and not (key == "offload_optimizer_ratio" and value == 1)


def resolve(scenario: dict, combo: dict) -> tuple[bool | None, dict]:
    """(pin_memory, RunSpec.modes) of one sweep combo: the combo's values over the scenario's;
    modes keeps only keys away from their default, so a study without them plans as before."""
    values = {key: combo.get(key, scenario.get(key)) for key in (*MODE_KEYS, "pin_memory")}
    modes = {key: values[key] for key in MODE_KEYS if is_set(key, values[key])}
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
