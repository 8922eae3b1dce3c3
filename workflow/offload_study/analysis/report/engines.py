"""The report's engines block, for a study with more than one engine: every engine x offload path
it ran side by side, and at each GPU memory level the fastest engine.

Per scenario: its engine and offload path in words (the engine registry's labels), tokens/s with
its 95 % CI (collect's summary), peak GPU memory (allocated, reserved), peak host memory per node
(each rank with its worker processes), and where a step's time goes (the harness's forward,
backward and optimizer parts, timed alike for every engine: metrics.json ``step_breakdown_ms``).

A memory level is a scenario's measured peak reserved GPU memory: at each level, among the
scenarios on the same GPUs that stayed within it, the fastest of each engine; the fastest engine
is compared with the next engine's best by the paired ratio of their tokens/s, repeat k with
repeat k (collect.paired_ratio, the rule of the vs-pair column), with its verdict word
(core.verdict) and the part of the step whose time differs most. A level whose answer is the
level below's is left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from offload_study import engines
from offload_study.analysis import collect
from offload_study.core import contracts, verdict

PART_NAMES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}
N_BOOT = 2000


def path_label(engine: str, offload_optimizer, offload_param) -> str:
    """An offload path in words: the engine's own label for it, else the offload keys."""
    try:
        path = engines.get(engine).path(offload_optimizer, offload_param)
    except engines.UnknownEngine:
        path = None
    if path is not None:
        return path.label
    return f"optimizer offload: {offload_optimizer}, parameter offload: {offload_param}"


def _num(row: Mapping, key: str) -> float | None:
    return verdict.finite_or_none(row.get(key))


def _row_view(row: Mapping) -> dict:
    engine = contracts.engine_of(row)
    return {
        "scenario": row["scenario"],
        "label": row.get("label") or row["scenario"],
        "engine": engines.label(engine),
        "engine_name": engine,
        "path": path_label(engine, row.get("offload_optimizer"), row.get("offload_param")),
        "world_size": _num(row, "world_size"),
        "n_ok": int(_num(row, "n_ok") or 0),
        "tokens_per_s": _num(row, "tokens_per_s"),
        "ci_low": _num(row, "tokens_per_s_ci_low"),
        "ci_high": _num(row, "tokens_per_s_ci_high"),
        "gpu_allocated_gib": _num(row, "peak_gpu_allocated_gib"),
        "gpu_reserved_gib": _num(row, "peak_gpu_reserved_gib"),
        "host_gib": collect.host_memory_gib(row),
        "parts_ms": {p: _num(row, f"step_breakdown_ms.{p}") for p in collect.STEP_PARTS},
    }


def _ok_runs(runs: pd.DataFrame, scenario: str) -> pd.DataFrame:
    return runs[(runs["scenario"] == scenario) & (runs["outcome"] == "ok")]


def _steps(ok: pd.DataFrame) -> dict[str, object]:
    """record_dir -> its measured steps' tokens/s (records still on disk)."""
    dirs = [d for d in ok.get("record_dir", pd.Series(dtype=object)).dropna() if Path(d).is_dir()]
    return {d: collect.read_step_speeds(d) for d in dirs}


def _biggest_difference(mine: dict, theirs: dict) -> str | None:
    diffs = [
        (abs(mine[p] - theirs[p]), p, mine[p] - theirs[p])
        for p in collect.STEP_PARTS
        if mine.get(p) is not None and theirs.get(p) is not None
    ]
    if not diffs:
        return None
    _, part, signed = max(diffs)
    more = "more" if signed > 0 else "less"
    return f"{PART_NAMES[part]}: {abs(signed):.0f} ms {more} per step"


def _ratio_view(runs: pd.DataFrame, mine: dict, theirs: dict) -> dict:
    a, b = _ok_runs(runs, mine["scenario"]), _ok_runs(runs, theirs["scenario"])
    point, lo, hi, pairs, how = collect.paired_ratio(
        a, b, _steps(pd.concat([a, b])), N_BOOT, seed=0
    )
    known = verdict.finite_or_none(point) is not None
    return {
        "ratio": verdict.finite_or_none(point),
        "pairs": pairs,
        "how": how,
        "word": verdict.speed(point, lo, hi) if known else None,
        "text": verdict.ratio_text(point, lo, hi) if known else None,
        "difference": _biggest_difference(mine["parts_ms"], theirs["parts_ms"]),
    }


def _measured(view: dict) -> bool:
    return view["n_ok"] > 0 and view["tokens_per_s"] is not None


def _fastest_by_engine(views: list[dict]) -> list[dict]:
    """Each engine's fastest scenario among ``views``, the fastest engine first."""
    best: dict[str, dict] = {}
    for v in views:
        if (
            v["engine_name"] not in best
            or v["tokens_per_s"] > best[v["engine_name"]]["tokens_per_s"]
        ):
            best[v["engine_name"]] = v
    return sorted(best.values(), key=lambda v: -v["tokens_per_s"])


def levels_view(runs: pd.DataFrame, views: list[dict]) -> list[dict]:
    """Per GPU count and memory level (ascending), the fastest engine within it against the
    next engine's best (None when only one engine ran within the level)."""
    out = []
    measured = [v for v in views if _measured(v) and v["gpu_reserved_gib"] is not None]
    for gpus in sorted({v["world_size"] or 0 for v in measured}):
        mine = [v for v in measured if (v["world_size"] or 0) == gpus]
        previous = None
        for level in sorted({v["gpu_reserved_gib"] for v in mine}):
            ranked = _fastest_by_engine([v for v in mine if v["gpu_reserved_gib"] <= level])
            key = tuple(v["scenario"] for v in ranked[:2])
            if key == previous:
                continue
            previous = key
            runner_up = ranked[1] if len(ranked) > 1 else None
            out.append(
                {
                    "gpus": int(gpus),
                    "level_gib": math.ceil(level * 10) / 10,
                    "fastest": ranked[0],
                    "runner_up": runner_up,
                    "ratio": _ratio_view(runs, ranked[0], runner_up) if runner_up else None,
                }
            )
    return out


def engines_view(runs: pd.DataFrame, summary: pd.DataFrame) -> dict | None:
    """Every scenario by GPU memory, and the fastest engine at each memory level; None when the
    study ran one engine."""
    if summary.empty:
        return None
    rows = summary.to_dict("records")
    if len({contracts.engine_of(r) for r in rows}) < 2:
        return None
    views = [_row_view(r) for r in rows]
    views.sort(
        key=lambda v: (
            v["world_size"] or 0,
            v["gpu_reserved_gib"] or math.inf,
            -(v["tokens_per_s"] or 0),
        )
    )
    return {"rows": views, "levels": levels_view(runs, views)}
