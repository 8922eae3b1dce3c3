"""A REAL SLURM for tests: munged + slurmctld + one slurmd per node in a temp dir, as root.

One node (default): the slurmd is this host. ``nodes=2`` (or more): each slurmd runs in its own
network namespace (address 10.213.x.1<i> on a bridge whose 10.213.x.1 is the controller), UTS
namespace (host name ``ost<i>``) and mount namespace (a hosts file naming all nodes over
/etc/hosts): srun, torchrun's rendezvous and gloo then see separate hosts. Measured: both
nodes idle ~0.5 s after start; a job's ``srun -N2`` reaches both.

Nothing global is touched: the daemons get their own config, munge key/socket, state, spool,
ports, logs and PID files under one temp dir, and every client command (and every snakemake
subprocess) must be run with ``cluster.env`` (it sets ``SLURM_CONF``).  /etc/slurm/slurm.conf
is never written -- a configured-but-dead controller there would make every later
``snakemake`` command ~10 s slower (the slurm executor plugin runs ``scontrol`` on import).

GPUs are faked with GRES: character devices cloned from /dev/null (``mknod c 1 3``) and
``AutoDetect=off``; jobs asking ``--gpus=<type>:N`` get ``CUDA_VISIBLE_DEVICES``.

Use::

    with slurm_cluster(partition="gpu-a", gres_type="a100", gpus=4) as cl:
        subprocess.run(["sbatch", ...], env=cl.env)

or the fixture helper ``slurm_fixture_gen`` (see tests/test_slurm.py).

When the SLURM/munge binaries are missing or we are not root, the tests fail with the reason
(.ci/run installs the packages).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from offload_study.training.launch import free_port

REPO = Path(__file__).resolve().parents[1]

REQUIRED_BINARIES = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "squeue",
    "scontrol",
    "scancel",
    "sinfo",
)
CLIENT_BINARIES = (
    "srun",
    "sbatch",
    "salloc",
    "squeue",
    "scontrol",
    "scancel",
    "sinfo",
    "sacct",
    "sstat",
    "sacctmgr",
    "sshare",
    "sprio",
)
# Debian: apt-get install slurm-wlm munge  (provides all of the above; mungekey comes with munge)
APT_HINT = "apt-get install -y slurm-wlm munge"


class SlurmUnavailable(RuntimeError):
    """The machine cannot run a local SLURM (binaries missing, not root, ...)."""


def missing_requirements() -> list[str]:
    """Return human-readable reasons why a local SLURM cannot be started ([] if it can)."""
    reasons = []
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None]
    # sbin is often not on a non-root PATH
    missing = [b for b in missing if not Path("/usr/sbin", b).exists()]
    if missing:
        reasons.append(f"missing binaries: {', '.join(missing)} (install: {APT_HINT})")
    if os.geteuid() != 0:
        reasons.append("must run as root (slurmd/slurmctld run as SlurmUser=root)")
    return reasons


def require_slurm() -> None:
    """In pytest: fail with what is missing when SLURM cannot run here."""
    import pytest

    reasons = missing_requirements()
    if not reasons:
        return
    pytest.fail(
        "local SLURM unavailable: " + "; ".join(reasons) + " (run as root after "
        "`apt-get install slurm-wlm munge`, as .ci/run does)",
        pytrace=False,
    )


def _bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/usr/bin", "/sbin"):
        if Path(d, name).exists():
            return str(Path(d, name))
    raise SlurmUnavailable(f"{name} not found ({APT_HINT})")


def _free_port_pair() -> tuple[int, int]:
    a = free_port()
    b = free_port()
    while b == a:
        b = free_port()
    return a, b


def node_topology(env: dict | None = None) -> dict[str, str]:
    """Parse ``slurmd -C`` (CPUs=, Boards=, SocketsPerBoard=, CoresPerSocket=, ThreadsPerCore=)."""
    out = subprocess.run(
        [_bin("slurmd"), "-C"], capture_output=True, text=True, check=True, env=env
    ).stdout
    first = out.splitlines()[0]
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    topo = {}
    for tok in first.split():
        k, _, v = tok.partition("=")
        if k in keys:
            topo[k] = v
    if "CPUs" not in topo:
        raise SlurmUnavailable(f"cannot parse `slurmd -C`: {out!r}")
    return topo


def mem_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise SlurmUnavailable("no MemTotal in /proc/meminfo")


@dataclass
class SlurmCluster:
    """Handle to a running local SLURM."""

    root: Path
    conf: Path
    node: str  # the first node's name
    nodes: list[str]
    partition: str
    gres_type: str | None
    gpus: int
    cpus: int
    real_memory_mb: int
    env: dict = field(repr=False)
    bring_up_s: float = 0.0
    _procs: dict = field(default_factory=dict, repr=False)

    # -- client helpers ----------------------------------------------------------------
    def run(self, *args: str, check: bool = True, timeout: float = 30, **kw):
        """Run a SLURM client command against this cluster; returns CompletedProcess."""
        return subprocess.run(
            list(args),
            env=self.env,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            **kw,
        )

    def answer(self, *args: str) -> str:
        """A client command's output, or "" while it does not answer (a daemon still starting
        on a busy machine): for the waits of the start-up, which ask again."""
        try:
            return self.run(*args, check=False, timeout=10).stdout
        except subprocess.TimeoutExpired:
            return ""

    def sbatch(self, *args: str, check: bool = True) -> str:
        """Submit with sbatch --parsable; return the job id."""
        cp = self.run("sbatch", "--parsable", *args, check=check)
        return cp.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str] | None:
        """``scontrol show job -o`` as a dict (None once the job is gone)."""
        cp = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if cp.returncode != 0 or not cp.stdout.strip():
            return None
        return parse_scontrol(cp.stdout)

    def job_state(self, job_id: str) -> str | None:
        info = self.job_info(job_id)
        return info.get("JobState") if info else None

    def wait_job_state(self, job_id: str, states, timeout: float = 60) -> str:
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = self.job_state(job_id)
            if st in states:
                return st
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} did not reach {states} in {timeout}s (last: {st})")

    def reach_time_limit_now(self, job_id: str) -> None:
        """End a running job's time limit now (``scontrol update EndTime``, as root): the
        controller then ends it for its time limit at its next check (every 30 s), exactly as at
        a limit reached (state TIMEOUT, "CANCELLED ... DUE TO TIME LIMIT", its TimeLimit kept),
        instead of after the 1-minute minimum limit. A job past its limit already is left be
        (SLURM refuses the update)."""
        soon = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 2))
        self.run("scontrol", "update", f"JobId={job_id}", f"EndTime={soon}", check=False)

    def jobs(self) -> list[dict[str, str]]:
        """All jobs slurmctld still knows (MinJobAge keeps finished ones for a while)."""
        cp = self.run("scontrol", "show", "job", "-o", check=False)
        return [parse_scontrol(line) for line in cp.stdout.splitlines() if "JobId=" in line]

    def logs(self, tail: int = 40) -> str:
        parts = []
        for p in sorted((self.root / "log").glob("*.log")):
            lines = p.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"==> {p.name} <==\n" + "\n".join(lines))
        return "\n".join(parts)

    def cancel_all(self, timeout: float = 15) -> None:
        self.run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            active = [
                j
                for j in self.jobs()
                if j.get("JobState")
                in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")
            ]
            if not active:
                return
            time.sleep(0.3)


def parse_scontrol(text: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` record (Key=Value pairs; values may hold spaces only
    for a few keys we don't use)."""
    out = {}
    for tok in re.split(r"\s+", text.strip()):
        k, sep, v = tok.partition("=")
        if sep and k not in out:
            out[k] = v
    return out


