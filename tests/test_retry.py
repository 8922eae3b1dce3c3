"""The retry policy (training/outcome.RETRY_POLICY): its table, the record that leaves its place
for the archive when the workflow is parsed, the budget, a killed remote rank judged by its node's
OOM count, and a results disk that fills up while a record is written (a real ENOSPC on a tiny
tmpfs, as root)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from builders import CLUSTER, STUDY, make_record
from runs import tmpfs

from offload_study.analysis import collect
from offload_study.core import contracts, layout
from offload_study.core.contracts import read_json, write_json
from offload_study.training import outcome, placement
from offload_study.training.supervise import Supervision, signal_verdict

BUDGET = {"infrastructure": 2, "time_limit": False}
WORKLOAD = ("gpu_oom", "host_oom", "config_error", "op_build_error", "infeasible", "timeout")


# --------------------------------------------------------------------------- the table (pure)
def test_every_outcome_has_one_rule_and_workload_failures_are_never_retried():
    assert set(contracts.OUTCOMES) <= set(outcome.RETRY_POLICY)
    for name in WORKLOAD:
        assert outcome.RETRY_POLICY[name].budget is None, name
    assert outcome.RETRY_POLICY["cancelled"].budget == "infrastructure"
    assert outcome.RETRY_POLICY["rank_lost"].budget == "infrastructure"
    assert outcome.RETRY_POLICY["slurm_time_limit"].budget == "time_limit"
    assert all(rule.why for rule in outcome.RETRY_POLICY.values())


def scontrol_says(state: str, restarts: int = 0):
    """scontrol show job, as the controller answers for a job in ``state``."""
    out = f"JobId=7 JobName=x JobState={state} Restarts={restarts} TimeLimit=00:01:00 NodeList=n1"
    return lambda argv, **kw: subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")


def decided(sup: Supervision, logs: dict | None = None, world: int = 1):
    return outcome.decide(outcome.Evidence(sup, logs or {}, {}, [], world, None))


@pytest.mark.parametrize(
    ("state", "verdict", "cause", "words"),
    [
        ("TIMEOUT", "timeout", "slurm_time_limit", "SLURM time limit reached (job 7"),
        ("NODE_FAIL", "cancelled", "cancelled", "its node failed"),
        ("PREEMPTED", "cancelled", "cancelled", "preempted by SLURM"),
        ("PENDING", "cancelled", "cancelled", "requeued by SLURM"),
        ("CANCELLED", "cancelled", "cancelled", "received signal 15"),
        ("COMPLETING", "cancelled", "cancelled", "received signal 15"),
        # requeued while the run's step is still ending: only the restart count says so
        ("COMPLETING/1", "cancelled", "cancelled", "requeued by SLURM (scontrol requeue, pre"),
    ],
)
def test_what_slurm_says_at_the_signal_decides_the_cause(state, verdict, cause, words):
    """The runner's own words (signal_verdict -> decide) are what failure_cause reads back."""
    state, _, restarts = state.partition("/")
    says = scontrol_says(state, int(restarts or 0))
    killed, detail = signal_verdict(15, {"SLURM_JOB_ID": "7"}, says, restarts_at_start=0)
    got, excerpt = decided(Supervision(rc=-15, killed=killed, detail=detail))
    assert (got, outcome.failure_cause(got, excerpt)) == (verdict, cause)
    assert words in excerpt


def test_a_timeout_of_the_study_is_not_the_time_limit_of_slurm():
    got, excerpt = decided(
        Supervision(rc=-15, killed="timeout", detail="run exceeded timeout_s=60")
    )
    assert outcome.failure_cause(got, excerpt) == "timeout"


# --------------------------------------------------------------------------- a killed remote rank
def root_cause(host: str, rank: int = 3) -> str:
    return (
        "offload_study.training.harness FAILED\nRoot Cause (first observed failure):\n[0]:\n"
        f"  time      : 2026-12-01_10:00:00\n  host      : {host}\n  rank      : {rank} "
        "(local_rank: 1)\n  exitcode  : -9 (pid: 25151)\n  error_file: <N/A>\n"
    )


