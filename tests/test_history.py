"""Comments say why, never when (scripts/check_history.py): no history in the code, its tests,
benchmarks and config, and the check finds what it is for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "check_history.py"
_spec = importlib.util.spec_from_file_location("check_history", SCRIPT)
check_history = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_history)

# Each marker split in two, so that this file does not match the pattern it tests.
LEASE, STOP, ISSUE, NOTES = "lea" + "se 3", "st" + "op 34", "Iss" + "ue 26", "shared" + "/notes"


def test_no_history_in_code_tests_benchmarks_or_config():
    assert check_history.hits(REPO_ROOT) == []


def test_the_check_names_file_and_line_of_each_kind(tmp_path):
    (tmp_path / "workflow" / "pkg").mkdir(parents=True)
    (tmp_path / "workflow" / "pkg" / "m.py").write_text(
        f"x = 1  # why it is 1\n# measured on {LEASE} (2026-12-02)\ny = 2  # {STOP}\n"
    )
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "c.json").write_text(f'{{"source": "../{NOTES}/gpu.md"}}\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(f'"""The check ({ISSUE})."""\n')
    (tmp_path / "tests" / "trace.gz").write_bytes(b"\x1f\x8b\xff\xfe" + LEASE.encode())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "CHANGELOG.md").write_text(f"- {STOP}: history belongs here\n")
    assert [hit.split(": ")[0] for hit in check_history.hits(tmp_path)] == [
        "workflow/pkg/m.py:2",
        "workflow/pkg/m.py:3",
        "config/c.json:1",
        "tests/test_x.py:1",
    ]


def test_the_script_fails_naming_the_line(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text(f"# as in {STOP}\n")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stdout.startswith("benchmarks/b.py:1: ")
    clean = tmp_path / "clean"
    (clean / "benchmarks").mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(clean)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout
