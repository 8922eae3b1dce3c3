"""Real DeepSpeed ZeRO-3 runs on CPU through the runner (slow) + record helpers (fast)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import make_spec
from runs import RUNNER_GRACE_S, load_record, make_run, run_runner, runner_argv

from offload_study.core import contracts
from offload_study.core.contracts import RankStats, StepRow
from offload_study.core.devices import free_port
from offload_study.training import (
    launch,
    metrics,
    outcome,
    placement,
    probes,
    provenance,
    runner,
    supervise,
)
from offload_study.training.supervise import Supervision

# --------------------------------------------------------------------------- real runs
MODES = [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")]


#: Every mode over 2 gloo ranks, and one mode on 1 rank: each run costs ~40 s of the CI's 2 cores
#: for DeepSpeed's start-up, and the 1-rank path is also run by the default study's
#: offload-opt-param-1rank and nvme-1rank scenarios (test_slurm, the chaos run).
MODE_RUNS = [(*mode, 2) for mode in MODES] + [("cpu", "cpu", 1)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "opt,param,world", MODE_RUNS, ids=["-".join(map(str, m)) for m in MODE_RUNS]
)
def test_offload_modes_ok(tmp_path, opt, param, world):
    spec_path, outdir, spec = make_run(tmp_path, opt, param, world)
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stdout + res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "ok", m["error_excerpt"]
    assert m["steps_measured"] == 3 and m["tokens_per_s"] > 0 and m["samples_per_s"] > 0
    assert math.isfinite(m["loss_first"]) and math.isfinite(m["loss_last"])
    assert 2 < m["loss_first"] < 12  # ~ln(vocab) for random init
    assert m["model_params"] > 100_000 and m["tflops_per_gpu"] > 0
    assert len(m["host_peak_rss_gib_per_rank"]) == world
    assert all(v > 0.1 for v in m["host_peak_rss_gib_per_rank"])
    assert m["host_peak_rss_gib"] == pytest.approx(sum(m["host_peak_rss_gib_per_rank"]), 1e-3)
    # each rank's process tree (tee is a child of every rank) holds at least the rank itself
    trees = m["host_peak_tree_gib_per_rank"]
    assert len(trees) == world and all(v > 0.1 for v in trees) and m["host_tree_measure"]
    assert m["host_peak_tree_gib"] == pytest.approx(sum(trees), 1e-3)
    threads = json.loads((outdir / "provenance.json").read_text())["rank_threads"]
    assert [t["rank"] for t in threads] == list(range(world))
    assert all(t["cpu_affinity"] and t["torch_threads"] >= 1 for t in threads)
    assert m["peak_gpu_allocated_gib"] is None and m["mfu"] is None
    bd = m["breakdown_ms"]
    assert bd["forward"] > 0 and bd["backward"] > 0 and bd["step"] >= 0
    for r in range(world):
        assert (outdir / "logs" / f"rank{r}.log").stat().st_size > 0
    steps = (outdir / "steps.csv").read_text().splitlines()
    assert steps[0] == ",".join(contracts.STEPS_COLUMNS)
    assert [s.split(",")[1] for s in steps[1:]] == ["warmup"] + ["measured"] * 3
    # the fixed mode (the study sets steps): exactly its steps; bf16 skips none
    assert (m["measure_mode"], m["stop_reason"], m["steps_warmup"]) == ("fixed", "fixed", 1)
    assert m["skipped_steps_measured"] == m["skipped_steps_ds_log"] == 0
    prov = json.loads((outdir / "provenance.json").read_text())
    assert prov["deepspeed_version"] and prov["rendezvous_port"] > 0
    assert prov["ds_config_sha256"] == m["ds_config_sha256"]
    assert "torch.distributed.run" in prov["launch_command"]
    assert prov["launch_env"]["DS_ACCELERATOR"] == "cpu"
    if opt == "nvme":
        assert m["nvme_bytes_used"] > 1_000_000
        assert bd["optimizer_swap_in"] is not None and bd["optimizer_swap_out"] is not None
        assert os.listdir(spec.nvme_path) == [], "NVMe swap files not cleaned"
    else:
        assert m["nvme_bytes_used"] is None
        assert bd["optimizer_swap_in"] is None


@pytest.mark.slow
def test_config_error(tmp_path):
    spec_path, outdir, _ = make_run(tmp_path, ds_over={"zero_optimization": {"bogus_knob": 1}})
    # the half record of a run whose runner died (pid 2**22 + 1 is above Linux's pid_max)
    stale = Path(str(outdir) + f".tmp-{2**22 + 1}")
    (stale / "logs").mkdir(parents=True)
    res = run_runner(spec_path, outdir)
    assert not stale.exists(), "an interrupted run's half record was left behind"
    assert res.returncode == 0, res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "config_error"
    assert "bogus_knob" in m["error_excerpt"] or "validation error" in m["error_excerpt"]
    assert m["tokens_per_s"] is None and m["steps_measured"] is None


@pytest.mark.slow
def test_batch_mismatch_is_config_error_and_strict_exits_1(tmp_path):
    spec_path, outdir, _ = make_run(tmp_path, strict=True, ds_over={"train_batch_size": 7})
    res = run_runner(spec_path, outdir)
    assert res.returncode == 1
    m = load_record(outdir)
    assert m["outcome"] == "config_error"
    assert "Check batch related parameters" in m["error_excerpt"]


#: What torch's agent prints when the rendezvous port is taken (torch 2.13, a real capture).
PORT_TAKEN = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
    "network address. port: 42777, useIpv6: false, code: -98, name: EADDRINUSE, message: "
    "address already in use"
)


def test_only_the_rendezvous_port_of_this_launch_being_taken_launches_it_again():
    assert runner.rendezvous_port_taken("...\n" + PORT_TAKEN + "\n", 42777)
    assert not runner.rendezvous_port_taken(PORT_TAKEN, 4277)
    assert not runner.rendezvous_port_taken(PORT_TAKEN.replace("EADDRINUSE", "ECONNREFUSED"), 42777)


@pytest.mark.slow
def test_a_port_taken_before_torchrun_binds_it_is_launched_again(tmp_path, monkeypatch):
    spec_path, outdir, _ = make_run(tmp_path)
    with socket.socket() as held:  # what takes the port chosen first, as a neighbour would
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        chosen = iter([taken])
        monkeypatch.setattr(launch, "free_port", lambda: next(chosen, None) or free_port())
        assert runner.run(str(spec_path), 0, str(outdir), strict=True) == 0
    assert load_record(outdir)["outcome"] == "ok"
    logs = outdir / "logs"
    assert f"port {taken} was taken" in (logs / "launcher.log").read_text()
    # the failed launch's text is kept, out of the logs the outcome is read from
    assert f"port: {taken}," in (logs / "launcher.port-taken-1.txt").read_text()
    assert "EADDRINUSE" not in "".join(p.read_text() for p in logs.glob("*.log"))
    prov = json.loads((outdir / "provenance.json").read_text())
    assert prov["rendezvous_port"] not in (taken, None)


@pytest.mark.slow
def test_step_timeout(tmp_path):
    spec_path, outdir, _ = make_run(tmp_path, step_timeout_s=0.001, steps=50)
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "timeout"
    assert "step_timeout_s" in m["error_excerpt"]
    # killed long before the 51 steps
    assert len((outdir / "steps.csv").read_text().splitlines()) < 40


@pytest.mark.slow
def test_sigterm_cancelled(tmp_path):
    spec_path, outdir, _ = make_run(tmp_path, steps=100000, world=2)
    cmd = runner_argv(spec_path, outdir)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    tmp_logs = None
    while time.time() < deadline:  # wait until training runs
        tmp_logs = list(outdir.parent.glob("rep0.tmp-*/steps.csv"))
        if tmp_logs and len(tmp_logs[0].read_text().splitlines()) > 2:
            break
        time.sleep(0.5)
    assert tmp_logs, "training never started"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=RUNNER_GRACE_S)
    assert proc.returncode == 0, out
    m = load_record(outdir)
    assert m["outcome"] == "cancelled"
    assert m["steps_measured"] >= 1  # partial measurements are kept
    # no rank survives the cancel
    ps = subprocess.run(["pgrep", "-f", str(outdir)], capture_output=True, text=True)
    assert ps.stdout.strip() == ""


@pytest.mark.parametrize("signalled", [True, False])
def test_a_signalled_runner_gives_its_ranks_the_short_grace(tmp_path, monkeypatch, signalled):
    """Whoever signalled the runner SIGKILLs it soon after (timeout -k 10 on the device, SLURM's
    KillWait): on a signal the ranks get CANCEL_GRACE_S, so that the cancelled record is written
    before that; a limit the runner enforces itself (here the run time) keeps KILL_GRACE_S."""
    graces = []
    kill_group = supervise.kill_group
    monkeypatch.setattr(
        supervise, "kill_group", lambda proc, grace_s: (graces.append(grace_s), kill_group(proc))
    )
    launched = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    spec = SimpleNamespace(cpu_mem_bytes=None, timeout_s=600 if signalled else 0, step_timeout_s=0)
    cancel = supervise.Cancelled()
    cancel.signum = signal.SIGTERM if signalled else None
    seen = supervise.supervise(launched, spec, contracts.RecordDir(tmp_path), cancel, print)
    assert seen.killed == ("cancelled" if signalled else "timeout")
    assert graces == [supervise.CANCEL_GRACE_S if signalled else supervise.KILL_GRACE_S]
    assert supervise.CANCEL_GRACE_S < supervise.KILL_GRACE_S


# --------------------------------------------------------------------------- fast helpers
def test_allowed_env_drops_secrets():
    env = {
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "INFO",
        "HF_TOKEN": "x",
        "NCCL_API_KEY": "y",
        "SLURM_JOB_ID": "12",
        "AWS_SECRET_ACCESS_KEY": "z",
        "HOME": "/root",
    }
    got = provenance.allowed_env(env)
    assert got == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "SLURM_JOB_ID": "12"}


def test_archive_dir(tmp_path):
    out = tmp_path / "results" / "c" / "s" / "scen" / "rep3"
    d = placement.archive_dir(out, "scen", 3, "2026-11-29T10:51:14Z", "ab" * 32)
    assert d == (tmp_path / "results/c/s/archive/scen/rep3/20261129T105114Z-abababab").resolve()


# a worker process that holds 200 MiB it has written (every page resident), then waits
WORKER_BYTES = 200 * 2**20
WORKER = (
    f"import sys; held = bytearray({WORKER_BYTES}); held[::4096] = b'x' * len(held[::4096]); "
    "print('ready', flush=True); sys.stdin.read()"
)

# The rank: a fresh process, so that its tree holds the worker alone (a pytest process can hold
# children an earlier test left exiting). It prints the sampler's record, both peaks, and the
# kernel's count of the worker's resident memory (/proc/<pid>/status, read apart from the sampler).
RANK = f"""
import json, subprocess, sys, time
from pathlib import Path
from offload_study.training import probes
sampler = probes.HostMemorySampler(interval_s=0.05, unique=sys.argv[1] == "unique").start()
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
assert worker.stdout.readline().strip() == "ready"
time.sleep(0.2)  # a few samples while the worker holds its memory
status = Path(f"/proc/{{worker.pid}}/status").read_text().splitlines()
worker_rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
recorded = sampler.stop()
worker.stdin.close()
worker.wait(timeout=30)
print(json.dumps(dict(recorded, measure=sampler.measure, own_peak=sampler.own_peak,
                      tree_peak=sampler.tree_peak, worker_rss=worker_rss)))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
