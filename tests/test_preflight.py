"""The op preflight on DeepSpeed's real op builders, the plan refusing a study before anything
trains, and op_build_error (with its fix) from failures captured for real (fixtures/op_build/)."""

from __future__ import annotations

import ctypes.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CLUSTER_DIR, SMALL_LLAMA, make_spec

from offload_study.admission import ops, preflight
from offload_study.core.contracts import RecordDir, read_json
from offload_study.planning.plan import Plan, write_scenario_files
from offload_study.training import logparse, outcome
from offload_study.training.supervise import Supervision

FIXTURES = Path(__file__).parent / "fixtures" / "op_build"
HOST = socket.gethostname()
LIBAIO_FIX = "fix: apt-get install libaio-dev (or conda install libaio"
SYSTEM_HAS_LIBAIO = bool(ctypes.util.find_library("aio")) and Path("/usr/include/libaio.h").exists()


def hide_libaio(tmp_path: Path) -> str:
    """LDFLAGS under which -laio finds an empty linker script first: io_submit stays undefined,
    as on a machine without libaio-dev, whether or not this one has it."""
    shadow = tmp_path / "no-libaio"
    shadow.mkdir(exist_ok=True)
    (shadow / "libaio.so").write_text("/* shadows the real libaio */\nINPUT()\n")
    return f"-L{shadow} {os.environ.get('LDFLAGS', '')}".strip()


def failing_ninja(tmp_path: Path) -> str:
    """PATH whose first ninja fails, as torch sees a missing one (it runs `ninja --version`)."""
    folder = tmp_path / "bad-ninja"
    folder.mkdir(exist_ok=True)
    (folder / "ninja").write_text("#!/bin/sh\nexit 127\n")
    (folder / "ninja").chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


# --------------------------------------------------------------------------- which ops
@pytest.mark.parametrize(
    "cluster,opt,param,expected",
    [
        ("local-cpu", "none", "none", ["shm_comm", "fused_adam"]),
        ("local-cpu", "cpu", "cpu", ["shm_comm", "cpu_adam"]),
        ("local-cpu", "none", "cpu", ["shm_comm", "fused_adam"]),
        ("local-cpu", "nvme", "nvme", ["shm_comm", "cpu_adam", "pin_memory", "async_io"]),
        ("local-cpu", "none", "nvme", ["shm_comm", "fused_adam", "pin_memory", "async_io"]),
        ("h200-1gpu", "none", "none", ["fused_adam"]),
        ("h200-1gpu", "cpu", "none", ["cpu_adam"]),
        ("h200-1gpu", "nvme", "none", ["cpu_adam", "pin_memory", "async_io"]),
    ],
)
def test_ops_needed_follow_deepspeeds_choices(tmp_path, cluster, opt, param, expected):
    nvme = str(tmp_path) if "nvme" in (opt, param) else None
    spec = make_spec(cluster, {"offload_optimizer": opt, "offload_param": param, "nvme_path": nvme})
    assert preflight.ops_needed(spec) == expected


# --------------------------------------------------------------------------- real op builders
def test_async_io_without_libaio_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LDFLAGS", hide_libaio(tmp_path))
    verdict = preflight.check_op("async_io", "cpu")
    assert verdict.missing == "libaio"
    line = preflight.refusal_line("nvme-opt-param", verdict, HOST)
    assert line == (
        f"scenario nvme-opt-param: DeepSpeed op async_io cannot be built on {HOST}: libaio not "
        f"found (a test program does not link with -laio) — fix: {ops.FIXES['libaio']}, then "
        "python -m offload_study.admission.ops --accelerator cpu async_io"
    )
    assert "\n" not in line


@pytest.mark.skipif(not SYSTEM_HAS_LIBAIO, reason="libaio-dev is not installed here")
def test_async_io_with_libaio_passes():
    assert preflight.check_op("async_io", "cpu").missing is None


def test_missing_ninja_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", failing_ninja(tmp_path))
    verdict = preflight.check_op("cpu_adam", "cpu")
    assert (verdict.missing, verdict.detail) == ("ninja", "ninja not found")


