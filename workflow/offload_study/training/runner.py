"""Runner of one training run (scenario x repeat) -> a complete run record.

    python -m offload_study.training.runner --spec RUN.json --repeat K \\
        --outdir results/<cluster>/<study>/<scenario>/rep<K>

Composes the parts, each in its own module:

- :mod:`~offload_study.admission.admit`  the gate at launch, admission's own checks for this run:
  an NVMe folder this node cannot write is ``config_error``, a run the plan predicts not to fit
  its memory or NVMe budget ``infeasible`` (unless ``force``), a run whose DeepSpeed ops cannot
  be built on this node ``op_build_error`` (the fix first in its excerpt); none is launched,
- :mod:`~offload_study.training.launch`     the command line (torchrun / srun) of the harness,
- :mod:`~offload_study.training.supervise`  the process group, its limits (timeout_s, step_timeout_s,
  cpu_mem_gb) and SIGTERM/SIGINT (-> cancelled),
- :mod:`~offload_study.training.outcome`    the one decision of the outcome, from what the run left,
- :mod:`~offload_study.training.metrics`    metrics.json, :mod:`~offload_study.training.provenance` provenance.json,
- :mod:`~offload_study.training.placement`  temp folder -> moved into place -> archived.
- :mod:`~offload_study.planning.samealloc`  with study key ``same_allocation_baseline``: right after an
  ok run, a short run of its no-offload pair in the same job, recorded in ``<record>/pair/``
  (:func:`run_pair`; its failure is that nested record's outcome, never the run's).

``logs/launcher.log`` gets the launcher's output and the runner's own lines. Exit status: 0
whatever the outcome, unless ``strict`` (then 1 when outcome != ok or the record breaks its schema).
NVMe swap folders of a killed run are cleaned on the runner's node only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from offload_study import engines
from offload_study.admission import admit, ops, preflight
from offload_study.core.contracts import (
    PAIR_DS_CONFIG_FILE,
    PAIR_SPEC_FILE,
    RecordDir,
    RunSpec,
    nvme_run_dir,
    read_rank_stats,
    read_run_spec,
    read_steps,
    write_json,
    write_run_spec,
    write_steps,
)
from offload_study.training import launch, outcome, placement, provenance
from offload_study.training.metrics import MetricsInput, compute_metrics, metrics_problems
from offload_study.training.supervise import Cancelled, Supervision, die_with_parent, supervise


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def granted_cores() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_ON_NODE")
    if slurm and slurm.isdigit():
        n = min(n, int(slurm))
    return max(1, n)


def read_logs(record: RecordDir) -> dict[str, str]:
    """Log file name -> text of every log of the record."""
    logs = {}
    for path in sorted(record.logs.glob("*.log")):
        try:
            logs[path.name] = path.read_text(errors="replace")
        except OSError:
            pass
    return logs


class RunnerLog:
    """The runner's own lines: to stdout and into logs/launcher.log (which the launcher shares)."""

    def __init__(self, path: Path):
        self.file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()

    def __call__(self, message: str) -> None:
        line = f"[runner {time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self.file.write((line + "\n").encode())

    def close(self) -> None:
        self.file.close()


def clear_stale_op_locks(spec: RunSpec, say: RunnerLog) -> None:
    """Remove the abandoned build locks of the ops ``spec`` loads: a build of one of them killed
    earlier (a timed-out run, a preempted job) left its lock, on which the ranks would wait
    until the run's timeout, and so would every later run. Looking never stops a launch."""
    if not preflight.machine_can_check(spec.accelerator):
        return
    try:
        removed = ops.clear_stale_locks(preflight.ops_needed(spec), spec.accelerator)
    except Exception as e:  # noqa: BLE001 - the ranks' own load says what is wrong
        say(f"stale build locks not checked: {type(e).__name__}: {e}")
        return
    for lock in removed:
        say(f"removed the stale build lock {lock}")


@dataclass(frozen=True)
class Attempt:
    """One run to make into one temp record, and what it may use."""

    spec: RunSpec
    spec_path: str
    repeat: int
    record: RecordDir
    plan_outdir: Path  # where admit.at_launch finds the study's plan.csv
    cores: int


#: Launches of one run whose rendezvous port was taken before torchrun's agent bound it. The
#: port is free when chosen (core.devices.free_port), but until the agent binds it any process
#: on the node may take it, an outgoing connection of a neighbouring run included (they draw
#: from the same ephemeral range). No rank has started then, so the run is launched again on
#: another port instead of being recorded as a dist_error it never met.
PORT_ATTEMPTS = 3


def rendezvous_port_taken(launcher_text: str, port: int) -> bool:
    """Whether torchrun's agent failed to bind the rendezvous ``port`` (torch's DistNetworkError
    "... port: N, useIpv6: ..., name: EADDRINUSE"): nothing ran."""
    return bool(re.search(rf"\bport: {port}\b.*EADDRINUSE", launcher_text))


