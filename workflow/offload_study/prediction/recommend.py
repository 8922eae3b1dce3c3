"""The fastest config for a model on given hardware under a GPU-memory budget (`snakemake recommend`).

A study with a ``recommend`` block (schema: ``schemas/study.schema.yaml``) is a search:

1. :func:`~offload_study.planning.candidates.with_candidates` (called by
   :class:`offload_study.planning.plan.Plan`) turns every engine's offload paths (the engine
   registry's grids) x the study's grid (engines, offload modes, partial-offload ratio,
   micro-batch, ZeRO knobs) into candidate scenarios named ``rec-...``, each capped at the
   budget; the study's own scenarios are the references (e.g. plain CPU optimizer offload,
   uncapped no offload).
2. ``rule plan`` predicts every candidate (plan.csv: memory, tokens/s, feasible).
3. ``checkpoint recommend_select`` (:func:`select`), round 0, keeps the feasible ones and ranks
   them by predicted tokens/s, a candidate predicted over its budget (feasible only within the
   model's memory error) after every one predicted to fit. The prediction's step time errs by up
   to the model's measured band (error_bands.json, ±54 % calibrated), so every candidate
   predicted within that band of the best predicted one may be the fastest: all of them are
   measured, up to ``recommend.max_measured``, the best predicted of each engine and offload
   mode first (the prediction is coarser across them than within one), then the next best;
   the budget left measures the best predicted of each engine with no candidate in the band.
   GPU memory is judged as the feasibility gate judges it: the reserved prediction, with the
   CUDA context counted as the cap counts it (:func:`~offload_study.prediction.predict.need_gib`).
4. The normal ``rule train`` measures them and the references. When no candidate measured so far
   ran ok (all ran out of GPU memory, say), round r+1 of the checkpoint (:func:`next_round`)
   picks those within the band of the best predicted one left, skipping every candidate
   predicted to need at least as much GPU memory as one that ran out of it; up to
   ``recommend.rounds`` rounds and ``recommend.max_measured`` candidates in all.
5. ``rule recommend`` (:func:`decide`) collects those records (collect's statistics), picks the
   fastest measured candidate or reference within the budget and unflagged, and writes
   ``recommend/recommendation.json`` (its measured speed and memory, its margin over the
   runner-up with a paired 95 % CI and its verdict (core.verdict.speed), the best config of each
   engine, what was measured and why, the ratio to every reference, why each other candidate
   lost, the search's device time), the winner's engine config, and an HTML page.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from offload_study.analysis import collect, sanity
from offload_study.core import layout, verdict
from offload_study.core.contracts import Prediction, read_json, read_predictions, write_json
from offload_study.core.study import StudyError

# the grid -> candidate scenarios is study expansion (planning)
from offload_study.planning import candidates
from offload_study.prediction import error_bands, predict


def space(plan) -> dict:
    """recommend/space.json: the search's budget and limits, its candidates (each with its
    engine, its group: engine x offload path x mode, and whether a cap stands for its card),
    those left out and why, and the references, from a
    :class:`~offload_study.planning.plan.Plan` of a recommend study."""
    rec = plan.study["recommend"]
    if not rec:
        raise StudyError(
            f"recommend: study {plan.study['study']!r} has no recommend block (recommend: "
            "{gpu_mem_gb: ..., gpus_per_node: ..., grid: ...})"
        )
    found, left_out = candidates.grid(plan.study, plan.cluster)
    runs = plan.by_name
    grid = {
        c.scenario["name"]: {
            "engine": c.engine,
            "group": c.group,
            "capped": predict.capped(runs[c.scenario["name"]]),
        }
        for c in found
        if c.scenario["name"] in runs
    }
    references = [s for s in plan.scenarios if s not in grid]
    return {
        "study": plan.study["study"],
        "cluster": plan.cluster["name"],
        "gpu_mem_gb": rec["gpu_mem_gb"],
        **{key: rec[key] for key in ("max_measured", "top_n", "rounds", "step_time_band")},
        "repeats": plan.study["repeats"],
        "candidates": grid,
        "left_out": left_out,
        "references": references,
        "reference_engines": {s: runs[s].engine for s in references},
    }


def selected_records(selected_json: str, results: str, repeats: Sequence[int]) -> list[str]:
    """metrics.json paths of every run one round of the checkpoint chose."""
    measure = read_json(selected_json)["measure"]
    return [
        f"{layout.record_dir(results, name, k)}/metrics.json" for name in measure for k in repeats
    ]


def search_rounds(get_round) -> list[str]:
    """selected.json of every round of the search, up to the first that measures nothing (the
    last). ``get_round(r)``: round r's path; in the workflow it asks the checkpoint, which makes
    Snakemake run round r (after the runs of the rounds before it) first."""
    paths: list[str] = []
    while not paths or read_json(paths[-1])["measure"]:
        paths.append(get_round(len(paths)))
    return paths


# --------------------------------------------------------------------------- 3. the checkpoint
def step_time_band(space_: dict, predictions: dict[str, Prediction]) -> float | None:
    """The relative step-time error the ranking allows: the study's recommend.step_time_band,
    else the band plan.csv states beside its predictions, else the model's calibrated band
    (error_bands.json; None where it was never measured)."""
    if space_.get("step_time_band") is not None:
        return float(space_["step_time_band"])
    stated = [p.step_time_band for p in predictions.values() if p.step_time_band is not None]
    if stated:
        return max(stated)
    return error_bands.bands(calibrated=True)["step_time"]


def _row(name: str, info: dict, p: Prediction | None) -> dict:
    """A candidate's line in selected.json: its prediction, GPU memory as the gate judges it."""
    need = predict.need_gib(p, info["capped"]) if p else None
    budget = p.gpu_budget_gib if p else None
    return {
        "scenario": name,
        "engine": info["engine"],
        "group": info["group"],
        "predicted_tokens_per_s": p.tokens_per_s if p else None,
        # reserved, the CUDA context counted as the cap counts it (allocated: older plans)
        "predicted_gpu_reserved_gib": need,
        # feasible allows the model's own error over the budget (predict.MARGINS)
        "over_budget": bool(need and budget and need > budget),
        "feasible": bool(p.feasible) if p else True,
        "reason": p.reason if p else "no prediction",
        # why no speed is predicted, where none is: plan.csv's note on the mode
        "unpredicted": None if p is None or p.tokens_per_s else p.note,
    }