@dataclass(frozen=True)
class Node:
    """One slurmd: its SLURM node name, the address slurmctld reaches it at, its network
    namespace (None: this host's own network)."""

    name: str
    addr: str
    netns: str | None = None
    hosts_file: Path | None = None  # bound over /etc/hosts for the node's processes


def _write_conf(
    root: Path,
    *,
    nodes: list[Node],
    ctld: Node,
    partition: str,
    gres_type: str | None,
    gpus: int,
    topo: dict,
    real_memory_mb: int,
    ctld_port: int,
    slurmd_port: int,
    max_time: str,
    min_job_age: int,
    munge_socket: Path,
    requeue_delay_s: int | None,
    preempt_partition: str | None,
) -> Path:
    node_lines = "\n".join(
        f"NodeName={n.name} NodeAddr={n.addr} {{topo}} RealMemory={real_memory_mb}{{gres}} "
        "State=UNKNOWN"
        for n in nodes
    )
    gres = ""
    if gpus:
        gres = f" Gres=gpu:{gres_type}:{gpus}" if gres_type else f" Gres=gpu:{gpus}"
    # A requeued job waits for the job credential's lifetime before it starts again (SLURM
    # sets its BeginTime to now + cred_expire + 1; default 120 s), then for the scheduler's next
    # pass (a job that became eligible by time waits for the backfill pass: bf_interval, 30 s).
    cred, sched = "", ""
    if requeue_delay_s:
        cred, sched = (
            f",cred_expire={requeue_delay_s}",
            "SchedulerParameters=bf_interval=1,sched_interval=2",
        )
    partitions = f"PartitionName={partition} Nodes=ALL Default=YES MaxTime={max_time} State=UP"
    if preempt_partition:  # its jobs requeue those of the default partition that they need
        partitions += (
            f" PriorityTier=1\nPartitionName={preempt_partition} Nodes=ALL MaxTime={max_time} "
            "State=UP PriorityTier=2\nPreemptType=preempt/partition_prio\nPreemptMode=REQUEUE"
        )
    topo_s = " ".join(
        f"{k}={topo[k]}"
        for k in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
        if k in topo
    )
    conf = f"""\
# generated by tests/slurm_cluster.py -- throwaway SLURM
ClusterName=offloadtest
SlurmctldHost={ctld.name}({ctld.addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}{cred}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
{sched}
DefMemPerCPU=1024
MinJobAge={min_job_age}
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
KillWait=5
MailProg=/bin/true
{"GresTypes=gpu" if gpus else ""}
{node_lines.format(topo=topo_s, gres=gres)}
{partitions}
"""
    path = root / "etc" / "slurm.conf"
    path.write_text(conf)
    gres_conf = "AutoDetect=off\n"
    if gpus:
        typ = f" Type={gres_type}" if gres_type else ""
        rng = f"[0-{gpus - 1}]" if gpus > 1 else "0"
        for n in nodes:
            gres_conf += f"NodeName={n.name} Name=gpu{typ} File={root}/dev/nvidia{rng}\n"
    (root / "etc" / "gres.conf").write_text(gres_conf)
    return path