def test_a_compiler_is_needed_only_for_an_op_not_built_yet(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    verdict = preflight.check_op("cpu_adam", "cpu")
    assert verdict.missing == "compiler" and "no-such-c++" in verdict.detail
    built = tmp_path / "ext" / "cpu_adam" / "cpu_adam.so"  # what torch leaves after a build
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    assert preflight.check_op("cpu_adam", "cpu") == preflight.OpVerdict("cpu_adam", "cpu")


def test_an_unbuilt_op_is_a_note_not_a_refusal(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    result = preflight.check_runs([make_spec("local-cpu", {"offload_optimizer": "cpu"})])
    assert result.refusals == {}
    assert result.notes == [
        f"DeepSpeed ops not built yet on {HOST}: shm_comm, cpu_adam; each compiles in the first "
        "run that needs it (to build them now: python -m offload_study.admission.ops --accelerator cpu "
        "shm_comm cpu_adam)"
    ]


@pytest.mark.parametrize(
    "arch_list,missing",
    [
        ("9.0a", "cuda_arch"),
        ("8.0;9.0a", "cuda_arch"),
        ("9.0", "cuda_home"),
        ("9.0+PTX", "cuda_home"),
    ],
)
def test_cuda_builders_check_the_arch_list_then_cuda_home(monkeypatch, arch_list, missing):
    """DeepSpeed's CUDA FusedAdamBuilder, here where torch has no CUDA (so no CUDA_HOME)."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    assert preflight.check_op("fused_adam", "cuda").missing == missing


@pytest.mark.skipif(preflight.machine_can_check("cuda"), reason="this machine has a CUDA device")
def test_a_cpu_machine_skips_a_cuda_clusters_ops_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setenv("LDFLAGS", hide_libaio(tmp_path))  # would refuse, were it checked
    spec = make_spec("h200-1gpu", {"offload_optimizer": "nvme", "nvme_path": str(tmp_path)})
    result = preflight.check_runs([spec])
    assert result.refusals == {}
    assert result.notes == [
        f"preflight skipped for cuda runs: {HOST} has no CUDA device to check their ops on; "
        "the runner checks them where they train"
    ]


# --------------------------------------------------------------------------- plan -> runner
def write_study(tmp_path: Path, mode: str) -> tuple[Path, list[str]]:
    """A planned two-scenario study (plan summary + configs/) under tmp_path, as the rules do."""
    scenario = {"gpus_per_node": 1, "gpu_mem_gb": 40, "cpu_mem_gb": 64}
    plan = Plan(
        {
            "study": "preflight",
            "cluster": "local-cpu",
            "preflight": mode,
            "model": {"config": dict(SMALL_LLAMA)},
            "seq_len": 64,
            "micro_batch": 2,
            "global_batch": 4,
            "gradient_checkpointing": False,
            "steps": 2,
            "warmup_steps": 1,
            "scenarios": [
                {"name": "zero3", **scenario},
                {
                    "name": "nvme-opt-param",
                    "offload_optimizer": "nvme",
                    "offload_param": "nvme",
                    "nvme_path": str(tmp_path / "nvme"),
                    **scenario,
                },
            ],
        },
        cluster_dir=CLUSTER_DIR,
    )
    specs = []
    for name in plan.scenarios:  # the paths of plan.json, under tmp_path (the runs' cwd)
        spec_path = f"{plan.results_dir}/configs/{name}.run.json"
        ds_path = str(tmp_path / plan.ds_config_path(name))
        write_scenario_files(plan.run_spec(name), ds_path, str(tmp_path / spec_path))
        specs.append(spec_path)
    summary = tmp_path / plan.results_dir / "plan.unchecked.json"
    summary.write_text(json.dumps(plan.summary()))
    return summary, specs


def run_module(tmp_path: Path, module: str, *args: str, **env: str):
    cmd = [sys.executable, "-m", f"offload_study.{module}", *args]
    return subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


def test_plan_refuses_a_study_whose_op_cannot_be_built(tmp_path):
    summary, specs = write_study(tmp_path, "refuse")
    out = summary.with_name("plan.json")
    res = run_module(
        tmp_path,
        "admission.admit",
        "--plan-json",
        str(summary),
        "--out",
        str(out),
        *specs,
        LDFLAGS=hide_libaio(tmp_path),
    )
    assert res.returncode == 1, res.stderr
    refused = [ln for ln in res.stderr.splitlines() if ln.startswith("scenario ")]
    assert refused == [
        f"scenario nvme-opt-param: DeepSpeed op async_io cannot be built on {HOST}: libaio not "
        f"found (a test program does not link with -laio) — {ops.remedy('libaio', 'async_io', 'cpu')}"
    ]
    assert "preflight: warn" in res.stderr and "compute nodes may differ" in res.stderr
    assert not out.exists()  # no plan.json: no train rule can start


def test_warn_plans_it_and_the_runner_records_op_build_error_unlaunched(tmp_path):
    summary, specs = write_study(tmp_path, "warn")
    out = summary.with_name("plan.json")
    hidden = hide_libaio(tmp_path)
    res = run_module(
        tmp_path,
        "admission.admit",
        "--plan-json",
        str(summary),
        "--out",
        str(out),
        *specs,
        LDFLAGS=hidden,
    )
    assert res.returncode == 0, res.stderr
    checked = read_json(out)["preflight"]
    assert checked["mode"] == "warn" and list(checked["refusals"]) == ["nvme-opt-param"]
    outdir = tmp_path / "rep0"
    nvme_spec = next(s for s in specs if "nvme" in s)
    res = run_module(
        tmp_path,
        "training.runner",
        "--spec",
        nvme_spec,
        "--repeat",
        "0",
        "--outdir",
        str(outdir),
        LDFLAGS=hidden,
    )
    assert res.returncode == 0, res.stderr
    metrics = read_json(outdir / "metrics.json")
    assert metrics["outcome"] == "op_build_error"
    assert metrics["error_excerpt"].startswith(ops.remedy("libaio", "async_io", "cpu") + "\n")
    assert sorted(p.name for p in RecordDir(outdir).logs.iterdir()) == ["launcher.log"]
    assert "not launched: scenario nvme-opt-param" in RecordDir(outdir).launcher_log.read_text()


# --------------------------------------------------------------------------- outcome table
OPS_CLI = "python -m offload_study.admission.ops"
CAPTURED = [  # folder, ranks, the excerpt's first line
    ("async_io_libaio_hidden", 2, ops.remedy("libaio", "async_io")),
    ("ninja_missing", 1, f"fix: {ops.FIXES['ninja']}, then {OPS_CLI} deepspeed_shm_comm"),
    ("compiler_missing", 1, ops.remedy("compiler")),
    ("fused_adam_arch_list", 1, ops.remedy("cuda_arch")),
    ("cuda_home_missing", 1, ops.remedy("cuda_home")),
    ("ds_report_libaio_hidden", 1, ops.remedy("libaio", "async_io")),
]


@pytest.mark.parametrize("folder,world,fix", CAPTURED, ids=[c[0] for c in CAPTURED])
def test_captured_op_failures_are_op_build_error_with_the_fix_first(folder, world, fix):
    logs = {p.name: p.read_text() for p in sorted((FIXTURES / folder).glob("*.log"))}
    evidence = outcome.Evidence(Supervision(rc=1), logs, {}, [], world, None)
    verdict, excerpt = outcome.decide(evidence)
    assert verdict == "op_build_error"
    assert excerpt.splitlines()[0] == fix
    assert len(excerpt.splitlines()) > 1  # the log lines follow the fix


def test_the_runners_refusal_is_a_value_not_its_logged_line(tmp_path, monkeypatch):
    """The runner's gate records the refusal as Supervision values (outcome, fix) that the
    outcome reads; the refusal line in the launcher log alone decides nothing."""
    monkeypatch.setenv("LDFLAGS", hide_libaio(tmp_path))
    spec = make_spec(
        "local-cpu",
        {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(tmp_path)},
    )
    checked = preflight.check_runs([spec])
    fix = ops.remedy("libaio", "async_io", "cpu")
    assert checked.fixes == {spec.scenario: fix} and "fixes" not in checked.to_dict()
    logged = {"launcher.log": checked.refusals[spec.scenario]}
    as_text = outcome.Evidence(Supervision(rc=None), logged, {}, [], 1, None)
    assert outcome.decide(as_text)[0] == "error"
    refused = Supervision(rc=None, killed="op_build_error", detail=fix)
    got, excerpt = outcome.decide(outcome.Evidence(refused, logged, {}, [], 1, None))
    assert got == "op_build_error"
    assert excerpt == f"{fix}\n{logged['launcher.log']}"


def test_the_arch_list_remedy_names_the_value_to_set():
    text = (FIXTURES / "fused_adam_arch_list" / "rank0.log").read_text()
    assert "TORCH_CUDA_ARCH_LIST=9.0" in logparse.classify(text).remedy


def test_every_remedy_is_a_fix_line():
    remedies = [r for _, _, r in logparse.OUTCOME_PATTERNS if r]
    assert remedies and all(r.startswith("fix: ") for r in remedies)
    assert all(o == "op_build_error" for o, _, r in logparse.OUTCOME_PATTERNS if r)


def test_the_ops_cli_builds_the_op_a_remedy_names():
    """A remedy quotes DeepSpeed's op name (deepspeed_shm_comm): the ops command takes it."""
    res = subprocess.run(
        [sys.executable, "-m", "offload_study.admission.ops", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and "deepspeed_shm_comm" in res.stdout
    assert ops.our_name("deepspeed_shm_comm") == "shm_comm"