def set_aside_if_port_taken(
    record: RecordDir, log_start: int, lch: launch.Launch | None, sup: Supervision, launch_no: int
) -> bool:
    """Whether a one-node launch failed only at binding its rendezvous port, as what it wrote to
    the launcher log from ``log_start`` on says (a multi-node run's port is its job's). If so,
    that text moves to ``logs/launcher.port-taken-<launch_no>.txt``: kept, but out of the logs
    the outcome is read from, which are the next launch's alone."""
    if lch is None or lch.nodes > 1 or sup.rc in (0, None) or sup.killed:
        return False
    with open(record.launcher_log, "rb") as f:
        f.seek(log_start)
        text = f.read()
    if not rendezvous_port_taken(text.decode(errors="replace"), lch.port):
        return False
    (record.logs / f"launcher.port-taken-{launch_no}.txt").write_bytes(text)
    os.truncate(record.launcher_log, log_start)  # the runner's log appends: it goes on from here
    return True


def launch_and_supervise(
    run: Attempt, run_id: str, cancel: Cancelled, say: RunnerLog
) -> tuple[launch.Launch | None, Supervision]:
    """Start the harness in its own process group and supervise it to the end; on one node,
    start it again on another port while the one chosen was taken (PORT_ATTEMPTS)."""
    for launch_no in range(1, PORT_ATTEMPTS):
        log_start = run.record.launcher_log.stat().st_size
        lch, sup = launch_once(run, run_id, cancel, say)
        if not set_aside_if_port_taken(run.record, log_start, lch, sup, launch_no):
            return lch, sup
        say(
            f"port {lch.port} was taken before the rendezvous bound it, and no rank had "
            f"started (logs/launcher.port-taken-{launch_no}.txt): launching again on another port"
        )
    return launch_once(run, run_id, cancel, say)


