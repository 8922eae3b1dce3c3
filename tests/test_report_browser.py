"""Open the report in headless Chromium from file://: DOM content, screenshot, no network fetch."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_collect import make_record, seed_like_records
from test_report import assert_self_contained, build_report

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path("/tmp/report_screenshot.png")

pytestmark = [
    pytest.mark.browser,
]


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


def test_detector_sees_page_requests(tmp_path):
    """Control: the net-log check catches a page that does fetch from the network."""
    page = tmp_path / "leaky.html"
    page.write_text(
        '<html><body><img src="http://127.0.0.1:9/x.png">'
        '<link rel="stylesheet" href="https://example.invalid/a.css"></body></html>'
    )
    _, reqs = chromium(tmp_path, page.as_uri(), "--dump-dom")
    leaked = page_requests(reqs)
    assert any("127.0.0.1:9" in u for u in leaked) and any("example.invalid" in u for u in leaked)


def test_report_in_browser(tmp_path):
    paths = seed_like_records(tmp_path)
    for gas in (8, 16):
        paths.append(
            make_record(
                tmp_path,
                f"zero3-offload-4gpu-gas{gas}",
                base_scenario="zero3-offload-4gpu",
                label=f"ZeRO-3 + Offload (4 GPU), gas={gas}",
                offload_optimizer="cpu",
                offload_param="cpu",
                world_size=4,
                gpus_per_node=4,
                gas=gas,
                tokens_per_s=2800 * (1 + gas / 40),
                peak_gpu_gib=14.5,
                host_rss_gib=390,
                cpu_mem_gb=512,
                sweep={"gradient_accumulation_steps": gas},
            )
        )
    html, figs, report = build_report(tmp_path, paths)
    assert_self_contained(html)
    url = report.resolve().as_uri()

    dom, reqs = chromium(tmp_path, url, "--dump-dom")
    assert page_requests(reqs) == []
    assert 'id="headline-table"' in dom and "ZeRO-3 + Offload (4 GPU)" in dom
    assert dom.count("<tr") >= 6
    for name in ("relative_speed", "speed_vs_gpu_memory", "step_breakdown", "speed_vs_gas"):
        assert f'id="fig-{name}"' in dom
    assert dom.count('src="data:image/png;base64,') == 4
    assert "host_oom" in dom  # failed scenario visible

    shot = tmp_path / "shot.png"
    _, reqs = chromium(tmp_path, url, f"--screenshot={shot}")
    assert page_requests(reqs) == []
    assert shot.exists() and shot.stat().st_size > 20_000
    shutil.copy(shot, SCREENSHOT)