def select(space_: dict, predictions: dict[str, Prediction]) -> dict:
    """recommend/selected.json: every candidate's rank and why it is (not) measured, the band
    that chose them, and the scenarios to train (the chosen candidates and every reference)."""
    rows = [_row(name, info, predictions.get(name)) for name, info in space_["candidates"].items()]
    feasible = [r for r in rows if r["feasible"]]
    # a run predicted over its budget is likelier to OOM than one predicted under it: it ranks
    # after all of those
    feasible.sort(key=lambda r: (r["over_budget"], -(r["predicted_tokens_per_s"] or 0.0)))
    for rank, row in enumerate(feasible, 1):
        row["rank"] = rank
    chosen, band = _choose(space_, feasible, step_time_band(space_, predictions), 0, 0)
    for row in rows:
        row["round"] = 0 if row in chosen else None
        row["why"] = _selection_why(row, band)
    measure = [r["scenario"] for r in chosen] + list(space_["references"])
    return {"round": 0, "candidates": rows, "measure": measure, "ended": None, "bands": [band]}


def _choose(
    space_: dict, ranked: list[dict], band: float | None, measured: int, rnd: int
) -> tuple[list[dict], dict]:
    """Round ``rnd``'s candidates from ``ranked`` (best first), ``measured`` having been measured
    before it: every one predicted within ``band`` of the best one's step time (all of them
    without a band), the best of each engine, then of each group first, up to max_measured in
    all and top_n a round; and what decided it (selected.json's ``bands``)."""
    left = space_["max_measured"] - measured
    limit = max(0, min(left, space_.get("top_n") or left))
    best = ranked[0] if ranked else None
    best_tps = best["predicted_tokens_per_s"] if best else None
    floor = best_tps / (1 + band) if best_tps and band is not None else None
    in_band = [r for r in ranked if floor is None or (r["predicted_tokens_per_s"] or 0) >= floor]
    for row in ranked:
        row["in_band"] = row in in_band
    chosen = _top(in_band, limit)
    # the step model errs most between engines (each has its own constants, and a model unlike
    # the fitted ones moves one engine's predictions, not the other's), so the budget left
    # measures the best predicted of each engine with no candidate in the band
    outside = [r for r in _best_of_each(ranked, "engine") if r not in in_band]
    engine_best = outside[: max(0, limit - len(chosen))]
    for row in ranked:
        row["engine_best"] = row in engine_best
    limited_by = "top_n" if space_.get("top_n") and space_["top_n"] < left else "max_measured"
    return chosen + engine_best, {
        "round": rnd,
        "step_time_band": band,
        "band_from_study": space_.get("step_time_band") is not None,
        "best": best and best["scenario"],
        "best_tokens_per_s": best_tps,
        "floor_tokens_per_s": floor,
        "in_band": len(in_band),
        "chosen": len(chosen),
        "engine_best": len(engine_best),
        "measured_before": measured,
        "limit": limit,
        "limited_by": limited_by,
        "limit_value": space_[limited_by],
    }


def _top(ranked: list[dict], n: int) -> list[dict]:
    """n of ``ranked``: the best of each engine first (the question is which engine to run,
    and the prediction is coarsest across engines), then the best of each group (engine x
    offload path x mode), then the next best."""
    ranked = sorted(ranked, key=lambda r: r["rank"])
    engines_first = _best_of_each(ranked, "engine")
    groups_first = [r for r in _best_of_each(ranked, "group") if r not in engines_first]
    chosen = engines_first + groups_first
    return (chosen + [r for r in ranked if r not in chosen])[:n]


def _best_of_each(ranked: list[dict], key: str) -> list[dict]:
    """The first row of each value of ``key`` in ``ranked`` (best first), in rank order."""
    firsts: dict = {}
    for row in ranked:
        firsts.setdefault(row[key], row)
    return list(firsts.values())


def next_round(space_: dict, previous: dict, metrics: Sequence[str]) -> dict:
    """Round r+1 of the checkpoint from round r's selected.json and the records of every run so
    far: nothing to measure once a candidate ran ok (or the rounds or max_measured are spent, or
    none is left); else those within the band of the best predicted one left, skipping
    candidates predicted to need at least as much GPU memory as one that ran out of it (the
    prediction orders candidates by memory better than it sizes them: 2 H200s at 40 GB,
    predicted 38.4 and 38.8 GiB ran out, 32.8 ran)."""
    rnd = previous["round"] + 1
    rows = [dict(r) for r in previous["candidates"]]
    outcome = {rec["scenario"]: rec for rec in map(collect.read_record, metrics)}
    ran = [r for r in rows if r["round"] is not None]
    ok = [r["scenario"] for r in ran if _ran_ok(outcome.get(r["scenario"]))]
    oom = [r for r in ran if (outcome.get(r["scenario"]) or {}).get("outcome") == "gpu_oom"]
    floor = min(
        (r["predicted_gpu_reserved_gib"] for r in oom if r["predicted_gpu_reserved_gib"]),
        default=None,
    )
    left = [r for r in rows if r["feasible"] and r["round"] is None]
    for row in left:
        if floor is not None and (row["predicted_gpu_reserved_gib"] or 0) >= floor:
            row["skipped"] = (
                f"predicted {row['predicted_gpu_reserved_gib']:.1f} GiB, not below "
                f"{floor:.1f} GiB of a candidate that ran out of GPU memory"
            )
    tries = sorted((r for r in left if not r.get("skipped")), key=lambda r: r["rank"])
    ended = _ended(space_, ok, rnd, ran, tries)
    bands = list(previous.get("bands") or [])
    chosen: list[dict] = []
    if not ended:
        first = bands[0]["step_time_band"] if bands else None  # one band for the search
        chosen, band = _choose(space_, tries, first, len(ran), rnd)
        bands.append(band)
    for row in rows:
        if row in chosen:
            row["round"] = rnd
        if row["round"] is None or row in chosen:
            row["why"] = row.get("skipped") and f"not measured: {row['skipped']}"
            row["why"] = row["why"] or _selection_why(row, bands[-1])
    return {
        "round": rnd,
        "candidates": rows,
        "measure": [r["scenario"] for r in chosen],
        "ended": ended,
        "bands": bands,
    }


def _ran_ok(record: dict | None) -> bool:
    return bool(record) and record.get("outcome") == "ok" and (record.get("tokens_per_s") or 0) > 0


