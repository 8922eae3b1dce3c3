"""Real DeepSpeed ZeRO-3 runs on CPU through the runner (slow) + record helpers (fast)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from offload_study import runner

SCHEMA = json.loads(runner.SCHEMA_PATH.read_text())
TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
    "max_position_embeddings": 128,
}  # fmt: skip


def make_run(tmp_path: Path, offload_optimizer="none", offload_param="none", world=1, **over):
    """Write a run spec (docs/design.md) + DeepSpeed config; return (spec_path, outdir, spec).

    Small stand-in for offload_study.plan. ``ds_over`` (dict) is merged into the DS config.
    """
    ds_over = over.pop("ds_over", {})
    model_over = over.pop("model_over", {})
    mb, gas = 2, 2
    nvme = "nvme" in (offload_optimizer, offload_param)
    scenario = f"z3-{offload_optimizer}-{offload_param}-w{world}"
    cfg = dict(TINY_LLAMA, **model_over)
    if nvme:  # big enough that partitions pass DeepSpeed's 1 MiB min_aio_bytes and are swapped
        cfg["vocab_size"] = 8192
    spec = {
        "schema_version": 1, "study": "test", "cluster": "local-cpu", "scenario": scenario,
        "base_scenario": scenario, "label": "ZeRO-3 <test>", "sweep": {},
        "model": {"source": "config", "preset": "tiny-llama", "config": cfg, "name_or_path": None},
        "seq_len": 64, "dtype": "bf16", "micro_batch": mb, "gradient_accumulation_steps": gas,
        "global_batch": mb * gas * world, "gradient_checkpointing": False,
        "steps": 3, "warmup_steps": 1, "seed": 1234,
        "data": {"kind": "synthetic", "token_file": None},
        "optimizer": {"type": "AdamW", "lr": 1e-4, "weight_decay": 0.0},
        "nodes": 1, "gpus_per_node": world, "world_size": world, "accelerator": "cpu",
        "gpu_mem_gb": 40, "cpu_mem_gb": 64,
        "offload_optimizer": offload_optimizer, "offload_param": offload_param,
        "nvme_path": str(tmp_path / "nvme") if nvme else None,
        "timeout_s": 300, "step_timeout_s": None, "strict": False,
        "ds_config": str(tmp_path / f"{scenario}.json"),
    }  # fmt: skip
    spec.update(over)
    zero = {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e8,
    }  # fmt: skip
    for key, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if dev != "none":
            zero[key] = {"device": dev, "pin_memory": True}
            if dev == "nvme":
                zero[key]["nvme_path"] = spec["nvme_path"]
    ds = {
        "train_batch_size": spec["global_batch"], "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
        "wall_clock_breakdown": True, "steps_per_print": 1,
    }  # fmt: skip
    if nvme:
        ds["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                     "single_submit": False, "overlap_events": True}  # fmt: skip
    for k, v in ds_over.items():
        if isinstance(v, dict) and isinstance(ds.get(k), dict):
            ds[k].update(v)
        else:
            ds[k] = v
    Path(spec["ds_config"]).write_text(json.dumps(ds, indent=2))
    spec_path = tmp_path / f"{scenario}.run.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    outdir = tmp_path / "results" / "local-cpu" / "test" / scenario / "rep0"
    return spec_path, outdir, spec


def run_runner(spec_path, outdir, timeout=300):
    cmd = [sys.executable, "-m", "offload_study.runner", "--spec", str(spec_path),
           "--repeat", "0", "--outdir", str(outdir)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def load_record(outdir: Path) -> dict:
    assert outdir.is_dir(), f"no record at {outdir}"
    assert not list(outdir.parent.glob("rep0.tmp-*")), "temporary record left behind"
    for name in ("metrics.json", "steps.csv", "provenance.json", "logs/launcher.log"):
        assert (outdir / name).is_file(), name
    m = json.loads((outdir / "metrics.json").read_text())
    jsonschema.validate(m, SCHEMA)
    archived = list((outdir.parents[1] / "archive" / outdir.parent.name / "rep0").glob("*"))
    assert len(archived) == 1 and (archived[0] / "metrics.json").is_file()
    return m


# --------------------------------------------------------------------------- real runs
MODES = [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("opt,param", MODES, ids=["-".join(m) for m in MODES])
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
    assert m["peak_gpu_allocated_gib"] is None and m["mfu"] is None
    bd = m["breakdown_ms"]
    assert bd["forward"] > 0 and bd["backward"] > 0 and bd["step"] >= 0
    for r in range(world):
        assert (outdir / "logs" / f"rank{r}.log").stat().st_size > 0
    steps = (outdir / "steps.csv").read_text().splitlines()
    assert steps[0] == "step,phase,step_time_s,tokens_per_s,samples_per_s,loss"
    assert [s.split(",")[1] for s in steps[1:]] == ["warmup"] + ["measured"] * 3
    prov = json.loads((outdir / "provenance.json").read_text())
    assert prov["deepspeed_version"] and prov["rendezvous_port"] > 0
    assert prov["ds_config_sha256"] == m["ds_config_sha256"]
    assert "torch.distributed.run" in prov["launch_command"]
    assert prov["launch_env"]["DS_ACCELERATOR"] == "cpu"
    if opt == "nvme":
        assert m["nvme_bytes_used"] > 1_000_000
        assert bd["optimizer_swap_in"] is not None and bd["optimizer_swap_out"] is not None
        assert os.listdir(spec["nvme_path"]) == [], "NVMe swap files not cleaned"
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


@pytest.mark.slow
def test_host_oom(tmp_path):
    spec_path, outdir, _ = make_run(tmp_path, cpu_mem_gb=0.15)
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "host_oom"
    assert "host memory budget exceeded" in m["error_excerpt"]


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
    cmd = [sys.executable, "-m", "offload_study.runner", "--spec", str(spec_path),
           "--repeat", "0", "--outdir", str(outdir)]  # fmt: skip
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
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    m = load_record(outdir)
    assert m["outcome"] == "cancelled"
    assert m["steps_measured"] >= 1  # partial measurements are kept
    # no rank survives the cancel
    ps = subprocess.run(["pgrep", "-f", str(outdir)], capture_output=True, text=True)
    assert ps.stdout.strip() == ""


# --------------------------------------------------------------------------- fast helpers
def test_allowed_env_drops_secrets():
    env = {"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO", "HF_TOKEN": "x", "NCCL_API_KEY": "y",
           "SLURM_JOB_ID": "12", "AWS_SECRET_ACCESS_KEY": "z", "HOME": "/root"}  # fmt: skip
    got = runner.allowed_env(env)
    assert got == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "SLURM_JOB_ID": "12"}


def test_archive_dir(tmp_path):
    out = tmp_path / "results" / "c" / "s" / "scen" / "rep3"
    d = runner.archive_dir(out, {"scenario": "scen"}, 3, "2026-11-29T10:51:14Z", "ab" * 32)
    assert d == (tmp_path / "results/c/s/archive/scen/rep3/20261129T105114Z-abababab").resolve()


def test_percentile():
    assert runner.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert runner.percentile([1.0, 2.0], 0.1) == pytest.approx(1.1)


@pytest.mark.slow
def test_token_file_and_gradient_checkpointing(tmp_path):
    """A token file instead of synthetic tokens, with activation checkpointing on."""
    import numpy as np

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 512, size=20_000, dtype=np.int32))
    spec_path, outdir, _ = make_run(
        tmp_path,
        data={"kind": "token_file", "token_file": str(tokens)},
        gradient_checkpointing=True,
    )
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "ok", m["error_excerpt"]
    assert m["gradient_checkpointing"] is True
    assert f"tokens from {tokens}: 20000 ids" in (outdir / "logs" / "rank0.log").read_text()
    assert math.isfinite(m["loss_last"]) and m["tokens_per_s"] > 0
