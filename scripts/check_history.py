"""Comments say why, never when: find history in the code, its tests, benchmarks and config.

    python scripts/check_history.py [ROOT]     # exit 1 naming file:line of every hit

A lease of a machine, a "stop N" of a work session or an issue of a tracker outside the
repository means nothing to a reader of the code and rots; a path outside the repository (such
as notes of the machine's operators) does not resolve in a clone. The reason such a comment gives
belongs in the comment, the history in docs/ (docs/CHANGELOG.md). `make lint` runs this, and
tests/test_history.py runs it in the test suite.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

#: What marks history: a work session's stop, a machine's lease, a tracker's issue by number, the
#: operators' notes outside the repository.
PATTERN = re.compile(r"\bstop [0-9]+|\blease [0-9]|\bissue [0-9]+|shared/notes", re.IGNORECASE)
#: Where it must not appear (docs/ may tell history).
ROOTS = ("workflow", "config", "benchmarks", "tests")
#: Build outputs inside the roots (and any folder named *.egg-info).
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}


def skipped(relative: Path) -> bool:
    return any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in relative.parts)


def files(root: Path) -> Iterator[Path]:
    for top in ROOTS:
        for path in sorted((root / top).rglob("*")):
            if path.is_file() and not skipped(path.relative_to(root)):
                yield path


def hits(root: Path) -> list[str]:
    """``file:line: text`` of every line that tells history, in file order."""
    found = []
    for path in files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary data (compressed traces): no comments in it
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if PATTERN.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    found = hits(root)
    for hit in found:
        print(hit)
    if found:
        print(
            f"{len(found)} line(s) tell history: keep the reason in the comment, move the "
            "history to docs/CHANGELOG.md",
            file=sys.stderr,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