def _band_words(row: dict, band: dict) -> str:
    """Where a candidate's prediction lies against the band of its round's best."""
    if band["best"] == row["scenario"]:
        return "the best predicted"
    if not row["predicted_tokens_per_s"]:
        return "ranked after every candidate with a predicted speed"
    if band["floor_tokens_per_s"] is None:
        return "no step-time error band: ranked by the prediction alone"
    width = error_bands.text(band["step_time_band"])
    error = (
        f"the study's {width} step-time band (recommend.step_time_band)"
        if band.get("band_from_study")
        else f"the model's {width} step-time error"
    )
    best = f"the best predicted ({band['best_tokens_per_s']:,.0f} tokens/s)"
    if row.get("in_band"):
        return f"within {error} of {best}"
    return f"slower than {best} by more than {error}"


def _ended(space_: dict, ok: list, rnd: int, ran: list, tries: list) -> str | None:
    """Why the search stops after round ``rnd``, or None while it goes on."""
    if ok:
        return "a candidate ran ok: " + ", ".join(ok)
    if rnd >= space_["rounds"]:
        return f"recommend.rounds ({space_['rounds']}) spent"
    if len(ran) >= space_["max_measured"]:
        return f"recommend.max_measured ({space_['max_measured']}) spent"
    if not tries:
        return "no candidate left to try"
    return None


def _selection_why(row: dict, band: dict) -> str:
    if not row["feasible"]:
        return f"predicted not to fit: {row['reason']}"
    tps = row["predicted_tokens_per_s"]
    said = f"predicted {tps:,.0f} tokens/s" if tps else "no speed predicted"
    if not tps and row.get("unpredicted"):
        said += f" ({row['unpredicted']})"
    if row["over_budget"]:
        said += (
            f", {row['predicted_gpu_reserved_gib']:.1f} GiB: over the budget within the "
            "model's error"
        )
    said += f", rank {row['rank']}: {_band_words(row, band)}"
    if row["round"] is not None and row.get("engine_best"):
        return (
            f"measured in round {row['round']} ({said}; the best predicted of its engine, "
            "measured since the prediction errs most between engines)"
        )
    if row["round"] is not None:
        return f"measured in round {row['round']} ({said})"
    if row.get("in_band"):
        return (
            f"not measured: {said}, but the budget, recommend.{band['limited_by']} "
            f"({band['limit_value']}), was spent on those ranked before it (the best of "
            "each engine first, then of each offload mode)"
        )
    return f"not measured: {said}"


# --------------------------------------------------------------------------- 5. the decision
def _steps(runs: pd.DataFrame) -> dict:
    ok = runs[runs["outcome"] == "ok"]
    return {
        rd: np.array([r.tokens_per_s for r in collect.read_timed_steps(rd)])
        for rd in ok["record_dir"].dropna()
    }


def _ratio(runs, steps, a: str, b: str, seed: int) -> dict:
    """a's tokens/s over b's, run for run (collect.paired_ratio), with its verdict
    (core.verdict.speed: faster, slower, no difference shown or inconclusive)."""
    ok = runs[runs["outcome"] == "ok"]
    r, lo, hi, n, how = collect.paired_ratio(
        ok[ok["scenario"] == a], ok[ok["scenario"] == b], steps, 2000, seed
    )
    word = "no pair" if math.isnan(r) else verdict.speed(r, lo, hi)
    return {
        "of": b,
        "ratio": r,
        "ci_low": lo,
        "ci_high": hi,
        "pairs": n,
        "verdict": word,
        "note": how,
    }


def row_state(row: pd.Series, budget: float) -> str | None:
    """Why a measured scenario cannot be recommended, or None when it can."""
    if not pd.to_numeric(row.get("tokens_per_s"), errors="coerce") > 0:
        return "no ok run"
    cap = row.get("gpu_mem_gb")
    if cap is None or pd.isna(cap):
        return "not held to the GPU-memory budget: it ran without a cap (a reference)"
    if float(cap) > budget:
        return f"not held to the GPU-memory budget: capped at {float(cap):g} GiB (a reference)"
    # an implausible result (sanity.blocking) is not recommended; a caution (a missed CI
    # target) is not a reason: its CI decides the ranking
    flags = sanity.blocking(row.get("flags"))
    return f"flagged {', '.join(flags)}" if flags else None


def _failure(runs: pd.DataFrame, scenario: str) -> str:
    mine = runs[runs["scenario"] == scenario]
    outcomes = ", ".join(sorted(set(mine["outcome"].astype(str))))
    excerpt = next((str(e) for e in mine.get("error_excerpt", []) if isinstance(e, str) and e), "")
    line = excerpt.strip().splitlines()[-1] if excerpt.strip() else ""
    return f"outcome {outcomes}" + (f": {line[:300]}" if line else "")


