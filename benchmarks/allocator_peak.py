"""What is live at the allocated peak of each recorded allocator trace: the blocks by size and by
the phase of the run that made them (init, forward, backward, step, each with its micro-step),
largest first, beside the peak torch measured. This names what a memory model misses: the
traces of ``TRACE=1 bash benchmarks/device/run_allocator.sh`` hold no stacks, but a block's size
says what made it (a weight's shape, tokens x hidden, an fp64 copy of the output head).

    python benchmarks/allocator_peak.py [TRACE_DIR] [--min-gib 0.01]

TRACE_DIR (default docs/results/h100-1gpu/allocator-traces-model-g-nvme) holds
``<n>-<scenario>-default.trace.jsonl.gz`` and the run's result JSON beside each. Deterministic,
a few seconds.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from offload_study.prediction import allocator

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO_ROOT / "docs" / "results" / "h100-1gpu" / "allocator-traces-model-g-nvme"
GIB = 2**30


def live_at_peak(trace: Path) -> tuple[int, dict]:
    """The allocated peak of a trace (bytes, as torch counts it: a block leaves the count when
    its tensor dies) and the blocks live then: key -> (size, phase tag)."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in allocator.read_trace(trace, free_action="free_requested"):
        if e.action == "alloc":
            live[e.key] = (e.size, e.tag)
            total += e.size
        elif e.action == "free" and e.key in live:
            total -= live.pop(e.key)[0]
        if total > peak:
            peak, at_peak = total, dict(live)
    return peak, at_peak


def peak_lines(trace: Path, min_gib: float) -> list[str]:
    measured = allocator.trace_result(trace)["peak_gpu_allocated_gib"]
    peak, blocks = live_at_peak(trace)
    lines = [f"{trace.name}: allocated peak {peak / GIB:.3f} GiB (measured {measured:.3f})"]
    by_kind = Counter((tag, size) for size, tag in blocks.values())
    for (tag, size), count in sorted(by_kind.items(), key=lambda kv: -kv[0][1] * kv[1]):
        if size * count >= min_gib * GIB:
            lines.append(
                f"  {tag:12s} {size:>15,d} B x {count:<3d} = {size * count / GIB:6.3f} GiB"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    p.add_argument("--min-gib", type=float, default=0.01, help="smallest total a line shows")
    a = p.parse_args(argv)
    for trace in sorted(a.trace_dir.glob("*.trace.jsonl.gz")):
        print("\n".join(peak_lines(trace, a.min_gib)))


if __name__ == "__main__":
    main()