@pytest.mark.parametrize(
    ("node_line", "expected"),
    [
        ("node ost2 oom_kill 4 -> 5", "host_oom"),  # that node's kernel killed something
        ("node ost2 oom_kill 4 -> 4", "error"),
        ("", "error"),  # the node left no count (it went away): no OOM kill that anyone knows of
    ],
)
def test_a_rank_killed_on_another_node_is_judged_by_that_nodes_count(node_line, expected):
    """The runner's host (ost1) counted OOM kills, but the rank died on ost2: ost2's count,
    printed by its launch wrapper (launch.NODE_OOM_WRAPPER), decides."""
    log = root_cause("ost2.cluster") + "node ost1 oom_kill 0 -> 0\n" + node_line + "\n"
    logs = {"launcher.log": log, "rank0.log": "RuntimeError: Connection reset by peer"}
    got, excerpt = decided(Supervision(rc=1, oom_kills=2, host="ost1"), logs, world=4)
    assert got == expected, excerpt
    if expected == "error":
        assert excerpt.startswith("rank 3 on node ost2.cluster was killed by SIGKILL from outside")
        assert outcome.failure_cause(got, excerpt) == "rank_lost"


def test_a_rank_killed_on_the_runners_host_is_judged_by_the_runners_count():
    logs = {"launcher.log": root_cause("ost1") + "node ost2 oom_kill 0 -> 3\n"}
    assert decided(Supervision(rc=1, oom_kills=1, host="ost1"), logs, 2)[0] == "host_oom"
    got, excerpt = decided(Supervision(rc=1, oom_kills=0, host="ost1"), logs, 2)
    assert got == "error" and excerpt.startswith("rank 3 was killed by SIGKILL from outside")


# --------------------------------------------------------------------------- records and archive
def study_dir(root: Path) -> Path:
    return root / "results" / CLUSTER / STUDY


def place_failed(
    root: Path,
    scratch: Path,
    stamp: str,
    outcome_: str = "cancelled",
    excerpt: str = "received signal 15",
) -> Path:
    """A failed run's record made as the runner makes it: a temp record, archived, moved into
    place (placement.place). Returns the record folder."""
    made = make_record(
        scratch / stamp, "s", outcome=outcome_, error_excerpt=excerpt, extra={"finished_at": stamp}
    )
    record = Path(layout.record_dir(study_dir(root), "s", 0))
    tmp = placement.temp_record(record)
    shutil.copytree(made.parent, tmp.root, dirs_exist_ok=True)
    placement.place(tmp, record, "s", 0, stamp)
    return record


def archived(root: Path) -> list[Path]:
    return sorted(layout.archive_dir(study_dir(root), "s", 0, "x").parent.iterdir())


def test_an_infrastructure_failure_leaves_for_the_archive_until_the_budget_is_spent(tmp_path):
    root, scratch = tmp_path / "w", tmp_path / "scratch"
    stamps = [f"2026-12-01T10:00:0{i}Z" for i in range(3)]
    for i, stamp in enumerate(stamps[:2]):
        record = place_failed(root, scratch, stamp)
        sha = contracts.sha256_file(record / "metrics.json")
        (note,) = placement.retry_failed_runs(study_dir(root), [("s", 0)], BUDGET)
        assert note.retried and note.failures == i + 1 and note.cause == "cancelled"
        assert not record.exists()  # Snakemake finds its outputs missing: it runs it again
        kept = [contracts.sha256_file(c / "metrics.json") for c in archived(root)]
        assert sha in kept and len(kept) == i + 1
    # the second re-run failed too: past retries.infrastructure = 2, the record stays, saying why
    record = place_failed(root, scratch, stamps[2])
    (note,) = placement.retry_failed_runs(study_dir(root), [("s", 0)], BUDGET)
    assert not note.retried and record.is_dir()
    assert "failed so 3 times, past the study's retries.infrastructure: 2" in str(note)
    assert placement.retries_of(record) == 2
    row = collect.read_record(record / "metrics.json")
    assert row["retries"] == 2 and row["outcome"] == "cancelled"
    summary = collect.summarize(collect.build_runs([row]), n_boot=10)
    assert summary["n_retried"].iloc[0] == 2 and "retried:2" in summary["outcomes"].iloc[0]


def round_file(r: int) -> str:
    return layout.RECOMMEND_ROUND.format(round=r)


