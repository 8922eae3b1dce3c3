"""A chaos run: a CPU study of many runs through ``snakemake --profile slurm``
on the real local test SLURM (tests/slurm_cluster.py) while faults are injected at random.

One home for the machinery, shared by tests/test_chaos.py (sized for CI) and
benchmarks/chaos.py (any size). The faults are data: :data:`FAULTS` maps a fault's name to the
small function that injects it, ReFrame-style. Each function returns what it did, or None when
there is nothing to hit right now (no train job running); the injector then tries again.

A seed picks the faults' order and spacing and their targets (printed; the same seed makes the
same choices, though which job a fault hits depends on the machine's timing). At the end, after
at most two re-invocations of Snakemake: every planned run has one current record, no finished
record seen during the run changed a byte (it is still there, in place or in the archive), and
the report lists every run that is not ok.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import html as htmllib
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml
from conftest import SMALL_LLAMA, copy_repo_for_run, place_calibration, record_fingerprints
from runs import tmpfs
from slurm_cluster import SlurmCluster, profile_snakemake, write_profile

from offload_study.analysis.report import words
from offload_study.core import layout
from offload_study.core.contracts import PROGRESS_FILE, read_json, sha256_tree
from offload_study.core.study import load_study
from offload_study.training.placement import retries_of, retry_failed_runs

CLUSTER = "test-slurm"  # config/clusters/test-slurm.yaml: CPU ranks on the test SLURM
STUDY = "chaos"
#: the one scenario, swept over two micro-batches; repeats make up the rest of the runs
SWEEP = {"micro_batch": [2, 1]}
#: Size of the tmpfs mounted as the results folder (the disk that a fault fills).
RESULTS_DISK = "64m"
#: The test SLURM (tests/slurm_cluster.py): one node, no GPUs (CPU ranks); finished jobs known
#: for an hour (squeue status); a requeued job may start again after 30 s instead of 120 s.
SLURM = {"gpus": 0, "gres_type": None, "min_job_age": 3600, "requeue_delay_s": 30}
#: Seconds between faults (uniform), once the first train job runs.
FAULT_GAP_S = (4.0, 12.0)
#: The SLURM job comment the slurm executor plugin gives a train job (then its wildcards).
TRAIN_JOB = "rule_train_wildcards_"


def chaos_study(runs: int) -> dict:
    """A study of at least ``runs`` tiny runs (1 rank, 1 warm-up + 2 measured steps)."""
    combos = len(SWEEP["micro_batch"])
    return {
        "study": STUDY,
        "cluster": CLUSTER,
        "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64,
        "dtype": "bf16",
        "micro_batch": 2,
        "gradient_checkpointing": False,
        "measure": {"mode": "fixed"},
        "steps": 2,
        "warmup_steps": 1,
        "seed": 1234,
        "timeout_min": 5,
        "repeats": -(-runs // combos),
        # FSDP2 (engine: fsdp2): the faults are the infrastructure's, not an engine's, and a run
        # without DeepSpeed's import and ZeRO-3 set-up starts in ~60 % of the time (measured on
        # the 2-core machine: 15.6 s against 25.9 s for the same tiny run)
        "scenarios": [
            {
                "name": "tiny",
                "engine": "fsdp2",
                "gpus_per_node": 1,
                "cpu_mem_gb": 2,
                "gradient_accumulation_steps": 1,
                "sweep": SWEEP,
            }
        ],
    }


@dataclass
class Fault:
    kind: str
    at_s: float  # seconds since the chaos run started
    what: str


@dataclass
class ChaosRun:
    """A study running through ``snakemake --profile`` in ``work`` on ``cluster``."""

    cluster: SlurmCluster
    work: Path
    profile: Path
    rng: random.Random
    args: list[str] = field(default_factory=lambda: ["--config", "study_file=chaos.yaml"])
    proc: subprocess.Popen | None = None
    faults: list[Fault] = field(default_factory=list)
    #: digest -> record folder of every complete record seen in place during the run
    seen: dict[str, str] = field(default_factory=dict)
    #: digest -> its files (relative path, size): what a lost record held, for the failure's text
    seen_files: dict[str, list] = field(default_factory=dict)
    #: record folder -> digest at the last snapshot
    last: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    invocations: int = 0
    orphans: set = field(default_factory=set)  # job names of the Snakemakes killed or ended

    @property
    def results(self) -> Path:
        return self.work / layout.study_dir(CLUSTER, STUDY)

    def start(self) -> None:
        # the slurm plugin names every job of one Snakemake after its run id: the jobs of those
        # killed before run on, and the faults hit the live Snakemake's jobs first
        self.orphans |= {j.get("JobName") for j in self.cluster.jobs()}
        self.invocations += 1
        log = open(self.work / f"snakemake.{self.invocations}.log", "w")  # noqa: SIM115
        self.proc = profile_snakemake(
            self.cluster,
            self.work,
            self.profile,
            *self.args,
            background=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def snapshot(self) -> None:
        """Remember every complete record in place now, once two snapshots in a row read it
        alike: one read races the moves and removals the run makes (a record replaced by
        os.replace, an output Snakemake deletes before it re-runs its job), and a folder read
        half-way through one of them is no state any record ever had."""
        now = in_place_fingerprints(self.results)
        for folder, digest in now.items():
            if self.last.get(folder) == digest and digest not in self.seen:
                self.seen[digest] = folder
                self.seen_files[digest] = files_of(Path(folder))
        self.last = now

    def train_jobs(self, stepping: bool = False, live: bool = False) -> list[str]:
        """Ids of the SLURM jobs running a train rule now; ``stepping``: only those whose run
        has started its training steps (its temp record has the progress file).

        Faults that end a run hit it only once it is stepping: torch loads an op (DeepSpeed's
        FusedAdam, shm_comm) under a lock file in the shared extension cache, and a rank killed
        (SIGKILL, or SIGTERM from scancel) while it holds the lock leaves it behind; every later
        run on the machine then waits for it forever (seen while this was built). That hazard is
        torch's, not what this run is about."""
        return [
            j["JobId"]
            for j in self.cluster.jobs()
            if j.get("JobState") == "RUNNING"
            and j.get("Comment", "").startswith(TRAIN_JOB)
            and (not stepping or self.stepping(j["Comment"].removeprefix(TRAIN_JOB)))
            and not (live and j.get("JobName") in self.orphans)
        ]

    def stepping(self, wildcards: str) -> bool:
        """Whether the run of a train job (its wildcards "<scenario>_<rep>") is stepping."""
        scenario, _, rep = wildcards.rpartition("_")
        record = layout.record_dir(self.results, scenario, rep)
        return any(Path(record).parent.glob(f"rep{rep}.tmp-*/{PROGRESS_FILE}"))

    def pick_train_job(self) -> str | None:
        jobs = self.train_jobs(stepping=True, live=True) or self.train_jobs(stepping=True)
        return self.rng.choice(sorted(jobs)) if jobs else None


