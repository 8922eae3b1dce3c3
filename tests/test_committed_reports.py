"""Every committed report as a reader opens it: headless Chromium at 1400×900 from file://.

The verdict is on the first screen, with one verdict per seed row where the study carries the
seed's table; no figure has a cut label; no request leaves the page. The committed pages are
re-rendered from their committed records (benchmarks/rerender.sh), so this checks what we
publish, not a page made for the test.
"""

from __future__ import annotations

import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from browser import chromium, page_requests
from conftest import REPO
from PIL import Image

from offload_study.analysis.report import figures
from offload_study.core import verdict

pytestmark = [pytest.mark.browser]

SCREEN = (1400, 900)
REPORTS = sorted(
    REPO / p
    for p in subprocess.run(
        ["git", "ls-files", "reports/*/*/report.html"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
)
BAND_WORDS = {
    verdict.REPRODUCED,
    verdict.NOT_REPRODUCED,
    verdict.INCONCLUSIVE,
    verdict.NOT_MEASURED,
}


def geometry(tmp: Path, report: Path, ids: list[str]) -> dict[str, list[float]]:
    """Top and bottom (CSS pixels) of the elements ``ids`` of ``report`` shown in a 1400×900
    frame: a wrapper page measures them once the report has loaded."""
    wrapper = tmp / "measure.html"
    wrapper.write_text(
        '<html><body style="margin:0">'
        f'<iframe id="f" src="{report.as_uri()}" style="width:{SCREEN[0]}px;height:{SCREEN[1]}px;'
        'border:0"></iframe><script>'
        "document.getElementById('f').onload = function () {"
        "  var d = this.contentDocument, out = {};"
        f"  {json.dumps(ids)}.forEach(function (id) {{"
        "    var e = d.getElementById(id);"
        "    if (e) { var r = e.getBoundingClientRect(); out[id] = [r.top, r.bottom]; } });"
        "  var p = document.createElement('pre'); p.id = 'out';"
        "  p.textContent = JSON.stringify(out); document.body.appendChild(p); };"
        "</script></body></html>"
    )
    dom, _ = chromium(tmp, wrapper.as_uri(), "--allow-file-access-from-files",
                      "--virtual-time-budget=5000", "--dump-dom")  # fmt: skip
    found = re.search(r'<pre id="out">(.*?)</pre>', dom, re.S)
    assert found, f"the wrapper could not measure {report}"
    return json.loads(found.group(1))


class SeedVerdicts(HTMLParser):
    """The text of the last cell of each body row of the seed table (its verdict column)."""

    def __init__(self):
        super().__init__()
        self.rows: list[str] = []
        self._in_table = self._in_body = False
        self._cells: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "table" and ("id", "seed-table") in attrs:
            self._in_table = True
        elif self._in_table and tag == "tbody":
            self._in_body = True
        elif self._in_body and tag == "tr":
            self._cells = []
        elif self._in_body and tag == "td":
            self._cells.append("")

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_table = self._in_body = False
        elif self._in_body and tag == "tr" and self._cells:
            self.rows.append(self._cells[-1].strip())

    def handle_data(self, data):
        if self._in_body and self._cells:
            self._cells[-1] += data


def study_reference_rows(report: Path) -> int:
    """How many scenarios of the report's study carry a published speed (plan.json beside the
    committed records, found through the page's own study and cluster)."""
    cluster, study = report.parent.parent.name, report.parent.name
    for plan in (REPO / "docs/results").rglob("plan.json"):
        data = json.loads(plan.read_text())
        if data.get("study") == study and data.get("cluster") == cluster:
            planned = [*data.get("scenarios", []), *data.get("predict_only", [])]
            return sum(bool((s.get("reference") or {}).get("speed_pct")) for s in planned)
    pytest.fail(f"no committed records for {report}")


def test_every_committed_study_has_its_report_here():
    assert len(REPORTS) >= 7, REPORTS


@pytest.mark.parametrize("report", REPORTS, ids=[p.parent.name for p in REPORTS])
def test_the_verdict_is_on_the_first_screen(report, tmp_path):
    where = geometry(tmp_path, report, ["seed", "verdict", "headline-table"])
    assert "verdict" in where, "no verdict block"
    for block in ("seed", "verdict"):
        if block in where:
            assert where[block][1] <= SCREEN[1], f"{block} ends below the first screen: {where}"
    assert where["headline-table"][0] < SCREEN[1], f"the tradeoff table starts below: {where}"


@pytest.mark.parametrize("report", REPORTS, ids=[p.parent.name for p in REPORTS])
def test_one_verdict_per_seed_row(report):
    parser = SeedVerdicts()
    parser.feed(report.read_text())
    assert len(parser.rows) == study_reference_rows(report)
    for cell in parser.rows:
        assert sum(cell.startswith(word) for word in BAND_WORDS) == 1, cell


@pytest.mark.parametrize("report", REPORTS, ids=[p.parent.name for p in REPORTS])
def test_no_figure_label_is_cut(report):
    pngs = sorted((report.parent / "figures").glob("*.png"))
    assert len(pngs) == len(figures.FIGURES)
    for png in pngs:
        image = Image.open(png)
        assert image.size[0] >= 1200, png
        assert figures.CUT_KEY not in image.text, f"{png}: {image.text[figures.CUT_KEY]}"


@pytest.mark.parametrize("report", REPORTS, ids=[p.parent.name for p in REPORTS])
def test_no_request_leaves_the_page(report, tmp_path):
    _, requests = chromium(tmp_path, report.as_uri(), "--dump-dom")
    assert page_requests(requests) == []
