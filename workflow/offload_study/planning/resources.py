"""Map one training run (run spec) to Snakemake resources for the SLURM executor plugin.

Pure functions, no Snakemake/SLURM import.  The resource names are the ones that
snakemake-executor-plugin-slurm 2.8 turns into sbatch options:

=================  =====================================  ==========================================
key                sbatch option                          when present
=================  =====================================  ==========================================
``nodes``          ``--nodes=N``                          always
``mem_mb``         ``--mem=<MB>`` (per node; SLURM reads   always
                   MiB, so the value is MiB)
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
``slurm_extra``    appended (the plugin puts it into a       cluster.slurm.slurm_extra set; parsed and
                   shell command line: each option checked   checked by :func:`sbatch_extra`
                   against :data:`SBATCH_EXTRA_OPTIONS`
                   and quoted)
=================  =====================================  ==========================================

For one cluster the key set is the same for every run, so a rule can use
``resources: **rule_resources(by_scenario, cluster)``.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from offload_study.core import architecture, units
from offload_study.core.contracts import RunSpec
from offload_study.core.study import StudyError

__all__ = [
    "RUNTIME_MARGIN_MIN",
    "MEM_HEADROOM_MIB",
    "check_fits",
    "sbatch_extra",
    "fit_problems",
    "train_resources",
    "resource_keys",
    "rule_resources",
]

#: minutes added to the run's timeout_s (the harness must time out, and write its record,
#: before SLURM kills the job); at least this, or 10 % of the timeout.
RUNTIME_MARGIN_MIN = 10
#: MiB requested on top of the scenario's cpu_mem_gb (launcher, Python, DeepSpeed runtime),
#: dropped (capped at the node's memory) when the node has no room for it.
MEM_HEADROOM_MIB = 1024
#: --mem per rank (gpus_per_node) when neither cpu_mem_gb nor mem_gb_per_node is known.
DEFAULT_MEM_MIB_PER_RANK = 3072

_GRES_TOKEN_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


# cluster.slurm setting -> the plugin's resource name (passed through when set)
SLURM_SETTING_RESOURCES = (
    ("partition", "slurm_partition"),
    ("account", "slurm_account"),
    ("qos", "qos"),
    ("constraint", "constraint"),
    ("slurm_extra", "slurm_extra"),
)


#: sbatch options a cluster description may add in ``slurm.slurm_extra``: long name -> (short
#: name or None, value: "flag" none, "value" required, "optional" only as --name=value).
#: Left out on purpose: what the plugin or the train rule's resources set (partition, account,
#: time, memory, CPUs, nodes, tasks, GPUs, job name, output, chdir, comment, export, ...) and
#: what runs or reads other things (--wrap, --export, --chdir, --get-user-env, burst buffer
#: scripts, --container, --uid/--gid, --hold).
SBATCH_EXTRA_OPTIONS = {
    "exclusive": (None, "optional"),
    "oversubscribe": ("s", "flag"),
    "reservation": (None, "value"),
    "exclude": ("x", "value"),
    "nodelist": ("w", "value"),
    "hint": (None, "value"),
    "switches": (None, "value"),
    "mail-type": (None, "value"),
    "mail-user": (None, "value"),
    "requeue": (None, "flag"),
    "no-requeue": (None, "flag"),
    "signal": (None, "value"),
    "begin": ("b", "value"),
    "deadline": (None, "value"),
    "distribution": ("m", "value"),
    "threads-per-core": (None, "value"),
    "ntasks-per-core": (None, "value"),
    "sockets-per-node": (None, "value"),
    "cores-per-socket": (None, "value"),
    "gpu-bind": (None, "value"),
    "gpu-freq": (None, "value"),
    "cpu-freq": (None, "value"),
    "mem-bind": (None, "value"),
    "network": (None, "value"),
    "licenses": ("L", "value"),
    "wckey": (None, "value"),
    "nice": (None, "optional"),
    "priority": (None, "value"),
    "core-spec": ("S", "value"),
    "thread-spec": (None, "value"),
    "tmp": (None, "value"),
    "prefer": (None, "value"),
    "time-min": (None, "value"),
    "dependency": ("d", "value"),
    "kill-on-invalid-dep": (None, "value"),
    "no-kill": ("k", "optional"),
    "spread-job": (None, "flag"),
    "use-min-nodes": (None, "flag"),
    "delay-boot": (None, "value"),
    "acctg-freq": (None, "value"),
    "profile": (None, "value"),
    "power": (None, "value"),
    "mcs-label": (None, "value"),
    "immediate": ("I", "optional"),
}
_SHORT_OPTIONS = {short: name for name, (short, _) in SBATCH_EXTRA_OPTIONS.items() if short}
#: an option's value: no shell metacharacters, no leading '-' (nodelists: node[01-04])
_SBATCH_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:/@+%=\[\]][A-Za-z0-9_.,:/@+%=\[\]-]*")


def sbatch_extra(text: str, where: str = "slurm.slurm_extra") -> str:
    """``slurm.slurm_extra`` as sbatch options, each checked and shell-quoted (the plugin
    appends the string to a command line it runs through a shell); StudyError names the
    option otherwise."""
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise StudyError(f"{where}: {text!r} cannot be split into options: {exc}") from None
    options, i = [], 0
    while i < len(tokens):
        name, value, used = _sbatch_option(tokens, i, where)
        options.append(f"--{name}" if value is None else f"--{name}={value}")
        i += used
    return " ".join(shlex.quote(option) for option in options)


def _sbatch_option(tokens: list[str], i: int, where: str) -> tuple[str, str | None, int]:
    """(long name, value or None, tokens used) of the option at ``tokens[i]``."""
    token, value = tokens[i], None
    if token.startswith("--"):
        name, eq, value = token[2:].partition("=")
        value = value if eq else None
    elif token.startswith("-") and len(token) >= 2 and token[1] in _SHORT_OPTIONS:
        name, value = _SHORT_OPTIONS[token[1]], token[2:] or None
    else:
        raise StudyError(f"{where}: {token!r} is not an sbatch option (--name or --name=value)")
    if name not in SBATCH_EXTRA_OPTIONS:
        allowed = ", ".join(f"--{n}" for n in sorted(SBATCH_EXTRA_OPTIONS))
        raise StudyError(f"{where}: --{name} is not allowed here; allowed: {allowed}")
    kind, used = SBATCH_EXTRA_OPTIONS[name][1], 1
    if value is None and kind == "value" and i + 1 < len(tokens):
        value, used = tokens[i + 1], 2
    if kind == "value" and value is None:
        raise StudyError(f"{where}: --{name} needs a value")
    if kind == "flag" and value is not None:
        raise StudyError(f"{where}: --{name} takes no value (given {value!r})")
    if value is not None and not _SBATCH_VALUE_RE.fullmatch(value):
        raise StudyError(
            f"{where}: --{name}: value {value!r} is not allowed; use letters, digits and "
            "_ . , : / @ + % = [ ] - (no spaces, quotes or shell characters)"
        )
    return name, value, used


def _slurm(cluster: dict) -> dict:
    return cluster.get("slurm") or {}


def check_fits(spec: RunSpec, cluster: dict, where: str | None = None) -> None:
    """Raise StudyError when the run asks for more than the cluster offers (see fit_problems).

    The plan passes ``where``, the scenario's key path (``scenarios[2]``): the message then starts
    with the key path of the first problem. Otherwise it names the scenario and every problem.
    """
    problems = fit_problems(spec, cluster)
    if not problems:
        return
    if where:
        key, text = problems[0]
        raise StudyError(f"{where}.{key}: {text}")
    raise StudyError(
        f"scenario {spec.scenario!r} does not fit cluster {cluster.get('name', '<cluster>')!r}: "
        + "; ".join(text for _, text in problems)
    )


def fit_problems(spec: RunSpec, cluster: dict) -> list[tuple[str, str]]:
    """(run spec key, what is wrong) for each way the run asks more than the cluster offers:
    accelerator, nodes, GPUs (ranks) per node, card and host memory, CPU cores, NVMe space."""
    cname = cluster.get("name", "<cluster>")
    gpn, nodes = spec.gpus_per_node, spec.nodes
    limits = [
        (
            "accelerator",
            spec.accelerator,
            cluster.get("accelerator"),
            "!=",
            f"accelerator={spec.accelerator!r} but cluster {cname!r} has "
            f"accelerator={cluster.get('accelerator')!r}",
        ),
        (
            "gpus_per_node",
            gpn,
            cluster.get("gpus_per_node"),
            ">",
            f"gpus_per_node={gpn} is more than cluster {cname!r} has per node "
            f"({cluster.get('gpus_per_node')})",
        ),
        (
            "nodes",
            nodes,
            cluster.get("nodes") or 1,
            ">",
            f"nodes={nodes} is more than cluster {cname!r} allows ({cluster.get('nodes') or 1})",
        ),
        (
            "world_size",
            spec.world_size,
            nodes * gpn,
            "!=",
            f"world_size={spec.world_size} != nodes*gpus_per_node={nodes * gpn}",
        ),
        (
            "gpu_mem_gb",
            spec.gpu_mem_gb,
            cluster.get("gpu_mem_gb"),
            ">",
            f"gpu_mem_gb={spec.gpu_mem_gb} GiB is more than the cards of cluster {cname!r} have "
            f"({cluster.get('gpu_mem_gb')} GiB); memory can only be capped, not added",
        ),
        (
            "cpu_mem_gb",
            spec.cpu_mem_gb,
            cluster.get("mem_gb_per_node"),
            ">",
            f"cpu_mem_gb={spec.cpu_mem_gb} GiB is more than a node of cluster {cname!r} has "
            f"({cluster.get('mem_gb_per_node')} GiB)",
        ),
    ]
    problems = [
        (key, text)
        for key, asked, offered, op, text in limits
        if asked is not None
        and offered is not None
        and (asked != offered if op == "!=" else asked > offered)
    ]
    return problems + _core_problems(spec, cluster) + _nvme_problems(spec, cluster)


def _core_problems(spec: RunSpec, cluster: dict) -> list[tuple[str, str]]:
    cores = cluster.get("cpu_cores_per_node")
    need = _cpus_per_task(spec, cluster, cap=False)
    cname, gpn = cluster.get("name", "<cluster>"), spec.gpus_per_node
    if cores is None or need <= cores:
        return []
    if cluster.get("accelerator") != "cuda":
        what = f"gpus_per_node={gpn} CPU ranks need {need} cores"
    elif _slurm(cluster).get("cpus_per_gpu"):
        what = f"gpus_per_node={gpn} x slurm.cpus_per_gpu needs {need} cores"
    else:
        return []  # GPU jobs without cpus_per_gpu take a share of the node: always fits
    return [("gpus_per_node", f"{what} > cluster {cname!r} cpu_cores_per_node={cores}")]


def _nvme_problems(spec: RunSpec, cluster: dict) -> list[tuple[str, str]]:
    """NVMe offload that cannot fit even the swap files of its partitions (refused only when
    clearly impossible: parameter count and capacity known; units.PLACEMENT's bytes per
    parameter, swap-file alignment left out)."""
    capacity = cluster.get("nvme_capacity_gb")
    if not (spec.uses_nvme and capacity):
        return []
    params = spec.model_params or architecture.param_count(spec.model)
    if not params:
        return []
    per_param = units.bytes_per_param(
        "nvme", spec.dtype, spec.offload_optimizer, spec.offload_param
    )
    need_bytes = params * per_param / spec.nodes  # ZeRO-3 splits it over the nodes
    if need_bytes <= units.gib_to_bytes(capacity):
        return []
    key = "offload_optimizer" if spec.offload_optimizer == "nvme" else "offload_param"
    return [
        (
            key,
            f"NVMe offload needs at least {units.bytes_to_gib(need_bytes):.1f} GiB per node "
            f"({params} "
            f"parameters x {per_param} B / {spec.nodes} node(s)) but cluster "
            f"{cluster.get('name', '<cluster>')!r} has nvme_capacity_gb={capacity}",
        )
    ]


def _cpus_per_task(spec: RunSpec, cluster: dict, cap: bool = True) -> int:
    """CPUs for the one task per node (the launcher and all of its ranks on that node)."""
    gpn = spec.gpus_per_node
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


def _runtime_min(spec: RunSpec, cluster: dict) -> int:
    # job_timeout_s: the run's timeout plus its same-allocation pair run's, made in this job
    base = math.ceil(spec.job_timeout_s / 60.0)
    runtime = base + max(RUNTIME_MARGIN_MIN, math.ceil(0.1 * base))
    max_rt = _slurm(cluster).get("max_runtime_min")
    if max_rt:
        runtime = min(runtime, int(max_rt))
    return max(1, int(runtime))


def _mem_mib(spec: RunSpec, cluster: dict) -> int:
    """SLURM's --mem for the run: its cpu_mem_gb (GiB, as the supervisor enforces it) and some
    headroom, within the node's mem_gb_per_node (GiB)."""
    node_bytes = units.gib_to_bytes_or_none(cluster.get("mem_gb_per_node"))
    if spec.cpu_mem_bytes is None:
        if node_bytes is not None:
            return units.bytes_to_mib_floor(node_bytes)  # no budget: the whole node's memory
        # nothing known: a modest request per rank (the node's real size decides the rest)
        return DEFAULT_MEM_MIB_PER_RANK * spec.gpus_per_node
    mib = units.bytes_to_mib_ceil(spec.cpu_mem_bytes) + MEM_HEADROOM_MIB
    if node_bytes is not None:
        mib = min(mib, units.bytes_to_mib_floor(node_bytes))
    return mib


