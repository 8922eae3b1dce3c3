"""The measurement method against a fixed step count, over real step-time series.

How many device-seconds does a run need to reach the 2 %
target of the adaptive method (offload_study.training.steady: settle rule for the warm-up, CI-of-the-median
stop), against "fixed 20": warm-up 3 (the schema's fixed-mode default) + 20 measured steps; and do
the two medians agree?

Both methods are evaluated on ONE series per run: a long fixed-mode run (its steps.csv; or, for a run
cut before it wrote a record, the step lines of its runner log) is replayed step by step through the
very Tracker the harness uses, with the study schema's default `measure` block (target 2 %), so the
adaptive stop is exactly where the harness would have stopped on those step times. Device-seconds
count the step times up to the stop (warm-up included); start-up (~25-30 s per run on the H200, the
same for both methods) is printed separately from metrics.json's wall time where there is one.

    python benchmarks/adaptive_vs_fixed.py RUN_DIR_OR_LOG [...] [--json out.json]

RUN_DIR: a record folder with steps.csv (e.g. docs/results/h200-1gpu/method/zero3/rep0);
LOG: a train log with `[runner ...] step i/N <phase> <t> s` lines.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

from offload_study.core.contracts import (
    METRICS_FILE,
    STEPS_FILE,
    MeasureSpec,
    read_json,
    read_steps,
)
from offload_study.core.study import load_schema
from offload_study.training.steady import Tracker, median_ci

FIXED_WARMUP, FIXED_STEPS = 3, 20
STEP_LINE = re.compile(r"\[runner [^\]]*\] step (\d+)/\d+ \w+ ([0-9.]+) s")


def default_measure(**overrides) -> MeasureSpec:
    """The study schema's default adaptive `measure` block (the one a study gets by default)."""
    props = load_schema("study")["$defs"]["measure"]["properties"]
    values = {k: p["default"] for k, p in props.items() if "default" in p}
    values.update(mode="adaptive", **overrides)
    return MeasureSpec(**{k: values[k] for k in MeasureSpec.__dataclass_fields__})


def read_series(source: Path) -> tuple[list[float], list[bool], float | None]:
    """Step times, skipped flags and the run's start-up seconds (None when unknown)."""
    if source.is_dir():
        rows = read_steps(source / STEPS_FILE)
        metrics = source / METRICS_FILE
        startup = None
        if metrics.exists():
            wall = read_json(metrics).get("wall_time_s")
            startup = wall - sum(r.step_time_s for r in rows) if wall else None
        return [r.step_time_s for r in rows], [bool(r.skipped) for r in rows], startup
    steps = {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(source.read_text())}
    times = [steps[i] for i in sorted(steps)]
    return times, [False] * len(times), None


def replay_adaptive(times: list[float], skipped: list[bool], measure: MeasureSpec) -> dict:
    """Feed the series to the harness's Tracker; where it stops, and what it measured."""
    tracker = Tracker(SimpleNamespace(measure=measure, warmup_steps=0, steps=0))
    for i, (t, s) in enumerate(zip(times, skipped, strict=True), start=1):
        decision = tracker.observe(t, s)
        if decision.stop:
            measured = [
                x
                for x, k in zip(tracker.times["measured"], tracker.skipped["measured"], strict=True)
                if not k
            ]
            return {
                "stop": decision.stop,
                "steps": i,
                "device_s": sum(times[:i]),
                "warmup_steps": len(tracker.times["warmup"]),
                "warmup_settled": tracker.warmup_settled,
                **_median(measured),
            }
    return {
        "stop": f"not reached in {len(times)} steps",
        "steps": len(times),
        "device_s": sum(times),
        "warmup_steps": len(tracker.times["warmup"]),
        "warmup_settled": tracker.warmup_settled,
        **_median(tracker.times["measured"]),
    }


def fixed(times: list[float], skipped: list[bool]) -> dict:
    """Warm-up 3 + the first 20 measured steps (None when the series is shorter)."""
    n = FIXED_WARMUP + FIXED_STEPS
    if len(times) < n:
        return {"stop": f"series has {len(times)} < {n} steps", "steps": len(times)}
    window = [
        t for t, s in zip(times[FIXED_WARMUP:n], skipped[FIXED_WARMUP:n], strict=True) if not s
    ]
    return {"stop": "fixed", "steps": n, "device_s": sum(times[:n]), **_median(window)}


def _median(times: list[float]) -> dict:
    ci = median_ci(times)
    return {
        "median_s": statistics.median(times) if times else None,
        "ci_half_pct": ci.half_pct if ci else None,
    }


def compare(source: Path, measure: MeasureSpec) -> dict:
    times, skipped, startup = read_series(source)
    a, f = replay_adaptive(times, skipped, measure), fixed(times, skipped)
    agree = None
    if a.get("median_s") and f.get("median_s"):
        agree = 100 * (a["median_s"] / f["median_s"] - 1)
    return {
        "source": str(source),
        "series_steps": len(times),
        "startup_s": startup,
        "adaptive": a,
        "fixed20": f,
        "median_diff_pct": agree,
    }


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_table(rows: list[dict]) -> None:
    print(
        f"{'run':58s} {'start-up':>8s} | {'adaptive: stop':>22s} {'warm':>4s} {'steps':>5s} {'dev-s':>7s} "
        f"{'median':>7s} {'CI%':>5s} | {'fixed20 dev-s':>13s} {'median':>7s} {'CI%':>5s} | "
        f"{'Δmedian %':>9s}"
    )
    for r in rows:
        a, f = r["adaptive"], r["fixed20"]
        warm = f"{a['warmup_steps']}{'' if a['warmup_settled'] else '*'}"
        print(
            f"{r['source'][-58:]:58s} {_fmt(r['startup_s'], '8.1f')} | {a['stop'][:22]:>22s} "
            f"{warm:>4s} {a['steps']:5d} {_fmt(a.get('device_s'), '7.1f')} {_fmt(a.get('median_s'), '7.3f')} "
            f"{_fmt(a.get('ci_half_pct'), '5.1f')} | {_fmt(f.get('device_s'), '13.1f')} "
            f"{_fmt(f.get('median_s'), '7.3f')} {_fmt(f.get('ci_half_pct'), '5.1f')} | "
            f"{_fmt(r['median_diff_pct'], '+9.1f')}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", type=Path, help="record folders or runner logs")
    p.add_argument(
        "--target-ci-pct",
        type=float,
        default=None,
        help="override the schema default target (2 %%)",
    )
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    overrides = {} if args.target_ci_pct is None else {"target_ci_pct": args.target_ci_pct}
    measure = default_measure(**overrides)
    print(f"adaptive rule: {measure}")
    rows = [compare(s, measure) for s in args.sources]
    print_table(rows)
    print(
        "warm: warm-up steps the settle rule took (* not settled yet / cut at max_warmup_steps);"
        " dev-s: step seconds to the stop (start-up excluded); CI%: half-width of the median's"
        " 95 % CI"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
