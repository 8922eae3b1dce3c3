"""Supervision of one launched run: its process group, its limits, signals to the runner.

:func:`supervise` waits for the launcher's process group and kills it when a limit is passed
(``timeout_s``, ``step_timeout_s``, the host memory budget ``cpu_mem_gb``: the summed RSS of the
local process tree, sampled 5x/s) or when the runner got SIGTERM/SIGINT. What it saw comes back as
:class:`Supervision`, the facts the outcome is decided from (:mod:`offload_study.training.outcome`).
A signal is ``cancelled``, unless SLURM sent it for the job's time limit (``timeout``).

Limit: the memory budget only sees processes on the runner's node (with ``nodes > 1`` the remote
ranks are not summed).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from offload_study.core import units
from offload_study.core.contracts import Progress, RecordDir, RunSpec, read_progress

POLL_S = 0.2
KILL_GRACE_S = 5.0
# A runner that got a signal is killed itself soon after (timeout -k, SLURM's KillWait, a second
# Ctrl-C): its ranks get a short grace, so that the cancelled record is written before that. A
# rank that has to exit (torchrun's agent shutting its workers down, a CUDA context torn down)
# could otherwise take the whole 5 s, and with the SIGKILL wait and the reap, past a 10 s grace.
CANCEL_GRACE_S = 1.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Supervision:
    """What supervision saw: exit status, why the runner killed the group (None: it did not)."""

    rc: int | None  # the launcher's exit status (negative: killed by that signal; None: no launch)
    # outcome the runner decided: it killed the run (timeout | host_oom | cancelled) or did not
    # launch it (config_error | infeasible | op_build_error)
    killed: str | None = None
    detail: str | None = None  # the limit that was passed or why not launched (a fix), in words
    peak_tree_rss: int = 0  # bytes, the process tree summed
    rank_peaks: dict[int, int] = field(default_factory=dict)  # rank -> peak RSS bytes
    elapsed: float = 0.0  # seconds
    # OOM kills by this host's kernel while the run went (None: not countable here); tells the
    # OOM killer's SIGKILL from anyone else's
    oom_kills: int | None = None
    host: str | None = None  # where the runner ran (a rank that died elsewhere is judged apart)


# ----------------------------------------------------------------------------- process tree
def tree_rss(pid: int, rank_peaks: dict[int, int]) -> int:
    """Sum of RSS over pid and its descendants; updates per-rank peaks of harness processes."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            rss = p.memory_info().rss
        except psutil.Error:
            continue
        total += rss
        try:
            if "offload_study.training.harness" in " ".join(p.cmdline()):
                r = p.environ().get("RANK")
                if r is not None:
                    rank_peaks[int(r)] = max(rank_peaks.get(int(r), 0), rss)
        except (psutil.Error, ValueError):
            pass
    return total


def kill_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group, SIGKILL what is left after grace_s."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # leader gone: make sure no straggler of the group survives
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def reap_group(pgid: int, flush_s: float = 2.0) -> None:
    """The group leader (new session) is gone: let tee flush, then no straggler (a rank torchrun
    lost, a tee) may outlive it."""
    deadline = time.monotonic() + flush_s
    try:
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux prctl
    PR_SET_PDEATHSIG). The launcher runs in its own session and the ranks under it: a runner
    killed by SIGKILL (node agent, OOM killer, a crashed Snakemake's whole job) would leave them
    training unsupervised. Called in the launcher's child before exec (``preexec_fn``) and first
    thing in each rank; a no-op where prctl does not exist."""
    parent = os.getppid()
    if _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)  # the parent died before the call


def _libc_prctl():
    """libc's prctl, looked up at import: not between fork and exec (a dlopen there can
    deadlock in a process with threads)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


class Cancelled:
    """Signal handler that only remembers the signal (the supervision loop acts on it)."""

    def __init__(self):
        self.signum = None

    def __call__(self, signum, _frame):
        self.signum = signum


#: What leads the detail of a run that SLURM ended at its job's time limit (outcome.failure_cause).
SLURM_TIME_LIMIT = "SLURM time limit reached"
#: SLURM job state at the signal -> what stopped the run, in words (others: "scancel or Ctrl-C").
SLURM_STOPPED_BY = {
    "PREEMPTED": "preempted by SLURM",
    "NODE_FAIL": "its node failed (SLURM NODE_FAIL)",
    "REQUEUED": "requeued by SLURM",
    "REQUEUE_HOLD": "requeued by SLURM",
    "REQUEUE_FED": "requeued by SLURM",
    "PENDING": "requeued by SLURM",
}
#: A job whose Restarts count grew while the run went: SLURM requeued it and starts it again.
SLURM_REQUEUED = (
    "requeued by SLURM (scontrol requeue, preemption or a node failure); SLURM starts it again"
)