def in_place_fingerprints(results: Path) -> dict[str, str]:
    """Record folder (``<scenario>/rep<k>``, in place) -> sha256_tree; a folder that changes
    while it is read (moved, removed) is left out of this snapshot."""
    prints = {}
    for metrics in results.glob("*/rep*/metrics.json"):
        if re.fullmatch(r"rep\d+", metrics.parent.name):
            with contextlib.suppress(OSError):
                prints[str(metrics.parent)] = sha256_tree(metrics.parent)
    return prints


def files_of(folder: Path) -> list[tuple[str, int]]:
    with contextlib.suppress(OSError):
        return sorted(
            (str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file()
        )
    return []


# --------------------------------------------------------------------------- the faults
def sigkill_rank(chaos: ChaosRun) -> str | None:
    """SIGKILL one torchrun worker (a training rank, not torchrun) of a stepping run."""
    ranks = [p for p in psutil.process_iter(["cmdline", "pid", "cwd"]) if is_rank(p, chaos)]
    if not ranks:
        return None
    rank = chaos.rng.choice(sorted(ranks, key=lambda p: p.pid))
    with contextlib.suppress(psutil.Error):
        rank.send_signal(signal.SIGKILL)
        return f"SIGKILL rank pid {rank.pid} writing {out_of(rank)}"
    return None


def is_rank(proc: psutil.Process, chaos: ChaosRun) -> bool:
    """A training rank of this study whose run is stepping."""
    cmd = proc.info["cmdline"] or []
    return (
        "offload_study.training.harness" in cmd
        and "torch.distributed.run" not in cmd
        and (proc.info["cwd"] or "").startswith(str(chaos.work))
        and (chaos.work / out_of(proc) / PROGRESS_FILE).exists()
    )


def out_of(rank: psutil.Process) -> str:
    """The temp record a harness process writes (its --out)."""
    cmd = rank.info["cmdline"]
    return cmd[cmd.index("--out") + 1] if "--out" in cmd[:-1] else "/nonexistent"


def scancel_job(chaos: ChaosRun) -> str | None:
    job = chaos.pick_train_job()
    if job is None:
        return None
    chaos.cluster.run("scancel", job, check=False)
    return f"scancel {job}"


def requeue_job(chaos: ChaosRun) -> str | None:
    job = chaos.pick_train_job()
    if job is None:
        return None
    cp = chaos.cluster.run("scontrol", "requeue", job, check=False)
    return f"scontrol requeue {job}" + (f" ({cp.stderr.strip()})" if cp.returncode else "")


def node_down_and_up(chaos: ChaosRun) -> str | None:
    """The node of a running train job set down (SLURM requeues its jobs), up again a few seconds
    later: by slurmd's next registration (ReturnToService=2), else by State=RESUME."""
    if not chaos.train_jobs(stepping=True):
        return None
    node, down_s = chaos.cluster.node, chaos.rng.uniform(2, 4)
    chaos.cluster.run("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=chaos")
    time.sleep(down_s)
    state = node_state(chaos.cluster)
    if "down" in state:
        chaos.cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
    return f"node {node} down, {state} after {down_s:.1f} s, now {node_state(chaos.cluster)}"


def node_state(cluster: SlurmCluster) -> str:
    return cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()


def results_disk_full(chaos: ChaosRun) -> str | None:
    """The results tmpfs filled by a ballast file for a few seconds while runs are writing."""
    if not chaos.train_jobs():
        return None
    ballast, hold_s = chaos.work / "results" / ".chaos-ballast", chaos.rng.uniform(2, 4)
    filled = fill_disk(ballast)
    time.sleep(hold_s)
    ballast.unlink()
    return f"results disk full ({filled >> 20} MiB ballast) for {hold_s:.1f} s"


def fill_disk(path: Path) -> int:
    """Write ``path`` until its filesystem has no byte left (ENOSPC); return bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            block = b"\0" * chunk
            try:
                while True:
                    written += f.write(block)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
    return written


def kill_snakemake(chaos: ChaosRun) -> str | None:
    """SIGKILL Snakemake's main process mid-run; unlock the working dir and start it again (its
    SLURM jobs run on meanwhile)."""
    if not chaos.running():
        return None
    pid = chaos.proc.pid
    chaos.proc.kill()
    chaos.proc.wait()
    profile_snakemake(chaos.cluster, chaos.work, chaos.profile, *chaos.args, "--unlock")
    chaos.start()
    return f"SIGKILL snakemake pid {pid}, restarted"


FAULTS: dict[str, Callable[[ChaosRun], str | None]] = {
    "sigkill_rank": sigkill_rank,
    "scancel": scancel_job,
    "requeue": requeue_job,
    "node_down_up": node_down_and_up,
    "results_disk_full": results_disk_full,
    "kill_snakemake": kill_snakemake,
}


def fault_schedule(rng: random.Random, count: int) -> list[str]:
    """Every kind of fault once, the rest drawn at random; in random order."""
    kinds = list(FAULTS) + rng.choices(list(FAULTS), k=max(0, count - len(FAULTS)))
    rng.shuffle(kinds)
    return kinds


# --------------------------------------------------------------------------- the run
@contextlib.contextmanager
def results_tmpfs(work: Path):
    """A small tmpfs mounted as the working dir's results folder (needs root)."""
    with tmpfs(work / "results", RESULTS_DISK) as results:
        yield results


