"""Headless Chromium for the tests: open a page from file://, read its DOM, and every request
it made (from Chromium's net log), so that a test can prove no request leaves a page."""

from __future__ import annotations

import html
import json
import re
import subprocess
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"


def chromium(tmp: Path, url: str, *extra: str) -> tuple[str, list[dict]]:
    """Run headless Chromium once; return (stdout, URL requests from its net log)."""
    assert Path(CHROMIUM).exists(), "needs Debian's chromium (apt-get install chromium)"
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    netlog = profile.with_suffix(".netlog.json")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--log-net-log={netlog}",
        "--window-size=1400,3000",
        *extra,
        url,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout, url_requests(netlog)


def url_requests(netlog: Path) -> list[dict]:
    """URL_REQUEST_START_JOB events of a Chromium net log (url, initiator, isolation key)."""
    data = json.loads(netlog.read_text())
    kind = data["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    out = []
    for e in data["events"]:
        p = e.get("params") or {}
        if e["type"] == kind and "url" in p:
            out.append(
                {
                    "url": p["url"],
                    "initiator": p.get("initiator"),
                    "nik": p.get("network_isolation_key", ""),
                }
            )
    return out


def page_requests(reqs: list[dict]) -> list[str]:
    """Requests the page made. Chromium's own background requests (update checks, account
    probes) have initiator 'not an origin' and no file:// isolation key: not the page's."""
    return [
        r["url"]
        for r in reqs
        if r["url"].startswith(("http:", "https:", "ws:", "wss:", "ftp:"))
        and (r["initiator"] != "not an origin" or "file://" in (r["nik"] or ""))
    ]


#: A page's "first screen" in the reading tests (CSS pixels).
SCREEN = (1400, 900)

_READER = """<html><body style="margin:0"><iframe id="f" style="width:%(w)dpx;height:%(h)dpx;border:0">
</iframe><script>
var pages = %(pages)s, ids = %(ids)s, out = [], i = 0, f = document.getElementById('f');
function text(d) { return d.body ? d.body.innerText : ''; }
f.onload = function () {
  if (i >= pages.length) return;
  var d = f.contentDocument, r = {page: pages[i], boxes: {}};
  r.on_load = text(d);
  ids.forEach(function (id) {
    var e = d.getElementById(id);
    if (e) { var b = e.getBoundingClientRect(); r.boxes[id] = [b.top, b.bottom]; } });
  r.alts = Array.prototype.map.call(d.images, function (m) { return m.alt; });
  d.querySelectorAll('details').forEach(function (e) { e.open = true; });
  r.whole = text(d);
  d.querySelectorAll('pre').forEach(function (e) { e.style.display = 'none'; });
  r.prose = text(d);
  out.push(r); i += 1;
  if (i < pages.length) { f.src = pages[i]; return; }
  var p = document.createElement('pre'); p.id = 'out';
  p.textContent = JSON.stringify(out); document.body.appendChild(p);
};
f.src = pages[0];
</script></body></html>"""


def read_pages(
    tmp: Path, pages: list[Path], ids: tuple[str, ...] = ()
) -> tuple[dict[Path, dict], list[dict]]:
    """Open every page in one Chromium, one after another in a SCREEN-sized frame, as a reader
    does: per page the text shown on load (collapsed sections closed: ``on_load``), the text
    with every section opened (``whole``) and the same without the files a page quotes in
    ``<pre>`` (``prose``), the images' alt texts, and the top and bottom of the elements
    ``ids`` in the frame (``boxes``); and the requests of the whole run (its net log). One
    browser for all pages: starting Chromium costs more than reading a page."""
    wrapper = tmp / "reader.html"
    wrapper.write_text(
        _READER
        % {
            "w": SCREEN[0],
            "h": SCREEN[1],
            "ids": json.dumps(list(ids)),
            "pages": json.dumps([p.resolve().as_uri() for p in pages]),
        }
    )
    budget = 4000 * len(pages)  # virtual ms: time stands still while a file loads
    dom, requests = chromium(
        tmp,
        wrapper.as_uri(),
        "--allow-file-access-from-files",
        f"--virtual-time-budget={budget}",
        "--dump-dom",
    )
    found = re.search(r'<pre id="out">(.*?)</pre>', dom, re.S)
    assert found, "the reader page read no page (a page failed to load?)"
    by_uri = {p.resolve().as_uri(): p for p in pages}
    read = {by_uri[r["page"]]: r for r in json.loads(html.unescape(found.group(1)))}
    return read, requests


def words(text: str) -> int:
    """Words as a reader counts them: runs of characters between white space."""
    return len(text.split())
