"""Replays recorded allocator traces through offload_study.prediction.allocator and prints, per
trace, the reserved peak torch measured beside the replayed one, and what the replay says was
cached (free in segments) at that peak, by the phase of the run that made the segment.

    python benchmarks/allocator_replay.py [TRACE_DIR]

TRACE_DIR (default docs/results/h200-1gpu/allocator-traces-2026-12-02) holds
``<n>-<scenario>-default.trace.jsonl.gz`` (``benchmarks/raw_deepspeed.py --memory-trace``, made
by ``TRACE=1 bash benchmarks/device/run_allocator.sh``) and the run's result JSON beside it.
Deterministic: no measurement, a few seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offload_study.prediction import allocator

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO_ROOT / "docs" / "results" / "h200-1gpu" / "allocator-traces-2026-12-02"
GIB = 2**30


def trace_line(trace: Path) -> str:
    """One table row: measured and replayed reserved peak, and the peak's cached bytes."""
    measured = allocator.trace_result(trace)
    run = allocator.replay(allocator.read_trace(trace))
    peak = run.peak
    cached = sorted(peak.cached_free_by_tag.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{tag}: {n / GIB:.2f}" for tag, n in cached if n >= 0.05 * GIB)
    res = measured["peak_gpu_reserved_gib"]
    err = run.reserved_peak_bytes / GIB / res - 1
    return (
        f"| {measured['study']}/{measured['scenario']} | {measured['peak_gpu_allocated_gib']:.2f} "
        f"| {res:.2f} | {run.reserved_peak_bytes / GIB:.2f} ({err:+.1%}) "
        f"| {measured['allocator']['segments_peak']} / {run.segments_peak} "
        f"| {peak.allocated_bytes / GIB:.2f} | {sum(n for _, n in cached) / GIB:.2f} | {shown} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    a = ap.parse_args(argv)
    traces = sorted(a.trace_dir.glob("*.trace.jsonl.gz"))
    if not traces:
        print(f"allocator_replay: no *.trace.jsonl.gz in {a.trace_dir}", file=sys.stderr)
        return 2
    print(
        "| run | allocated peak GiB | reserved peak GiB, measured | replayed | segments held at "
        "their peak, measured / replayed | allocated at the reserved peak | cached free there | cached, by "
        "the phase (micro-step) that made the segment |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for trace in traces:
        print(trace_line(trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
