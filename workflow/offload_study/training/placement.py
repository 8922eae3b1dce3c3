"""Where a run record lives: written in a temp folder, moved into place, archived.

A record is written into ``<outdir>.tmp-<host>-<pid>`` and moved into place when complete, so a
reader never sees half a record; the finished record is also copied into
``results/<cluster>/<study>/archive/<scenario>/rep<K>/<finished_at>-<sha8>/``. The half record of a
run whose runner died (SIGKILL, a node gone) is removed by the next run of the same outdir on the
same host (on another host, a runner's pid says nothing: its temp record is left alone).

A record leaves its place only for the archive: before one is replaced (a second runner of the
same run, e.g. the SLURM job of a killed Snakemake still running beside its re-submission) or
taken out for a retry, it is moved into the archive unless a copy of every byte of it
(:func:`offload_study.core.contracts.sha256_tree`) is there already.

A record whose failure the retry policy re-runs (:data:`offload_study.training.outcome.RETRY_POLICY`)
leaves its place for the archive when the workflow is parsed (:func:`retry_failed_runs`), so that
Snakemake, finding its outputs missing, runs it again. Snakemake makes a missing file again only
when a target, or a job that runs, needs it: the default target names every record, and what was
made from the records (the tables; recommend's decision, `snakemake recommend`'s target) leaves
with the record, which it would otherwise still show.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from offload_study.core import layout
from offload_study.core.contracts import (
    METRICS_FILE,
    RecordDir,
    read_json,
    sha256_file,
    sha256_tree,
)
from offload_study.training.outcome import RETRY_POLICY, failure_cause


def _host() -> str:
    """This host's name as a temp record's name carries it (no '/', nothing odd)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def temp_record(outdir: Path) -> RecordDir:
    """A fresh temp record beside outdir (with its logs folder) for this process on this host:
    results live on a filesystem that the nodes share, where pids of two nodes can be equal."""
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = outdir.with_name(outdir.name + f".tmp-{_host()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    record = RecordDir(tmp)
    record.logs.mkdir(parents=True)
    return record


def _writer(temp: Path) -> tuple[str, int] | None:
    """(host, pid) of the runner of a temp record ``rep<k>.tmp-<host>-<pid>``; a name without a
    host (``.tmp-<pid>``, written before hosts were named) is taken for this host's."""
    host, _, pid = temp.name.partition(".tmp-")[2].rpartition("-")
    return (host or _host(), int(pid)) if pid.isdigit() else None


def remove_interrupted_records(outdir: Path) -> list[Path]:
    """Temp records of runs on this host whose runner is gone (SIGKILL, a node that rebooted):
    this run redoes them. A runner on another host may still be running: its temp is left."""
    removed = []
    for path in outdir.parent.glob(outdir.name + ".tmp-*"):
        writer = _writer(path)
        if writer and writer != (_host(), os.getpid()) and writer[0] == _host():
            if not _pid_alive(writer[1]):
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
    study = layout.study_of_record(outdir.resolve())
    return layout.archive_dir(study, scenario, repeat, copy_name(finished_at, sha))


def copy_name(finished_at: str | None, sha: str) -> str:
    """An archived copy's folder name: ``<finished_at digits>-<sha8>`` (sha of metrics.json)."""
    return f"{re.sub(r'[^0-9TZ]', '', str(finished_at or 'unplaced'))}-{sha[:8]}"


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
    try:
        archive.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(record.root, archive, dirs_exist_ok=True)
    except OSError as e:  # a full disk: no half copy in the archive, the record in place kept
        shutil.rmtree(archive, ignore_errors=True)
        raise OSError(e.errno, f"cannot archive the record {record.root} to {archive}: {e}") from e
    # another runner of this run placed its record meanwhile (an empty folder is no record:
    # Snakemake makes the output's folder before the job starts)
    if (outdir / METRICS_FILE).exists():
        leave_for_archive(outdir, archive.parent)
    move_into_place(record.root, outdir)
    return archive


# ----------------------------------------------------------------------------- retries
@dataclass(frozen=True)
class RetryNote:
    """What became of one failed record when the workflow was parsed."""

    record: Path
    cause: str  # key of RETRY_POLICY
    failures: int  # archived failures of this run that the policy re-runs (this one included)
    retried: bool
    why: str
    dry_run: bool = False  # decided only (snakemake -n): nothing was taken out of place

    @property
    def retryable(self) -> bool:
        """A failure of the infrastructure (re-run, or not any more: its budget is spent)."""
        return RETRY_POLICY[self.cause].budget is not None

    def __str__(self) -> str:
        verb = ("would re-run" if self.dry_run else "re-run") if self.retried else "not retried"
        return f"{self.record}: {self.cause}, {verb}: {self.why}"


def _archived(archive: Path) -> list[tuple[Path, dict]]:
    """(copy, its metrics) of every archived attempt of one run, one per metrics.json (a record
    archived twice, other bytes beside the same metrics, is one attempt; unreadable ones out)."""
    found, seen = [], set()
    for copy in sorted(archive.glob(f"*/{METRICS_FILE}")):
        try:
            sha, metrics = sha256_file(copy), read_json(copy)
        except (OSError, ValueError):
            continue
        if sha not in seen:
            seen.add(sha)
            found.append((copy.parent, metrics))
    return found


def retried_failures(archive: Path) -> int:
    """Archived copies of one run whose failure the retry policy re-runs."""
    return sum(
        RETRY_POLICY[failure_cause(m.get("outcome", ""), m.get("error_excerpt"))].budget is not None
        for _, m in _archived(archive)
    )


def retries_of(record: Path) -> int:
    """How often the run of this record was re-run after a failure of the infrastructure: its
    archived copies that the policy re-runs, other than the record in place itself."""
    own = sha256_file(Path(record) / "metrics.json", missing_ok=True)
    scenario, rep = Path(record).parent.name, Path(record).name.removeprefix("rep")
    if not rep.isdigit():
        return 0
    archive = layout.archive_dir(layout.study_of_record(record), scenario, int(rep), "x").parent
    return sum(
        RETRY_POLICY[failure_cause(m.get("outcome", ""), m.get("error_excerpt"))].budget is not None
        and sha256_file(copy / "metrics.json", True) != own
        for copy, m in _archived(archive)
    )


def retry_decision(cause: str, failures: int, retries: dict) -> tuple[bool, str]:
    """(re-run it?, why) for a record failed of ``cause``, ``failures`` times so far, under the
    study's ``retries`` key ({infrastructure: N, time_limit: bool})."""
    rule = RETRY_POLICY[cause]
    if rule.budget is None:
        return False, rule.why
    if rule.budget == "time_limit" and not retries["time_limit"]:
        return False, f"{rule.why} (retries.time_limit: false)"
    if failures > retries["infrastructure"]:
        return False, (
            f"{rule.why}; but it failed so {failures} times, past the study's "
            f"retries.infrastructure: {retries['infrastructure']}"
        )
    return (
        True,
        f"{rule.why} (failure {failures}, retries.infrastructure: {retries['infrastructure']})",
    )


def retry_failed_run(study: Path, scenario: str, repeat: int, retries: dict, move: bool = True):
    """The record of one run, if failed: its RetryNote, and when the policy re-runs it, the record
    leaves its place for the archive (where place() put a copy of it already; a record without
    one is moved there). None for a missing or unreadable record, or an ok one."""
    record = Path(layout.record_dir(study, scenario, repeat))
    try:
        metrics = read_json(record / "metrics.json")
        cause = failure_cause(metrics["outcome"], metrics.get("error_excerpt"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if cause == "ok":
        return None
    archive = layout.archive_dir(study, scenario, repeat, "x").parent
    failures = max(1, retried_failures(archive))
    retried, why = retry_decision(cause, failures, retries)
    if retried and move:
        leave_for_archive(record, archive)
    return RetryNote(record, cause, failures, retried, why, dry_run=not move)


def _archived_whole(record: Path, archive: Path) -> bool:
    """Whether the archive of the run holds a copy of every byte of ``record``."""
    tree = sha256_tree(record)
    return any(sha256_tree(c.parent) == tree for c in archive.glob(f"*/{METRICS_FILE}"))


def leave_for_archive(record: Path, archive: Path) -> None:
    """Take a record out of its place, keeping it: it moves into the run's ``archive`` folder
    unless a copy of every byte of it is there (placed copies are, from :func:`place`)."""
    if not _archived_whole(record, archive):
        sha = sha256_file(record / METRICS_FILE, missing_ok=True) or "nometrics"
        try:
            finished = read_json(record / METRICS_FILE).get("finished_at")
        except (OSError, ValueError, AttributeError):
            finished = None
        target = archive / copy_name(finished, sha)
        if target.exists():  # the same metrics, other bytes beside them: a name of its own
            target = target.with_name(f"{target.name}-{sha256_tree(record)[:8]}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(record, target)
        return
    gone = record.with_name(record.name + f".gone-{_host()}-{os.getpid()}")
    os.replace(record, gone)  # out of place at once, then deleted
    shutil.rmtree(gone, ignore_errors=True)


def retry_failed_runs(study: str | Path, runs, retries: dict, move: bool = True) -> list[RetryNote]:
    """RetryNotes of the failed records among ``runs`` ((scenario, repeat) pairs); those the
    policy re-runs are taken out of place (``move``) so that the next run makes them again."""
    notes = (retry_failed_run(Path(study), s, int(r), retries, move) for s, r in runs)
    notes = [n for n in notes if n is not None]
    if move and any(n.retried for n in notes):
        forget_what_records_made(study)
    return notes


def forget_what_records_made(study: str | Path) -> None:
    """Remove what the workflow made from the study's records (layout.made_from_records): they
    are derived, so removing them loses nothing, and the next run makes them again from the records
    then in place. recommend's decision is `snakemake recommend`'s target: without it, that target
    stands and its records taken out are never made again (Snakemake ignores a missing
    intermediate file; the chaos run's "Nothing to be done")."""
    for path in layout.made_from_records(study):
        path.unlink(missing_ok=True)
