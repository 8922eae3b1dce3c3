"""What the terminal shows when a run ends (offload_study.analysis.report.terminal, called by the
Snakefile's onsuccess:), from records written by builders.make_record."""

from __future__ import annotations

import json
import re

from builders import CLUSTER, STUDY, make_plan, run_collect_cli, seed_like_records

from offload_study.analysis.report import terminal


def test_the_headline_table_and_the_report_path(tmp_path):
    study_dir = tmp_path / "results" / CLUSTER / STUDY
    paths = seed_like_records(tmp_path)
    assert run_collect_cli(paths, study_dir, baseline="zero3-8gpu") == 0
    (study_dir / "plan.json").write_text(make_plan(tmp_path, paths).read_text())
    report = tmp_path / "report.html"
    assert terminal.summary_text(str(study_dir), str(report)).count("report:") == 0  # not made
    report.write_text("<html></html>")
    lines = terminal.summary_text(str(study_dir), str(report)).splitlines()
    assert lines[0].split()[:2] == ["scenario", "tokens/s"] and lines[-1] == f"report: {report}"
    rows = {line.split("  ")[0].strip(): line for line in lines[1:-1]}
    assert "baseline" in rows["ZeRO-3 (8 GPU)"]
    four = rows["ZeRO-3 + Offload (4 GPU)"]  # 2,800 of 8,000 tokens/s
    assert "2,800" in four and re.search(r"35(\.\d)?% \[", four), four
    assert four.split()[-3] == "slower", four
    assert "host_oom" in rows[next(k for k in rows if "NVMe" in k or "nvme" in k)]


def test_without_a_summary_or_a_report_nothing_is_printed(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"study": "s"}))
    assert terminal.summary_text(str(tmp_path), str(tmp_path / "missing.html")) == ""
