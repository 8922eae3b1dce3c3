"""`snakemake --profile slurm` against a REAL local SLURM (tests/slurm_cluster.py starts it).

Needs root and `apt-get install slurm-wlm munge` (they fail, saying so, without them).
Two differently set-up clusters (partition, GRES type/count, MaxTime) run the same tests, but for
the default study end to end and the cancelled job (setup a only).
Only the default study's first run (setup a) measures the machine in a SLURM job; the other
workflow runs plan with the session's measured calibration (conftest.cpu_calibration).
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import REPO, copy_repo_for_run, make_cluster, make_spec
from slurm_cluster import profile_snakemake as snakemake
from slurm_cluster import slurm_fixture_gen, write_profile

from offload_study.core.contracts import (
    PROGRESS_FILE,
    read_json,
    sha256_file,
    write_json,
    write_run_spec,
)
from offload_study.core.study import StudyError
from offload_study.planning.resources import train_resources
from offload_study.training import logparse

pytestmark = pytest.mark.slurm

# Two differently set-up SLURMs; the study only changes its cluster description.
SETUPS = {
    "a": dict(partition="debug", gres_type="h200", gpus=8),
    "b": dict(partition="cpu-b", gres_type="a100", gpus=4, max_time="60"),
}
# the cluster description (config/clusters/<name>.yaml) matching each setup
CLUSTER_FILE = {"a": "test-slurm", "b": "test-slurm-b"}


#: Seconds a finished job stays known to slurmctld: the tests look up every job of a run after
#: it ends, and the default study takes longer than SLURM's default 300 s.
MIN_JOB_AGE_S = 3600


#: Seconds a requeued job waits before SLURM starts it again (SLURM's default: 120).
REQUEUE_DELAY_S = 5
#: The partition of higher PriorityTier whose jobs preempt (requeue) the train jobs.
URGENT = "urgent"


@pytest.fixture(scope="module", params=list(SETUPS), ids=[f"setup-{k}" for k in SETUPS])
def cluster(request):
    for cl in slurm_fixture_gen(
        **SETUPS[request.param],
        min_job_age=MIN_JOB_AGE_S,
        requeue_delay_s=REQUEUE_DELAY_S,
        preempt_partition=URGENT,
    ):
        cl.setup = request.param
        yield cl


def gpu_cluster_desc(cl, **kw) -> dict:
    """A validated cuda cluster description of the test SLURM (``kw`` overrides keys)."""
    d = {
        "name": "fake-gpu",
        "accelerator": "cuda",
        "gpus_per_node": cl.gpus,
        "nodes": 1,
        "cpu_cores_per_node": cl.cpus,
        "mem_gb_per_node": cl.real_memory_mb // 1024,
        "scheduler": "slurm",
        "slurm": {"partition": cl.partition, "gres_type": cl.gres_type},
    }
    d.update(kw)
    return make_cluster(d)


def planned(cluster_desc: dict, name: str, gpus: int, **scenario):
    """The run of scenario ``name`` with ``gpus`` GPUs, planned by the real planner."""
    return make_spec(cluster_desc, {"name": name, "gpus_per_node": gpus, **scenario})


# A stand-in for the train rule: the planned run specs (specs/<scenario>.run.json) give its
# resources exactly as in the workflow; `--config sleep=<s>` sets how long each job runs.
SNAKEFILE = textwrap.dedent(
    """\
    from pathlib import Path
    from offload_study.core.contracts import read_json, read_run_spec
    from offload_study.planning.resources import rule_resources, train_resources
    CLUSTER = read_json("cluster.json")
    SPECS = {p.name.removesuffix(".run.json"): read_run_spec(p)
             for p in Path("specs").glob("*.run.json")}
    localrules: all
    rule all:
        input: expand("out/{s}.txt", s=SPECS)
    rule train:
        output: "out/{scenario}.txt"
        params: sleep=config.get("sleep", 1)
        resources: **rule_resources({n: train_resources(s, CLUSTER) for n, s in SPECS.items()}, CLUSTER)
        shell:
            "echo $SLURM_JOB_ID > {output}.tmp; "
            "echo CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES:-}} >> {output}.tmp; "
            "sleep {params.sleep}; mv {output}.tmp {output}"
    """
)


def make_workflow(tmp: Path, cluster_desc: dict, specs: list) -> Path:
    wf = tmp / "wf"
    wf.mkdir()
    (wf / "Snakefile").write_text(SNAKEFILE)
    write_json(wf / "cluster.json", cluster_desc)
    for spec in specs:
        write_run_spec(wf / "specs" / f"{spec.scenario}.run.json", spec)
    return wf


def mem_mb(text: str) -> float:
    """scontrol memory ("2G", "3072M", "1.50T") -> MB."""
    mult = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    return float(text[:-1]) * mult[text[-1]] if text[-1] in mult else float(text)


def test_profile_submits_with_requested_resources(cluster, tmp_path):
    desc = gpu_cluster_desc(cluster)
    specs = [planned(desc, "two", 2, cpu_mem_gb=1), planned(desc, "one", 1, cpu_mem_gb=2)]
    wf = make_workflow(tmp_path, desc, specs)
    prof = write_profile(tmp_path / "prof")
    t0 = time.monotonic()
    cp = snakemake(cluster, wf, prof)
    elapsed = time.monotonic() - t0
    assert cp.returncode == 0, cp.stdout + cp.stderr + cluster.logs()
    print(f"two-job snakemake --profile run: {elapsed:.1f}s (bring-up {cluster.bring_up_s:.2f}s)")
    for s in specs:
        lines = (wf / "out" / f"{s.scenario}.txt").read_text().split()
        job_id = lines[0]
        res = train_resources(s, desc)
        info = cluster.job_info(job_id)  # MinJobAge keeps it visible after completion
        assert info is not None, f"job {job_id} unknown to slurmctld"
        assert info["JobState"] == "COMPLETED"
        assert info["Partition"] == cluster.partition
        tres_gpu = info.get("TresPerNode") or info.get("TresPerJob") or ""
        assert tres_gpu.endswith(f"gpu:{cluster.gres_type}:{s.gpus_per_node}"), info
        assert mem_mb(info["MinMemoryNode"]) == res["mem_mb"]
        assert int(info["CPUs/Task"]) == res["cpus_per_task"]
        assert int(info["NumNodes"]) == 1
        # time limit in minutes, H:MM:SS
        h, m, _ = info["TimeLimit"].split(":")
        assert int(h) * 60 + int(m) == res["runtime"]
        # the job step (the plugin's `srun` inside the job) saw exactly its GPUs
        visible = lines[1].split("=", 1)[1]
        assert len(set(visible.split(","))) == s.gpus_per_node, visible


def test_more_gpus_than_exist_is_reported(cluster, tmp_path):
    # A cluster description that overstates the node: SLURM itself must refuse the job.
    desc = gpu_cluster_desc(cluster, gpus_per_node=cluster.gpus * 2)
    specs = [planned(desc, "greedy", cluster.gpus + 1, cpu_mem_gb=1)]
    wf = make_workflow(tmp_path, desc, specs)
    cp = snakemake(cluster, wf, write_profile(tmp_path / "prof"))
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0
    assert "SLURM sbatch failed" in out or "sbatch failed" in out, out
    assert "Requested node configuration is not available" in out, out

    # An honest description: the planner refuses the scenario, naming the key ...
    desc = gpu_cluster_desc(cluster)
    with pytest.raises(
        StudyError,
        match=rf"scenarios\[0\]\.gpus_per_node: gpus_per_node="
        rf"{cluster.gpus + 1} is more than",
    ):
        planned(desc, "greedy", cluster.gpus + 1)
    # ... and a run planned elsewhere is refused by its resources before anything is submitted.
    (tmp_path / "honest").mkdir()
    wf2 = make_workflow(tmp_path / "honest", desc, specs)
    cp = snakemake(cluster, wf2, write_profile(tmp_path / "prof2"))
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0
    assert "greedy" in out and f"gpus_per_node={cluster.gpus + 1}" in out, out
    assert not [j for j in cluster.jobs() if j.get("JobName", "").startswith("greedy")]


# --- the real workflow --------------------------------------------------------------------


#: The default study's adaptive measurement with the smallest budget its rules allow (6
#: measured steps, after at most 2 x settle_window warm-up steps), given as a --configfile over
#: it: the test judges where the study's jobs ran, not what they measured (test_steady does).
SHORT_MEASURE = {"measure": {"max_warmup_steps": 6, "min_steps": 6, "max_steps": 8}}


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [pytest.param("a", id="setup-a")], indirect=True)
def test_default_study_end_to_end(cluster, tmp_path):
    """The default study through `snakemake --profile <test profile>` on the test cluster, as
    `make study` runs it but for its measurement budget (SHORT_MEASURE; the calibration and
    the adaptive measurement in SLURM jobs too); every
    run's provenance.json carries its SLURM job id. Setup a only: setup b's partition, GRES and
    time limit are checked job by job (test_profile_submits_with_requested_resources) and its
    real train job runs through the profile to a record with its job id in
    test_a_requeued_preempted_or_node_failed_job_ends_in_a_completed_rerun."""
    name = CLUSTER_FILE[cluster.setup]
    study = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    work = copy_repo_for_run(tmp_path)
    (work / "short-measure.yaml").write_text(yaml.safe_dump(SHORT_MEASURE))
    args = ["--configfile", "short-measure.yaml", "--config", f"cluster={name}"]
    prof = write_profile(tmp_path / "prof", jobs=4)
    t0 = time.monotonic()
    cp = snakemake(cluster, work, prof, *args, timeout=1500)
    elapsed = time.monotonic() - t0
    assert cp.returncode == 0, cp.stdout[-8000:] + cp.stderr[-8000:]
    print(f"default study on {name}: {elapsed:.0f}s")
    provs = sorted((work / "results" / name).glob("*/*/rep*/provenance.json"))
    assert {p.parent.parent.name for p in provs} == {s["name"] for s in study["scenarios"]}
    assert (work / "results" / name / "logs" / "calibrate.log").exists()
    known = {j["JobId"]: j for j in cluster.jobs()}
    for p in provs:
        prov = read_json(p)
        jid = prov.get("slurm_job_id") or (prov.get("slurm") or {}).get("job_id")
        assert jid, f"{p}: no SLURM job id"
        assert str(jid) in known, f"{p}: job {jid} not a job of this SLURM"
        assert known[str(jid)]["Partition"] == cluster.partition
        metrics = read_json(p.parent / "metrics.json")
        assert metrics["slurm_job_id"] == str(jid)
        assert metrics["measure_mode"] == "adaptive"
        assert metrics["steps_measured"] <= SHORT_MEASURE["measure"]["max_steps"]


def one_run_study(work: Path, cluster_name: str, study: str) -> str:
    """A study of the default study's offload-opt-param-1rank run alone, measuring a fixed number
    of steps (FAULT_STEPS: long enough for a fault to land while it trains); its file name."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config.update(
        study=study,
        cluster=cluster_name,
        measure={"mode": "fixed"},
        steps=FAULT_STEPS,
        warmup_steps=1,
        timeout_min=10,
    )
    config["scenarios"] = [s for s in config["scenarios"] if s["name"] == "offload-opt-param-1rank"]
    (work / f"{study}.yaml").write_text(yaml.safe_dump(config))
    return f"{study}.yaml"


