"""A recommend study's candidate scenarios: every engine's offload paths, as the engine registry
offers them to a recommendation (offload_study.engines: each path's ``grid``), x the grid of the
study's ``recommend`` block (engines, offload modes, partial-offload ratio, micro-batch, ZeRO
knobs), as scenarios named ``rec-<engine>-<path>...``, each capped at the budget (schema:
``schemas/study.schema.yaml``; the search itself: offload_study.prediction.recommend). Part of
loading the study, before it is expanded.

A candidate that its engine's admission refuses on the cluster (an offload path that needs a
CUDA GPU, on a CPU cluster; a mode the installed DeepSpeed lacks) is left out, in the engine's
words; an engine without a ZeRO block is searched without the grid's ZeRO knobs.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from offload_study import engines
from offload_study.core.study import StudyError, load_schema, load_study
from offload_study.core.yamlsafe import normalize_number
from offload_study.planning.names import KNOB_ABBREV, expanded_name, format_value

_GRID = load_schema("study")["properties"]["recommend"]["properties"]["grid"]["properties"]
PREFIX = "rec-"
#: The grid's offload modes (the schema's enum) by what a path offloads: (offload_optimizer,
#: offload_param) -> mode. A grid entry that sets one of the other modes, each a scenario key
#: (zenflow, super_offload), is that mode.
DEVICE_MODES = {
    ("none", "none"): "none",
    ("cpu", "none"): "optimizer",
    ("cpu", "cpu"): "optimizer+param",
}
MODES: tuple[str, ...] = tuple(_GRID["offload"]["items"]["enum"])
OFFLOAD_KEYS = ("offload_optimizer", "offload_param")
#: the grid's one key that refines an offload path (on the paths that take it)
RATIO = "offload_optimizer_ratio"


@dataclass(frozen=True)
class Entry:
    """One thing a recommendation may try: an engine's offload path with its scenario keys."""

    engine: engines.Engine
    path: engines.OffloadPath
    keys: dict  # scenario keys, the offload devices included; ``label``: the entry in words

    @property
    def mode(self) -> str | None:
        """The grid's offload mode this entry is (None: none of the schema's)."""
        named = [k for k in self.keys if k in MODES]
        devices = tuple(self.keys.get(k, "none") for k in OFFLOAD_KEYS)
        return named[0] if named else DEVICE_MODES.get(devices)

    @property
    def base(self) -> str:
        """The candidate's name before its knobs: rec-<engine>-<path>[-<mode key>...]."""
        parts = [f"{PREFIX}{self.engine.name}-{self.path.name}"]
        for key, value in self.keys.items():
            if key not in (*OFFLOAD_KEYS, "label"):
                shown = "" if value is True or isinstance(value, dict) else format_value(value)
                parts.append(f"{KNOB_ABBREV.get(key, key)}{shown}")
        return "-".join(parts)

    @property
    def label(self) -> str:
        """The entry in words: the engine's label and the path's (or the entry's own)."""
        return f"{self.engine.label} — {self.keys.get('label') or self.path.label}"


@dataclass(frozen=True)
class Candidate:
    scenario: dict  # as a study writes it
    engine: str
    group: str  # engine x offload path x mode x ratio: what "the best of each" is counted by
    mode: str


def entries() -> list[Entry]:
    """Every engine x offload path x scenario keys the registry offers a recommendation: the
    engine's own ``grid`` (its path found by the offload keys) and each path's."""
    out = []
    for engine in engines.engines():
        for keys in engine.grid:
            path = engine.path(*(keys.get(k, "none") for k in OFFLOAD_KEYS))
            if path is None:
                raise RuntimeError(f"engine {engine.name}: grid entry {keys} has no offload path")
            out.append(Entry(engine, path, dict(keys)))
        for path in engine.paths:
            devices = dict(zip(OFFLOAD_KEYS, path.devices, strict=True))
            out += [Entry(engine, path, {**devices, **keys}) for keys in path.grid]
    return out


@functools.cache
def _labels() -> dict[str, str]:
    return {entry.base: entry.label for entry in entries()}


def label_of(name: str) -> str | None:
    """A candidate's engine and offload path in words, from its name alone (None: not one of
    this registry's)."""
    return _labels().get(name.split("__")[0])


# --------------------------------------------------------------------------- 1. the grid
def _variants(entry: Entry, ratios: list[float]) -> list[tuple[dict, str]]:
    """(scenario keys, group) of an entry and of each partial-offload ratio its path takes (on
    the entry that sets none of the path's own keys)."""
    keys = {k: v for k, v in entry.keys.items() if k != "label"}
    out = [(keys, entry.base)]
    if RATIO in entry.path.keys and not entry.path.keys & set(keys):
        for ratio in (r for r in ratios if r != 1):
            out.append(({**keys, RATIO: ratio}, expanded_name(entry.base, {RATIO: ratio})))
    return out


