"""A run's outcome, decided in one place: supervision facts + logs + rank stats + steps.

ReFrame-style: :data:`RULES` is a table of small pure checks, tried in order; the first that
speaks decides ``(outcome, excerpt)``. What the runner decided itself comes as values (its
:class:`Supervision`: a limit it enforced, or a run it did not launch, such as an op the preflight
found that DeepSpeed cannot build, with the fix); only what DeepSpeed and torch say is read from
the logs, by :data:`logparse.OUTCOME_PATTERNS` (whose remedies lead an excerpt, e.g.
"fix: apt-get install libaio-dev ...").
Every outcome is one of :data:`offload_study.core.contracts.OUTCOMES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from offload_study.core.contracts import LAUNCHER_LOG, RankStats, StepRow
from offload_study.training import logparse
from offload_study.training.supervise import SLURM_TIME_LIMIT, Supervision

Verdict = tuple[str, str | None]
KERNEL_KILL_CODES = (-9, 137)  # SIGKILL seen by Popen / by a shell


@dataclass(frozen=True)
class Evidence:
    """Everything the outcome is judged from."""

    supervision: Supervision
    logs: dict[str, str]  # log file name (launcher.log, rank<r>.log) -> text
    stats: dict[int, RankStats]
    steps: list[StepRow]
    world_size: int
    step_timeout_s: float | None

    @property
    def finished_ranks(self) -> int:
        return sum(1 for s in self.stats.values() if s.finished)

    @property
    def completed(self) -> bool:
        """The launcher exited 0 and every rank finished."""
        return self.supervision.rc == 0 and self.finished_ranks >= self.world_size

    @property
    def rank_text(self) -> str:
        return "\n".join(v for k, v in self.logs.items() if k.startswith("rank"))

    @property
    def all_text(self) -> str:
        return "\n".join(self.logs.values())


def _failure_excerpt(ev: Evidence, line: str | None) -> str | None:
    """Error lines of the rank logs when the root cause is there, else of all logs."""
    source = ev.rank_text if line and line in ev.rank_text else ev.all_text
    excerpt = logparse.error_excerpt(source)
    if ev.supervision.rc == 0:
        excerpt = (excerpt or "") + (
            f"\n(launcher exited 0 but {ev.finished_ranks}/{ev.world_size} ranks finished)"
        )
    return excerpt


# ----------------------------------------------------------------------------- the checks
def killed_by_runner(ev: Evidence) -> Verdict | None:
    """A limit was passed, the runner was signalled, or the runner did not launch the run (its
    gate: config_error, infeasible, op_build_error): supervision says which, and why in its
    detail, which leads the excerpt."""
    if ev.supervision.killed:
        return ev.supervision.killed, logparse.error_excerpt(
            ev.logs.get(LAUNCHER_LOG, "") or ev.all_text
        )
    return None


def step_over_limit(ev: Evidence) -> Verdict | None:
    """Completed, but a step took longer than step_timeout_s (too quick for the runner's poll)."""
    limit = ev.step_timeout_s
    if ev.completed and limit and any(r.step_time_s > limit for r in ev.steps):
        return "timeout", f"a step exceeded step_timeout_s={limit}"
    return None


def completed(ev: Evidence) -> Verdict | None:
    return ("ok", None) if ev.completed else None


def nothing_timed(ev: Evidence) -> Verdict | None:
    """Completed, but the engine skipped every measured optimizer step: no step did the work
    being measured, so there is no speed to report. Either fp16's loss scale overflowed (an
    H200 capture: tests/fixtures/gpu-fp16-overflow) or the loss itself was never finite."""
    measured = [r for r in ev.steps if r.phase == "measured"]
    if not (ev.completed and measured and not any(r.timed for r in measured)):
        return None
    if not any(math.isfinite(r.loss) for r in measured):  # no loss scale brings this back
        return "error", (
            f"the loss was not finite at all {len(measured)} measured steps, so every optimizer "
            "step was skipped (non-finite gradients): no speed to report; the model's forward "
            "makes NaN or inf (its weights, its inputs or its precision), not a loss scale"
        )
    return "error", (
        f"all {len(measured)} measured optimizer steps were skipped by DeepSpeed (fp16 "
        "loss-scale overflow): no speed to report; lower fp16.initial_scale_power or let "
        "the warm-up run until the loss scale settles (adaptive measure)"
    )


def disk_full(ev: Evidence) -> Verdict | None:
    """A disk (the NVMe path) filled up: DeepSpeed's failure then names no disk at all."""
    found = logparse.disk_full(ev.all_text)
    if found is None:
        return None
    why = f"disk full under the NVMe path: {found} (free space there, or offload less)"
    return "error", f"{why}\n{_failure_excerpt(ev, None) or ''}".strip()


def log_pattern(ev: Evidence) -> Verdict | None:
    """A known failure in the logs: rank logs first (root cause), then the launcher's output.
    A known remedy leads the excerpt."""
    found = logparse.classify(ev.rank_text)
    if found.outcome == "error":
        found = logparse.classify(ev.all_text)
    if found.outcome == "error":
        return None
    excerpt = _failure_excerpt(ev, found.line)
    return found.outcome, f"{found.remedy}\n{excerpt or ''}".strip() if found.remedy else excerpt


#: What leads the excerpt of a process killed by SIGKILL while no OOM kill was counted where it
#: ran: lost to its node or to someone's kill, not to the workload (RETRY_POLICY: rank_lost).
KILLED_FROM_OUTSIDE = "was killed by SIGKILL from outside the run"


def _sigkilled(ev: Evidence, who: str, ooms: int | None, where: str = "this host") -> Verdict:
    """SIGKILL that the runner did not send: the kernel's OOM killer, unless the kernel counted
    no OOM kill where the process ran while the run went (then someone else: a user, an admin's
    script, a node going away). A surviving rank's broken connection is its consequence."""
    excerpt = _failure_excerpt(ev, None)
    if ooms == 0:
        why = f"{who} {KILLED_FROM_OUTSIDE} (the kernel's OOM killer killed nothing on {where} meanwhile)"
        return "error", f"{why}\n{excerpt or ''}".strip()
    return "host_oom", excerpt


def rank_sigkilled(ev: Evidence) -> Verdict | None:
    """torchrun's root cause: a rank that died of SIGKILL (before the other ranks' errors).
    On the runner's host its OOM kills are supervision's count; on another node they are that
    node's count, as the node's own line in the launcher log says (launch.NODE_OOM_WRAPPER). A
    remote node that left no count (it went away) counted no OOM kill that anyone knows of."""
    log = ev.logs.get(LAUNCHER_LOG, "")
    cause = logparse.root_cause(log)
    if ev.supervision.rc == 0 or not cause or cause.exit_code != KERNEL_KILL_CODES[0]:
        return None
    if cause.host is None or logparse.same_host(cause.host, ev.supervision.host):
        return _sigkilled(ev, f"rank {cause.rank}", ev.supervision.oom_kills)
    ooms = logparse.node_oom_kills(log).get(logparse.short_host(cause.host), 0)
    where = f"node {cause.host}"
    return _sigkilled(ev, f"rank {cause.rank} on node {cause.host}", ooms, where)


def killed_by_kernel(ev: Evidence) -> Verdict | None:
    """The launcher itself died of SIGKILL that the runner did not send."""
    if ev.supervision.rc in KERNEL_KILL_CODES:
        return _sigkilled(ev, "the launcher", ev.supervision.oom_kills)
    return None


def unexplained(ev: Evidence) -> Verdict:
    return "error", _failure_excerpt(ev, None)


RULES: list[tuple[str, Callable[[Evidence], Verdict | None]]] = [
    ("the runner killed it", killed_by_runner),
    ("a step over step_timeout_s", step_over_limit),
    ("no measured step did optimizer work", nothing_timed),
    ("every rank finished", completed),
    ("a rank died of SIGKILL", rank_sigkilled),
    ("a disk filled up", disk_full),
    ("a known failure in the logs", log_pattern),
    ("the launcher died of SIGKILL", killed_by_kernel),
    ("anything else", unexplained),
]


def decide(ev: Evidence) -> Verdict:
    """(outcome, error excerpt) of a run: the first rule of RULES that speaks.

    The excerpt starts with what the runner saw (the limit passed) and is never empty for a
    failure (at least the exit code).
    """
    outcome, excerpt = next(v for _, rule in RULES if (v := rule(ev)) is not None)
    if ev.supervision.detail:
        excerpt = f"{ev.supervision.detail}\n{excerpt or ''}".strip()
    if outcome != "ok" and not excerpt:
        excerpt = f"exit code {ev.supervision.rc}"
    return outcome, excerpt


# ----------------------------------------------------------------------------- retry policy
@dataclass(frozen=True)
class Retry:
    """Whether a failure is re-run on the next invocation: ``budget`` names the study key
    (``retries.<budget>``) that allows it, None: never (the workload failed: it would fail again)."""

    budget: str | None
    why: str


#: The retry policy: a failed run's cause (its outcome, or what its excerpt says of it:
#: :func:`failure_cause`) -> re-run or not, and why. Infrastructure failures are re-run up to
#: the study's ``retries.infrastructure`` times; a SLURM time limit only with
#: ``retries.time_limit: true``; failures of the workload never.
RETRY_POLICY: dict[str, Retry] = {
    "cancelled": Retry(
        "infrastructure",
        "stopped from outside (scancel, preemption, requeue, "
        "node failure, Ctrl-C): the run itself did not fail",
    ),
    "rank_lost": Retry(
        "infrastructure",
        "a process died of SIGKILL while no OOM kill was "
        "counted where it ran: lost to its node, not to the workload",
    ),
    "slurm_time_limit": Retry(
        "time_limit",
        "SLURM's time limit ended the job: re-run only when "
        "the study allows it (retries.time_limit), else raise timeout_min",
    ),
    "timeout": Retry(
        None, "past the study's timeout_min or step_timeout_s: it would be as slow again"
    ),
    "gpu_oom": Retry(None, "the workload does not fit GPU memory: it would fail again"),
    "host_oom": Retry(None, "the workload does not fit host memory: it would fail again"),
    "config_error": Retry(None, "DeepSpeed refused the config: it would refuse it again"),
    "op_build_error": Retry(
        None, "an op does not build on this node: fix it first (the excerpt says how)"
    ),
    "infeasible": Retry(None, "predicted not to fit: not launched (force: true runs it)"),
    "dist_error": Retry(
        None,
        "NCCL/gloo/rendezvous failed with every rank alive: a setup fault "
        "that a re-run meets again",
    ),
    "error": Retry(None, "an unexplained failure of the run: re-running it would hide it"),
    "ok": Retry(None, "measured"),
}


def failure_cause(outcome: str, excerpt: str | None) -> str:
    """The key of RETRY_POLICY for a record: its outcome, refined where the excerpt (written by
    this package: supervise.SLURM_TIME_LIMIT, KILLED_FROM_OUTSIDE) says the infrastructure did it."""
    text = excerpt or ""
    if outcome == "timeout" and text.startswith(SLURM_TIME_LIMIT):
        return "slurm_time_limit"
    if outcome == "error" and KILLED_FROM_OUTSIDE in text.split("\n", 1)[0]:
        return "rank_lost"
    return outcome if outcome in RETRY_POLICY else "error"


def retry_of(outcome: str, excerpt: str | None) -> Retry:
    return RETRY_POLICY[failure_cause(outcome, excerpt)]
