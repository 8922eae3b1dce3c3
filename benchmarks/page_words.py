"""Words each committed page shows on load (collapsed sections closed) and with every section
open, read in headless Chromium as a reader sees it (tests/browser.py, one browser for all):

    PYTHONPATH=workflow python benchmarks/page_words.py [reports/<cluster>/<study>/*.html ...]

Without arguments: every committed report and recommend page (git ls-files). A page should
open on at most ~1,200 words (tests/test_committed_reports.py holds it to that).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from browser import read_pages, words  # noqa: E402


def committed_pages() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "reports/*/*/report.html", "reports/*/*/recommend.html"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO / p for p in sorted(listed)]


def main(argv: list[str]) -> int:
    pages = [Path(p).resolve() for p in argv] or committed_pages()
    with tempfile.TemporaryDirectory() as tmp:
        read, _ = read_pages(Path(tmp), pages)
    print(f"{'page':<62} {'on load':>8} {'whole':>7}")
    for page in pages:
        name = page.relative_to(REPO) if page.is_relative_to(REPO) else page
        r = read[page]
        print(f"{str(name):<62} {words(r['on_load']):>8} {words(r['whole']):>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