def decide(space_: dict, selected: dict, metrics: Sequence[str]) -> dict:
    """recommendation.json from the measured records (see the module's docstring); ``selected``:
    the last round's selected.json (its candidates say why each unmeasured one was not)."""
    runs, summary = collect.collect(metrics)
    steps = _steps(runs)
    rows = {r["scenario"]: r for _, r in summary.iterrows()}
    state = {name: row_state(row, space_["gpu_mem_gb"]) for name, row in rows.items()}
    eligible = sorted(
        (n for n in rows if state[n] is None), key=lambda n: -float(rows[n]["tokens_per_s"])
    )
    winner = eligible[0] if eligible else None
    ci = None
    if winner:
        ci = [float(rows[winner].get(f"tokens_per_s_ci_{s}", math.nan)) for s in ("low", "high")]
    out = {
        "study": space_["study"],
        "cluster": space_["cluster"],
        "gpu_mem_gb": space_["gpu_mem_gb"],
        "winner": winner,
        "tokens_per_s": float(rows[winner]["tokens_per_s"]) if winner else None,
        "tokens_per_s_ci": ci,
        "runner_up": eligible[1] if len(eligible) > 1 else None,
        "margin": _ratio(runs, steps, winner, eligible[1], 0) if len(eligible) > 1 else None,
        "vs_references": [
            _ratio(runs, steps, winner, ref, i + 1)
            for i, ref in enumerate(space_["references"])
            if winner and ref in rows and ref != winner
        ],
        "others": _others(space_, selected, runs, steps, rows, state, winner),
        "device_time": _device_time(runs),
        "rounds": selected.get("round", 0) + (1 if selected.get("measure") else 0),
        "search_ended": selected.get("ended"),
        "winner_engine": _engine_of(space_).get(winner),
        "winner_memory": _memory(rows[winner]) if winner else None,
        "best_of_engines": best_of_engines(space_, selected, runs, rows, state, winner),
        "measured": _measured(selected, runs, rows, state),
        "selection": {
            "max_measured": space_.get("max_measured"),
            "top_n": space_.get("top_n"),
            "candidates": len(space_["candidates"]),
            "measured": sum(r["round"] is not None for r in selected["candidates"]),
            "bands": selected.get("bands") or [],
            "left_out": space_.get("left_out") or [],
        },
    }
    return _no_nan(out)


def _engine_of(space_: dict) -> dict[str, str]:
    """Every candidate's and reference's engine, by scenario."""
    return {
        **{n: c["engine"] for n, c in space_["candidates"].items()},
        **(space_.get("reference_engines") or {}),
    }


def _number(value) -> float | None:
    value = pd.to_numeric(value, errors="coerce")
    return None if pd.isna(value) else float(value)


def _memory(row: pd.Series) -> dict:
    """A scenario's measured peaks: GPU reserved (torch's, what the cap limits) and allocated
    per GPU, host per node; GiB."""
    return {
        "gpu_reserved_gib": _number(row.get("peak_gpu_reserved_gib")),
        "gpu_allocated_gib": _number(row.get("peak_gpu_allocated_gib")),
        "host_gib": _number(collect.host_memory_gib(row)),
    }


