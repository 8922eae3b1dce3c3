"""What admission asks of an fsdp2 scenario: no key that only DeepSpeed has (unless its offload
path takes it), and offload keys that one of FSDP2's offload paths serves, on a cluster where
that path can run (each problem as "key path: message" text, naming the key)."""

from __future__ import annotations

from offload_study.planning import modes
from offload_study.planning.plan import BATCH_KNOBS

#: Sweep knobs every fsdp2 scenario takes (the rest are DeepSpeed's, or a path's own keys).
SWEEPABLE = (*BATCH_KNOBS, "pin_memory", "bind_cores")


def _paths_text(engine) -> str:
    return "; ".join(
        f"offload_optimizer: {p.devices[0]} with offload_param: {p.devices[1]} ({p.label})"
        for p in engine.paths
    )


def scenario_problems(study: dict, scenario: dict, cluster: dict, where: str) -> list[str]:
    from offload_study import engines

    engine = engines.get(scenario["engine"])
    devices = (scenario["offload_optimizer"], scenario["offload_param"])
    path = engine.path(*devices)
    taken = path.keys if path else frozenset()
    why = (
        f"a DeepSpeed key: engine {engine.name} has no such setting"
        + (f" on the path {path.label}" if path else "")
        + "; remove it or use engine deepspeed"
    )
    errors = [f"{where}.zero: {why}"] if scenario.get("zero") else []
    errors += [
        f"{where}.sweep.{knob}: {why}"
        for knob in scenario.get("sweep", {})
        if knob not in SWEEPABLE and knob not in taken
    ]
    errors += [
        f"{where}.{key}: {why}"
        for key in modes.DEEPSPEED_KEYS
        if modes.is_set(key, scenario.get(key)) and key not in taken
    ]
    if path is None:
        nvme = [
            k
            for k, d in zip(("offload_optimizer", "offload_param"), devices, strict=True)
            if d == "nvme"
        ]
        key = nvme[0] if nvme else "offload_param" if devices[0] == "cpu" else "offload_optimizer"
        errors.append(
            f"{where}.{key}: engine {engine.name} has no offload path for "
            f"offload_optimizer: {devices[0]} with offload_param: {devices[1]}; "
            f"allowed: {_paths_text(engine)}"
        )
        return errors
    return errors + path.problems(study, scenario, cluster, where)