def slurm_job(environ=os.environ, runner=subprocess.run) -> dict[str, str]:
    """``scontrol show job`` of the job this process runs in, as Key -> value ({} outside SLURM
    or when the controller does not answer)."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    try:
        show = runner(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"JobId": job, **dict(token.partition("=")[::2] for token in show.split())}


def job_restarts(fields: dict[str, str]) -> int | None:
    """How often SLURM has started the job again (``Restarts``; None when unknown). Read at the
    start and at the signal: a count that grew means SLURM requeued the job meanwhile."""
    count = fields.get("Restarts", "")
    return int(count) if count.isdigit() else None


def signal_verdict(
    signum, environ=os.environ, runner=subprocess.run, restarts_at_start: int | None = None
) -> tuple[str, str]:
    """(outcome, detail) of the SIGTERM/SIGINT the runner got: ``timeout`` when SLURM is ending
    its job for the time limit (the controller marks the job TIMEOUT before it signals the
    steps), else ``cancelled`` (scancel, preemption, requeue, node failure, Ctrl-C), its detail
    naming what SLURM says stopped it. A requeue (``scontrol requeue``, PreemptMode=REQUEUE, a
    node failure of a ``--requeue`` job) shows as a grown ``Restarts`` count while the job is
    still COMPLETING (``restarts_at_start``: the count when the run began)."""
    detail = f"received signal {signum}"
    fields = slurm_job(environ, runner)
    job, state = fields.get("JobId"), fields.get("JobState")
    if state == "TIMEOUT":
        return "timeout", (
            f"{SLURM_TIME_LIMIT} (job {job}, TimeLimit={fields.get('TimeLimit')}): {detail}"
        )
    if state in SLURM_STOPPED_BY:
        return "cancelled", f"{SLURM_STOPPED_BY[state]} (job {job}, JobState={state}): {detail}"
    restarts = job_restarts(fields)
    if None not in (restarts, restarts_at_start) and restarts > restarts_at_start:
        return "cancelled", (
            f"{SLURM_REQUEUED} (job {job}, JobState={state}, Restarts={restarts}): {detail}"
        )
    return "cancelled", detail


def host_oom_kills() -> int | None:
    """The kernel's count of OOM kills on this host since boot (/proc/vmstat ``oom_kill``)."""
    try:
        with open("/proc/vmstat") as vmstat:
            counts = dict(line.split(maxsplit=1) for line in vmstat if " " in line)
        return int(counts["oom_kill"])
    except (OSError, KeyError, ValueError):
        return None


# ----------------------------------------------------------------------------- limits
@dataclass
class Watch:
    """What the loop has seen so far (the limits are judged from it)."""

    started: float
    rss: int = 0
    progress: Progress | None = None
    last_step: int | None = None
    last_step_at: float | None = None


def limit_passed(spec: RunSpec, watch: Watch, now: float, signum) -> tuple[str, str] | None:
    """(outcome, detail) of the first limit passed, in order: signal, memory, run time, step time."""
    budget_bytes = spec.cpu_mem_bytes  # GiB, as SLURM's --mem and the plan's budget count it
    if signum is not None:
        return "cancelled", f"received signal {signum}"
    if budget_bytes and watch.rss > budget_bytes:
        return "host_oom", (
            f"host memory budget exceeded: process tree RSS "
            f"{units.bytes_to_gib(watch.rss):.3f} GiB > cpu_mem_gb {spec.cpu_mem_gb} GiB"
        )
    if now - watch.started > float(spec.timeout_s):
        return "timeout", f"run exceeded timeout_s={spec.timeout_s}"
    limit = spec.step_timeout_s
    if limit and watch.last_step_at is not None:
        stuck = now - watch.last_step_at
        took = (watch.progress.step_time_s if watch.progress else None) or 0.0
        if took > float(limit) or stuck > float(limit):
            return "timeout", (
                f"step exceeded step_timeout_s={limit} (last step {took:.3f} s, "
                f"{stuck:.1f} s since step {watch.last_step})"
            )
    return None


def _note_progress(watch: Watch, record: RecordDir, now: float, say: Callable[[str], None]):
    progress = read_progress(record)
    watch.progress = progress or watch.progress
    if progress is not None and progress.step != watch.last_step:
        watch.last_step, watch.last_step_at = progress.step, now
        if progress.step:
            say(
                f"step {progress.step}/{progress.total} {progress.phase} "
                f"{progress.step_time_s or 0:.3f} s"
            )


def supervise(
    proc: subprocess.Popen, spec: RunSpec, record: RecordDir, cancel: Cancelled, say
) -> Supervision:
    """Wait for the launched group, killing it when a limit is passed (see limit_passed)."""
    watch = Watch(started=time.monotonic())
    peak, rank_peaks, breach, ooms_before = 0, {}, None, host_oom_kills()
    restarts_at_start = job_restarts(slurm_job())  # a requeue later shows as a grown count
    while proc.poll() is None:
        now = time.monotonic()
        watch.rss = tree_rss(proc.pid, rank_peaks)
        peak = max(peak, watch.rss)
        _note_progress(watch, record, now, say)
        breach = limit_passed(spec, watch, now, cancel.signum)
        if breach:
            say(f"killing process group: {breach[1]}")
            kill_group(proc, CANCEL_GRACE_S if breach[0] == "cancelled" else KILL_GRACE_S)
            break
        time.sleep(POLL_S)
    rc = proc.wait()
    reap_group(proc.pid)
    if breach is None and cancel.signum is not None:
        # scancel signals the whole step: the ranks may die before the loop sees the signal
        breach = ("cancelled", f"received signal {cancel.signum}")
    if breach and breach[0] == "cancelled":
        breach = signal_verdict(cancel.signum, restarts_at_start=restarts_at_start)
    killed, detail = breach or (None, None)
    ooms_after = host_oom_kills()
    ooms = None if None in (ooms_before, ooms_after) else ooms_after - ooms_before
    elapsed = time.monotonic() - watch.started
    host = socket.gethostname()
    return Supervision(rc, killed, detail, peak, rank_peaks, elapsed, ooms, host)