#: Measured steps of the fault tests' run.
FAULT_STEPS = 12


def training_job(cluster, run_dir: Path, proc, seen: set, timeout: float = 300) -> str:
    """Wait until a new attempt of the run trains (a progress file in a temp record not in
    ``seen``), then return the id of its RUNNING SLURM job."""
    deadline = time.monotonic() + timeout
    while True:
        fresh = {p.parent for p in run_dir.glob(f"rep0.tmp-*/{PROGRESS_FILE}")} - seen
        if fresh:
            seen |= fresh
            break
        assert proc.poll() is None, "snakemake ended before the run trained:\n" + proc.stdout.read()
        assert time.monotonic() < deadline, f"the run never trained\n{cluster.jobs()}"
        time.sleep(0.25)
    (job,) = [j["JobId"] for j in cluster.jobs() if j.get("JobState") == "RUNNING"]
    return job


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [pytest.param("a", id="setup-a")], indirect=True)
def test_cancelled_training_job_is_run_again_by_the_next_invocation(
    cluster, tmp_path, cpu_calibration
):
    """scancel of a running `train` job: Snakemake reports the job failed and CANCELLED (and
    exits non-zero), SLURM has it CANCELLED, the run's record says `cancelled` with its job id.
    The next invocation re-runs it (the retry policy) and archives the cancelled record."""
    name = CLUSTER_FILE[cluster.setup]
    work = copy_repo_for_run(tmp_path, cpu_calibration, name)
    args = (write_profile(tmp_path / "prof"), "--configfile", one_run_study(work, name, "cancel"))
    proc = snakemake(cluster, work, *args, background=True)
    results = work / "results" / name / "cancel"
    run_dir = results / "offload-opt-param-1rank"
    try:
        job_id = training_job(cluster, run_dir, proc, set())
        cluster.run("scancel", job_id)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"SLURM-job '{job_id}' failed" in out and "CANCELLED" in out, out[-4000:]
    metrics = read_json(run_dir / "rep0" / "metrics.json")
    assert metrics["outcome"] == "cancelled", out[-4000:]
    assert metrics["slurm_job_id"] == str(job_id)
    assert cluster.job_state(job_id) == "CANCELLED"
    cancelled = sha256_file(run_dir / "rep0" / "metrics.json")

    cp = snakemake(cluster, work, *args, timeout=600)
    assert cp.returncode == 0, cp.stdout[-6000:] + cp.stderr[-6000:]
    assert "cancelled, re-run: stopped from outside" in cp.stderr, cp.stderr[-4000:]
    assert read_json(run_dir / "rep0" / "metrics.json")["outcome"] == "ok"
    archived = [sha256_file(p) for p in (results / "archive").glob("*/rep0/*/metrics.json")]
    assert cancelled in archived and len(archived) == 2
    assert pd.read_csv(results / "runs.csv")["retries"].tolist() == [1]


