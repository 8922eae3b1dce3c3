"""The reader's words for what a page shows: a scenario's settings, a sweep point, an outcome, a
GPU setup, each generated from the data, never an internal id.

A study names its scenarios for its YAML (``offload-opt-2gpu-80gb``) and the planner names sweep
points and recommend candidates for files (``rec-deepspeed-cpu-none__ratio-0.8__mb-8``). Pages
say the same in words: the study's label where it wrote one (a recommend candidate's is its
engine and offload path in words, the planner's), and the knobs in words after it ("offload
ratio 0.8, micro-batch 8"). A candidate of an older search, whose label the planner made
("candidate opt-r0.8"), gets its offload mode in words instead ("partial optimizer offload,
ratio 0.8").
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from offload_study.planning import candidates, names

#: A knob as a reader says it (study keys, sweep knobs, recommend's grid); a knob not here is
#: its key with spaces.
KNOB_WORDS = {
    "micro_batch": "micro-batch",
    "gradient_accumulation_steps": "gradient accumulation steps",
    "global_batch": "global batch",
    "reduce_bucket_size": "reduce bucket",
    "stage3_prefetch_bucket_size": "prefetch bucket",
    "prefetch_bucket_size": "prefetch bucket",
    "stage3_max_live_parameters": "live parameters",
    "stage3_param_persistence_threshold": "persistence threshold",
    "sub_group_size": "optimizer sub-group",
    "offload_optimizer_ratio": "offload ratio",
    "bind_cores": "cores bound",
    "pin_memory": "pinned host memory",
    "super_offload": "SuperOffload",
    "cpuadam_cores_perc": "SuperOffload's worker's share of the cores",
}
#: recommend's grid offload modes (the study schema's enum) in words.
MODE_WORDS = {
    "none": "no offload",
    "optimizer": "CPU optimizer offload",
    "optimizer+param": "CPU optimizer + parameter offload",
    "zenflow": "ZenFlow",
    "super_offload": "SuperOffload",
}
#: A run's outcome (contracts.OUTCOMES) as a reader says it; an outcome not here reads as itself.
OUTCOME_WORDS = {
    "ok": "ok",
    "gpu_oom": "ran out of GPU memory",
    "host_oom": "ran out of host memory",
    "nvme_full": "ran out of NVMe space",
    "timeout": "timed out",
    "error": "failed with an error",
    "infeasible": "predicted not to fit, not run",
    "missing": "left no record",
    "not run": "not run",
}
_ABBREV_KNOB = {abbrev: knob for knob, abbrev in names.KNOB_ABBREV.items()}
_CANDIDATE_LABEL = re.compile(r"candidate (\S+)")
_RATIO_SLUG = re.compile(r"(.+)-r([\d.]+)")
#: The offload modes of an older search's candidate names (before every engine was searched).
_SLUG_MODES = {
    "none": "none",
    "opt": "optimizer",
    "optparam": "optimizer+param",
    "zenflow": "zenflow",
    "super": "super_offload",
}


def knob(key: str, value) -> str:
    """'micro-batch 8', 'reduce bucket 5e8'."""
    words = KNOB_WORDS.get(key, key.replace("_", " "))
    return f"{words} {names.format_value(value) if not isinstance(value, str) else value}"


def name_knobs(name: str) -> dict[str, str]:
    """The knobs a planner-made name carries after its base ('x__mb-8__rbs-5e8' ->
    {micro_batch: '8', reduce_bucket_size: '5e8'}); {} for a name without them."""
    out = {}
    for part in name.split("__")[1:]:
        abbrev, _, value = part.partition("-")
        out[_ABBREV_KNOB.get(abbrev, abbrev)] = value
    return out


def sweep_words(scenario: str, sweep: Mapping) -> str:
    """The sweep point in words: the sweep's knobs, else the knobs in the planner's name (a
    recommend candidate's grid point has no sweep)."""
    knobs = dict(sweep) or name_knobs(scenario)
    return ", ".join(knob(k, v) for k, v in knobs.items())


def candidate_words(label: str) -> str | None:
    """A recommend candidate's planner-made label ('candidate opt-r0.8') in words ('partial CPU
    optimizer offload, ratio 0.8'); None for any other label (the study's words stand)."""
    found = _CANDIDATE_LABEL.fullmatch(label or "")
    if not found:
        return None
    slug, ratio = found.group(1), None
    if (split := _RATIO_SLUG.fullmatch(slug)) and split.group(1) in _SLUG_MODES:
        slug, ratio = split.groups()
    mode = _SLUG_MODES.get(slug)
    if mode is None:
        return None
    words = MODE_WORDS.get(mode, mode)
    return f"partial {words}, ratio {ratio}" if ratio else words


def reader_label(label: str, scenario: str) -> str:
    """The label a page shows: the study's, a candidate's in words (by its planner-made label,
    or its name where no label came with it), else the scenario's name."""
    if not label and scenario.startswith(candidates.PREFIX):
        slug = scenario.split("__")[0][len(candidates.PREFIX) :]
        label = candidates.label_of(scenario) or f"candidate {slug}"
    return candidate_words(label) or label or scenario


def outcome(name: str | None) -> str:
    return OUTCOME_WORDS.get(str(name), str(name)) if name else "no record"


def outcomes(counts: str | None) -> str:
    """collect's 'ok:1, infeasible:1' as '1 ok, 1 predicted not to fit, not run'."""
    parts = []
    for item in (counts or "").split(","):
        name, _, n = item.strip().rpartition(":")
        if name:
            parts.append(f"{n} {outcome(name)}")
        elif item.strip():
            parts.append(outcome(item.strip()))
    return ", ".join(parts) or "no record"


def gib(value, digits: int | None = None) -> str:
    """'80 GiB', '140.4 GiB': whole numbers without decimals, else one."""
    x = float(value)
    if digits is None:
        digits = 0 if x == round(x) else 1
    return f"{x:,.{digits}f} GiB"


def gpu_setup(gpus, cap_gib, usable_gib, unit: str = "GPU") -> str:
    """'2 GPUs × 80 GiB' (a cap), '2 GPUs × 140.4 GiB (the whole card)', '8 ranks'."""
    count = f"{int(gpus)} {unit}" + ("s" if gpus and int(gpus) != 1 else "") if gpus else unit + "s"
    if cap_gib is not None:
        return f"{count} × {gib(cap_gib)}"
    if usable_gib is not None:
        return f"{count} × {gib(usable_gib, 1)} (the whole card)"
    return count