def prepare(tmp: Path, calibration: Path, runs: int) -> Path:
    """The working dir: the repo's workflow, the chaos study, this machine's calibration."""
    work = copy_repo_for_run(tmp)
    (work / "chaos.yaml").write_text(yaml.safe_dump(chaos_study(runs)))
    return work


def inject(chaos: ChaosRun, kinds: list[str], say) -> None:
    """Inject ``kinds`` in order, a random gap apart, while Snakemake runs (a fault without a
    target now is tried again until one appears)."""
    while chaos.running() and not chaos.train_jobs():
        chaos.snapshot()
        time.sleep(0.5)
    for kind in kinds:
        until = time.monotonic() + chaos.rng.uniform(*FAULT_GAP_S)
        while time.monotonic() < until:
            chaos.snapshot()
            time.sleep(0.5)
        what = None
        while what is None and chaos.running():
            what = FAULTS[kind](chaos)
            if what is None:
                time.sleep(0.3)
        if what is None:
            return  # Snakemake ended first
        chaos.faults.append(Fault(kind, time.monotonic() - chaos.started, what))
        say(f"[chaos {chaos.faults[-1].at_s:6.1f} s] {kind}: {what}")


def finish(chaos: ChaosRun, timeout_s: float, say) -> list[int]:
    """Wait for the chaos invocation, then re-invoke Snakemake at most twice until it succeeds
    (each within ``timeout_s``); return every invocation's exit status after the faults."""
    codes = []
    deadline = time.monotonic() + timeout_s
    while chaos.running() and time.monotonic() < deadline:
        chaos.snapshot()
        time.sleep(1)
    if chaos.running():
        chaos.proc.kill()
    codes.append(chaos.proc.wait())
    for _ in range(2):  # as a user would: again while it failed or the retry policy has work
        if codes[-1] == 0 and not retryable_left(chaos):
            break
        say(f"[chaos {time.monotonic() - chaos.started:6.1f} s] re-invoking snakemake")
        chaos.start()
        codes.append(chaos.proc.wait(timeout=timeout_s))
        chaos.snapshot()
    return codes