#: The SLURM faults that hit each setup's run, one after the other (each fault once in all).
FAULTS = {"a": ("requeue",), "b": ("node down", "preemption")}


def inject(cluster, job_id: str, fault: str) -> None:
    """`scontrol requeue` of the running job; its node set down (back up once SLURM has taken
    the job off it: the node's own return to service or, else, an admin's resume); or a job of
    the higher-tier partition that needs the whole node (SLURM preempts: requeues the job)."""
    if fault == "requeue":
        cluster.run("scontrol", "requeue", job_id)
    elif fault == "node down":
        cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=DOWN", "Reason=test")
        cluster.wait_job_state(job_id, {"PENDING", "COMPLETING"}, timeout=60)
        cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME", check=False)
    else:
        cluster.sbatch(
            "-p", URGENT, "--exclusive", "--mem=100", "-o", "/dev/null", "--wrap", "sleep 1"
        )
        cluster.wait_job_state(job_id, {"PENDING", "COMPLETING"}, timeout=60)


@pytest.mark.slow
@pytest.mark.injects_fault
def test_a_requeued_preempted_or_node_failed_job_ends_in_a_completed_rerun(
    cluster, tmp_path, cpu_calibration
):
    """A running `train` job requeued (`scontrol requeue`), its node set down, or preempted by a
    job of a higher-tier partition: SLURM starts it again (the profile's slurm-requeue),
    Snakemake waits for it and succeeds, no human acts. The record is the re-run's (ok); each
    interrupted attempt's `cancelled` record is in the archive, saying that SLURM requeued it,
    and counts as a retry in runs.csv."""
    faults, name = FAULTS[cluster.setup], CLUSTER_FILE[cluster.setup]
    work = copy_repo_for_run(tmp_path, cpu_calibration, name)
    args = ("--configfile", one_run_study(work, name, "fault"))
    t0 = time.monotonic()
    proc = snakemake(cluster, work, write_profile(tmp_path / "prof"), *args, background=True)
    results = work / "results" / name / "fault"
    run_dir, seen, jobs = results / "offload-opt-param-1rank", set(), set()
    try:
        for fault in faults:
            jobs.add(job := training_job(cluster, run_dir, proc, seen))
            inject(cluster, job, fault)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{' + '.join(faults)} on {name}: {time.monotonic() - t0:.0f}s")
    assert proc.returncode == 0, out[-6000:] + cluster.logs()
    assert read_json(run_dir / "rep0" / "metrics.json")["outcome"] == "ok"
    attempts = [read_json(p) for p in (results / "archive").glob("*/rep0/*/metrics.json")]
    cancelled = [m for m in attempts if m["outcome"] == "cancelled"]
    assert len(cancelled) == len(faults), attempts
    for m in cancelled:
        assert "requeued by SLURM" in m["error_excerpt"], m["error_excerpt"]
    assert {m["slurm_job_id"] for m in cancelled} == jobs  # one job, started again by SLURM
    runs = pd.read_csv(results / "runs.csv")
    assert runs["retries"].tolist() == [len(faults)] and runs["outcome"].tolist() == ["ok"]


