"""Faults injected into real runs (CPU, real DeepSpeed): each becomes its outcome row, the tables
and the report still build, and no other record is lost or rewritten.

The runner-level faults leave their records in one study folder (``fault_study``, shared by the
module), next to a healthy run's; every fault runs inside ``results_ledger.guard`` (conftest):
the complete records before it are there, byte for byte, after it. The SLURM time limit starts
its own local SLURM (tests/slurm_cluster.py; marker ``slurm``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml
from conftest import SMALL_LLAMA, copy_repo_for_run, make_spec
from runs import NVME_AIO, RUNNER_GRACE_S, load_record, run_runner, runner_argv, tmpfs
from slurm_cluster import slurm_fixture_gen

from offload_study.core.contracts import read_json, write_json
from offload_study.planning.plan import write_scenario_files
from offload_study.training import outcome
from offload_study.training.supervise import Supervision

STUDY = "faults"


@pytest.fixture(scope="module")
def fault_study(tmp_path_factory) -> Path:
    """results/local-cpu/faults/ holding one healthy run's record (the others must not lose it)."""
    study = tmp_path_factory.mktemp("faults") / "results" / "local-cpu" / STUDY
    spec_path, outdir = plan_run(study, "healthy")
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0 and load_record(outdir)["outcome"] == "ok", res.stdout[-3000:]
    return study


def plan_run(study: Path, name: str, world: int = 1, scenario=None, **keys) -> tuple[Path, Path]:
    """Plan scenario ``name`` of the fault study (real planner) and write its run spec and
    DeepSpeed config where the plan rule puts them; return (spec path, record folder)."""
    spec = make_spec(
        "local-cpu",
        {"name": name, "gpus_per_node": world, "cpu_mem_gb": 8, **(scenario or {})},
        study=STUDY,
        **keys,
    )
    spec_path = study / "configs" / f"{name}.run.json"
    write_scenario_files(spec, str(study / "configs" / f"{name}.json"), str(spec_path))
    return spec_path, study / name / "rep0"


def start_runner(spec_path: Path, outdir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        runner_argv(spec_path, outdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for_steps(outdir: Path, steps: int, timeout: float = 300) -> None:
    """Until the running record (rep<k>.tmp-<pid>) has ``steps`` rows in steps.csv."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for csv in outdir.parent.glob(f"{outdir.name}.tmp-*/steps.csv"):
            if len(csv.read_text().splitlines()) > steps:
                return
        time.sleep(0.3)
    raise AssertionError(f"{outdir}: training never reached step {steps}")


def harness_rank(outdir: Path, rank: int) -> psutil.Process:
    """The training process of ``rank`` writing into outdir's temp record (its full path: other
    tests, in other pytest-xdist workers, train into a ``rep0.tmp-<pid>`` of their own)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "offload_study.training.harness" in cmd and f"{outdir}.tmp-" in cmd:
            try:
                if proc.environ().get("RANK") == str(rank):
                    return proc
            except psutil.Error:
                continue
    raise AssertionError(f"no rank {rank} process of {outdir}")


def processes_of(path: Path) -> list[str]:
    """Command lines of live processes that name ``path`` (none may outlive a run)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "pid"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if str(path) in cmd and proc.info["pid"] != os.getpid():
            found.append(cmd)
    return found


# --------------------------------------------------------------------------- runner-level faults
ROOT_CAUSE = """offload_study.training.harness FAILED
Root Cause (first observed failure):
[0]:
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 25151)  (SIGKILL)
"""


@pytest.mark.parametrize(("ooms", "expected"), [(0, "error"), (1, "host_oom"), (None, "host_oom")])
def test_a_sigkilled_rank_is_host_oom_only_when_the_kernel_killed(ooms, expected):
    """torchrun's root cause decides, not the survivor's broken connection; SIGKILL is the OOM
    killer's unless the kernel counted no OOM kill during the run."""
    logs = {"launcher.log": ROOT_CAUSE, "rank0.log": "RuntimeError: Connection reset by peer"}
    ev = outcome.Evidence(Supervision(rc=1, oom_kills=ooms), logs, {}, [], 2, None)
    got, excerpt = outcome.decide(ev)
    assert got == expected
    assert ("rank 1 was killed by SIGKILL from outside" in excerpt) == (expected == "error")


