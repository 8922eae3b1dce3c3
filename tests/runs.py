"""Real runs of the runner for the tests: a one-scenario study planned and written as the plan
rules do (``make_run``), the runner started as the train rule starts it (``run_runner``), and
the record it leaves read back and checked against its schemas (``load_record``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
from conftest import REPO, SMALL_LLAMA, make_spec

from offload_study.core import contracts
from offload_study.core.contracts import read_run_spec
from offload_study.planning.plan import write_scenario_files

NVME_AIO = {
    "block_size": 1048576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}


@contextlib.contextmanager
def tmpfs(mount: Path, size: str):
    """A real tmpfs of ``size`` (mount's -o size=, e.g. "256k") mounted at ``mount`` for the
    block: a small disk the test fills. Needs root (.ci/run runs the tests as root)."""
    mount.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        import pytest

        pytest.fail("mounting a tiny tmpfs needs root (as .ci/run runs the tests)", pytrace=False)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def make_run(
    tmp_path: Path,
    offload_optimizer="none",
    offload_param="none",
    world=1,
    *,
    ds_over=None,
    scenario=None,
    **study,
):
    """Plan a one-scenario study (conftest.make_spec) and write its run spec + DeepSpeed config
    as the plan rules do; return (spec_path, outdir, spec).

    ``scenario``/``study`` keys go into the study; ``ds_over`` (dict) is merged into the written
    DeepSpeed config afterwards (a config DeepSpeed refuses at run time).
    """
    nvme = "nvme" in (offload_optimizer, offload_param)
    name = f"z3-{offload_optimizer}-{offload_param}-w{world}"
    # NVMe: big enough that partitions pass DeepSpeed's 1 MiB min_aio_bytes and are swapped
    model = dict(SMALL_LLAMA, vocab_size=8192) if nvme else SMALL_LLAMA
    scenario = {
        "name": name,
        "gpus_per_node": world,
        "gpu_mem_gb": 40,
        "cpu_mem_gb": 64,
        "offload_optimizer": offload_optimizer,
        "offload_param": offload_param,
        "nvme_path": str(tmp_path / "nvme") if nvme else None,
        **(scenario or {}),
    }
    study = {"model": {"config": model}, "aio": NVME_AIO if nvme else {}, **study}
    spec_path, ds_path = tmp_path / f"{name}.run.json", tmp_path / f"{name}.json"
    write_scenario_files(make_spec("local-cpu", scenario, **study), str(ds_path), str(spec_path))
    ds = contracts.read_json(ds_path)
    for k, v in (ds_over or {}).items():
        if isinstance(v, dict) and isinstance(ds.get(k), dict):
            ds[k].update(v)
        else:
            ds[k] = v
    contracts.write_json(ds_path, ds)
    outdir = tmp_path / "results" / "local-cpu" / "test" / name / "rep0"
    return spec_path, outdir, read_run_spec(spec_path)


#: Seconds a test waits for a runner beyond the run's own time limit. The runner ends a run at
#: that limit itself and records it (outcome timeout, with what the run was doing); this clock
#: only stops a runner that hangs, and leaves room for a busy machine.
RUNNER_GRACE_S = 300


def runner_timeout(spec_path) -> float:
    """How long a test waits for the runner of ``spec_path``: its job's limit plus the grace."""
    return read_run_spec(spec_path).job_timeout_s + RUNNER_GRACE_S


def runner_argv(spec_path, outdir) -> list[str]:
    """The command that runs one record of a run spec, as the workflow's train rule does."""
    return [
        sys.executable,
        "-m",
        "offload_study.training.runner",
        "--spec",
        str(spec_path),
        "--repeat",
        "0",
        "--outdir",
        str(outdir),
    ]


def run_runner(spec_path, outdir):
    return subprocess.run(
        runner_argv(spec_path, outdir),
        capture_output=True,
        text=True,
        timeout=runner_timeout(spec_path),
    )


def load_record(outdir: Path) -> dict:
    assert outdir.is_dir(), f"no record at {outdir}"
    assert not list(outdir.parent.glob("rep0.tmp-*")), "temporary record left behind"
    for name in ("metrics.json", "steps.csv", "provenance.json", "logs/launcher.log"):
        assert (outdir / name).is_file(), name
    m = json.loads((outdir / "metrics.json").read_text())
    jsonschema.validate(m, contracts.metrics_schema())
    prov = json.loads((outdir / "provenance.json").read_text())
    jsonschema.validate(prov, contracts.provenance_schema())
    assert prov["schema_problems"] == []
    # written in the schema's order (a reader of the JSON sees the fields as the schema lists them)
    assert [k for k in prov if k in contracts.PROVENANCE_FIELDS] == contracts.PROVENANCE_FIELDS
    archived = list((outdir.parents[1] / "archive" / outdir.parent.name / "rep0").glob("*"))
    assert len(archived) == 1 and (archived[0] / "metrics.json").is_file()
    return m


SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def snakemake(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The workflow run as a user runs it, from the checkout (or ``cwd``)."""
    return subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