def launch_once(
    run: Attempt, run_id: str, cancel: Cancelled, say: RunnerLog
) -> tuple[launch.Launch | None, Supervision]:
    """One launch of the harness in its own process group, supervised to its end."""
    lch = None
    try:
        clear_stale_op_locks(run.spec, say)
        lch = launch.build_launch(
            run.spec, run.spec_path, str(run.record.root), cores=run.cores, run_id=run_id
        )
        env = {**lch.environ(os.environ), "OFFLOAD_STUDY_RUN_ID": run_id}
        say(f"{run.spec.scenario} rep{run.repeat}: {lch.command_line}")
        say("env: " + " ".join(f"{k}={v}" for k, v in sorted(lch.env.items())))
        proc = subprocess.Popen(
            lch.argv,
            env=env,
            stdout=say.file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return lch, supervise(proc, run.spec, run.record, cancel, say)
    except Exception as e:  # noqa: BLE001 - a launch failure is a recorded outcome too
        say(f"launch failed: {type(e).__name__}: {e}")
        return lch, Supervision(rc=None)


@dataclass(frozen=True)
class FinishedRun:
    """What the runner knows of a run once its processes are gone."""

    spec: RunSpec
    repeat: int
    record: RecordDir
    run_id: str
    cores: int
    launched: launch.Launch | None
    supervision: Supervision
    started_at: str
    finished_at: str


def write_record(run: FinishedRun) -> tuple[dict, list[str]]:
    """metrics.json, steps.csv (header only when the run wrote none), provenance.json.

    Returns (metrics, the ways metrics or provenance break their schema).
    """
    spec, record, sup = run.spec, run.record, run.supervision
    stats, logs, steps = read_rank_stats(record), read_logs(record), read_steps(record.steps)
    verdict, excerpt = outcome.decide(
        outcome.Evidence(sup, logs, stats, steps, spec.world_size, spec.step_timeout_s)
    )
    metrics = compute_metrics(
        MetricsInput(
            spec,
            run.repeat,
            sup,
            verdict,
            excerpt,
            steps,
            stats,
            logs,
            run.started_at,
            run.finished_at,
        )
    )
    prov = provenance.provenance(spec, run.launched, stats, run.cores, sup, run.run_id)
    problems = metrics_problems(metrics)
    problems += [f"provenance.json: {p}" for p in provenance.provenance_problems(prov)]
    prov["schema_problems"] = problems
    if not record.steps.exists():
        write_steps(record.steps, [])
    write_json(record.metrics, metrics)
    write_json(record.provenance, prov)
    return metrics, problems


def gate(spec: RunSpec, plan_outdir: Path, say: RunnerLog, what: str) -> Supervision | None:
    """Why the run is not launched, as the Supervision its record gets (None: launch it): the
    first problem admission finds at launch (offload_study.admission.admit.at_launch).
    ``plan_outdir``: the record folder whose study's plan.csv holds the run's prediction."""
    found = admit.at_launch(spec, plan_outdir)
    if found is None:
        return None
    if found.outcome == "config_error":  # the plan could not check it (not this machine)
        detail = f"config_error: nvme_path {found.message}"
        say(f"{what}: not launched: {detail}")
        return Supervision(rc=None, killed="config_error", detail=detail)
    say(f"{what}: not launched: {found.message}")
    if found.outcome == "infeasible":  # predicted not to fit: nothing launched
        return Supervision(rc=None, killed="infeasible", detail=found.message)
    # op_build_error: a value, not the logged line read back; its fix leads the excerpt
    return Supervision(rc=None, killed="op_build_error", detail=found.fix)


def execute(attempt: Attempt, cancel: Cancelled, say: RunnerLog) -> tuple[dict, list[str]]:
    """Gate, launch and supervise one run, then write its record (metrics, steps, provenance);
    returns (metrics, schema problems)."""
    spec, repeat = attempt.spec, attempt.repeat
    run_id = re.sub(r"[^A-Za-z0-9._-]", "_", f"{spec.scenario}-rep{repeat}-{os.getpid()}")
    started = now_iso()
    lch, sup = None, gate(spec, attempt.plan_outdir, say, f"{spec.scenario} rep{repeat}")
    if sup is None:
        lch, sup = launch_and_supervise(attempt, run_id, cancel, say)
    finished = FinishedRun(
        spec, repeat, attempt.record, run_id, attempt.cores, lch, sup, started, now_iso()
    )
    if spec.nvme_path:  # NVMe swap files of a killed run: the harness could not clean them
        shutil.rmtree(nvme_run_dir(spec.nvme_path, run_id), True)
    metrics, problems = write_record(finished)
    if problems:
        say("record does not validate: " + "; ".join(problems))
    speed = f", {metrics['tokens_per_s']:.1f} tokens/s" if metrics["tokens_per_s"] else ""
    say(f"outcome {metrics['outcome']}{speed}, wall {metrics['wall_time_s']:.1f} s")
    return metrics, problems


def run_pair(run: Attempt, cancel: Cancelled, say: RunnerLog) -> None:
    """The short no-offload pair run (study key same_allocation_baseline) in this job, on the
    same cores and GPUs, into ``<record>/pair/``: a temp folder beside it, moved into place.
    Whatever becomes of it is the nested record's outcome; the run's own record is never
    touched (an error of the runner itself here is logged, and the half pair record removed)."""
    pair = run.spec.pair_spec()
    target = run.record.pair.root
    record = placement.temp_record(target)
    try:
        pair = pair.with_ds_config(record.root / PAIR_DS_CONFIG_FILE)
        write_json(pair.ds_config, engines.of(pair).build_config(pair))
        write_run_spec(record.root / PAIR_SPEC_FILE, pair)
        say(f"same-allocation pair {pair.scenario}: its record goes to {target}")
        pair_say = RunnerLog(record.launcher_log)
        attempt = Attempt(
            pair, str(record.root / PAIR_SPEC_FILE), run.repeat, record, run.plan_outdir, run.cores
        )
        try:
            metrics, _ = execute(attempt, cancel, pair_say)
        finally:
            pair_say.close()
        record.progress.unlink(missing_ok=True)  # the heartbeat means nothing once it is over
        placement.move_into_place(record.root, target)
        say(f"same-allocation pair {pair.scenario}: outcome {metrics['outcome']}")
    except Exception as e:  # noqa: BLE001 - the run's record must be placed whatever happens here
        say(f"same-allocation pair {pair.scenario}: not recorded: {type(e).__name__}: {e}")
        shutil.rmtree(record.root, ignore_errors=True)


def run(
    spec_path: str, repeat: int, outdir: str, strict: bool | None = None, cores: int | None = None
) -> int:
    spec = read_run_spec(spec_path)
    strict = spec.strict if strict is None else strict
    outdir_p = Path(outdir)
    record = placement.temp_record(outdir_p)
    interrupted = placement.remove_interrupted_records(outdir_p)
    say = RunnerLog(record.launcher_log)
    for path in interrupted:
        say(f"removed the half record of an interrupted run: {path}")
    # Held until the record is in place: a second SIGTERM must not cut the record short.
    cancel = Cancelled()
    old_handlers = {s: signal.signal(s, cancel) for s in (signal.SIGTERM, signal.SIGINT)}
    attempt = Attempt(spec, spec_path, repeat, record, outdir_p, cores or granted_cores())
    metrics, problems = execute(attempt, cancel, say)
    if spec.same_allocation_pair is not None:
        if metrics["outcome"] == "ok" and cancel.signum is None:
            run_pair(attempt, cancel, say)
        else:  # the pair only serves this run's paired ratio: none without a measured run
            say(f"no same-allocation pair run: the run's outcome is {metrics['outcome']}")
    say.close()
    placement.place(record, outdir_p, spec.scenario, repeat, now_iso())
    for sig, handler in old_handlers.items():
        signal.signal(sig, handler)
    return 1 if strict and (metrics["outcome"] != "ok" or problems) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run one training run and write its record.")
    p.add_argument("--spec", required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--outdir", required=True)
    p.add_argument("--strict", action="store_true", default=None, help="override spec strict")
    p.add_argument(
        "--cores",
        type=int,
        default=None,
        help="cores granted to this run (default: CPU affinity, capped by SLURM_CPUS_ON_NODE); "
        "OMP_NUM_THREADS = cores / ranks per node",
    )
    a = p.parse_args(argv)
    return run(a.spec, a.repeat, a.outdir, a.strict, a.cores)


if __name__ == "__main__":
    sys.exit(main())
