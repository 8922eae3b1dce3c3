"""DeepSpeed config generation: the seed's production ZeRO-3 config plus each scenario's offload.

What the *installed* DeepSpeed accepts is read here and only here: its config classes, read
from its source with ``ast`` (cached) so that admission does not pay for ``import deepspeed``
(seconds, and a GPU probe); admission (offload_study.admission.admit) asks the check_* functions.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.metadata
import importlib.util
import math
import re
import sys
from pathlib import Path

from offload_study.core.contracts import RunSpec
from offload_study.core.study import StrictValidator, StudyError, shown
from offload_study.core.units import MAX_INT64
from offload_study.core.yamlsafe import NUMBER_TEXT, normalize_number
from offload_study.planning import modes

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


def _deepspeed_dir() -> Path | None:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


@dataclasses.dataclass(frozen=True)
class Knob:
    """What a DeepSpeed config key takes, read from its pydantic field (or aio default).

    kind: int | float | bool | other (an enum or a nested block: left to DeepSpeed's parser);
    ge/gt/le: the field's bounds; replaced_by: the new key of a deprecated alias.
    """

    kind: str
    nullable: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    replaced_by: str | None = None
    sets_new: bool = False  # the alias sets replaced_by (cpu_offload: true -> CPU offload on)


def _annotation_kind(node: ast.expr) -> tuple[str, bool]:
    """(kind, nullable) of an annotation: int, Optional[bool], ... ("other" for the rest)."""
    nullable = False
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Optional":
        node, nullable = node.slice, True
    name = node.id if isinstance(node, ast.Name) else ""
    return (name if name in ("int", "float", "bool") else "other"), nullable


def _field_knob(stmt: ast.AnnAssign) -> tuple[Knob, str | None]:
    """The Knob of one class field and its alias (None when it has none)."""
    kind, nullable = _annotation_kind(stmt.annotation)
    bounds, alias, deprecated = {}, None, {}
    keywords = stmt.value.keywords if isinstance(stmt.value, ast.Call) else []
    for kw in keywords:
        if kw.arg in ("ge", "gt", "le") and isinstance(kw.value, ast.Constant):
            bounds[kw.arg] = kw.value.value
        elif kw.arg == "alias" and isinstance(kw.value, ast.Constant):
            alias = kw.value.value
        elif kw.arg == "json_schema_extra" and isinstance(kw.value, ast.Dict):
            deprecated = _deprecation(kw.value)
    return Knob(kind, nullable, **bounds, **deprecated), alias


def _deprecation(extra: ast.Dict) -> dict:
    """replaced_by/sets_new of a field's json_schema_extra ({} when not deprecated)."""
    keys = [k.value if isinstance(k, ast.Constant) else None for k in extra.keys]
    values = dict(zip(keys, extra.values, strict=True))
    flag, new = values.get("deprecated"), values.get("new_param")
    if not (
        isinstance(flag, ast.Constant) and flag.value is True and isinstance(new, ast.Constant)
    ):
        return {}
    return {"replaced_by": new.value, "sets_new": "new_param_fn" in values}


def _class_knobs(source: str, class_name: str) -> dict[str, Knob]:
    """Field names and aliases of a pydantic model class, read from source text."""
    knobs: dict[str, Knob] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    knob, alias = _field_knob(stmt)
                    knobs[stmt.target.id] = knob
                    if alias:
                        knobs[alias] = knob
    return knobs


def _aio_knobs(source: str) -> dict[str, Knob]:
    """aio keys (constants AIO_X = "key") with the kind of their AIO_X_DEFAULT."""
    constants = {
        node.targets[0].id: node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    kinds = {bool: "bool", int: "int", float: "float"}
    # ge=1: a block size, queue depth or thread count of 0 is not a setting (DeepSpeed takes it).
    return {
        key: Knob(kinds.get(type(constants.get(f"{name}_DEFAULT")), "other"), ge=1)
        for name, key in constants.items()
        if re.fullmatch(r"AIO_[A-Z_]+", name)
        and not name.endswith(("_DEFAULT", "_FORMAT"))
        and name != "AIO"
    }


@functools.lru_cache(maxsize=4)
def _parse_knobs(ds: Path) -> dict[str, dict[str, Knob]]:
    zero_src = (ds / "runtime/zero/config.py").read_text()
    offload_src = (ds / "runtime/zero/offload_config.py").read_text()
    return {
        "zero": _class_knobs(zero_src, "DeepSpeedZeroConfig"),
        "offload_param": _class_knobs(offload_src, "DeepSpeedZeroOffloadParamConfig"),
        "offload_optimizer": _class_knobs(offload_src, "DeepSpeedZeroOffloadOptimizerConfig"),
        "aio": _aio_knobs((ds / "runtime/swap_tensor/constants.py").read_text()),
    }


def installed_knobs() -> dict[str, dict[str, Knob]]:
    """ZeRO, offload and aio keys of the installed DeepSpeed, each with what it takes.

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
    return _parse_knobs(ds)


@functools.lru_cache(maxsize=1)
def installed_key_names() -> dict[str, set[str]]:
    """ZeRO, offload and aio key names of the installed DeepSpeed."""
    return {block: set(knobs) for block, knobs in installed_knobs().items()}


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
    names = installed_key_names()
    zenflow_src = _deepspeed_dir() / "runtime/zenflow/zenflow_config.py"
    zenflow = set()
    if zenflow_src.exists():
        zenflow = set(_class_knobs(zenflow_src.read_text(), "ZenFlowConfig"))
    return {  # a ZeRO config naming zenflow without its ZenFlowConfig: no ZenFlow either
        "zero_optimization": names["zero"] - (set() if zenflow else {"zenflow"}),
        "zero_optimization.offload_optimizer": names["offload_optimizer"],
        "zero_optimization.zenflow": zenflow - ZENFLOW_INTERNAL,
    }


def _version_errors(key: str, where: str) -> list[str]:
    section, _, field = modes.DEEPSPEED_KEYS[key].rpartition(".")
    if field in installed_fields()[section]:
        return []
    return [
        f"{where}.{key}: the installed DeepSpeed {deepspeed_version()} has no "
        f"{modes.DEEPSPEED_KEYS[key]} (its config classes lack '{field}'); install a DeepSpeed "
        "that has it or remove the key"
    ]


def _zenflow_errors(block: dict, where: str) -> list[str]:
    known = installed_fields()["zero_optimization.zenflow"]
    return [
        f"{where}.zenflow.{key}: not a key of the installed DeepSpeed {deepspeed_version()}'s "
        f"ZenFlowConfig (keys: {', '.join(sorted(known))})"
        for key in block
        if key not in known
    ]


def _mode_sweep_errors(scenario: dict, where: str) -> list[str]:
    errors = []
    for knob, values in scenario.get("sweep", {}).items():
        if knob not in modes.SWEEPABLE:
            continue
        validator = StrictValidator(modes.SCENARIO_KEYS[knob])  # exact types (1.0 is no int)
        for value in values:
            errors += [
                f"{where}.sweep.{knob}: {value!r}: {err.message}"
                for err in validator.iter_errors(value)
            ]
    return errors


def _needs_errors(scenario: dict, key: str, where: str) -> list[str]:
    """A mode that refines another (modes.NEEDS) without it, own or swept."""
    needed = modes.NEEDS.get(key)
    values = [scenario.get(needed), *scenario.get("sweep", {}).get(needed, [])] if needed else []
    if not needed or any(modes.is_set(needed, v) for v in values):
        return []
    return [f"{where}.{key}: needs {needed}: true (it refines that mode)"]


def check_modes(scenario: dict, where: str) -> list[str]:
    """Errors for the scenario's mode keys (own and swept; offload_study.planning.modes): the
    installed DeepSpeed must have them, they need the optimizer offloaded to the CPU, and sweep
    values must be valid."""
    errors = _mode_sweep_errors(scenario, where)
    swept = scenario.get("sweep", {})
    for key in modes.DEEPSPEED_KEYS:
        if not any(modes.is_set(key, v) for v in [scenario.get(key), *swept.get(key, [])]):
            continue
        errors += _version_errors(key, where) + _needs_errors(scenario, key, where)
        if scenario["offload_optimizer"] != "cpu":
            errors.append(
                f"{where}.{key}: needs offload_optimizer: cpu (the scenario has "
                f"{scenario['offload_optimizer']!r})"
            )
    if isinstance(scenario.get("zenflow"), dict) and not _version_errors("zenflow", where):
        errors += _zenflow_errors(scenario["zenflow"], where)
    return errors


def _unknown_key_message(where: str, key: str, known) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}.{key}: not a key of the installed DeepSpeed's {where.split('.')[-1]}{hint}"


#: Above this no size fits DeepSpeed's 64-bit integers.
MAX_INT = MAX_INT64


def _positive_only(key: str) -> bool:
    """Sizes that must be >= 1 (stricter than DeepSpeed, which takes 0 for some: 0 elements
    per bucket or sub-group is a typo, not a setting worth measuring)."""
    return key.endswith(("bucket_size", "sub_group_size", "buffer_size", "buffer_count"))


def knob_value_problem(key: str, knob: Knob, value) -> str | None:
    """Why ``value`` cannot be given to DeepSpeed's ``key`` (None when it can).

    Stricter than DeepSpeed's parser: booleans are not numbers, text is not a number (YAML 1.1
    reads ``5e8`` without a dot as the text '5e8'), a count has no fraction.
    """
    if knob.kind == "other" or (value is None and knob.nullable):
        return None
    if knob.kind == "bool":
        ok = isinstance(value, bool)
        return None if ok else f"{shown(value)} is not a boolean; allowed: true or false"
    allowed = f"allowed: {_range_text(key, knob)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{shown(value)} is not a number{_text_hint(value)}; {allowed}"
    if not math.isfinite(value) or (knob.kind == "int" and value != int(value)):
        return f"{value!r} is not allowed; {allowed}"
    if knob.kind == "int" and abs(value) > MAX_INT:
        return f"{value!r} does not fit DeepSpeed's 64-bit integers; {allowed}"
    low = 1 if _positive_only(key) else knob.ge
    if (
        (low is not None and value < low)
        or (knob.gt is not None and value <= knob.gt)
        or (knob.le is not None and value > knob.le)
    ):
        return f"{value!r} is out of range; {allowed}"
    return None


def _text_hint(value) -> str:
    """What to write instead of a number given as text."""
    if not (isinstance(value, str) and NUMBER_TEXT.match(value.strip())):
        return ""
    if "e" in value.lower() and "." not in value:
        return f" (YAML reads {value} without a dot as text: write {float(value):.1e} or {float(value):.0f})"
    return " (write it without quotes)"


def _range_text(key: str, knob: Knob) -> str:
    what = "a whole number" if knob.kind == "int" else "a number"
    if _positive_only(key) or (knob.ge is None and knob.gt is None):
        low = ">= 1" if _positive_only(key) else ""
    else:
        low = f">= {knob.ge}" if knob.ge is not None else f"> {knob.gt}"
    high = f"<= {knob.le}" if knob.le is not None else ""
    return f"{what} {' and '.join(b for b in (low, high) if b)}".strip()


def _deprecated_message(where: str, key: str, knob: Knob) -> str:
    new = knob.replaced_by
    managed = any(k in new for k in MANAGED_ZERO_KEYS)
    instead = (
        "the scenario's offload_optimizer, offload_param and pin_memory keys"
        if managed
        else repr(new)
    )
    effect = ": true switches CPU offload on" if knob.sets_new and managed else ""
    return (
        f"{where}.{key}: a deprecated DeepSpeed alias (DeepSpeed maps it to {new}{effect}); "
        f"use {instead} instead"
    )


def _key_problem(knobs: dict[str, Knob], key: str, value, where: str) -> str | None:
    """The error of one key: unknown, deprecated alias, or a value DeepSpeed must not get."""
    if key not in knobs:
        return _unknown_key_message(where, key, knobs)
    if knobs[key].replaced_by:
        return _deprecated_message(where, key, knobs[key])
    problem = knob_value_problem(key, knobs[key], value)
    return f"{where}.{key}: {problem}" if problem else None


def check_block_values(values: dict, block: str, where: str) -> list[str]:
    """One error per key of ``values`` that the installed DeepSpeed's ``block`` (zero,
    offload_param, offload_optimizer, aio) does not know, or whose value it must not get."""
    knobs = installed_knobs()[block]
    problems = (_key_problem(knobs, key, value, where) for key, value in values.items())
    return [p for p in problems if p]


def check_zero_keys(knobs: dict, where: str) -> list[str]:
    """Errors for ZeRO knob overrides DeepSpeed would reject, that are deprecated aliases or
    that the scenario manages (key and value)."""
    managed = [
        f"{where}.{key}: set by the scenario (stage is always 3; use "
        "offload_optimizer/offload_param of the scenario), not a ZeRO override"
        for key in knobs
        if key in MANAGED_ZERO_KEYS
    ]
    rest = {k: v for k, v in knobs.items() if k not in MANAGED_ZERO_KEYS}
    return managed + check_block_values(rest, "zero", where)


def check_sweep_values(knob: str, values: list, where: str) -> list[str]:
    """A ZeRO knob swept over ``values`` (``where``: the scenario's sweep): the key, then each
    value as if it were set in zero: (errors name sweep.<knob>[i])."""
    known = installed_knobs()["zero"]
    if knob in MANAGED_ZERO_KEYS or knob not in known or known[knob].replaced_by:
        return check_zero_keys({knob: None}, where)
    problems = (knob_value_problem(knob, known[knob], value) for value in values)
    return [f"{where}.{knob}[{i}]: {p}" for i, p in enumerate(problems) if p]


def check_aio_keys(aio: dict, where: str = "aio") -> list[str]:
    """aio keys by their installed names (an old name DeepSpeed ignores is refused) and values."""
    known = installed_knobs()["aio"]
    old = {k for k in aio if k in RENAMED_AIO_KEYS and k not in known}
    return [
        f"{where}.{key}: DeepSpeed ignores this name; use {RENAMED_AIO_KEYS[key]}" for key in old
    ] + check_block_values({k: v for k, v in aio.items() if k not in old}, "aio", where)


def offload_block(device: str, nvme_path: str | None, pin_memory: bool | None) -> dict | None:
    """pin_memory None: left out, so the installed DeepSpeed's default holds."""
    if device == "none":
        return None
    block = {"device": device}
    if pin_memory is not None:
        block["pin_memory"] = pin_memory
    if device == "nvme":
        block["nvme_path"] = nvme_path
    return block


def build_ds_config(run: RunSpec) -> dict:
    """The DeepSpeed config of one planned run (see offload_study.planning.plan.expand_plan)."""
    zero = dict(SEED_ZERO3)
    zero.update({k: normalize_number(v) for k, v in run.zero.items()})
    for kind, device in (("optimizer", run.offload_optimizer), ("param", run.offload_param)):
        block = offload_block(device, run.nvme_path, run.pin_memory)
        if block:
            zero[f"offload_{kind}"] = block
    modes.apply(zero, run.modes)  # ratio, SuperOffload, ZenFlow (offload_study.planning.modes)
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
    start a one-process gloo group, which deepspeed.comm then adopts. Its store lives in memory,
    not on a port: a port chosen free can be taken before the group binds it when other runs
    start beside this one."""
    import torch.distributed as dist
    from deepspeed import comm

    if comm.is_initialized():
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def parse_with_deepspeed(config: dict, world_size: int):
    """Run real DeepSpeed's own config parser (batch arithmetic, pydantic key checks)."""
    ensure_single_process_comm()
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config, mpu=_DataParallelWorld(world_size))
