"""DeepSpeed config generation: the seed's production ZeRO-3 config plus each scenario's offload.

Key names are checked against the *installed* DeepSpeed, read from its source with ``ast`` so
that planning does not pay for ``import deepspeed`` (seconds, and a GPU probe).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

from offload_study.contracts import RunSpec
from offload_study.launch import free_port
from offload_study.study import StudyError

# The seed document's "ZeRO-3 production config" (shared/seed): the base of every scenario.
SEED_ZERO3 = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 500_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 100_000_000,
    # Only affects ZeRO-1/2 (DeepSpeed ignores it at stage 3); kept because the seed sets it.
    "round_robin_gradients": True,
}
SEED_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}

# Keys a study may not set inside zero_optimization: they are derived from the scenario.
MANAGED_ZERO_KEYS = {"stage", "offload_optimizer", "offload_param"}
# Renamed aio keys that DeepSpeed ignores silently under the old name.
RENAMED_AIO_KEYS = {"thread_count": "intra_op_parallelism (renamed in DeepSpeed 0.16.4)"}

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def normalize_number(value):
    """YAML 1.1 reads 5e8 as the string '5e8'; DeepSpeed wants integers for sizes."""
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        value = float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _deepspeed_dir() -> Path | None:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _class_fields(source: str, class_name: str) -> set[str]:
    """Field names and aliases of a pydantic model class, read from source text."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    names.add(stmt.target.id)
                    if isinstance(stmt.value, ast.Call):
                        for kw in stmt.value.keywords:
                            if kw.arg == "alias" and isinstance(kw.value, ast.Constant):
                                names.add(kw.value.value)
    return names


@functools.lru_cache(maxsize=1)
def installed_key_names() -> dict[str, set[str]]:
    """ZeRO, offload and aio key names of the installed DeepSpeed.

    Raises StudyError when DeepSpeed is not importable here: the plan would otherwise accept
    any key, and a typo would only surface when the first run fails (or never, for aio).
    """
    ds = _deepspeed_dir()
    if ds is None:
        raise StudyError(
            f"DeepSpeed is not importable by {sys.executable}, so the ZeRO and aio keys of the "
            "study cannot be checked: install deepspeed where snakemake runs (e.g. "
            "`pip install -e .` in the environment of the snakemake command)"
        )
    zero_src = (ds / "runtime/zero/config.py").read_text()
    offload_src = (ds / "runtime/zero/offload_config.py").read_text()
    aio_src = (ds / "runtime/swap_tensor/constants.py").read_text()
    aio = set()
    for node in ast.walk(ast.parse(aio_src)):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and re.fullmatch(r"AIO_[A-Z_]+", node.targets[0].id)
            and not node.targets[0].id.endswith(("_DEFAULT", "_FORMAT"))
            and node.targets[0].id != "AIO"
            and isinstance(node.value, ast.Constant)
        ):
            aio.add(node.value.value)
    return {
        "zero": _class_fields(zero_src, "DeepSpeedZeroConfig"),
        "offload_param": _class_fields(offload_src, "DeepSpeedZeroOffloadParamConfig"),
        "offload_optimizer": _class_fields(offload_src, "DeepSpeedZeroOffloadOptimizerConfig"),
        "aio": aio,
    }


def _unknown_key_message(where: str, key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}.{key}: not a key of the installed DeepSpeed's {where.split('.')[-1]}{hint}"


def check_zero_keys(knobs: dict, where: str) -> list[str]:
    """Errors for ZeRO knob overrides DeepSpeed would reject or that the scenario manages."""
    known = installed_key_names()["zero"]
    errors = []
    for key in knobs:
        if key in MANAGED_ZERO_KEYS:
            errors.append(
                f"{where}.{key}: set by the scenario (stage is always 3; use "
                "offload_optimizer/offload_param of the scenario), not a ZeRO override"
            )
        elif key not in known:
            errors.append(_unknown_key_message(where, key, known))
    return errors


def check_aio_keys(aio: dict, where: str = "aio") -> list[str]:
    known = installed_key_names()["aio"]
    errors = []
    for key in aio:
        if key in RENAMED_AIO_KEYS and key not in known:
            errors.append(
                f"{where}.{key}: DeepSpeed ignores this name; use {RENAMED_AIO_KEYS[key]}"
            )
        elif key not in known:
            errors.append(_unknown_key_message(where, key, known))
    return errors


def offload_block(device: str, nvme_path: str | None, pin_memory: bool) -> dict | None:
    if device == "none":
        return None
    block = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        block["nvme_path"] = nvme_path
    return block


def build_ds_config(run: RunSpec) -> dict:
    """The DeepSpeed config of one planned run (see offload_study.plan.expand_plan)."""
    zero = dict(SEED_ZERO3)
    zero.update({k: normalize_number(v) for k, v in run.zero.items()})
    for kind, device in (("optimizer", run.offload_optimizer), ("param", run.offload_param)):
        block = offload_block(device, run.nvme_path, run.pin_memory)
        if block:
            zero[f"offload_{kind}"] = block
    config = {
        "train_batch_size": run.global_batch,
        "train_micro_batch_size_per_gpu": run.micro_batch,
        "gradient_accumulation_steps": run.gradient_accumulation_steps,
        "zero_optimization": zero,
        "optimizer": {
            "type": run.optimizer.type,
            "params": {"lr": run.optimizer.lr, "weight_decay": run.optimizer.weight_decay},
        },
        "gradient_clipping": 1.0,
        # Per-step forward/backward/step timers: the report's step-time breakdown comes from them.
        "wall_clock_breakdown": True,
        "steps_per_print": 1,
    }
    if run.dtype == "fp16":
        config["fp16"] = dict(SEED_FP16)
    elif run.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if run.uses_nvme and run.aio:
        config["aio"] = {k: normalize_number(v) for k, v in run.aio.items()}
    return config


def rewrite_nvme_path(ds_config: dict, nvme_dir: str) -> bool:
    """Point every nvme offload block of a DS config at nvme_dir; True if any uses nvme."""
    zero = ds_config.get("zero_optimization", {}) or {}
    used = False
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        if isinstance(block, dict) and block.get("device") == "nvme":
            block["nvme_path"] = nvme_dir
            used = True
    return used


class _DataParallelWorld:
    """Tells DeepSpeed's config parser the data-parallel world size without starting torch.distributed."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def ensure_single_process_comm() -> None:
    """DeepSpeedConfig only honours the data-parallel size it is told once deepspeed.comm is up:
    start a one-process gloo group on a free port, leaving the caller's environment as it was."""
    from deepspeed import comm

    if comm.is_initialized():
        return
    single = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    saved = {key: os.environ.get(key) for key in single}
    os.environ.update(single)
    try:
        comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def parse_with_deepspeed(config: dict, world_size: int):
    """Run real DeepSpeed's own config parser (batch arithmetic, pydantic key checks)."""
    ensure_single_process_comm()
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config, mpu=_DataParallelWorld(world_size))
