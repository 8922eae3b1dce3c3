"""What admission asks of a DeepSpeed scenario: ZeRO and aio keys the installed DeepSpeed knows,
its offload modes, a folder for NVMe offload, the config through DeepSpeed's own parser, and the
compiled ops a run loads (each problem as "key path: message" text)."""

from __future__ import annotations

from offload_study.core.study import nvme_path_problem, unless_refused
from offload_study.engines.deepspeed import config
from offload_study.planning import modes
from offload_study.planning.plan import BATCH_KNOBS, nvme_path_key


def study_problems(study: dict) -> list[str]:
    """The study-wide ZeRO and aio keys (each skipped where the schema refused its value)."""
    return unless_refused(config.check_zero_keys, study["zero"], "zero") + unless_refused(
        config.check_aio_keys, study["aio"]
    )


def scenario_problems(study: dict, scenario: dict, cluster: dict, where: str) -> list[str]:
    """ZeRO knobs the installed DeepSpeed knows, modes it has, a folder for NVMe offload."""
    errors = config.check_zero_keys(scenario.get("zero", {}), f"{where}.zero")
    for knob, values in scenario.get("sweep", {}).items():
        if knob not in BATCH_KNOBS and knob not in modes.SWEEPABLE:
            errors += config.check_sweep_values(knob, values, f"{where}.sweep")
    errors += config.check_modes(scenario, where)
    devices = (scenario["offload_optimizer"], scenario["offload_param"])
    path, key = nvme_path_key(scenario, cluster, where)
    problem = nvme_path_problem(path) if path is not None else None
    if problem and (key.startswith(where) or "nvme" in devices):
        errors.append(f"{key}: {problem}")
    if "nvme" in devices and not path:
        key = "offload_optimizer" if devices[0] == "nvme" else "offload_param"
        errors.append(
            f"{where}.{key}: nvme offload needs a directory: set {where}.nvme_path or "
            f"nvme_path in config/clusters/{cluster['name']}.yaml"
        )
    return errors


def config_problem(spec, ds_config: dict) -> str | None:
    """Why DeepSpeed's own parser refuses the config (batch arithmetic, pydantic keys)."""
    try:
        config.parse_with_deepspeed(ds_config, spec.world_size)
    except Exception as exc:  # DeepSpeed raises AssertionError, ValueError, ValidationError
        return f"DeepSpeed refused it: {exc}"
    return None


def ops_needed(spec) -> list[str]:
    """The DeepSpeed ops a run loads, in the order it loads them."""
    needed = ["shm_comm"] if spec.accelerator == "cpu" else []
    needed.append("fused_adam" if spec.offload_optimizer == "none" else "cpu_adam")
    if spec.uses_nvme:
        needed += ["pin_memory", "async_io"]
    return needed