def retryable_left(chaos: ChaosRun) -> list[str]:
    """Failed records in place that the retry policy re-runs on the next invocation."""
    plan = read_json(chaos.results / layout.PLAN_JSON)
    runs = [(s["scenario"], r) for s in plan["scenarios"] for r in range(plan["repeats"])]
    retries = load_study(chaos.work / "chaos.yaml")["retries"]  # the budget, defaults filled in
    notes = retry_failed_runs(chaos.results, runs, retries, move=False)
    return [str(note) for note in notes if note.retried]


@dataclass
class Verdict:
    planned: list[str]  # the planned record folders (relative to the study folder)
    missing: list[str]  # planned runs without a current record
    extra: list[str]  # current records no planned run owns
    lost: list[str]  # records seen complete during the run, gone or changed since
    retried: dict[str, int]  # run -> its re-runs after failures of the infrastructure
    retry_left: list[str]  # infrastructure failures left in place though the budget allows more
    outcomes: dict[str, str]  # planned record -> its current outcome
    unreported: list[str]  # runs not ok, and scenarios' retry counts, the report does not show

    def line(self, faults: int) -> str:
        return (
            f"{len(self.planned)} runs, {faults} faults injected, {len(self.retried)} "
            f"retried, {len(self.lost) + len(self.missing)} lost"
        )


