"""The workflow's runs against plain loops of the same config, per engine and offload path.

    python benchmarks/fidelity_table.py [docs/results]

Reads every pair committed under the results folder: a plain loop's JSON line
(``<study>/device-logs/raw-<engine>/<scenario>.rep<k>.json``, written by
``benchmarks/device/run_study.sh`` with PAIRED=1 beside the workflow's run of that repeat on the
same machine, minutes apart) and the workflow's record (``<study>/<scenario>/rep<k>/metrics.json``).
Prints one row per pair, with which of its two loops ran first (run_study.sh ran the workflow
first until PAIRED_ORDER=alternate; a plain loop stamped with its start says so); then per path
(engine, offloads, accumulation steps) the geometric mean of workflow / plain tokens/s with its
95 % t-interval over the pairs (on log ratios), and whether the two loops' GPU memory matched to
the MiB; where a path's pairs ran on more than one GPU model, the same per path and model, since two
machines' disks and hosts differ more than a harness does. Pairs set aside under ``superseded/``
are not read.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from offload_study import engines
from offload_study.core.devices import card_name

MIB_IN_GIB = 1024
SAME_MIB_WORDS = {True: "yes", False: "no", None: "no GPU"}
#: effective-mode keys of metrics.json that name a mode of their own
MODE_NAMES = (("super_offload", "SuperOffload"), ("zenflow", "ZenFlow"))
# Student's t, 97.5th percentile, by degrees of freedom (a t-interval over few pairs); past 10, 2.2.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228}  # fmt: skip


def pairs(results: Path) -> list[dict]:
    """Every (plain loop, workflow record) pair under ``results``, in path order."""
    found = []
    for raw_path in sorted(results.glob("*/*/device-logs/raw-*/*.rep*.json")):
        scenario, rep = raw_path.name.removesuffix(".json").rsplit(".rep", 1)
        record = raw_path.parents[2] / scenario / f"rep{rep}" / "metrics.json"
        if record.is_file():
            found.append(pair_row(json.loads(raw_path.read_text()), json.loads(record.read_text())))
    return found


def pair_row(raw: dict, record: dict) -> dict:
    """One pair's figures and the path it measures, in the record's words."""
    gas = record["gradient_accumulation_steps"]
    offloads = f"optimizer {record['offload_optimizer']}, parameters {record['offload_param']}"
    offloads += "".join(f", {words}" for words in mode_words(record))
    allocated_gib = (raw.get("peak_gpu_allocated_gib"), record.get("peak_gpu_allocated_gib"))
    return {
        "study": record["study"],
        "run": f"{record['label']}, repeat {record['repeat']}",
        "path": f"{engines.label(record['engine'])}: {offloads}, gas {gas}",
        "workflow": record["tokens_per_s"],
        "plain": raw["tokens_per_s"],
        "ratio": record["tokens_per_s"] / raw["tokens_per_s"],
        # None: neither loop had a GPU (a CPU machine's pairs)
        "same_mib": None
        if allocated_gib == (None, None)
        else None not in allocated_gib
        and round(allocated_gib[0] * MIB_IN_GIB) == round(allocated_gib[1] * MIB_IN_GIB),
        "first": first_loop(raw, record),
        "gpu": card_name(record.get("device_name")) or "no GPU",
    }


def first_loop(raw: dict, record: dict) -> str:
    """Which loop of a pair ran first: by their UTC starts where the plain loop has one (ISO
    stamps of one format order as strings); else the workflow, the only order run_study.sh had
    before the plain loops were stamped."""
    raw_start, workflow_start = raw.get("started_at"), record.get("started_at")
    if raw_start and workflow_start and raw_start < workflow_start:
        return "plain loop"
    return "workflow"


def mode_words(record: dict) -> list[str]:
    """The offload mode a record ran beyond its offload keys (its effective modes), in words: runs
    of different modes are different paths, even where their offload keys are alike."""
    modes = record.get("modes") or {}
    effective = modes.get("effective") or {}
    words = [name for key, name in MODE_NAMES if effective.get(key)]
    ratio = effective.get("offload_optimizer_ratio")
    if ratio is not None and ratio < 1:
        words.append(f"{ratio:g} of the optimizer on the CPU")
    if modes.get("bound_cores"):
        words.append("cores bound")
    return words


def mean_and_ci(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """Geometric mean of ``ratios`` and its 95 % t-interval (None with fewer than 2)."""
    logs = [math.log(r) for r in ratios]
    centre = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(centre), None, None
    half = T_975.get(len(logs) - 1, 2.2) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(centre), math.exp(centre - half), math.exp(centre + half)


def main(argv: list[str]) -> int:
    rows = pairs(Path(argv[0] if argv else "docs/results"))
    print(
        "| study | run | GPU | workflow tok/s | plain tok/s | ratio | GPU memory same to the MiB "
        "| ran first |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['study']} | {r['run']} | {r['gpu']} | {r['workflow']:,.0f} | {r['plain']:,.0f} "
            f"| {r['ratio']:.3f} | {SAME_MIB_WORDS[r['same_mib']]} | {r['first']} |"
        )
    print_intervals("path", group(rows, "path"))
    by_card = group(rows, "path", "gpu")
    paths = [path for path, _ in by_card]
    across = {key: ratios for key, ratios in by_card.items() if paths.count(key[0]) > 1}
    if across:
        print("\nThe paths whose pairs ran on more than one GPU model, per model:")
        print_intervals("path | GPU", across)
    return 0


def group(rows: list[dict], *keys: str) -> dict[tuple, list[float]]:
    """The pairs' ratios by the values of ``keys``, in sorted order."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r["ratio"])
    return dict(sorted(groups.items()))


def print_intervals(heading: str, groups: dict[tuple, list[float]]) -> None:
    columns = heading.count("|") + 1
    print(f"\n| {heading} | pairs | workflow / plain (geometric mean) | 95 % CI |")
    print("|---" * (columns + 3) + "|")
    for key, ratios in groups.items():
        centre, low, high = mean_and_ci(ratios)
        interval = f"[{low:.3f}, {high:.3f}]" if low is not None else "one pair"
        print(f"| {' | '.join(key)} | {len(ratios)} | {centre:.3f} | {interval} |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