def _raw(study: dict, grid: dict) -> list[Candidate]:
    """Every candidate of the grid, each with the grid's ZeRO knobs."""
    rec = study["recommend"]
    wanted = grid["engine"] or engines.names()
    micro = grid.get("micro_batch") or [study["micro_batch"]]
    knobs = {"micro_batch": micro, **grid["zero"]}
    combos = [dict(zip(knobs, v, strict=True)) for v in itertools.product(*knobs.values())]
    base = {
        "gpus_per_node": rec["gpus_per_node"],
        "nodes": rec["nodes"],
        "gpu_mem_gb": rec["gpu_mem_gb"],
        "cpu_mem_gb": rec["cpu_mem_gb"],
    }
    out = []
    for entry in entries():
        if entry.engine.name not in wanted or entry.mode not in grid["offload"]:
            continue
        for (keys, group), combo in itertools.product(_variants(entry, grid[RATIO]), combos):
            zero = {k: normalize_number(v) for k, v in combo.items() if k != "micro_batch"}
            named = {k: v for k, v in keys.items() if k == RATIO} | combo
            scenario = {
                "name": expanded_name(entry.base, named),
                "label": entry.label,
                **base,
                "engine": entry.engine.name,
                **keys,
                "micro_batch": combo["micro_batch"],
                **({"zero": zero} if zero else {}),
            }
            out.append(Candidate(scenario, entry.engine.name, group, entry.mode))
    return out


def _problems(study: dict, cluster: dict, scenarios: list[dict]) -> list[list[str]]:
    """What each candidate's engine says against it on the cluster ("key: why" lines)."""
    if not scenarios:
        return []
    loaded = load_study({**study, "scenarios": scenarios})["scenarios"]
    out = []
    for scenario in loaded:
        name = scenario["name"]
        found = engines.get(scenario["engine"]).scenario_problems(study, scenario, cluster, name)
        out.append([p.removeprefix(f"{name}.") for p in found])
    return out


def _without_zero(candidate: Candidate) -> Candidate:
    """The candidate for an engine without a ZeRO block: its name and keys without the knobs."""
    scenario = {k: v for k, v in candidate.scenario.items() if k != "zero"}
    named = {k: scenario[k] for k in (RATIO, "micro_batch") if k in scenario}
    scenario["name"] = expanded_name(candidate.group.split("__")[0], named)
    return Candidate(scenario, candidate.engine, candidate.group, candidate.mode)


def grid(study: dict, cluster: dict) -> tuple[list[Candidate], list[dict]]:
    """The candidates of a study's recommend block on a cluster, and those left out (each
    {engine, label, why}, once per engine and offload path); ([], []) without the block."""
    rec = study.get("recommend")
    if not rec:
        return [], []
    settings = {k: v.get("default") for k, v in _GRID.items()} | rec["grid"]
    raw = _raw(study, settings)
    if len(raw) > rec["max_candidates"]:
        raise StudyError(
            f"recommend.grid: {len(raw)} candidates, more than recommend.max_candidates "
            f"({rec['max_candidates']}); shrink the grid or raise the limit"
        )
    kept: dict[str, Candidate] = {}
    left_out: dict[tuple[str, str], dict] = {}
    for candidate, found in zip(
        raw, _problems(study, cluster, [c.scenario for c in raw]), strict=True
    ):
        typos = [p for p in found if p.startswith("zero.")]
        if typos:
            raise StudyError(f"recommend.grid.{typos[0]}")
        if any(p.startswith("zero:") for p in found):  # the engine has no ZeRO block
            candidate = _without_zero(candidate)
            found = [p for p in found if not p.startswith("zero:")]
        if found:
            why = "; ".join(found)
            label = candidate.scenario["label"]
            left_out[label, why] = {"engine": candidate.engine, "label": label, "why": why}
        else:
            kept.setdefault(candidate.scenario["name"], candidate)
    if raw and not kept:
        whys = "; ".join(f"{o['label']}: {o['why']}" for o in left_out.values())
        raise StudyError(
            f"recommend.grid: no candidate can run on cluster {cluster['name']}: {whys}"
        )
    return list(kept.values()), list(left_out.values())


def why_not_here(study: dict, cluster: dict, name: str) -> str | None:
    """Why this machine has no candidate ``name`` that a search's files name (a results folder
    planned where the candidate's engine could run it: a package installed there, not here), in
    the engine's words; None when the name is no candidate this machine leaves out."""
    label = label_of(name)
    if label is None or not study.get("recommend"):
        return None
    whys = [o["why"] for o in grid(study, cluster)[1] if o["label"] == label]
    return f"this machine leaves {label} out: {whys[0]}" if whys else None


def candidates(study: dict, cluster: dict) -> list[dict]:
    """The candidate scenarios of a study's recommend block (empty without one)."""
    return [c.scenario for c in grid(study, cluster)[0]]


def with_candidates(study: dict, cluster: dict, source: str | None = None) -> dict:
    """The study with its candidate scenarios after its own (validated again, defaults filled);
    the study itself when it has no recommend block."""
    found = candidates(study, cluster)
    if not found:
        return study
    clash = {s["name"] for s in study["scenarios"]} & {c["name"] for c in found}
    if clash:
        raise StudyError(f"scenarios: {sorted(clash)[0]!r}: the prefix {PREFIX!r} is recommend's")
    return load_study({**study, "scenarios": study["scenarios"] + found}, source=source)