def judge(chaos: ChaosRun) -> Verdict:
    """What the run left, against what was planned and what was seen."""
    results, plan = chaos.results, read_json(chaos.results / layout.PLAN_JSON)
    planned = [f"{s['scenario']}/rep{r}" for s in plan["scenarios"] for r in range(plan["repeats"])]
    current = {
        str(p.parent.relative_to(results))
        for p in results.glob("*/rep*/metrics.json")
        if re.fullmatch(r"rep\d+", p.parent.name)
    }
    final = set(record_fingerprints(results).values())
    retried = {run: retries_of(results / run) for run in planned if run in current}
    outcomes = {
        run: read_json(results / run / "metrics.json")["outcome"]
        for run in planned
        if run in current
    }
    html = (chaos.work / layout.report_html(CLUSTER, STUDY)).read_text()
    return Verdict(
        planned=planned,
        missing=[run for run in planned if run not in current],
        extra=sorted(current - set(planned)),
        lost=[lost_record(chaos, digest) for digest in chaos.seen if digest not in final],
        retried={run: n for run, n in retried.items() if n},
        retry_left=retryable_left(chaos),
        outcomes=outcomes,
        unreported=unshown_outcomes(outcomes, html)
        + [
            f"{scenario} retried:{n}"
            for scenario, n in retries_by_scenario(retried).items()
            if words.outcomes(f"retried:{n}") not in html
        ],
    )


def lost_record(chaos: ChaosRun, digest: str) -> str:
    """A lost record's folder, the files it held when seen, and those of what is left of its
    run (in place, and each archived copy): what the failure's text needs to find the cause."""
    folder = Path(chaos.seen[digest])
    run = folder.relative_to(chaos.results)
    archive = Path(
        layout.archive_dir(chaos.results, run.parts[0], int(folder.name[3:]), "x")
    ).parent
    left = {
        str(p.relative_to(chaos.results)): files_of(p)
        for p in [folder, *sorted(archive.glob("*"))]
        if p.is_dir()
    }
    return f"{run} (seen holding {chaos.seen_files[digest]}; now {left})"


def unshown_outcomes(outcomes: dict[str, str], html: str) -> list[str]:
    """Each scenario's count of every not-ok outcome, counted from its records, that its row
    on the page does not show in the page's words ("2 ran out of GPU memory")."""
    counts = collections.Counter((run.split("/")[0], o) for run, o in outcomes.items())
    text = htmllib.unescape(html)
    return [
        f"{scenario} {o}:{n}"
        for (scenario, o), n in sorted(counts.items())
        if o != "ok" and not re.search(rf"(?<!\d){n} {re.escape(words.outcome(o))}", text)
    ]


def retries_by_scenario(retried: dict[str, int]) -> dict[str, int]:
    """Re-runs per scenario (the report's outcomes column says "retried:<n>")."""
    total = collections.Counter()
    for run, n in retried.items():
        total[run.split("/")[0]] += n
    return {scenario: n for scenario, n in total.items() if n}


def chaos_run(
    cluster: SlurmCluster,
    tmp: Path,
    calibration: Path,
    *,
    runs: int,
    faults: int,
    seed: int,
    jobs: int = 4,
    timeout_s: float = 900,
    say=None,
):
    """The whole chaos run; returns (ChaosRun, Verdict, exit codes, wall seconds).

    ``jobs``: the profile's jobs, twice the 2 cores of CI, so that a requeued job waiting to
    start again (cred_expire) does not leave a core idle."""
    say = say or (lambda message: print(message, flush=True))
    say(f"chaos seed {seed}: {runs} runs, {faults} faults (reproduce: --seed {seed})")
    rng = random.Random(seed)
    work = prepare(tmp, calibration, runs)
    t0 = time.monotonic()
    with results_tmpfs(work):
        place_calibration(work, CLUSTER, calibration)
        profile = write_profile(tmp / "profile", jobs=jobs)
        chaos = ChaosRun(cluster, work, profile, rng)
        try:
            chaos.start()
            inject(chaos, fault_schedule(rng, faults), say)
            codes = finish(chaos, timeout_s, say)
            verdict = judge(chaos)
        finally:
            if chaos.running():
                chaos.proc.kill()
        wall_s = time.monotonic() - t0
        say(verdict.line(len(chaos.faults)))
        say(f"chaos wall time {wall_s:.0f} s; snakemake exit codes after the faults {codes}")
    return chaos, verdict, codes, wall_s
