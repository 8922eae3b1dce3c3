"""provenance.json of one run (schema: ``schemas/provenance.schema.json``): where and with what.

Environment variables come only from an allowlist, never ones whose names look secret; every
text of the record is scrubbed (:func:`scrub`) of URL credentials and access tokens, so a
bundle (provenance travels between clusters) never carries a secret.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
from importlib import metadata
from pathlib import Path

from offload_study import engines
from offload_study.core import devices
from offload_study.core.contracts import (
    RankStats,
    RunSpec,
    provenance_schema,
    schema_problems,
    sha256_file,
)
from offload_study.training.launch import Launch
from offload_study.training.supervise import Supervision

REPO_ROOT = Path(__file__).resolve().parents[3]
# environment recorded in provenance: allowlist (names or prefixes), minus anything secret-looking
ENV_ALLOW = [
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_EXTENSIONS_DIR",
    "TORCH_CUDA_ARCH_LIST",
    "LD_LIBRARY_PATH",
    "HOSTNAME",
    "NCCL_",
    "DS_",
    "TORCH_NCCL_",
    "TORCH_SYMM_MEM_",
    "NVSHMEM_",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_GPUS",
    "SLURM_CPUS_ON_NODE",
    "SLURM_JOB_PARTITION",
    "SLURM_NNODES",
    "SLURM_GPUS_ON_NODE",
    "SLURM_CLUSTER_NAME",
]
SECRET_RX = re.compile(
    r"TOKEN|KEY|SECRET|PASS|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|CERT", re.IGNORECASE
)


#: user:password@ in a URL (https://user:pw@host/...), and access tokens that appear in
#: command lines or values (Hugging Face hf_..., GitHub ghp_/gho_/github_pat_..., AWS AKIA...)
URL_CREDENTIALS_RX = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
TOKEN_RX = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|AKIA[A-Z0-9]{16})\b"
)
REDACTED = "<redacted>"


def is_secret_name(name: str) -> bool:
    return bool(SECRET_RX.search(name))


def scrub(value):
    """``value`` with credentials removed from every text in it: a mapping's secret-named keys
    dropped (environments), URL credentials and tokens replaced by <redacted>."""
    if isinstance(value, str):
        value = URL_CREDENTIALS_RX.sub(rf"\g<scheme>{REDACTED}@", value)
        return TOKEN_RX.sub(REDACTED, value)
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items() if not is_secret_name(str(k))}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


def allowed_env(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    out = {}
    for name, value in environ.items():
        if is_secret_name(name):
            continue
        if any(name == a or (a.endswith("_") and name.startswith(a)) for a in ENV_ALLOW):
            out[name] = value
    return dict(sorted(out.items()))


def pkg_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


#: Written by ``git archive`` (.gitattributes: export-subst): the commit a source tree without
#: its own ``.git`` was exported from; in a checkout it holds the unexpanded placeholder.
SOURCE_COMMIT = Path(__file__).parents[1] / "SOURCE_COMMIT"


def engine_versions(spec: RunSpec, first_stat) -> dict:
    """torch_version, deepspeed_version, engine, engine_version of a record (metrics and
    provenance), as the run's engine says (``first_stat``: a rank stat by name)."""
    torch_version = first_stat("torch_version") or pkg_version("torch")
    versions = engines.of(spec).versions(first_stat)
    return {"torch_version": torch_version, "engine": spec.engine, **versions}