def _gres(spec: RunSpec, cluster: dict) -> str:
    typ = _slurm(cluster).get("gres_type")
    if typ:
        if not set(typ) <= _GRES_TOKEN_OK:
            raise StudyError(f"cluster slurm.gres_type={typ!r}: only letters, digits, '_' and '.'")
        return f"gpu:{typ}:{spec.gpus_per_node}"
    return f"gpu:{spec.gpus_per_node}"


def train_resources(spec: RunSpec, cluster: dict) -> dict[str, Any]:
    """Snakemake resources (for the slurm executor plugin) of one training run.

    Raises StudyError (see :func:`check_fits`) when the run does not fit the cluster.
    """
    check_fits(spec, cluster)
    res: dict[str, Any] = {
        "nodes": spec.nodes,
        "mem_mb": _mem_mib(spec, cluster),  # the plugin's name; SLURM reads the value as MiB
        "runtime": _runtime_min(spec, cluster),
        "cpus_per_task": _cpus_per_task(spec, cluster),
    }
    if cluster.get("accelerator") == "cuda":
        res["gres"] = _gres(spec, cluster)
    else:
        res["tasks"] = spec.nodes  # one launcher task per node
    s = _slurm(cluster)
    for src, dst in SLURM_SETTING_RESOURCES:
        if s.get(src):
            res[dst] = str(s[src])
    if s.get("slurm_extra"):
        where = f"cluster {cluster.get('name', '<cluster>')!r}: slurm.slurm_extra"
        res["slurm_extra"] = sbatch_extra(str(s["slurm_extra"]), where)
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


def rule_resources(
    by_scenario: Mapping[str, dict[str, Any]],
    cluster: dict,
    scenario_of: Callable[[Any], str] = lambda wildcards: wildcards.scenario,
) -> dict[str, Any]:
    """A rule's ``resources: **...`` from each run's :func:`train_resources` (computed once).

    A key with the same value for every run is that value; otherwise a function of the job's
    wildcards (``scenario_of`` names its scenario and may refuse an unknown one). Snakemake calls
    a function once per job and key, which costs seconds for 1,000 runs.
    """

    def per_job(key: str):
        values = {name: res[key] for name, res in by_scenario.items()}
        if len(set(values.values())) == 1:
            return next(iter(values.values()))
        return lambda wildcards: values[scenario_of(wildcards)]

    return {key: per_job(key) for key in resource_keys(cluster)} if by_scenario else {}
