"""Every committed page as a reader opens it: headless Chromium, one browser for all of them,
each page in a 1400×900 frame from file:// (tests/browser.py read_pages).

The pages are rendered from their committed records (benchmarks/rerender.sh), so this checks
what we publish, not a page made for the test. Each page is whole (no file "not found", no
empty plot, no internal id in its prose), opens on its answer (the seed verdict where there is
one and the "use this" sentence on the first screen, at most ~1,200 words before a section is
opened), ends with the commands that re-run it, says so when its runs came from a dirty tree,
and its seed figure draws what its seed table says. The index lists every page.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from browser import SCREEN, page_requests, read_pages, words
from conftest import REPO
from PIL import Image

from offload_study import engines
from offload_study.across import headlines
from offload_study.analysis.report import figures
from offload_study.core import contracts, verdict

pytestmark = [pytest.mark.browser]

PAGES = sorted(
    REPO / p
    for p in subprocess.run(
        ["git", "ls-files", "reports/*/*/report.html", "reports/*/*/recommend.html"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
)
REPORTS = [p for p in PAGES if p.name == "report.html"]
INDEX = REPO / "reports" / "index.html"
IDS = ("seed", "use-this", "verdict", "headline-table", "rerun")
BAND_WORDS = {
    verdict.REPRODUCED,
    verdict.NOT_REPRODUCED,
    verdict.INCONCLUSIVE,
    verdict.NOT_MEASURED,
}
#: At most this many words of a page show before any section is opened: the page opens on its
#: answer, the detail waits behind the sections.
WORDS_ON_LOAD = 1200
#: What a reader must never meet in a page's prose (its text without the files it quotes):
#: module paths, the planner's abbreviations and name joints, collect's outcome counts and
#: pairing notes, a file that is not there, a plot without data.
NOT_FOR_READERS = {
    "module path": r"\boffload_study\.\w",
    "planner abbreviation": r"\b(?:mb|rbs|gas|pbs|sgs|live|persist)-\d",
    "name joint": r"\w__\w",
    "'gas'": r"\bgas\b",
    "outcome count": r"\b[a-z_]+:\d+\b",
    "pairing note": r"pair\(s\)|repeats\+steps",
    "git's dirty mark": r"\+dirty",
    "missing file": r"not found",
    "empty plot": r"\(no data\)|no data:",
    "memory in GB": r"\d\s?GB\b(?!/s)",
}


@pytest.fixture(scope="module")
def reading(tmp_path_factory) -> tuple[dict[Path, dict], list[dict]]:
    """Every committed page and the index, read once."""
    return read_pages(tmp_path_factory.mktemp("reader"), [*PAGES, INDEX], IDS)


def records(page: Path) -> Path:
    # the committed records a committed page was rendered from, whatever results/ holds here
    found = headlines.records_of(
        page.parent.parent.name, page.parent.name, REPO, published_only=True
    )
    assert found is not None, f"no committed records for {page}"
    return found


def page_id(p: Path) -> str:
    return f"{p.parent.name}-{p.stem}"


def test_there_are_pages_and_the_index_lists_every_one(reading):
    assert len(REPORTS) >= 13 and len(PAGES) >= 16, PAGES
    listed = {
        (INDEX.parent / h).resolve()
        for h in re.findall(r'<a class="(?:report|recommend)" href="([^"]+)"', INDEX.read_text())
    }
    assert listed == set(PAGES)
    index = reading[0][INDEX]["on_load"]
    assert index.index("Studies: what to use") < index.index("Method and calibration studies")
    assert index.count("UTC") >= len(PAGES)  # each line its own render date


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_page_is_whole_and_speaks_the_readers_words(reading, page):
    read = reading[0][page]
    prose = read["prose"] + "\n" + "\n".join(read["alts"])
    for what, pattern in NOT_FOR_READERS.items():
        found = re.search(pattern, prose)
        assert not found, f"{what}: …{prose[max(found.start() - 80, 0) : found.end() + 80]}…"
    plan = contracts.read_json(records(page) / "plan.json")
    ids = [s["name"] for s in plan["scenarios"] if s["name"] not in engines.names()]
    named = [n for n in ids if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", prose)]
    assert not named, f"scenario names (ids) on the page: {named}"


def test_the_index_speaks_the_readers_words_and_holds_the_one_legend(reading):
    prose = reading[0][INDEX]["prose"]
    for what, pattern in NOT_FOR_READERS.items():
        found = re.search(pattern, prose)
        assert not found, f"{what}: …{prose[max(found.start() - 80, 0) : found.end() + 80]}…"
    assert 'id="legend"' in INDEX.read_text()
    for page in PAGES:  # each page's "how to read this page" leads to it
        (link,) = re.findall(r'href="([^"]*#legend)"', page.read_text())
        assert (page.parent / link.split("#")[0]).resolve() == INDEX, (page, link)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_the_first_screen_holds_the_answer(reading, page):
    boxes = reading[0][page]["boxes"]
    assert "use-this" in boxes, "no 'use this' sentence"
    for block in ("seed", "use-this"):
        if block in boxes:
            assert boxes[block][1] <= SCREEN[1], f"{block} ends below the first screen: {boxes}"
    if page in REPORTS:
        assert boxes["verdict"][0] < SCREEN[1], f"the verdict starts below: {boxes}"


def test_a_page_opens_on_at_most_1200_words(reading):
    counts = {str(p.relative_to(REPO)): words(reading[0][p]["on_load"]) for p in PAGES}
    print("\nwords on load:", json.dumps(counts, indent=1))
    over = {p: n for p, n in counts.items() if n > WORDS_ON_LOAD}
    assert not over, over


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_page_ends_with_its_commands_and_says_when_runs_were_dirty(reading, page):
    text = reading[0][page]["on_load"]
    tail = text[text.rindex("Re-run the ") :]
    assert "snakemake " in tail and "Re-render this page from its records: " in tail
    dirty = any(
        contracts.read_json(p).get("git_dirty")
        for p in records(page).glob("*/rep*/provenance.json")
    )
    assert ("ran from a working tree with uncommitted changes" in text) is dirty


def test_no_request_leaves_any_page(reading):
    assert page_requests(reading[1]) == []


class SeedTable(HTMLParser):
    """The seed table's body rows, each a list of its cells' text."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self._in = self._body = False

    def handle_starttag(self, tag, attrs):
        if tag == "table" and ("id", "seed-table") in attrs:
            self._in = True
        elif self._in and tag == "tbody":
            self._body = True
        elif self._body and tag == "tr":
            self.rows.append([])
        elif self._body and tag == "td":
            self.rows[-1].append("")

    def handle_endtag(self, tag):
        if tag == "table":
            self._in = self._body = False

    def handle_data(self, data):
        if self._body and self.rows and self.rows[-1]:
            self.rows[-1][-1] += data


