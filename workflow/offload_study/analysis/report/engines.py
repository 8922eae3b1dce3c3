"""The report's engines block: DeepSpeed ZeRO-3 and PyTorch FSDP2 side by side, for each kind of
scenario both ran (no offload; CPU offload), only where a study has more than one engine.

Per scenario: tokens/s with its 95 % CI (collect's summary), peak GPU memory (allocated,
reserved), peak host memory per node, and where a step's time goes (the harness' forward, backward
and optimizer parts, timed alike for both engines: steps.csv, metrics.json
``step_breakdown_ms``). Per FSDP2 scenario and DeepSpeed scenario of the same kind and
settings (contracts.SAME_SETTINGS_KEYS): the paired ratio of their tokens/s, repeat k with
repeat k (collect.paired_ratio, the rule of the vs-pair column), with its verdict word
(core.verdict), and the part of the step whose time differs most.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from offload_study.analysis import collect
from offload_study.core import contracts, verdict

#: Scenario kinds compared across engines: name -> (offload_optimizer, offload_param) test.
KINDS = {
    "no offload": contracts.offloads_nothing,
    "CPU offload": lambda opt, param: "cpu" in (opt, param) and "nvme" not in (opt, param),
}
PART_NAMES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}
N_BOOT = 2000


def _row_view(row: Mapping) -> dict:
    parts = {
        p: verdict.finite_or_none(row.get(f"step_breakdown_ms.{p}")) for p in collect.STEP_PARTS
    }
    return {
        "scenario": row["scenario"],
        "label": row.get("label") or row["scenario"],
        "engine": contracts.engine_of(row),
        "n_ok": int(verdict.finite_or_none(row.get("n_ok")) or 0),
        "tokens_per_s": verdict.finite_or_none(row.get("tokens_per_s")),
        "ci_low": verdict.finite_or_none(row.get("tokens_per_s_ci_low")),
        "ci_high": verdict.finite_or_none(row.get("tokens_per_s_ci_high")),
        "gpu_allocated_gib": verdict.finite_or_none(row.get("peak_gpu_allocated_gib")),
        "gpu_reserved_gib": verdict.finite_or_none(row.get("peak_gpu_reserved_gib")),
        "host_gib": collect.host_memory_gib(row),
        "parts_ms": parts,
    }


def _ok_runs(runs: pd.DataFrame, scenario: str) -> pd.DataFrame:
    return runs[(runs["scenario"] == scenario) & (runs["outcome"] == "ok")]


def _steps(ok: pd.DataFrame) -> dict[str, object]:
    """record_dir -> its measured steps' tokens/s (records still on disk)."""
    dirs = [d for d in ok.get("record_dir", pd.Series(dtype=object)).dropna() if Path(d).is_dir()]
    return {d: collect.read_step_speeds(d) for d in dirs}


def _biggest_difference(mine: dict, theirs: dict) -> str | None:
    diffs = [(abs(mine[p] - theirs[p]), p, mine[p] - theirs[p]) for p in collect.STEP_PARTS
             if mine.get(p) is not None and theirs.get(p) is not None]  # fmt: skip
    if not diffs:
        return None
    _, part, signed = max(diffs)
    more = "more" if signed > 0 else "less"
    return f"{PART_NAMES[part]}: {abs(signed):.0f} ms {more} per step"


def _ratio_view(runs: pd.DataFrame, fsdp: dict, ds: dict) -> dict:
    mine, theirs = _ok_runs(runs, fsdp["scenario"]), _ok_runs(runs, ds["scenario"])
    point, lo, hi, pairs, how = collect.paired_ratio(
        mine, theirs, _steps(pd.concat([mine, theirs])), N_BOOT, seed=0
    )
    return {
        "fsdp2": fsdp["label"], "deepspeed": ds["label"], "ratio": verdict.finite_or_none(point),
        "ci_low": verdict.finite_or_none(lo), "ci_high": verdict.finite_or_none(hi), "pairs": pairs, "how": how,
        "word": verdict.speed(point, lo, hi) if verdict.finite_or_none(point) else None,
        "text": verdict.ratio_text(point, lo, hi) if verdict.finite_or_none(point) else None,
        "difference": _biggest_difference(fsdp["parts_ms"], ds["parts_ms"]),
    }  # fmt: skip


def engines_view(runs: pd.DataFrame, summary: pd.DataFrame) -> list[dict] | None:
    """One block per scenario kind both engines ran; None when the study has one engine."""
    if summary.empty or "engine" not in summary:
        return None
    rows = summary.to_dict("records")
    if len({contracts.engine_of(r) for r in rows}) < 2:
        return None
    blocks = []
    for kind, test in KINDS.items():
        same_kind = [_row_view(r) | {"settings": contracts.settings_of(r)} for r in rows
                     if test(r.get("offload_optimizer"), r.get("offload_param"))]  # fmt: skip
        fsdp = [r for r in same_kind if r["engine"] == "fsdp2"]
        ds = [r for r in same_kind if r["engine"] == "deepspeed"]
        if not fsdp or not ds:
            continue
        ratios = [_ratio_view(runs, f, d) for f in fsdp for d in ds
                  if f["settings"] is not None and f["settings"] == d["settings"]]  # fmt: skip
        blocks.append({"kind": kind, "rows": ds + fsdp, "ratios": ratios})
    return blocks or None
