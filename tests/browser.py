"""Headless Chromium for the tests: open a page from file://, read its DOM, and every request
it made (from Chromium's net log), so that a test can prove no request leaves a page."""

from __future__ import annotations

import json
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