def seed_rows(report: Path) -> list[list[str]]:
    parser = SeedTable()
    parser.feed(report.read_text())
    return [[" ".join(c.split()) for c in row] for row in parser.rows]


@pytest.mark.parametrize("report", REPORTS, ids=page_id)
def test_one_verdict_per_seed_row(report):
    plan = contracts.read_json(records(report) / "plan.json")
    planned = [*plan.get("scenarios", []), *plan.get("predict_only", [])]
    rows = seed_rows(report)
    assert len(rows) == sum(bool((s.get("reference") or {}).get("speed_pct")) for s in planned)
    for row in rows:
        assert sum(row[-1].startswith(word) for word in BAND_WORDS) == 1, row


@pytest.mark.parametrize("report", REPORTS, ids=page_id)
def test_the_seed_figure_draws_what_the_seed_table_says(report):
    """Each diamond at the row's published figure, each bar at this cluster's share as the
    table gives it (the figure's PNG text lists what it drew), and the page shows that PNG."""
    rows = seed_rows(report)
    png = report.parent / "figures" / figures.FIGURES["seed_share"]
    if not rows:
        return
    page = report.read_text()
    shown = re.search(r'id="fig-seed_share"><img src="data:image/png;base64,([^"]+)"', page)
    assert shown and base64.b64decode(shown.group(1)) == png.read_bytes()
    marks = json.loads(Image.open(png).text[figures.SEED_KEY])
    by_label = {r[0]: r for r in rows}
    assert len(marks) == len(rows) - 1  # the basis row is 100 % by definition, not drawn
    for mark in marks:
        row = next(
            r
            for label, r in by_label.items()
            if label.startswith(_label_of(report, mark["scenario"]))
        )
        assert float(row[1].rstrip("%")) == mark["seed_pct"], (row, mark)
        share = re.match(r"([\d.]+)%", row[2])
        if mark["share_pct"] is None:
            assert share is None, (row, mark)
        else:
            assert abs(float(share.group(1)) - mark["share_pct"]) <= 0.5, (row, mark)


def _label_of(report: Path, scenario: str) -> str:
    plan = contracts.read_json(records(report) / "plan.json")
    planned = {s["name"]: s for s in [*plan["scenarios"], *plan.get("predict_only", [])]}
    return planned[scenario]["label"]


def test_seed_2gpu_says_its_row_is_not_steady():
    """The seed's 2-GPU offload row: repeat 1 still climbed (28 → 36 s) when 3 steps ended it."""
    report = REPO / "reports/h200-2gpu/seed-2gpu/report.html"
    (row,) = [r for r in seed_rows(report) if r[0].startswith("ZeRO-3 + Offload (2 GPU)")]
    assert "caution: step time not steady" in row[0]


@pytest.mark.parametrize("report", REPORTS, ids=page_id)
def test_no_figure_label_is_cut(report):
    pngs = sorted((report.parent / "figures").glob("*.png"))
    assert len(pngs) == len(figures.FIGURES)
    for png in pngs:
        image = Image.open(png)
        assert image.size[0] >= 1200, png
        assert figures.CUT_KEY not in image.text, f"{png}: {image.text[figures.CUT_KEY]}"
        if png.name != figures.FIGURES["seed_share"]:  # the seed's figures are on its own basis
            assert "seed (published)" not in image.text["Description"], png
