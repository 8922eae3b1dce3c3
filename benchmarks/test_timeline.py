"""Where a parallel `make test` spends its wall time: reads the timeline the test suite writes
with OFFLOAD_STUDY_TEST_TIMELINE=<file> (tests/conftest.py: one line per test, worker, start,
end, CPU seconds of the worker and its waited-for children) and prints per worker its busy and
idle seconds, when it finished, and the tests that took longest in wall time and in CPU.

    OFFLOAD_STUDY_TEST_TIMELINE=/tmp/timeline.tsv make test
    python benchmarks/test_timeline.py /tmp/timeline.tsv
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> list[tuple[str, float, float, float, str]]:
    rows = []
    for line in path.read_text().splitlines():
        worker, start, end, cpu, test = line.split("\t", 4)
        rows.append((worker, float(start), float(end), float(cpu), test))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    rows = read(a.timeline)
    t0 = min(r[1] for r in rows)
    wall = max(r[2] for r in rows) - t0
    by_worker = defaultdict(list)
    for r in rows:
        by_worker[r[0]].append(r)
    print(f"{len(rows)} tests, wall {wall:.0f} s from the first test's start to the last's end")
    for worker, its in sorted(by_worker.items()):
        busy = sum(e - s for _, s, e, _, _ in its)
        done = max(e for _, _, e, _, _ in its) - t0
        print(
            f"  {worker}: {len(its)} tests, busy {busy:.0f} s, idle {done - busy:.0f} s, "
            f"finished at {done:.0f} s, CPU {sum(c for *_, c, _ in its):.0f} s"
        )
    print(f"longest {a.top} (wall s, CPU s, started at s, worker):")
    for w, s, e, c, test in sorted(rows, key=lambda r: r[2] - r[1], reverse=True)[: a.top]:
        print(f"  {e - s:7.1f} {c:7.1f} {s - t0:7.0f}  {w:5s} {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
