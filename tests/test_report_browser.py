"""Open the report in headless Chromium from file://: DOM content, screenshot, no network fetch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from browser import chromium, page_requests
from builders import assert_self_contained, build_report, make_record, seed_like_records

SCREENSHOT = Path("/tmp/report_screenshot.png")

pytestmark = [
    pytest.mark.browser,
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
    from offload_study.analysis.report.figures import FIGURES

    shown = [name for name in FIGURES if f'id="fig-{name}"' in dom]  # those with data
    assert {"relative_speed", "seed_share", "speed_vs_gas"} <= set(shown)
    assert dom.count('src="data:image/png;base64,') == len(shown)
    assert "ran out of host memory" in dom  # failed scenario visible

    shot = tmp_path / "shot.png"
    _, reqs = chromium(tmp_path, url, f"--screenshot={shot}")
    assert page_requests(reqs) == []
    assert shot.exists() and shot.stat().st_size > 20_000
    shutil.copy(shot, SCREENSHOT)
