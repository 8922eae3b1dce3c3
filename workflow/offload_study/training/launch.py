"""Launch command lines and environment for one training run (pure functions + port helpers).

Single node::

    torchrun --nnodes 1 --nproc_per_node N --master_addr 127.0.0.1 --master_port P \\
        -m offload_study.training.harness --spec RUN.json --out DIR --run-id ID

Multi-node (nodes > 1, inside a SLURM allocation)::

    srun --nodes N --ntasks N --ntasks-per-node 1 --overlap torchrun --nnodes N \\
        --nproc_per_node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m offload_study.training.harness ...

HOST is the first host of ``SLURM_JOB_NODELIST`` (``scontrol show hostnames``), PORT is derived
from ``SLURM_JOB_ID`` so all nodes agree without talking to each other. The runner itself runs
inside a job step (Snakemake's SLURM executor starts it with ``srun -n1``), whose environment
says ``SLURM_NTASKS=1`` and whose step holds the job's resources: so ``--ntasks N`` (else srun
shrinks to one node) and ``--overlap`` (else the new step waits for the runner's to end).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from offload_study.core.contracts import RunSpec
from offload_study.core.devices import (
    free_port,  # the one free-port helper (core: calibration uses it too)
)

# Always exported into the launched environment (NVLink multicast/NVLS off: see device notes).
FIXED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
PORT_BASE, PORT_SPAN = 20000, 20000  # SLURM-derived ports fall in [20000, 40000)
#: What a multi-node srun keeps of the SLURM variables around it. The runner runs in a job step
#: whose variables describe that step (one node, one task; SLURM_JOB_NODELIST even names only
#: the step's node when Snakemake's SLURM executor started it): srun then refuses a 2-node step
#: ("Only allocated 1 nodes asked for 2"). With the job's identity only, srun asks the
#: controller for the allocation (as the executor plugin does for its own srun).
SLURM_KEEP = frozenset(
    {
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_CONF",
        "SLURM_CLUSTER_NAME",
        "SLURM_SUBMIT_DIR",
        "SLURM_SUBMIT_HOST",
    }
)


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]  # variables to set on top of the inherited environment
    port: int
    rdzv_host: str
    nodes: int
    nproc_per_node: int
    extra: dict = field(default_factory=dict)
    drop_env: frozenset[str] = frozenset()  # inherited variables the launcher must not see

    @property
    def command_line(self) -> str:
        return shlex.join(self.argv)

    def environ(self, inherited: Mapping[str, str]) -> dict[str, str]:
        """The launcher's whole environment: the inherited one less drop_env, plus env."""
        return {**{k: v for k, v in inherited.items() if k not in self.drop_env}, **self.env}


#: Each node's torchrun runs under this shell, which prints the node's kernel OOM kills before
#: and after it (``node <host> oom_kill <before> -> <after>``, read by logparse.node_oom_kills):
#: a rank killed on another node is then judged by that node's count, not the runner's. The
#: torchrun's exit status is kept (srun's --kill-on-bad-exit acts on it).
NODE_OOM_WRAPPER = (
    'oom() { awk \'$1 == "oom_kill" {print $2}\' /proc/vmstat; }; b=$(oom); "$@"; rc=$?; '
    'echo "node $(hostname) oom_kill ${b:-?} -> $(oom)"; exit $rc'
)


def slurm_port(job_id: str | int, step: int = 0) -> int:
    """Deterministic rendezvous port from the SLURM job id (same on every node)."""
    return PORT_BASE + (int(job_id) * 7 + step) % PORT_SPAN


def first_slurm_host(nodelist: str, runner=subprocess.run) -> str:
    """First host of a SLURM nodelist expression via ``scontrol show hostnames``."""
    res = runner(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    hosts = res.stdout.split()
    if not hosts:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} gave no hosts")
    return hosts[0]


def threads_per_rank(cores: int, ranks: int) -> int:
    return max(1, int(cores) // max(1, int(ranks)))


def harness_args(spec_path: str, out_dir: str, run_id: str | None = None) -> list[str]:
    args = ["-m", "offload_study.training.harness", "--spec", str(spec_path), "--out", str(out_dir)]
    if run_id:
        args += ["--run-id", str(run_id)]
    return args


def build_env(spec: RunSpec, cores: int) -> dict[str, str]:
    env = dict(FIXED_ENV)
    env["OMP_NUM_THREADS"] = str(threads_per_rank(cores, spec.gpus_per_node))
    if spec.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def build_launch(
    spec: RunSpec,
    spec_path: str,
    out_dir: str,
    *,
    cores: int,
    run_id: str | None = None,
    port: int | None = None,
    environ: Mapping[str, str] | None = None,
    torchrun: str | None = None,
    hostname_resolver=first_slurm_host,
) -> Launch:
    """Command line + env for a run spec. Single node: free local port (or `port`).

    Multi-node needs SLURM_JOB_ID and SLURM_JOB_NODELIST in `environ` (default os.environ).
    """
    environ = os.environ if environ is None else environ
    nodes, g = spec.nodes, spec.gpus_per_node
    torchrun = torchrun or default_torchrun()
    h_args = harness_args(spec_path, out_dir, run_id)
    env = build_env(spec, cores)
    if nodes <= 1:
        port = port or free_port()
        argv = [
            *torchrun,
            "--nnodes", "1",
            "--nproc_per_node", str(g),
            "--master_addr", "127.0.0.1",
            "--master_port", str(port),
            *h_args,
        ]  # fmt: skip
        return Launch(argv, env, port, "127.0.0.1", 1, g)
    job_id = environ.get("SLURM_JOB_ID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise RuntimeError(
            f"nodes={nodes} needs a SLURM allocation (SLURM_JOB_ID/SLURM_JOB_NODELIST unset)"
        )
    host = hostname_resolver(nodelist)
    port = port or slurm_port(job_id)
    argv = [
        "srun", "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1",
        "--overlap", "--kill-on-bad-exit=1",
        "sh", "-c", NODE_OOM_WRAPPER, "node-oom",
        *torchrun,
        "--nnodes", str(nodes),
        "--nproc_per_node", str(g),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{host}:{port}",
        "--rdzv-id", str(job_id),
        *h_args,
    ]  # fmt: skip
    step_env = frozenset(
        k for k in environ if k.startswith(("SLURM_", "SRUN_", "SBATCH_")) and k not in SLURM_KEEP
    )
    return Launch(argv, env, port, host, nodes, g, drop_env=step_env)


def default_torchrun() -> list[str]:
    """`python -m torch.distributed.run` of this interpreter (same venv on every node)."""
    return [sys.executable, "-m", "torch.distributed.run"]
