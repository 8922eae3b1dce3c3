"""A recommend study's candidate scenarios: the grid of its ``recommend`` block (offload mode x
partial-offload ratio x micro-batch x ZeRO knobs) as scenarios named ``rec-...``, each capped at
the budget (schema: ``schemas/study.schema.yaml``; the search itself:
offload_study.prediction.recommend). Part of loading the study, before it is expanded.
"""

from __future__ import annotations

import itertools

from offload_study.core.study import StudyError, load_schema, load_study
from offload_study.core.yamlsafe import normalize_number
from offload_study.planning.names import expanded_name

_GRID = load_schema("study")["properties"]["recommend"]["properties"]["grid"]["properties"]
#: grid offload mode -> (name slug, scenario keys); its keys are the schema's enum (a test checks).
OFFLOAD_MODES: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "optimizer": ("opt", {"offload_optimizer": "cpu"}),
    "optimizer+param": ("optparam", {"offload_optimizer": "cpu", "offload_param": "cpu"}),
    "zenflow": ("zenflow", {"offload_optimizer": "cpu", "zenflow": {}}),
    "super_offload": ("super", {"offload_optimizer": "cpu", "super_offload": True}),
}
PREFIX = "rec-"


# --------------------------------------------------------------------------- 1. the grid
def _modes(grid: dict) -> list[tuple[str, dict]]:
    """(mode label, scenario keys) per offload mode and ratio of the grid."""
    out = []
    for mode in grid["offload"]:
        slug, keys = OFFLOAD_MODES[mode]
        out.append((slug, dict(keys)))
        if mode == "optimizer":
            for ratio in grid["offload_optimizer_ratio"]:
                if ratio != 1:
                    out.append((f"opt-r{ratio:g}", {**keys, "offload_optimizer_ratio": ratio}))
    return out


def candidates(study: dict) -> list[dict]:
    """The candidate scenarios of a study's recommend block (empty without one)."""
    rec = study.get("recommend")
    if not rec:
        return []
    grid = {k: v.get("default") for k, v in _GRID.items()} | rec["grid"]
    micro = grid.get("micro_batch") or [study["micro_batch"]]
    knobs = {"micro_batch": micro, **grid["zero"]}
    combos = [
        dict(zip(knobs, values, strict=True)) for values in itertools.product(*knobs.values())
    ]
    base = {"gpus_per_node": rec["gpus_per_node"], "nodes": rec["nodes"],
            "gpu_mem_gb": rec["gpu_mem_gb"], "cpu_mem_gb": rec["cpu_mem_gb"]}  # fmt: skip
    out = []
    for (slug, keys), combo in itertools.product(_modes(grid), combos):
        zero = {k: normalize_number(v) for k, v in combo.items() if k != "micro_batch"}
        out.append({
            "name": expanded_name(PREFIX + slug, combo), "label": f"candidate {slug}", **base,
            **keys, "micro_batch": combo["micro_batch"], **({"zero": zero} if zero else {}),
        })  # fmt: skip
    return out


def with_candidates(study: dict, source: str | None = None) -> dict:
    """The study with its candidate scenarios after its own (validated again, defaults filled);
    the study itself when it has no recommend block."""
    found = candidates(study)
    if not found:
        return study
    limit = study["recommend"]["max_candidates"]
    if len(found) > limit:
        raise StudyError(
            f"recommend.grid: {len(found)} candidates, more than recommend.max_candidates "
            f"({limit}); shrink the grid or raise the limit"
        )
    clash = {s["name"] for s in study["scenarios"]} & {c["name"] for c in found}
    if clash:
        raise StudyError(f"scenarios: {sorted(clash)[0]!r}: the prefix {PREFIX!r} is recommend's")
    return load_study({**study, "scenarios": study["scenarios"] + found}, source=source)
