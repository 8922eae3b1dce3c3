"""Where a run record lives: written in a temp folder, moved into place, archived.

A record is written into ``<outdir>.tmp-<pid>`` and moved into place when complete, so a reader
never sees half a record; the finished record is also copied into
``results/<cluster>/<study>/archive/<scenario>/rep<K>/<finished_at>-<sha8>/``. The half record of a
run whose runner died (node failure, SIGKILL) is removed by the next run of the same outdir.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from offload_study.core import layout
from offload_study.core.contracts import RecordDir, sha256_file


def temp_record(outdir: Path) -> RecordDir:
    """A fresh temp record beside outdir (with its logs folder) for this process."""
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = outdir.with_name(outdir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    record = RecordDir(tmp)
    record.logs.mkdir(parents=True)
    return record


def remove_interrupted_records(outdir: Path) -> list[Path]:
    """Temp records of runs whose runner is gone (node failure, SIGKILL): this run redoes them."""
    removed = []
    for path in outdir.parent.glob(outdir.name + ".tmp-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def archive_dir(outdir: Path, scenario: str, repeat: int, finished_at: str, sha: str) -> Path:
    """results/<cluster>/<study>/archive/<scenario>/rep<K>/<finished_at>-<sha8>/"""
    stamp = re.sub(r"[^0-9TZ]", "", finished_at)
    study = layout.study_of_record(outdir.resolve())
    return layout.archive_dir(study, scenario, repeat, f"{stamp}-{sha[:8]}")


def move_into_place(tmp: Path, outdir: Path) -> None:
    old = None
    if outdir.exists():
        old = outdir.with_name(outdir.name + f".old-{os.getpid()}")
        os.replace(outdir, old)
    os.replace(tmp, outdir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def place(record: RecordDir, outdir: Path, scenario: str, repeat: int, finished_at: str) -> Path:
    """Archive the finished temp record, then move it into place; returns the archive folder.

    The archive folder is named by the sha256 of metrics.json (so re-runs never collide).
    """
    if record.progress.exists():
        record.progress.unlink()  # the heartbeat means nothing once the run is over
    archive = archive_dir(outdir, scenario, repeat, finished_at, sha256_file(record.metrics))
    archive.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(record.root, archive, dirs_exist_ok=True)
    move_into_place(record.root, outdir)
    return archive