def best_of_engines(space_, selected, runs, rows, state, winner) -> list[dict]:
    """The best config of each engine the search tried, the winner's engine first: its fastest
    measured one within the budget (with its best predicted candidate where that one was not
    measured: a reference may be all that ran of an engine the band left out), else its best
    predicted (and why it was not measured, or how its run failed), else why none of its
    candidates could be tried."""
    engine_of, picks = _engine_of(space_), {r["scenario"]: r for r in selected["candidates"]}
    left_out = space_.get("left_out") or []
    order = dict.fromkeys(
        [engine_of.get(winner), *engine_of.values(), *(o["engine"] for o in left_out)]
    )
    out = []
    for engine in (e for e in order if e):
        mine = [n for n, e in engine_of.items() if e == engine]
        measured = sorted(
            (n for n in mine if n in rows and state[n] is None),
            key=lambda n: -float(rows[n]["tokens_per_s"]),
        )
        ranked = sorted(
            (picks[n] for n in mine if n in picks and picks[n]["feasible"]), key=lambda r: r["rank"]
        )
        if measured:
            name = measured[0]
            out.append(
                {
                    "engine": engine,
                    "scenario": name,
                    "measured": True,
                    "winner": name == winner,
                    "tokens_per_s": float(rows[name]["tokens_per_s"]),
                    "gpu_reserved_gib": _memory(rows[name])["gpu_reserved_gib"],
                    "why": None,
                    "best_predicted": _unmeasured_best(ranked),
                }
            )
        elif ranked:
            row = ranked[0]
            made = row["round"] is not None and _result(runs, rows, state, row["scenario"])
            out.append(
                {
                    "engine": engine,
                    "scenario": row["scenario"],
                    "measured": False,
                    "winner": False,
                    "tokens_per_s": row["predicted_tokens_per_s"],
                    "gpu_reserved_gib": row["predicted_gpu_reserved_gib"],
                    "why": f"measured: {made}" if made else row["why"],
                }
            )
        else:
            whys = [picks[n]["why"] for n in mine if n in picks]
            whys += [f"{o['label']}: {o['why']}" for o in left_out if o["engine"] == engine]
            out.append(
                {
                    "engine": engine,
                    "scenario": None,
                    "measured": False,
                    "winner": False,
                    "tokens_per_s": None,
                    "gpu_reserved_gib": None,
                    "why": "; ".join(dict.fromkeys(whys)) or "no candidate",
                }
            )
    return out


def _unmeasured_best(ranked: list[dict]) -> dict | None:
    """An engine's best predicted candidate when the search did not choose it: its prediction
    and why it was not measured (None when it was chosen, or there is none)."""
    if not ranked or ranked[0]["round"] is not None:
        return None
    best = ranked[0]
    return {
        "scenario": best["scenario"],
        "tokens_per_s": best["predicted_tokens_per_s"],
        "why": best["why"],
    }


def _measured(selected, runs, rows, state) -> list[dict]:
    """Every candidate measured, in the order chosen: why it was, and what it made."""
    chosen = sorted(
        (r for r in selected["candidates"] if r["round"] is not None),
        key=lambda r: (r["round"], r["rank"]),
    )
    return [
        {
            "scenario": r["scenario"],
            "engine": r["engine"],
            "round": r["round"],
            "why": r["why"],
            "result": _result(runs, rows, state, r["scenario"]),
        }
        for r in chosen
    ]


def _result(runs, rows, state, name: str) -> str:
    """What a measured scenario made: its tokens/s (and why it cannot be recommended), or how
    its runs ended."""
    if name not in rows or (state[name] or "").startswith("no ok run"):
        return _failure(runs, name)
    speed = f"{float(rows[name]['tokens_per_s']):,.0f} tokens/s"
    return f"{speed}, {state[name]}" if state[name] else speed


def _no_nan(value):
    """NaN (no pair, no CI) as null: recommendation.json stays standard JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def _others(space_, selected, runs, steps, rows, state, winner) -> list[dict]:
    """Why each scenario other than the winner lost (measured ones first)."""
    out = []
    chosen = list(dict.fromkeys(runs["scenario"].dropna().astype(str)))  # records decide
    made = set(runs.loc[runs["outcome"] != "missing", "scenario"])
    for i, name in enumerate(n for n in chosen if n != winner):
        kind = "reference" if name in space_["references"] else "candidate"
        if name not in rows or (state[name] or "").startswith("no ok run"):
            why = _failure(runs, name) if name in rows else "no record"
        else:
            ratio = _ratio(runs, steps, name, winner, 100 + i) if winner else None
            speed = f"{float(rows[name]['tokens_per_s']):,.0f} tokens/s"
            word = "slower"  # by the ranking; a paired CI, where there is one, decides the word
            if ratio and not math.isnan(ratio["ratio"]):
                word = ratio["verdict"]
                speed += (
                    f" = {ratio['ratio']:.1%} of the winner (95% CI {ratio['ci_low']:.1%}"
                    f"–{ratio['ci_high']:.1%})"
                )
            why = f"{state[name]}: {speed}, {word}" if state[name] else f"{word}: {speed}"
        out.append({"scenario": name, "kind": kind, "measured": name in made, "why": why})
    for row in selected["candidates"]:
        if row["scenario"] not in chosen:
            out.append(
                {
                    "scenario": row["scenario"],
                    "kind": "candidate",
                    "measured": False,
                    "why": row["why"],
                }
            )
    return out


def spending(space_: dict, device_time: dict, predictions: dict) -> dict:
    """What the search spent (device-minutes measured, from the records) and what measuring the
    whole grid would have cost: every feasible candidate and reference at plan.csv's predicted
    GPU-hours (the study's repeats and measuring method); saved = the grid's less the spent."""
    names = [*space_["candidates"], *space_["references"]]
    rows = [predictions[n] for n in names if n in predictions and predictions[n].feasible]
    hours = [r.gpu_hours for r in rows if r.gpu_hours is not None]
    grid = 60 * sum(hours) if hours else None
    spent = device_time["device_minutes"]
    return {
        "spent_device_minutes": spent,
        "grid_runs": len(rows),
        "grid_not_predicted": len(rows) - len(hours),
        "grid_predicted_device_minutes": grid,
        "saved_device_minutes": None if grid is None else grid - spent,
    }


def spending_line(spend: dict) -> str:
    """The terminal's line of what the search spent and saved."""
    grid = spend["grid_predicted_device_minutes"]
    line = (
        f"recommend: spent {spend['spent_device_minutes']:.1f} device-minutes measured (wall "
        "time x GPUs, or ranks on a CPU cluster)"
    )
    if grid is None:
        return line + " (the grid's cost is not predicted: no step time in plan.csv)"
    return line + (
        f"; measuring the whole grid ({spend['grid_runs']} feasible configs) would take "
        f"{grid:.1f} device-minutes predicted, saved {spend['saved_device_minutes']:.1f}"
    )


def _device_time(runs: pd.DataFrame) -> dict:
    """The search's device time: each run's wall time x its GPUs (ranks on a CPU cluster)."""
    runs = runs[runs["outcome"] != "missing"]  # a run never made took no device time
    wall = pd.to_numeric(runs.get("wall_time_s"), errors="coerce").fillna(0)
    world = pd.to_numeric(runs.get("world_size"), errors="coerce").fillna(1)
    return {
        "runs": len(runs),
        "wall_s": float(wall.sum()),
        "device_minutes": float((wall * world).sum() / 60),
    }


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.prediction.recommend", description=__doc__
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sel = sub.add_parser("select", help="rank the predicted candidates, pick those to measure")
    dec = sub.add_parser("decide", help="the fastest measured config within the budget")
    for p in (sel, dec):
        p.add_argument("--space", required=True, help="recommend/space.json")
        p.add_argument("--out", required=True, help="JSON to write")
    sel.add_argument("--plan-csv", required=True, help="the plan's predictions")
    sel.add_argument("--previous", help="the last round's selected.json (round 1 on)")
    sel.add_argument("metrics", nargs="*", help="metrics.json of every run so far (round 1 on)")
    dec.add_argument(
        "--rounds",
        required=True,
        nargs="+",
        help="every round's selected.json; the last says why each unmeasured "
        "candidate was not measured",
    )
    dec.add_argument("--configs", required=True, help="the study's configs/ folder")
    dec.add_argument("--plan-csv", help="the plan's predictions (what the whole grid would cost)")
    dec.add_argument(
        "--ds-config-out", required=True, help="the winner's engine config (its configs/ JSON)"
    )
    dec.add_argument("--html", required=True, help="the recommendation page")
    dec.add_argument("metrics", nargs="*", help="metrics.json of every measured run")
    a = ap.parse_args(argv)
    space_ = read_json(a.space)
    if a.command == "select":
        if a.previous:
            write_json(a.out, next_round(space_, read_json(a.previous), a.metrics))
        else:
            write_json(a.out, select(space_, read_predictions(a.plan_csv)))
        return 0
    result = decide(space_, read_json(a.rounds[-1]), a.metrics)
    if a.plan_csv:
        result["spending"] = spending(space_, result["device_time"], read_predictions(a.plan_csv))
    write_json(a.out, result)
    if result["winner"]:
        shutil.copyfile(Path(a.configs) / f"{result['winner']}.json", a.ds_config_out)
    else:
        write_json(a.ds_config_out, {"error": "no candidate ran ok within the budget"})
    from offload_study.analysis.report.recommend import terminal_line, write_page

    write_page(result, a.html, Path(a.configs).parent)  # the study's records
    print(terminal_line(result, a.html, Path(a.configs).parent))
    if result.get("spending"):
        print(spending_line(result["spending"]))
    return 0  # no winner is a result too: recommendation.json says why each lost


if __name__ == "__main__":
    sys.exit(main())