@pytest.mark.parametrize("unique", [True, False], ids=["rss+uss", "rss"])
def test_the_host_memory_sampler_counts_the_ranks_worker_process(unique):
    """The rank starts a worker holding 200 MiB, as SuperOffload's optimizer worker holds the
    Adam moments: the tree's peak exceeds the rank's own by about that."""
    argv = [sys.executable, "-c", RANK, "unique" if unique else "rss"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(done.stdout)
    assert got["measure"] == ("rss+uss" if unique else "rss")
    assert got["host_tree_measure"] == got["measure"] + contracts.TREE_FLOORED
    assert got["host_peak_tree_bytes"] == got["tree_peak"]
    worker_part = got["tree_peak"] - got["own_peak"]
    # the 200 MiB, and at most what /proc says the worker holds (USS <= RSS) and some slack
    # for the rank's own memory moving between samples
    assert WORKER_BYTES <= worker_part <= got["worker_rss"] + 8 * 2**20


def test_memory_own_and_tree_per_rank_and_per_node():
    """metrics.json keeps the ranks' own peaks and adds their trees'; a node's tree is null
    unless every rank measured it (the report then falls back to the own figure)."""
    spec = make_spec("local-cpu", {"gpus_per_node": 2})
    gib = 2**30

    def rank(r, tree):
        return RankStats(
            rank=r,
            local_rank=r,
            world_size=2,
            host="h",
            pid=1,
            host_peak_rss_bytes=3 * gib,
            host_peak_tree_bytes=tree,
            host_tree_measure="rss+uss" if tree else None,
        )

    m = metrics_of(spec, {0: rank(0, 5 * gib), 1: rank(1, 4 * gib)})
    assert m["host_peak_rss_gib_per_rank"] == [3.0, 3.0] and m["host_peak_rss_gib"] == 6.0
    assert m["host_peak_tree_gib_per_rank"] == [5.0, 4.0]
    assert m["host_peak_tree_gib_per_node"] == [9.0] and m["host_peak_tree_gib"] == 9.0
    assert m["host_tree_measure"] == "rss+uss"
    m = metrics_of(spec, {0: rank(0, 5 * gib), 1: rank(1, None)})  # rank 1 died before its stats
    assert m["host_peak_tree_gib_per_node"] == [None] and m["host_peak_tree_gib"] is None
    assert m["host_peak_rss_gib"] == 6.0


def test_cores_and_threads_as_the_rank_sees_them(monkeypatch):
    import torch

    assert probes.cpu_ranges([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert probes.cpu_ranges([5]) == "5"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    got = probes.cores_and_threads()
    assert got["cpu_affinity"] == probes.cpu_ranges(os.sched_getaffinity(0))
    assert got["torch_threads"] == torch.get_num_threads() >= 1
    assert got["torch_interop_threads"] == torch.get_num_interop_threads() >= 1
    assert (got["omp_num_threads"], got["mkl_num_threads"]) == ("3", None)


def test_percentile():
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert metrics.percentile([1.0, 2.0], 0.1) == pytest.approx(1.1)


@pytest.mark.slow
def test_token_file_and_gradient_checkpointing(tmp_path):
    """A token file instead of synthetic tokens, with activation checkpointing on."""
    import numpy as np

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 512, size=20_000, dtype=np.int32))
    spec_path, outdir, _ = make_run(tmp_path, token_file=str(tokens), gradient_checkpointing=True)
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "ok", m["error_excerpt"]
    assert m["gradient_checkpointing"] is True
    assert f"tokens from {tokens}: 20000 ids" in (outdir / "logs" / "rank0.log").read_text()
    assert math.isfinite(m["loss_last"]) and m["tokens_per_s"] > 0


# --------------------------------------------------------------------------- outcome (pure)
def evidence(rc=1, killed=None, detail=None, logs=None, finished=(), steps=(), step_timeout=None):
    stats = {
        r: RankStats(rank=r, local_rank=r, world_size=2, host="h", pid=1, finished=True)
        for r in finished
    }
    sup = Supervision(rc=rc, killed=killed, detail=detail)
    return outcome.Evidence(sup, logs or {}, stats, list(steps), 2, step_timeout)


STEP = StepRow(1, "measured", 0.5, 100.0, 1.0, 6.0)
SKIPPED = StepRow(2, "measured", 0.3, 160.0, 1.6, 6.0, skipped=1, loss_scale=2.0**31)
WARM_SKIPPED = StepRow(1, "warmup", 0.3, 160.0, 1.6, 6.0, skipped=1, loss_scale=2.0**31)
OOM_LOG = {"launcher.log": "exitcode 1", "rank1.log": "torch.OutOfMemoryError: CUDA out of memory."}
DECISIONS = [
    # (evidence, outcome, words the excerpt must contain)
    (
        evidence(rc=-15, killed="timeout", detail="run exceeded timeout_s=60"),
        "timeout",
        ["run exceeded timeout_s=60"],
    ),
    (
        evidence(rc=0, finished=(0, 1), steps=[STEP], step_timeout=0.1),
        "timeout",
        ["a step exceeded step_timeout_s=0.1"],
    ),
    (evidence(rc=0, finished=(0, 1), steps=[STEP], step_timeout=1.0), "ok", []),
    (
        evidence(rc=0, finished=(0, 1), steps=[SKIPPED, SKIPPED]),
        "error",
        ["all 2 measured optimizer steps were skipped", "initial_scale_power"],
    ),
    (evidence(rc=0, finished=(0, 1), steps=[WARM_SKIPPED, SKIPPED, STEP]), "ok", []),
    (evidence(rc=1, logs=OOM_LOG, finished=(0,)), "gpu_oom", ["CUDA out of memory"]),
    (evidence(rc=-9, logs={"rank0.log": "step 3"}), "host_oom", []),
    (evidence(rc=1), "error", ["exit code 1"]),
    (
        evidence(rc=0, finished=(0,), logs={"rank0.log": "bye"}),
        "error",
        ["launcher exited 0 but 1/2 ranks finished"],
    ),
    (
        evidence(rc=None, logs={"launcher.log": "launch failed: RuntimeError: no SLURM"}),
        "error",
        ["launch failed"],
    ),
    (
        evidence(
            rc=None,
            killed="op_build_error",
            detail="fix: apt-get install libaio-dev",
            logs={"launcher.log": "not launched: op async_io"},
        ),
        "op_build_error",
        ["fix: apt-get install libaio-dev\nnot launched: op async_io"],
    ),
]


@pytest.mark.parametrize(("ev", "expected", "words"), DECISIONS)
def test_outcome_is_decided_by_the_rule_table(ev, expected, words):
    got, excerpt = outcome.decide(ev)
    assert got == expected and got in contracts.OUTCOMES
    assert (excerpt is None) == (got == "ok")
    for word in words:
        assert word in excerpt


def test_every_outcome_a_rule_or_pattern_gives_is_in_the_schema():
    from offload_study.training import logparse

    assert {o for o, _, _ in logparse.OUTCOME_PATTERNS} <= set(contracts.OUTCOMES)
    assert {"ok", "timeout", "host_oom", "cancelled", "error"} <= set(contracts.OUTCOMES)


# --------------------------------------------------------------------------- metrics (pure)
def metrics_of(spec, stats=None, logs=None, steps=(STEP,), outcome_="ok"):
    spec = spec.with_ds_config("no-such-config.json")  # its sha256 is then null
    inp = metrics.MetricsInput(
        spec,
        0,
        Supervision(rc=0, elapsed=3.0),
        outcome_,
        None,
        list(steps),
        stats or {},
        logs or {},
        "2026-01-01T00:00:00Z",
        "2026-01-01T00:00:03Z",
    )
    m = metrics.compute_metrics(inp)
    assert metrics.metrics_problems(m) == [] and list(m) == contracts.METRICS_FIELDS
    return m


GPU_CLUSTER = {
    "name": "g",
    "accelerator": "cuda",
    "gpus_per_node": 1,
    "gpu_mem_gb": 141,
    "gpu_model": "NVIDIA H200",
}


def test_mfu_uses_the_clusters_peak_tflops_override():
    stats = {
        0: RankStats(
            rank=0,
            local_rank=0,
            world_size=1,
            host="h",
            pid=1,
            device_name="NVIDIA H200",
            model_params=10**9,
        )
    }
    m = metrics_of(make_spec(dict(GPU_CLUSTER, peak_tflops=500.0), {"gpus_per_node": 1}), stats)
    assert m["peak_tflops"] == 500.0 and m["mfu"] == pytest.approx(m["tflops_per_gpu"] / 500)
    # no override: the device torch named, else the cluster's gpu_model
    assert metrics_of(make_spec(GPU_CLUSTER, {"gpus_per_node": 1}), stats)["peak_tflops"] == 989.0
    assert metrics_of(make_spec(GPU_CLUSTER, {"gpus_per_node": 1}))["peak_tflops"] == 989.0


def test_gpu_cap_from_stats_else_from_the_log():
    spec = make_spec(GPU_CLUSTER, {"gpus_per_node": 1, "gpu_mem_gb": 40})
    stats = {
        0: RankStats(rank=0, local_rank=0, world_size=1, host="h", pid=1, gpu_mem_cap_gib=40.0)
    }
    died = {"rank0.log": f"{contracts.GPU_CAP_LOG_PREFIX}40.00 GiB of 139.80 GiB\nTraceback"}
    assert metrics_of(spec, stats)["gpu_mem_cap_gib"] == 40.0
    assert metrics_of(spec, logs=died, steps=(), outcome_="gpu_oom")["gpu_mem_cap_gib"] == 40.0
    assert metrics_of(spec)["gpu_mem_cap_gib"] is None
    # the harness' cap rule: below the cluster's card only, and smaller than the device
    assert probes.gpu_cap_bytes(spec, 150 * 2**30) == 40 * 2**30
    assert probes.gpu_cap_bytes(make_spec(GPU_CLUSTER, {"gpu_mem_gb": 141}), 150 * 2**30) is None


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
def test_a_peak_between_two_samples_still_counts():
    """The model built on the host and moved to the GPU within one sampling interval: the
    tree's peak holds it (the rank's high-water mark), though no sample saw it."""
    sampler = probes.HostMemorySampler(interval_s=3600).start()
    time.sleep(0.2)  # the thread's first sample, before the build
    before = sampler.own_peak  # this process alone: the tree holds what else pytest runs
    built = b"\x01" * (300 * 2**20)  # every page written
    del built
    recorded = sampler.stop()
    # (a few MiB of slack: pages of this process freed between the first sample and the build)
    assert recorded["host_peak_tree_bytes"] >= before + 290 * 2**20
