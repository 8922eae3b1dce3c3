"""PyTorch FSDP2 (scenario key ``engine: fsdp2``): ``fully_shard`` per decoder layer, then the
root, torch AdamW; its settings (``config``), admission (``admission``), the rank's engine
(``train``), its offload paths (``paths``) and its memory and step-time model (``model``).
"""

from __future__ import annotations

from offload_study import engines
from offload_study.engines.fsdp2 import admission, config, model, paths, train


def breakdown(spec, rank0_log: str, steps: list, parts: dict | None) -> dict:
    """FSDP2 has no timers of its own: its forward, backward and step are the harness's parts
    (each ended by a device synchronization); the other keys stay empty."""
    from offload_study.core.contracts import BREAKDOWN_KEYS

    timers = dict.fromkeys(BREAKDOWN_KEYS)
    if parts:
        timers.update(forward=parts["forward"], backward=parts["backward"], step=parts["optimizer"])
    return timers


def versions(first_stat) -> dict:
    """FSDP2 is part of torch: its version is torch's; no DeepSpeed is imported."""
    from importlib import metadata

    torch_version = first_stat("torch_version") or metadata.version("torch")
    return {"deepspeed_version": None, "engine_version": torch_version}


ENGINE = engines.register(
    engines.Engine(
        name=model.ENGINE_NAME,
        label="FSDP2",
        summary="PyTorch FSDP2: fully_shard per decoder layer, then the root; torch AdamW, fused "
        "on the GPU, foreach on the CPU. Its offload paths are chosen by offload_optimizer and "
        "offload_param; it refuses NVMe offload, ZeRO knobs, aio and DeepSpeed's modes that its "
        "path does not take, naming the key",
        study_problems=lambda study: [],
        scenario_problems=admission.scenario_problems,
        config_problem=lambda spec, settings: None,
        ops_needed=lambda spec: [],
        build_config=config.build_config,
        start_rank=train.start_rank,
        trainer=train.Fsdp2Engine,
        breakdown=breakdown,
        versions=versions,
        model=model,
        host_probe=train.host_probe,
        paths=(
            engines.OffloadPath(
                "fsdp2", "none", "no offload", ("none", "none"), parts=paths.Fsdp2Path(), grid=({},)
            ),
            engines.OffloadPath(
                "fsdp2",
                "cpu-offload-policy",
                "parameters, gradients and optimizer states offloaded to the CPU together "
                "(CPUOffloadPolicy)",
                ("cpu", "cpu"),
                parts=paths.OffloadPolicyPath(),
                grid=({},),
            ),
        ),
    )
)
