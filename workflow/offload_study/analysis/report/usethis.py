"""The page's answer to "what should I use?": for the study's cluster and model, the fastest
measured configuration at each GPU-memory level that fits, with its CI and its config to
download; where the data cannot decide, it says so. And the one sentence a result a reader
would not expect gets: what the step breakdown measured of it.

A memory level is the GPU memory per GPU a scenario was given: its cap (``gpu_mem_gb``), else the
whole card as the runs saw it. A configuration that ran within a level fits every larger one, so
each level picks among the scenarios at or below it, on the same number of GPUs. A pick is
undecided when another candidate's tokens/s CI reaches the pick's (their 95 % CIs overlap).
Scenarios flagged implausible or never measured are not candidates (analysis.sanity). Pure
functions over the scenario views.
"""

from __future__ import annotations

import math

from offload_study.analysis.report import words
from offload_study.analysis.report.views import Row, count_of, fmt_ci, isnum
from offload_study.core import contracts


def _level(v: Row) -> float:
    """The scenario's GPU memory per GPU (GiB); the whole card when unknown (infinite)."""
    level = v["memory_level_gib"]
    return float(level) if isnum(level) else math.inf


def _candidates(views: list[Row]) -> list[Row]:
    return [v for v in views if isnum(v["tokens_per_s"]) and v["n_ok"] and not v["blocking"]]


def _overlaps(a: Row, b: Row) -> bool:
    """Whether the tokens/s CIs of two scenarios overlap (no CI: the point itself)."""

    def ci(v):
        lo, hi = v["tokens_per_s_ci_low"], v["tokens_per_s_ci_high"]
        tps = float(v["tokens_per_s"])
        return (float(lo) if isnum(lo) else tps), (float(hi) if isnum(hi) else tps)

    (a_lo, a_hi), (b_lo, b_hi) = ci(a), ci(b)
    return a_lo <= b_hi and b_lo <= a_hi


def _level_words(level: float, pick: Row) -> str | None:
    """'24 GiB per GPU', 'the whole card (140.4 GiB)'; None for CPU ranks (no GPU memory)."""
    if pick["unit"] != "GPU":
        return None
    if math.isfinite(level) and level != pick["usable_gib"]:
        return f"{words.gib(level)} per GPU"
    card = pick["usable_gib"]
    return f"the whole card ({words.gib(card, 1)})" if isnum(card) else "the whole card"


def _choice(v: Row) -> dict:
    cautions = [f["title"] for f in v["flag_list"] if not f["blocks"]]
    return {
        "scenario": v["scenario"],
        "label": v["plot_label"],
        "cautions": cautions,
        "tokens": fmt_ci(v["tokens_per_s"], v["tokens_per_s_ci_low"], v["tokens_per_s_ci_high"]),
    }


def picks(views: list[Row]) -> list[dict]:
    """Per GPU count and memory level (ascending), the fastest candidate at or below it and the
    candidates whose CI overlaps it; a level whose pick is the smaller level's is left out."""
    out = []
    found = _candidates(views)
    for gpus in sorted({v["world_size"] or 0 for v in found}):
        mine = [v for v in found if (v["world_size"] or 0) == gpus]
        previous = None
        for level in sorted({_level(v) for v in mine}):
            fits = [v for v in mine if _level(v) <= level]
            best = max(fits, key=lambda v: float(v["tokens_per_s"]))
            if best is previous:
                continue
            previous = best
            rivals = [v for v in fits if v is not best and _overlaps(v, best)]
            rivals.sort(key=lambda v: -float(v["tokens_per_s"]))
            out.append(
                {
                    "gpus": gpus,
                    "level": _level_words(level, best),
                    "pick": _choice(best),
                    "rivals": [_choice(v) for v in rivals],
                }
            )
    return out