def _git(path: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def exported_commit(source_commit: Path = SOURCE_COMMIT) -> str | None:
    """The commit ``git archive`` wrote into ``source_commit``; None in a checkout."""
    try:
        text = source_commit.read_text().strip()
    except OSError:
        return None
    return text if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else None


#: What a checkout holds besides the code that runs: a user's studies, clusters and
#: calibrations, the pages the studies render, the docs. Changed or new files there leave the
#: code a run ran as its commit holds it (the run's own inputs are in its run spec).
NOT_CODE = ("config", "reports", "docs")


def git_commit(path: Path, source_commit: Path = SOURCE_COMMIT) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the source tree at ``path``, dirty when its code differs from the
    commit (:data:`NOT_CODE` aside). Only a repository whose top level is
    ``path`` counts: a tree exported by ``git archive`` into another repository's folder (a copy
    sent to a cluster or a device) would otherwise report that repository's HEAD. Such a tree
    names its commit in :data:`SOURCE_COMMIT` (whether it was edited since: unknown, None)."""
    top = _git(path, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(path).resolve():
        return exported_commit(source_commit), None
    code = [".", *(f":(exclude){folder}" for folder in NOT_CODE)]
    head, status = _git(path, "rev-parse", "HEAD"), _git(path, "status", "--porcelain", "--", *code)
    return head, (bool(status) if status is not None else None)


def gpu_info() -> dict:
    info = {"gpu_model": None, "gpu_count": 0, "gpu_driver": None, "gpus": []}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML here
        return info
    try:
        drv = pynvml.nvmlSystemGetDriverVersion()
        info["gpu_driver"] = drv.decode() if isinstance(drv, bytes) else drv
        n = pynvml.nvmlDeviceGetCount()
        info["gpu_count"] = n
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            info["gpus"].append({"index": i, "name": name, "memory_total_bytes": int(mem)})
        if info["gpus"]:
            info["gpu_model"] = info["gpus"][0]["name"]
    except Exception as e:  # noqa: BLE001
        info["nvml_error"] = str(e)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return info


#: Linux's id of the current boot: a new one at every boot, different on every machine.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID) -> str | None:
    """The boot id of this host (None where unreadable: not Linux). Runs with the same boot id
    ran on one machine, so collect pairs repeats only within one (hostnames do not tell: a
    cloud lease is "vm" on every machine)."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _host_facts(cores: int) -> dict:
    import psutil

    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": devices.cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cores_granted": cores,
        "ram_total_bytes": int(psutil.virtual_memory().total),
    }


def rank_threads(stats: dict[int, RankStats]) -> list[dict]:
    """Each rank's cores and threads as it saw them once its engine was built (the fields the
    schema's rank_threads names, read from its stats: probes.cores_and_threads)."""
    fields = provenance_schema()["properties"]["rank_threads"]["items"]["properties"]
    return [{key: getattr(s, key) for key in fields} for _, s in sorted(stats.items())]


def provenance(
    spec: RunSpec,
    launch: Launch | None,
    stats: dict[int, RankStats],
    cores: int,
    supervision: Supervision,
    run_id: str,
) -> dict:
    """The provenance.json record, scrubbed of secrets (``schema_problems`` is the caller's to
    fill in)."""
    commit, dirty = git_commit(REPO_ROOT)
    rank0 = stats.get(0)
    config = spec.ds_config
    return scrub(
        {
            "host": socket.gethostname(),
            "boot_id": boot_id(),
            "hosts": sorted({s.host for s in stats.values() if s.host}),
            **gpu_info(),
            "cuda_version": rank0.cuda_version if rank0 else None,
            **engine_versions(spec, lambda name: getattr(rank0, name, None)),
            "transformers_version": pkg_version("transformers"),
            **_host_facts(cores),
            "rank_threads": rank_threads(stats),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_job_nodelist": os.environ.get("SLURM_JOB_NODELIST"),
            "slurm_job_gpus": os.environ.get("SLURM_JOB_GPUS"),
            "slurm_cpus_on_node": os.environ.get("SLURM_CPUS_ON_NODE"),
            "git_commit": commit,
            "git_dirty": dirty,
            "ds_config": str(config) if config else None,
            "ds_config_sha256": sha256_file(config, missing_ok=True) if config else None,
            "launch_command": launch.command_line if launch else None,
            "launch_env": launch.env if launch else None,
            "rendezvous_host": launch.rdzv_host if launch else None,
            "rendezvous_port": launch.port if launch else None,
            "environment": allowed_env(),
            "runner_exit_code_of_launcher": supervision.rc,
            "runner_peak_tree_rss_bytes": supervision.peak_tree_rss,
            "run_id": run_id,
            "schema_problems": [],
        }
    )


def provenance_problems(record: dict) -> list[str]:
    return schema_problems(record, provenance_schema())