def made_from_records(root: Path) -> list[Path]:
    """The tables and recommend files a finished study holds, made from its records."""
    study, recommend = study_dir(root), study_dir(root) / layout.RECOMMEND_DIR
    made = [
        study / layout.RUNS_CSV,
        study / layout.RUNS_PARQUET,
        study / layout.SUMMARY_CSV,
        recommend / layout.RECOMMENDATION_JSON,
        recommend / round_file(1),
    ]
    for path in [*made, recommend / round_file(0)]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    return made


@pytest.mark.parametrize(("failure", "retried"), [("cancelled", True), ("gpu_oom", False)])
def test_a_retried_record_takes_what_was_made_from_the_records_with_it(tmp_path, failure, retried):
    """A retry removes the files derived from the records (the tables; recommend's decision,
    `snakemake recommend`'s target, which Snakemake must find missing to make the record again);
    round 0 of recommend (the plan's ranking alone) and a study whose failures stay keep theirs."""
    root = tmp_path / "w"
    place_failed(root, tmp_path / "scratch", "2026-12-01T10:00:00Z", failure, "boom")
    made = made_from_records(root)
    (note,) = placement.retry_failed_runs(study_dir(root), [("s", 0)], BUDGET)
    assert note.retried == retried
    assert [p.exists() for p in made] == [not retried] * len(made)
    assert (study_dir(root) / layout.RECOMMEND_DIR / round_file(0)).is_file()


@pytest.mark.parametrize("failure", WORKLOAD)
def test_a_workload_failure_stays_with_why(tmp_path, failure):
    record = place_failed(
        tmp_path / "w", tmp_path / "scratch", "2026-12-01T10:00:00Z", failure, "boom"
    )
    before = contracts.sha256_file(record / "metrics.json")
    (note,) = placement.retry_failed_runs(study_dir(tmp_path / "w"), [("s", 0)], BUDGET)
    assert not note.retried and note.why == outcome.RETRY_POLICY[failure].why
    assert contracts.sha256_file(record / "metrics.json") == before


def test_a_slurm_time_limit_is_retried_only_when_the_study_allows_it(tmp_path):
    _, detail = signal_verdict(15, {"SLURM_JOB_ID": "7"}, scontrol_says("TIMEOUT"))
    root = tmp_path / "w"
    record = place_failed(root, tmp_path / "scratch", "2026-12-01T10:00:00Z", "timeout", detail)
    (note,) = placement.retry_failed_runs(study_dir(root), [("s", 0)], BUDGET, move=False)
    assert not note.retried and "retries.time_limit: false" in note.why
    allow = {**BUDGET, "time_limit": True}
    (dry,) = placement.retry_failed_runs(study_dir(root), [("s", 0)], allow, move=False)
    assert dry.retried and ", would re-run: " in str(dry) and record.exists()  # snakemake -n
    (note,) = placement.retry_failed_runs(study_dir(root), [("s", 0)], allow)
    assert note.retried and ", re-run: " in str(note)
    assert not record.exists() and len(archived(root)) == 1


def test_ok_and_missing_records_are_left_alone(tmp_path):
    make_record(tmp_path, "s")
    runs = [("s", 0), ("s", 1), ("absent", 0)]
    assert placement.retry_failed_runs(study_dir(tmp_path), runs, BUDGET) == []
    assert (study_dir(tmp_path) / "s" / "rep0" / "metrics.json").is_file()


def every_record_tree(root: Path) -> set[str]:
    """sha256_tree of every complete record, in place or archived."""
    return {contracts.sha256_tree(m.parent) for m in study_dir(root).rglob("metrics.json")}


def test_a_second_runner_of_one_run_replaces_the_record_and_loses_no_byte_of_it(tmp_path):
    """The SLURM job of a killed Snakemake runs on beside its re-submission: two runners of one
    run. The first placed, then something wrote into its record (a late log line); the second
    places over it. The first, as it was in place, moves into the archive: no byte is lost."""
    root, scratch = tmp_path / "w", tmp_path / "scratch"
    first = place_failed(root, scratch, "2026-12-01T10:00:00Z", "ok", None)
    with open(first / "logs" / "late.log", "w") as fh:
        fh.write("a line after the record was placed\n")
    seen = contracts.sha256_tree(first)
    second = place_failed(root, scratch, "2026-12-01T10:05:00Z", "ok", None)
    assert read_json(second / "metrics.json")["finished_at"] == "2026-12-01T10:05:00Z"
    assert seen in every_record_tree(root)
    assert len(archived(root)) == 3  # each placed copy, and the first as it was in place
    assert not [p for p in second.parent.iterdir() if p.name != "rep0"]  # no half copy left


