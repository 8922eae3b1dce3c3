"""Map one training run (run spec) to Snakemake resources for the SLURM executor plugin.

Pure functions, no Snakemake/SLURM import.  The resource names are the ones that
snakemake-executor-plugin-slurm 2.8 turns into sbatch options:

=================  =====================================  ==========================================
key                sbatch option                          when present
=================  =====================================  ==========================================
``nodes``          ``--nodes=N``                          always
``mem_mb``         ``--mem=<MB>`` (per node)              always
``runtime``        ``-t <minutes>``                       always
``cpus_per_task``  ``--cpus-per-task=N``                  always (one task per node)
``tasks``          ``--ntasks=N`` (= nodes)               accelerator cpu only (on GPU jobs the
                                                          plugin would turn it into
                                                          --ntasks-per-gpu)
``gres``           ``--gres=gpu[:<type>]:<gpus/node>``    accelerator cuda only (per-node count,
                                                          so it is right for multi-node jobs too;
                                                          the plugin's ``gpu`` key is a job-wide
                                                          ``--gpus=`` total)
``slurm_partition`` ``-p``                                cluster.slurm.partition set
``slurm_account``  ``-A``                                 cluster.slurm.account set
``qos``            ``--qos=``                             cluster.slurm.qos set
``constraint``     ``-C``                                 cluster.slurm.constraint set
``slurm_extra``    appended verbatim                      cluster.slurm.slurm_extra set
=================  =====================================  ==========================================

For one cluster the key set is the same for every run, so a rule can use
``resources: **resource_callables(spec_for, cluster)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "RUNTIME_MARGIN_MIN",
    "MEM_HEADROOM_MB",
    "check_fits",
    "train_resources",
    "resource_keys",
    "resource_callables",
]

#: minutes added to the run's timeout_s (the harness must time out, and write its record,
#: before SLURM kills the job); at least this, or 10 % of the timeout.
RUNTIME_MARGIN_MIN = 10
#: MB requested on top of the scenario's cpu_mem_gb (launcher, Python, DeepSpeed runtime),
#: dropped (capped at the node's memory) when the node has no room for it.
MEM_HEADROOM_MB = 1024
#: --mem per rank (gpus_per_node) when neither cpu_mem_gb nor mem_gb_per_node is known.
DEFAULT_MEM_MB_PER_RANK = 3072
#: runtime when neither timeout_s nor max_runtime_min is given.
DEFAULT_RUNTIME_MIN = 24 * 60

_GRES_TOKEN_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


# cluster.slurm setting -> the plugin's resource name (passed through when set)
SLURM_SETTING_RESOURCES = (
    ("partition", "slurm_partition"),
    ("account", "slurm_account"),
    ("qos", "qos"),
    ("constraint", "constraint"),
    ("slurm_extra", "slurm_extra"),
)


def _slurm(cluster: dict) -> dict:
    return cluster.get("slurm") or {}


def _name(run_spec: dict) -> str:
    return str(run_spec.get("scenario") or run_spec.get("base_scenario") or "<unnamed>")


def _int(run_spec: dict, key: str, default: int | None = None) -> int:
    val = run_spec.get(key, default)
    if val is None:
        raise ValueError(f"scenario {_name(run_spec)!r}: run spec lacks {key!r}")
    if isinstance(val, bool) or not isinstance(val, (int, float)) or int(val) != val or val < 1:
        raise ValueError(f"scenario {_name(run_spec)!r}: {key}={val!r} must be a positive integer")
    return int(val)


def check_fits(run_spec: dict, cluster: dict) -> None:
    """Raise ValueError (naming the scenario and the key) when the run asks for more than the
    cluster offers: nodes, gpus_per_node, host memory per node, CPU cores per node, or a
    different accelerator."""
    name = _name(run_spec)
    cname = cluster.get("name", "<cluster>")
    nodes = _int(run_spec, "nodes", 1)
    gpn = _int(run_spec, "gpus_per_node")
    world = run_spec.get("world_size")
    problems = []

    acc_c = cluster.get("accelerator")
    acc_r = run_spec.get("accelerator")
    if acc_r is not None and acc_c is not None and acc_r != acc_c:
        problems.append(f"accelerator={acc_r!r} but cluster {cname!r} has accelerator={acc_c!r}")
    c_nodes = cluster.get("nodes", 1) or 1
    if nodes > c_nodes:
        problems.append(f"nodes={nodes} > cluster {cname!r} nodes={c_nodes}")
    c_gpn = cluster.get("gpus_per_node")
    if c_gpn is not None and gpn > c_gpn:
        what = "GPUs" if acc_c == "cuda" else "ranks (gpus_per_node)"
        problems.append(f"gpus_per_node={gpn} > cluster {cname!r} gpus_per_node={c_gpn} ({what})")
    if world is not None and world != nodes * gpn:
        problems.append(f"world_size={world} != nodes*gpus_per_node={nodes * gpn}")
    mem = run_spec.get("cpu_mem_gb")
    c_mem = cluster.get("mem_gb_per_node")
    if mem is not None and c_mem is not None and mem > c_mem:
        problems.append(f"cpu_mem_gb={mem} > cluster {cname!r} mem_gb_per_node={c_mem}")
    cores = cluster.get("cpu_cores_per_node")
    if cores is not None:
        need = _cpus_per_task(run_spec, cluster, cap=False)
        if acc_c != "cuda" and need > cores:
            problems.append(
                f"gpus_per_node={gpn} CPU ranks need {need} cores > cluster {cname!r} "
                f"cpu_cores_per_node={cores}"
            )
        if acc_c == "cuda" and _slurm(cluster).get("cpus_per_gpu") and need > cores:
            problems.append(
                f"gpus_per_node={gpn} x slurm.cpus_per_gpu needs {need} cores > cluster "
                f"{cname!r} cpu_cores_per_node={cores}"
            )
    if problems:
        raise ValueError(
            f"scenario {name!r} does not fit cluster {cname!r}: " + "; ".join(problems)
        )


def _cpus_per_task(run_spec: dict, cluster: dict, cap: bool = True) -> int:
    """CPUs for the one task per node (the launcher and all of its ranks on that node)."""
    gpn = _int(run_spec, "gpus_per_node")
    cores = cluster.get("cpu_cores_per_node")
    per_gpu = _slurm(cluster).get("cpus_per_gpu")
    if cluster.get("accelerator") == "cuda":
        if per_gpu:
            need = per_gpu * gpn
        elif cores and cluster.get("gpus_per_node"):
            # this job's share of the node's cores (its GPUs' fraction of the node)
            need = (cores * gpn) // cluster["gpus_per_node"]
        else:
            need = gpn
    else:
        # CPU accelerator: every rank is a process that needs at least one core
        need = gpn * (per_gpu or 1)
    need = max(1, need)
    if cap and cores:
        need = min(need, cores)
    return need


def _runtime_min(run_spec: dict, cluster: dict) -> int:
    max_rt = _slurm(cluster).get("max_runtime_min")
    timeout_s = run_spec.get("timeout_s")
    if timeout_s is None:
        rt = max_rt or DEFAULT_RUNTIME_MIN
    else:
        base = math.ceil(float(timeout_s) / 60.0)
        rt = base + max(RUNTIME_MARGIN_MIN, math.ceil(0.1 * base))
    if max_rt:
        rt = min(rt, int(max_rt))
    return max(1, int(rt))


def _mem_mb(run_spec: dict, cluster: dict) -> int:
    mem_gb = run_spec.get("cpu_mem_gb")
    c_mem = cluster.get("mem_gb_per_node")
    if mem_gb is None:
        if c_mem is not None:
            return int(c_mem * 1024)  # no budget: the whole node's memory
        # nothing known: a modest request per rank (the node's real size decides the rest)
        return DEFAULT_MEM_MB_PER_RANK * _int(run_spec, "gpus_per_node")
    mb = math.ceil(float(mem_gb) * 1024) + MEM_HEADROOM_MB
    if c_mem is not None:
        mb = min(mb, int(c_mem * 1024))
    return mb


def _gres(run_spec: dict, cluster: dict) -> str:
    gpn = _int(run_spec, "gpus_per_node")
    typ = _slurm(cluster).get("gres_type")
    if typ:
        if not set(typ) <= _GRES_TOKEN_OK:
            raise ValueError(f"cluster slurm.gres_type={typ!r}: only letters, digits, '_' and '.'")
        return f"gpu:{typ}:{gpn}"
    return f"gpu:{gpn}"


def train_resources(run_spec: dict, cluster: dict) -> dict[str, Any]:
    """Snakemake resources (for the slurm executor plugin) of one training run.

    Raises ValueError (see :func:`check_fits`) when the run does not fit the cluster.
    """
    check_fits(run_spec, cluster)
    nodes = _int(run_spec, "nodes", 1)
    res: dict[str, Any] = {
        "nodes": nodes,
        "mem_mb": _mem_mb(run_spec, cluster),
        "runtime": _runtime_min(run_spec, cluster),
        "cpus_per_task": _cpus_per_task(run_spec, cluster),
    }
    if cluster.get("accelerator") == "cuda":
        res["gres"] = _gres(run_spec, cluster)
    else:
        res["tasks"] = nodes  # one launcher task per node
    s = _slurm(cluster)
    for src, dst in SLURM_SETTING_RESOURCES:
        if s.get(src):
            res[dst] = str(s[src])
    return res


def resource_keys(cluster: dict) -> list[str]:
    """The keys :func:`train_resources` returns for every run on this cluster."""
    keys = ["nodes", "mem_mb", "runtime", "cpus_per_task"]
    keys.append("gres" if cluster.get("accelerator") == "cuda" else "tasks")
    s = _slurm(cluster)
    for src, dst in SLURM_SETTING_RESOURCES:
        if s.get(src):
            keys.append(dst)
    return keys


def resource_callables(
    spec_for: Callable[[Any], dict], cluster: dict
) -> dict[str, Callable[[Any], Any]]:
    """``{key: lambda wildcards: ...}`` for a rule's ``resources: **...``.

    spec_for(wildcards) returns the run spec dict of the job (e.g. looked up by
    wildcards.scenario in the plan computed at parse time)."""

    def getter(key: str):
        def f(wildcards):
            return train_resources(spec_for(wildcards), cluster)[key]

        f.__name__ = f"train_resource_{key}"
        return f

    return {k: getter(k) for k in resource_keys(cluster)}