def use_this(views: list[Row], cluster: str, model: str) -> dict | None:
    """The block's data: {"on": whom it is for, "levels": picks(...)}; None when nothing was
    measured."""
    levels = picks(views)
    if not levels:
        return None
    counts = {p["gpus"] for p in levels}
    unit = views[0]["unit"] if views else "GPU"
    on = f"{cluster}, {model}"
    if len(counts) == 1 and next(iter(counts)):
        on += f", {count_of(next(iter(counts)), unit)}"
    return {"on": on, "levels": levels, "per_count": len(counts) > 1, "unit": unit}


# --------------------------------------------------------------------------- surprises
#: What a scenario moves off the GPU, for "offloads more" (a superset of the other's).
_MOVES = (("optimizer", "offload_optimizer"), ("parameters", "offload_param"))
#: The step's parts a sentence compares (DeepSpeed's timers, else the harness' own), in words.
PARTS = (
    ("forward", ("breakdown_ms.forward", "step_breakdown_ms.forward")),
    ("backward", ("breakdown_ms.backward", "step_breakdown_ms.backward")),
    ("optimizer step", ("breakdown_ms.step", "step_breakdown_ms.optimizer")),
)


def _moved(v: Row) -> frozenset[tuple[str, str]]:
    return frozenset((what, str(v[key])) for what, key in _MOVES if v[key] not in ("none", "?"))


def _part_ms(v: Row, columns: tuple[str, ...]) -> float | None:
    return next((float(v[c]) for c in columns if isnum(v[c])), None)


def _largest_difference(a: Row, b: Row) -> tuple[str, float, float] | None:
    parts = [(name, _part_ms(a, cols), _part_ms(b, cols)) for name, cols in PARTS]
    parts = [(n, x, y) for n, x, y in parts if x is not None and y is not None]
    return max(parts, key=lambda p: abs(p[1] - p[2])) if parts else None


def surprises(views: list[Row]) -> list[str]:
    """One sentence per pair of configurations where the one that offloads more (a strict
    superset of what the other moves) is faster beyond both CIs at the same settings (GPUs,
    micro-batch, accumulation, sweep point): offloading more adds transfers, so a reader would
    not expect it. The sentence counts the settings where it holds and, at the fastest, says
    what the step breakdown measured: the part of the step whose median time differs most."""
    found = [v for v in _candidates(views) if contracts.settings_of(v) is not None]
    groups: dict[tuple[str, str], list[tuple[Row, Row]]] = {}
    for more in found:
        for less in found:
            same = (contracts.settings_of(more), more["sweep_text"]) == (
                contracts.settings_of(less),
                less["sweep_text"],
            )
            if same and _moved(less) < _moved(more):
                groups.setdefault((more["label"], less["label"]), []).append((more, less))
    out = []
    for pairs in groups.values():
        faster = [
            (a, b)
            for a, b in pairs
            if not _overlaps(a, b) and float(a["tokens_per_s"]) > float(b["tokens_per_s"])
        ]
        if faster:
            more, less = max(faster, key=lambda p: float(p[0]["tokens_per_s"]))
            out.append(_surprise_sentence(more, less, len(faster), len(pairs)))
    return out


def _surprise_sentence(more: Row, less: Row, n: int, of: int) -> str:
    where = f"at {n} of the {of} settings both ran" if of > 1 else "at the settings both ran"
    at = f"; at {more['sweep_text']}" if more["sweep_text"] else ""
    said = (
        f"{more['label']} is faster than {less['label']} though it offloads more, beyond "
        f"both CIs {where}{at}: {_choice(more)['tokens']} against {_choice(less)['tokens']} "
        "tokens/s"
    )
    part = _largest_difference(more, less)
    if part is None:
        return said + "; no step breakdown was recorded to say where."
    name, mine, theirs = part
    return (
        f"{said}; per step, the {name} differs most: {mine / 1000:.2g} s against "
        f"{theirs / 1000:.2g} s (medians of the step's timers)."
    )