def test_a_folder_without_a_record_is_replaced_not_archived(tmp_path):
    """Snakemake makes a job's output folder before the job runs: that empty folder is no
    record, and the run's one archived copy is its own."""
    root = tmp_path / "w"
    (study_dir(root) / "s" / "rep0").mkdir(parents=True)
    record = place_failed(root, tmp_path / "scratch", "2026-12-01T10:00:00Z", "ok", None)
    assert (record / "metrics.json").is_file() and len(archived(root)) == 1


def test_a_retried_record_changed_after_it_was_placed_moves_to_the_archive_whole(tmp_path):
    root = tmp_path / "w"
    record = place_failed(root, tmp_path / "scratch", "2026-12-01T10:00:00Z")
    (record / "logs" / "late.log").write_text("written after placement\n")
    seen = contracts.sha256_tree(record)
    (note,) = placement.retry_failed_runs(study_dir(root), [("s", 0)], BUDGET)
    assert note.retried and not record.exists() and seen in every_record_tree(root)
    # two archived copies of one failure (the same metrics.json) are one attempt, not two
    assert len(archived(root)) == 2 and note.failures == 1


def test_a_temp_record_is_removed_only_by_a_runner_on_its_own_host(tmp_path, monkeypatch):
    """Results live on a filesystem the nodes share: a pid of another host says nothing here."""
    outdir = tmp_path / "s" / "rep0"
    dead = 2**22 + 1  # above Linux's pid_max: no process has it
    other_host = tmp_path / "s" / f"rep0.tmp-node-elsewhere-{dead}"
    mine_dead = tmp_path / "s" / f"rep0.tmp-{placement._host()}-{dead}"
    legacy = tmp_path / "s" / f"rep0.tmp-{dead}"  # before hosts were named: this host's
    for temp in (other_host, mine_dead, legacy):
        (temp / "logs").mkdir(parents=True)
    own = placement.temp_record(outdir)
    assert own.root.name == f"rep0.tmp-{placement._host()}-{placement.os.getpid()}"
    assert sorted(placement.remove_interrupted_records(outdir)) == sorted([mine_dead, legacy])
    assert other_host.is_dir() and own.root.is_dir()


# --------------------------------------------------------------------------- results disk full
@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs (as root), filled to the last byte after the test's first write."""
    with tmpfs(tmp_path / "results-disk", "256k") as mount:
        yield mount


def fill(mount: Path) -> None:
    with open(mount / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == 28  # ENOSPC: the disk is full


def test_a_full_results_disk_keeps_the_earlier_record_and_names_the_path(full_disk, tmp_path):
    root = full_disk / "w"
    record = place_failed(root, tmp_path / "scratch", "2026-12-01T10:00:00Z", "ok", None)
    before = {p.name: p.read_bytes() for p in record.iterdir() if p.is_file()}
    fill(full_disk)
    with pytest.raises(OSError, match=f"cannot write {record}/metrics.json: No space left"):
        write_json(record / "metrics.json", {"outcome": "ok", "pad": "x" * 100_000})
    assert not list(record.glob("*.tmp-*"))  # no temp file left to fill the disk further
    # the runner's next record, made complete elsewhere, cannot be archived: nothing moves
    tmp = placement.RecordDir(tmp_path / "next")
    shutil.copytree(record, tmp.root)
    write_json(tmp.metrics, {**read_json(tmp.metrics), "pad": "y" * 300_000})
    with pytest.raises(OSError, match="cannot archive the record .*No space left"):
        placement.place(tmp, record, "s", 0, "2026-12-01T11:00:00Z")
    assert {p.name: p.read_bytes() for p in record.iterdir() if p.is_file()} == before
    assert len(archived(root)) == 1  # no half copy in the archive