@pytest.mark.slow
@pytest.mark.injects_fault
def test_rank_killed_by_sigkill(fault_study, results_ledger):
    """SIGKILL to rank 1 mid-run (not the OOM killer): the run's row says so, nothing survives."""
    spec_path, outdir = plan_run(fault_study, "rank-killed", world=2, steps=100000)
    with results_ledger.guard(fault_study):
        runner = start_runner(spec_path, outdir)
        wait_for_steps(outdir, 2)
        harness_rank(outdir, 1).send_signal(signal.SIGKILL)
        out, _ = runner.communicate(timeout=RUNNER_GRACE_S)
    assert runner.returncode == 0, out
    m = load_record(outdir)
    assert m["outcome"] == "error", m["error_excerpt"]
    assert "SIGKILL" in m["error_excerpt"] and "OOM killer" in m["error_excerpt"]
    assert m["steps_measured"] >= 1  # the steps measured before the kill are kept
    assert processes_of(outdir.parent) == []


def test_a_launcher_dies_with_its_runner():
    """die_with_parent (the runner's preexec_fn for torchrun, each rank's first act): a process
    started so dies when its parent is SIGKILLed, instead of training on unsupervised."""
    code = (
        "import subprocess, sys, time; from offload_study.training.supervise import die_with_parent; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], "
        "stdout=subprocess.DEVNULL, preexec_fn=die_with_parent); print(p.pid, flush=True); "
        "time.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60  # at once when idle; room for a busy machine
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(child), "the child outlived its SIGKILLed parent"


def gone(proc: psutil.Process) -> bool:
    """Exited (a zombie not yet reaped counts as exited)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.injects_fault
def test_host_memory_budget_exhausted(fault_study, results_ledger):
    """The runner's host memory budget (cpu_mem_gb) passed: host_oom, the ranks are gone."""
    # force: the plan predicts it does not fit; the run must be taken into the budget
    spec_path, outdir = plan_run(
        fault_study, "host-oom", scenario={"cpu_mem_gb": 0.2, "force": True}
    )
    with results_ledger.guard(fault_study):
        res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stdout[-3000:]
    m = load_record(outdir)
    assert m["outcome"] == "host_oom"
    assert "host memory budget exceeded" in m["error_excerpt"]
    assert processes_of(outdir.parent) == []


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 3 MiB tmpfs (as root): the NVMe path that fills up when the optimizer swaps out."""
    with tmpfs(tmp_path / "nvme-tiny", "3m") as mount:
        yield mount


def plan_nvme_run(study: Path, name: str, nvme_path: Path, force: bool) -> tuple[Path, Path]:
    """A run whose optimizer and parameters go to NVMe at ``nvme_path`` (a model large enough
    that DeepSpeed swaps its partitions: runs.make_run)."""
    offload = {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(nvme_path)}
    model = {"config": dict(SMALL_LLAMA, vocab_size=8192)}
    return plan_run(study, name, scenario={**offload, "force": force}, model=model, aio=NVME_AIO)


@pytest.mark.slow
@pytest.mark.injects_fault
def test_nvme_path_fills_up(fault_study, results_ledger, tiny_filesystem):
    """NVMe offload onto a filesystem too small for its swap files, forced past the launch
    check: a failed row that says the device is full; the swap folder is cleaned."""
    spec_path, outdir = plan_nvme_run(fault_study, "nvme-full", tiny_filesystem, force=True)
    with results_ledger.guard(fault_study):
        res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stdout[-3000:]
    m = load_record(outdir)
    assert m["outcome"] == "error" and m["tokens_per_s"] is None, m
    assert m["error_excerpt"].startswith("disk full under the NVMe path: swap file "), m
    assert f"{tiny_filesystem}/" in m["error_excerpt"] and "came out short" in m["error_excerpt"]
    assert os.listdir(tiny_filesystem) == []
    assert processes_of(outdir.parent) == []


@pytest.mark.slow
@pytest.mark.injects_fault
def test_nvme_path_without_room_is_refused_at_launch(fault_study, results_ledger, tiny_filesystem):
    """The same run onto the same filesystem, not forced: the runner's launch check finds less
    free space there than the swap files need and records infeasible, saying both; nothing is
    launched and nothing is written there."""
    spec_path, outdir = plan_nvme_run(fault_study, "nvme-no-room", tiny_filesystem, force=False)
    with results_ledger.guard(fault_study):
        res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stdout[-3000:]
    m = load_record(outdir)
    assert m["outcome"] == "infeasible" and m["tokens_per_s"] is None, m
    assert re.search(
        rf"{tiny_filesystem} has 0\.00\d+ GiB free on .*, the run's swap files "
        r"need 0\.0\d+ GiB \(predicted\)",
        m["error_excerpt"],
    ), m["error_excerpt"]
    assert [p.name for p in (outdir / "logs").iterdir()] == ["launcher.log"]
    assert os.listdir(tiny_filesystem) == []


@pytest.fixture(scope="module")
def slurm():
    """A local single-node SLURM (tests/slurm_cluster.py) without GPUs."""
    yield from slurm_fixture_gen(gpus=0, gres_type=None)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.injects_fault
def test_slurm_time_limit_reached(fault_study, results_ledger, slurm):
    """A run in a SLURM job of 1 minute that would train for hours: SLURM ends it at the time
    limit, the record says timeout (not cancelled) with the job id. Once it trains, the limit's
    end is moved to now (SLURM's own enforcement, ~45 s sooner than the 1-minute minimum)."""
    spec_path, outdir = plan_run(fault_study, "time-limit", steps=100000)
    with results_ledger.guard(fault_study):
        job = slurm.sbatch(
            "--time=1",
            "--mem=4000",
            "--cpus-per-task=2",
            f"--output={fault_study}/tl.out",
            "--wrap",
            shlex.join(runner_argv(spec_path, outdir)),
        )
        wait_for_steps(outdir, 2)
        slurm.reach_time_limit_now(job)
        slurm.wait_job_state(job, "TIMEOUT", timeout=240)
        deadline = time.monotonic() + 30  # the runner writes the record within SLURM's KillWait
        while not (outdir / "metrics.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    m = load_record(outdir)
    assert m["outcome"] == "timeout", m["error_excerpt"]
    assert m["error_excerpt"].startswith(
        f"SLURM time limit reached (job {job}, TimeLimit=00:01:00)"
    )
    assert m["slurm_job_id"] == job and m["steps_measured"] >= 1
    assert "DUE TO TIME LIMIT" in (fault_study / "tl.out").read_text()  # SLURM's own enforcement


# --------------------------------------------------------------------------- broken records
def collect_and_report(study: Path, metrics_paths: list[Path]) -> pd.DataFrame:
    """collect + report CLIs (as the rules call them) over the records; returns the runs table."""
    tables = {k: study / f"{k}" for k in ("runs.csv", "runs.parquet", "summary.csv")}
    write_json(study / "plan.json", {"study": STUDY, "cluster": "local-cpu"})
    steps = [
        [
            sys.executable,
            "-m",
            "offload_study.analysis.collect",
            "--n-boot",
            "50",
            "--runs-csv",
            str(tables["runs.csv"]),
            "--runs-parquet",
            str(tables["runs.parquet"]),
            "--summary-csv",
            str(tables["summary.csv"]),
            *map(str, metrics_paths),
        ],
        [
            sys.executable,
            "-m",
            "offload_study.analysis.report",
            "--runs",
            str(tables["runs.csv"]),
            "--summary",
            str(tables["summary.csv"]),
            "--plan",
            str(study / "plan.json"),
            "--out",
            str(study / "report" / "report.html"),
            "--figures-dir",
            str(study / "report"),
        ],
    ]
    for cmd in steps:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    return pd.read_csv(tables["runs.csv"])


def crashed_copy(study: Path, source: str, name: str) -> Path:
    """A copy of record ``source`` as scenario ``name`` (its run spec too): the crash victim."""
    record = study / name / "rep0"
    shutil.copytree(study / source / "rep0", record)
    spec = read_json(study / "configs" / f"{source}.run.json")
    write_json(study / "configs" / f"{name}.run.json", {**spec, "scenario": name})
    write_json(record / "metrics.json", {**read_json(record / "metrics.json"), "scenario": name})
    return record


@pytest.mark.slow
@pytest.mark.injects_fault
def test_truncated_records_are_shown_broken_and_nothing_else_is_lost(fault_study, results_ledger):
    """A metrics.json cut in half and a steps.csv cut mid-row (plus junk) left by a crash:
    collect and report build, those rows say what is broken, every other record is there."""
    cut_metrics = crashed_copy(fault_study, "healthy", "cut-metrics") / "metrics.json"
    cut_metrics.write_bytes(cut_metrics.read_bytes()[: cut_metrics.stat().st_size // 2])
    cut_steps = crashed_copy(fault_study, "healthy", "cut-steps") / "steps.csv"
    cut_steps.write_bytes(cut_steps.read_bytes()[:-7] + b"\x00\xff\xfe junk")
    records = sorted(p for p in fault_study.glob("*/rep0/metrics.json"))
    with results_ledger.guard(fault_study):
        runs = collect_and_report(fault_study, records).set_index("scenario")
    missing = {p.parent.parent.name for p in records} - set(runs.index)
    results_ledger.note_lost(sorted(missing))
    assert not missing, f"records left out of runs.csv: {missing}"
    assert runs.loc["cut-metrics", "outcome"] == "error"
    assert "corrupt metrics.json" in runs.loc["cut-metrics", "error_excerpt"]
    assert runs.loc["healthy", "outcome"] == "ok"
    assert runs.loc["cut-steps", "outcome"] == "ok"  # metrics.json intact: its numbers stand
    html = (fault_study / "report" / "report.html").read_text()
    for name in ("cut-metrics", "cut-steps", "healthy"):  # each row, by its label
        assert str(runs.loc[name, "label"]) in html, name


# --------------------------------------------------------------------------- the workflow
def study_file(work: Path) -> Path:
    """Two tiny one-rank runs, fixed steps (enough to be killed while training): the study the
    Snakemake process dies in."""
    study = {
        "study": "killed",
        "cluster": "local-cpu",
        "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64,
        "dtype": "bf16",
        "micro_batch": 2,
        "global_batch": 4,
        "gradient_checkpointing": False,
        "steps": 20,
        "warmup_steps": 1,
        "repeats": 1,
        "timeout_min": 5,
        "scenarios": [
            {"name": n, "gpus_per_node": 1, "cpu_mem_gb": 8} for n in ("first", "second")
        ],
    }
    path = work / "killed.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def snakemake(work: Path, *args: str, background: bool = False):
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "killed.yaml", *args]
    if background:
        return subprocess.Popen(
            cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.injects_fault
def test_snakemake_killed_mid_study_and_restarted(tmp_path, results_ledger, cpu_calibration):
    """SIGKILL to the Snakemake process (and its job) while the second run goes; the restart
    (--rerun-incomplete) re-runs only that run, the first record stays byte for byte. Then a
    run of the finished study is cancelled: the next invocation makes it again."""
    work = copy_repo_for_run(tmp_path, cpu_calibration, "local-cpu")
    study_file(work)
    results = work / "results" / "local-cpu" / "killed"
    # -j1: one run at a time, so that the kill finds one complete record and one running
    proc = snakemake(work, "--jobs", "1", background=True)
    try:
        deadline = time.monotonic() + 400
        while not list(results.glob("*/rep0/metrics.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            time.sleep(0.5)
        (done,) = [p.parent.parent.name for p in results.glob("*/rep0/metrics.json")]
        other = ({"first", "second"} - {done}).pop()
        wait_for_steps(results / other / "rep0", 2)  # it trains: torchrun and its rank run
        crash(proc.pid)  # Snakemake with its job (shell, runner) at once, as a node crash does
    finally:
        proc.kill()
        proc.communicate()
    time.sleep(2)
    assert processes_of(results) == [], "the launcher or a rank outlived its runner"
    with results_ledger.guard(results):
        snakemake(work, "--unlock")
        res = snakemake(work, "--rerun-incomplete")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert len(re.findall(r"^(?:local)?rule train:", res.stderr, re.M)) == 1, res.stderr
    for name in (done, other):  # one archived record each: the first was not run again
        assert load_record(results / name / "rep0")["outcome"] == "ok"
    assert (work / "reports" / "local-cpu" / "killed" / "report.html").is_file()
    cancelled_run_made_again(work, results / done / "rep0")
    changed_scenario_runs_again_alone(work)


def changed_scenario_runs_again_alone(work: Path) -> None:
    """The finished study has nothing to do; once one scenario changes, its run alone is
    planned again, in the same invocation. (A train behind the study-wide plan job through an
    ancient input alone is not: Snakemake does not look at a job's own reasons below a job that
    re-runs, snakemake/snakemake#4166; its config job per scenario is what re-runs it.)"""
    res = snakemake(work, "-n")
    assert "Nothing to be done" in res.stdout + res.stderr, res.stdout[-4000:]
    study = yaml.safe_load((work / "killed.yaml").read_text())
    study["scenarios"][1]["cpu_mem_gb"] = 7
    (work / "killed.yaml").write_text(yaml.safe_dump(study))
    res = snakemake(work, "-n")
    planned = re.findall(
        r"^rule train:\n(?:\s+.*\n)*?\s+wildcards: scenario=([^,\s]+)", res.stdout, re.M
    )
    assert planned == ["second"], res.stdout[-4000:]


def cancelled_run_made_again(work: Path, record: Path) -> None:
    """A finished study (its tables and report built) whose run SLURM cancelled: the next
    invocation makes the run again (the retry policy), and runs.csv holds the new record."""
    metrics = read_json(record / "metrics.json")
    write_json(
        record / "metrics.json",
        {**metrics, "outcome": "cancelled", "error_excerpt": "received signal 15"},
    )
    res = snakemake(work)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "retry policy:" in res.stderr and "cancelled, re-run" in res.stderr, res.stderr
    assert len(re.findall(r"^(?:local)?rule train:", res.stderr, re.M)) == 1, res.stderr
    assert read_json(record / "metrics.json")["outcome"] == "ok"
    runs = pd.read_csv(record.parents[1] / "runs.csv")
    assert set(runs["outcome"]) == {"ok"} and runs["retries"].sum() == 1


def crash(pid: int) -> None:
    """SIGKILL to a process and all its descendants at once."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