#: Seconds each step of the start-up (munged, slurmctld, the nodes idle) may take. The whole
#: start-up usually takes under a second (``bring_up_s``) and the waits ask again every
#: 0.1-0.2 s, so the limit costs nothing then; it leaves room for a machine whose test workers
#: import torch and train while several clusters start at once, and for a first start.
START_S = 120


def _wait_for(pred, timeout: float, what: str, cluster_root: Path, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    logs = []
    for p in sorted((cluster_root / "log").glob("*.log")):
        logs.append(f"==> {p} <==\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
    raise SlurmUnavailable(f"timed out after {timeout}s waiting for {what}\n" + "\n".join(logs))


def _stop(proc: subprocess.Popen | None, pid_file: Path | None, timeout: float = 10) -> None:
    """Stop one daemon: SIGTERM by its PID file (fallback: the Popen handle), then SIGKILL."""
    pid = None
    if pid_file is not None and pid_file.exists():
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
    if pid is None and proc is not None:
        pid = proc.pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return
        if proc is None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


@contextlib.contextmanager
def node_network(host: str, count: int, tag: int):
    """``count`` SLURM nodes on this machine, each in its own network namespace with its own
    address on a bridge of this host (the controller's address), and a hosts file naming them
    all (:func:`slurmd_argv` binds it over /etc/hosts). Yields (controller Node, [Node, ...]).

    ``tag`` (a free port) keeps the names of concurrent clusters apart."""
    bridge, net = f"ostbr{tag}", f"10.213.{tag % 250}"
    ctld, etc = Node(host, f"{net}.1"), Path(tempfile.mkdtemp(prefix="ostnet-"))
    nodes = [
        Node(f"ost{i}", f"{net}.{10 + i}", f"ost{tag}-{i}", etc / f"hosts-ost{i}")
        for i in range(1, count + 1)
    ]
    hosts = "".join(f"{n.addr} {n.name}\n" for n in [ctld, *nodes])

    def ip(*args: str, ns: str | None = None) -> None:
        cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{ctld.addr}/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, n in enumerate(nodes, 1):
            n.hosts_file.write_text(f"127.0.0.1 localhost\n{hosts}")
            ip("netns", "add", n.netns)
            ip(
                "link",
                "add",
                f"ost{tag}v{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                n.netns,
            )
            ip("link", "set", f"ost{tag}v{i}", "master", bridge, "up")
            ip("addr", "add", f"{n.addr}/24", "dev", "eth0", ns=n.netns)
            for dev in ("eth0", "lo"):
                ip("link", "set", dev, "up", ns=n.netns)
        yield ctld, nodes
    finally:
        for n in nodes:
            pids = subprocess.run(["ip", "netns", "pids", n.netns], capture_output=True, text=True)
            for pid in pids.stdout.split():  # processes of this cluster's jobs on that node
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", n.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        shutil.rmtree(etc, ignore_errors=True)


def slurmd_argv(node: Node, conf: Path) -> list[str]:
    """slurmd for ``node``: in its network namespace, with its own host name (UTS namespace) and
    hosts file (mount namespace). Not ``ip netns exec``: it remounts /sys, and slurmd then
    finds no cgroup filesystem and refuses to start."""
    slurmd = [_bin("slurmd"), "-D", "-N", node.name, "-f", str(conf)]
    if node.netns is None:
        return slurmd
    setup = f'mount --bind {node.hosts_file} /etc/hosts && hostname {node.name} && exec "$@"'
    return [
        "nsenter",
        f"--net=/run/netns/{node.netns}",
        "unshare",
        "--uts",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        setup,
        "slurmd",
        *slurmd,
    ]


@contextlib.contextmanager
def slurm_cluster(nodes: int = 1, **kwargs):
    """Bring up munged + slurmctld + one slurmd per node; yield a :class:`SlurmCluster`.

    nodes=1: one slurmd for this host (its own name, 127.0.0.1). nodes>1: each slurmd in its
    own network namespace with its own address and host name (:func:`node_network`), so that
    SLURM, srun and torchrun's rendezvous see real separate hosts. Other keys: :func:`_cluster`.
    """
    if nodes <= 1:
        host = socket.gethostname().split(".")[0]
        yield from _cluster([Node(host, "127.0.0.1")], Node(host, "127.0.0.1"), **kwargs)
        return
    with node_network(socket.gethostname().split(".")[0], nodes, free_port()) as (ctld, names):
        yield from _cluster(names, ctld, **kwargs)


def _cluster(
    nodes: list[Node],
    ctld: Node,
    partition: str = "debug",
    gres_type: str | None = "h200",
    gpus: int = 8,
    max_time: str = "INFINITE",
    min_job_age: int = 300,
    mem_reserve_mb: int = 512,
    keep_dir: bool = False,
    requeue_delay_s: int | None = None,
    preempt_partition: str | None = None,
):
    """Generator body of :func:`slurm_cluster` (one function: the daemons' start-up and their
    stop in its finally belong together).

    partition: partition name (the only one, Default=YES); gres_type: GRES type of the fake
    GPUs (None = untyped ``gpu:N``); gpus: fake GPU count (0 = none); max_time: partition
    MaxTime (e.g. "60" minutes); min_job_age: how long finished jobs stay visible to squeue
    (the slurm executor plugin's squeue status needs >= 3 x init seconds); requeue_delay_s:
    how long a requeued (or preempted, node-failed) job waits before it starts again (SLURM's
    job credential lifetime, ``AuthInfo=cred_expire``; None: SLURM's 120 s); preempt_partition:
    a second partition of higher PriorityTier whose jobs preempt (requeue) the default
    partition's (``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``).
    """
    reasons = missing_requirements()
    if reasons:
        raise SlurmUnavailable("; ".join(reasons))
    t0 = time.monotonic()
    # short path: the munge socket path must stay well under 108 chars
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    for sub in ("etc", "state", "spool", "run", "log", "dev", "munge"):
        (root / sub).mkdir()
    os.chmod(root, 0o755)  # munged checks that parent dirs are not group/other-writable
    os.chmod(root / "munge", 0o711)  # socket dir must be traversable

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    topo = node_topology(env=base_env)
    real_mem = max(256, mem_total_mb() - mem_reserve_mb)
    for i in range(gpus):
        os.mknod(root / "dev" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(1, 3))

    munge_socket = root / "munge" / "munge.socket"
    ctld_port, slurmd_port = _free_port_pair()
    conf = _write_conf(
        root,
        nodes=nodes,
        ctld=ctld,
        partition=partition,
        gres_type=gres_type,
        gpus=gpus,
        topo=topo,
        real_memory_mb=real_mem,
        ctld_port=ctld_port,
        slurmd_port=slurmd_port,
        max_time=max_time,
        min_job_age=min_job_age,
        munge_socket=munge_socket,
        requeue_delay_s=requeue_delay_s,
        preempt_partition=preempt_partition,
    )
    env = dict(base_env)
    env["SLURM_CONF"] = str(conf)
    # Client wrappers that pin SLURM_CONF: inside a job the slurm jobstep plugin drops every
    # SLURM_* variable (SLURM_CONF too) before its `srun`, which then looks for
    # /etc/slurm/slurm.conf (absent: we never write it).  PATH survives, so the wrappers do.
    wrap_dir = root / "bin"
    wrap_dir.mkdir()
    for client in CLIENT_BINARIES:
        real = shutil.which(client, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if real is None:
            continue
        w = wrap_dir / client
        w.write_text(f'#!/bin/sh\nSLURM_CONF={conf} exec {real} "$@"\n')
        w.chmod(0o755)
    path = env.get("PATH", "/usr/bin:/bin")
    if "/usr/sbin" not in path.split(":"):  # the daemons live in sbin
        path += ":/usr/sbin"
    env["PATH"] = f"{wrap_dir}:{path}"

    cluster = SlurmCluster(
        root=root,
        conf=conf,
        node=nodes[0].name,
        nodes=[n.name for n in nodes],
        partition=partition,
        gres_type=gres_type,
        gpus=gpus,
        cpus=int(topo["CPUs"]),
        real_memory_mb=real_mem,
        env=env,
    )
    procs = cluster._procs
    try:
        # -- munge: own key + socket --------------------------------------------------
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        procs["munged"] = subprocess.Popen(
            [
                _bin("munged"),
                "--foreground",
                "--force",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={root}/run/munged.pid",
                f"--seed-file={root}/munge/munged.seed",
                f"--log-file={root}/log/munged.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(root / "log" / "munged.stderr.log", "w"),
            env=env,
            start_new_session=True,
        )
        _wait_for(
            lambda: munge_socket.exists() or procs["munged"].poll() is not None,
            START_S,
            "munged socket",
            root,
        )
        if procs["munged"].poll() is not None:
            raise SlurmUnavailable(
                "munged exited: " + (root / "log" / "munged.stderr.log").read_text()
            )

        # -- slurmctld, slurmd (foreground, own session) -------------------------------
        procs["slurmctld"] = subprocess.Popen(
            [_bin("slurmctld"), "-D", "-i", "-f", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(root / "log" / "slurmctld.stderr.log", "w"),
            env=env,
            start_new_session=True,
        )
        _wait_for(
            lambda: (
                cluster.answer("scontrol", "ping").count("UP") > 0
                or procs["slurmctld"].poll() is not None
            ),
            START_S,
            "slurmctld to answer ping",
            root,
        )
        if procs["slurmctld"].poll() is not None:
            raise SlurmUnavailable("slurmctld exited\n" + cluster.logs())
        for n in nodes:
            (root / "spool" / n.name).mkdir()
            procs[f"slurmd-{n.name}"] = subprocess.Popen(
                slurmd_argv(n, conf),
                stdout=subprocess.DEVNULL,
                stderr=open(root / "log" / f"slurmd-{n.name}.stderr.log", "w"),
                env=env,
                start_new_session=True,
            )
        daemons = ["slurmctld", *(f"slurmd-{n.name}" for n in nodes), "munged"]

        def nodes_idle() -> bool:
            if any(procs[d].poll() is not None for d in daemons):
                raise SlurmUnavailable("a daemon exited\n" + cluster.logs())
            out = cluster.answer("sinfo", "-h", "-N", "-o", "%N %T")
            st = dict(line.split() for line in out.splitlines())  # a row per partition
            if "drain" in out or "inval" in out:
                raise SlurmUnavailable(f"node states {st!r}\n" + cluster.logs())
            return st == {n.name: "idle" for n in nodes}

        _wait_for(nodes_idle, START_S, "nodes idle", root, interval=0.2)
        # wait for the PID files the daemons write a moment after start (used by stop)
        for name in daemons:
            _wait_for(
                lambda n=name: (root / "run" / f"{n}.pid").exists(),
                START_S,
                f"{name} PID file",
                root,
            )
        cluster.bring_up_s = time.monotonic() - t0
        yield cluster
    finally:
        if "slurmctld" in procs and procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                cluster.cancel_all()
        for name in [*(f"slurmd-{n.name}" for n in nodes), "slurmctld", "munged"]:
            _stop(procs.get(name), root / "run" / f"{name}.pid")
        # leftover job step daemons of this cluster (they carry our SlurmdSpoolDir in argv/env
        # only indirectly, so match on their parent being gone and the conf in their environ)
        _kill_stray_stepds(str(conf))
        if not keep_dir:
            shutil.rmtree(root, ignore_errors=True)


def _kill_stray_stepds(conf: str) -> None:
    """SIGKILL processes left by this cluster's jobs: slurmstepd and job processes whose
    environment names our SLURM_CONF.  (proctrack/linuxproc, unlike cgroup, loses track of
    e.g. the slurm plugin's in-job snakemake after scancel.)"""
    me = os.getpid()
    needle = f"SLURM_CONF={conf}\0".encode()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == me:
            continue
        try:
            environ = (pid_dir / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if needle in environ:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_dir.name), signal.SIGKILL)


def slurm_fixture_gen(**kwargs):
    """Generator body for a pytest fixture: ``yield from slurm_fixture_gen(partition=...)``.
    Fails, naming what is missing, when SLURM cannot run."""
    import pytest

    require_slurm()
    try:
        cm = slurm_cluster(**kwargs)
        cl = cm.__enter__()
    except SlurmUnavailable as e:
        pytest.fail(f"local SLURM failed to start: {e}", pytrace=False)
    try:
        yield cl
    finally:
        cm.__exit__(None, None, None)


def write_profile(dest: Path, **overrides) -> Path:
    """The repo's slurm/config.yaml with test overrides (short status polling)."""
    prof = yaml.safe_load((REPO / "slurm" / "config.yaml").read_text())
    prof.update(
        {
            "slurm-init-seconds-before-status-checks": 1,
            "latency-wait": 5,
            "slurm-keep-successful-logs": True,
        }
    )
    prof.update(overrides)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(prof))
    return dest


def profile_snakemake(cl, wf: Path, profile: Path, *args, timeout=300, **popen_kw):
    """``snakemake --profile <profile> *args`` in ``wf`` against the cluster ``cl``, with this
    checkout's library. ``background=True``: started and returned (a Popen; its output in a pipe
    unless ``popen_kw`` says where)."""
    env = dict(cl.env)
    env["PYTHONPATH"] = f"{REPO / 'workflow'}:{env.get('PYTHONPATH', '')}".rstrip(":")
    cmd = [sys.executable, "-m", "snakemake", "--profile", str(profile), *args]
    if popen_kw.pop("background", False):
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen_kw}
        return subprocess.Popen(cmd, cwd=wf, env=env, **out)
    return subprocess.run(
        cmd, cwd=wf, env=env, capture_output=True, text=True, timeout=timeout, **popen_kw
    )


if __name__ == "__main__":  # manual smoke test: python tests/slurm_cluster.py
    with slurm_cluster() as cl:
        print(f"up in {cl.bring_up_s:.2f}s: {cl}")
        jid = cl.sbatch(
            "--gpus=h200:2",
            "--mem=100",
            "-o",
            "/tmp/smoke-%j.out",
            "--wrap",
            "echo $CUDA_VISIBLE_DEVICES; sleep 2",
        )
        print(cl.wait_job_state(jid, "RUNNING", 30), cl.job_info(jid).get("TRES"))
        print(cl.wait_job_state(jid, "COMPLETED", 30))
        print((cl.root / "spool").exists())