# --- two nodes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_nodes():
    """The two-node SLURM that config/clusters/test-slurm-2node.yaml describes."""
    yield from slurm_fixture_gen(nodes=2, gpus=0, gres_type=None, min_job_age=MIN_JOB_AGE_S)


@pytest.mark.slow
def test_two_node_run_of_the_default_study(two_nodes, tmp_path, cpu_calibration):
    """A 2-node scenario of the default study through `snakemake --profile`: srun starts one
    torchrun per node, their c10d rendezvous and gloo work, and the record names both hosts."""
    work = copy_repo_for_run(tmp_path, cpu_calibration, "test-slurm-2node")
    study = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    (scenario,) = [s for s in study["scenarios"] if s["name"] == "zero3-2rank"]
    scenario.update(name="zero3-2node", nodes=2, gpus_per_node=1)
    study.update(
        study="two-node",
        cluster="test-slurm-2node",
        scenarios=[scenario],
        measure={"mode": "fixed"},
        steps=3,
        warmup_steps=1,
    )
    (work / "two-node.yaml").write_text(yaml.safe_dump(study))
    cp = snakemake(
        two_nodes,
        work,
        write_profile(tmp_path / "prof"),
        "--configfile",
        "two-node.yaml",
        timeout=900,
    )
    assert cp.returncode == 0, cp.stdout[-6000:] + cp.stderr[-6000:] + two_nodes.logs()
    record = work / "results" / "test-slurm-2node" / "two-node" / "zero3-2node" / "rep0"
    metrics, prov = read_json(record / "metrics.json"), read_json(record / "provenance.json")
    assert metrics["outcome"] == "ok", metrics["error_excerpt"]
    assert (metrics["nodes"], metrics["world_size"]) == (2, 2)
    assert prov["hosts"] == two_nodes.nodes == ["ost1", "ost2"]
    assert prov["launch_command"].startswith("srun --nodes 2")
    assert prov["rendezvous_host"] == "ost1"
    job = two_nodes.job_info(metrics["slurm_job_id"])
    assert job["NumNodes"] == "2" and job["NodeList"] == "ost[1-2]", job
    ranks = {read_json(p)["rank"]: read_json(p)["host"] for p in record.glob("rank*.stats.json")}
    assert ranks == {0: "ost1", 1: "ost2"}
    # each node's OOM count, for a rank killed there (launch.NODE_OOM_WRAPPER)
    assert set(logparse.node_oom_kills((record / "logs" / "launcher.log").read_text())) == {
        "ost1",
        "ost2",
    }
