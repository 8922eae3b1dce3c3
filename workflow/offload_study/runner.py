"""Supervisor of one training run (scenario x repeat) -> a complete run record.

    python -m offload_study.runner --spec RUN.json --repeat K \\
        --outdir results/<cluster>/<study>/<scenario>/rep<K>

Launches the harness through :mod:`offload_study.launch` in its own process group, captures
``logs/launcher.log`` (the harness tees each rank into ``logs/rank<r>.log``), enforces
``timeout_s`` / ``step_timeout_s`` (-> ``timeout``) and the host memory budget ``cpu_mem_gb``
(sum of the RSS of the local process tree, sampled 5x/s -> ``host_oom``), turns SIGTERM/SIGINT
into ``cancelled``, classifies failures from exit codes and logs (:mod:`offload_study.logparse`)
and writes ``metrics.json`` (validated against ``workflow/schemas/metrics.schema.json``),
``steps.csv`` and ``provenance.json``.

Everything is written into ``<outdir>.tmp-<pid>`` and moved into place at the end; the finished
record is also copied into ``results/<cluster>/<study>/archive/<scenario>/rep<K>/<ts>-<sha8>/``.
Exit status: 0 whatever the outcome, unless ``spec["strict"]`` (then 1 when outcome != ok).

Limits: the memory budget only sees processes on the runner's node (with ``nodes > 1`` the remote
ranks are not summed); NVMe swap folders are cleaned on the runner's node only.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from offload_study import devices, launch, logparse

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "metrics.schema.json"
POLL_S = 0.2
KILL_GRACE_S = 5.0
GIB = 2**30

SETUP_KEYS = [
    "nodes", "gpus_per_node", "world_size", "accelerator", "micro_batch",
    "gradient_accumulation_steps", "global_batch", "seq_len", "dtype", "offload_optimizer",
    "offload_param", "gpu_mem_gb", "cpu_mem_gb", "gradient_checkpointing",
]  # fmt: skip
BREAKDOWN_NULL = {k: None for k in logparse.BREAKDOWN_KEYS.values()}

# environment recorded in provenance: allowlist (names or prefixes), minus anything secret-looking
ENV_ALLOW = [
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUDA_HOME",
    "PYTORCH_CUDA_ALLOC_CONF", "TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST",
    "LD_LIBRARY_PATH", "HOSTNAME", "NCCL_", "DS_", "TORCH_NCCL_", "TORCH_SYMM_MEM_",
    "NVSHMEM_", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_JOB_GPUS", "SLURM_CPUS_ON_NODE",
    "SLURM_JOB_PARTITION", "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_CLUSTER_NAME",
]  # fmt: skip
SECRET_RX = re.compile(
    r"TOKEN|KEY|SECRET|PASS|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|CERT", re.IGNORECASE
)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_RX.search(name))


def allowed_env(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    out = {}
    for name, value in environ.items():
        if is_secret_name(name):
            continue
        if any(name == a or (a.endswith("_") and name.startswith(a)) for a in ENV_ALLOW):
            out[name] = value
    return dict(sorted(out.items()))


def sha256_file(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def granted_cores() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_ON_NODE")
    if slurm and slurm.isdigit():
        n = min(n, int(slurm))
    return max(1, n)


# ----------------------------------------------------------------------------- process tree
def tree_rss(pid: int, rank_peaks: dict[int, int]) -> int:
    """Sum of RSS over pid and its descendants; updates per-rank peaks of harness processes."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            rss = p.memory_info().rss
        except psutil.Error:
            continue
        total += rss
        try:
            if "offload_study.harness" in " ".join(p.cmdline()):
                r = p.environ().get("RANK")
                if r is not None:
                    rank_peaks[int(r)] = max(rank_peaks.get(int(r), 0), rss)
        except (psutil.Error, ValueError):
            pass
    return total


def kill_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group, SIGKILL what is left after grace_s."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # leader gone: make sure no straggler of the group survives
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


# ----------------------------------------------------------------------------- supervision
class Cancelled:
    def __init__(self):
        self.signum = None

    def __call__(self, signum, _frame):
        self.signum = signum


def read_progress(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def supervise(proc: subprocess.Popen, spec: dict, tmp: Path, cancel: Cancelled, say) -> dict:
    """Wait for the launched group; returns {'killed': reason|None, 'peak_tree_rss', ...}."""
    t0 = time.monotonic()
    timeout_s = spec.get("timeout_s")
    step_timeout_s = spec.get("step_timeout_s")
    budget = spec.get("cpu_mem_gb")
    budget_b = float(budget) * 1e9 if budget else None
    peak, rank_peaks = 0, {}
    killed, detail = None, None
    last_step, last_step_t = None, None
    progress_path = tmp / "progress.json"
    while proc.poll() is None:
        now = time.monotonic()
        rss = tree_rss(proc.pid, rank_peaks)
        peak = max(peak, rss)
        prog = read_progress(progress_path)
        if prog is not None and prog.get("step") != last_step:
            last_step, last_step_t = prog.get("step"), now
            if prog.get("step"):
                say(
                    f"step {prog['step']}/{prog.get('total')} {prog.get('phase')} "
                    f"{prog.get('step_time_s', 0):.3f} s"
                )
        if cancel.signum is not None:
            killed, detail = "cancelled", f"received signal {cancel.signum}"
        elif budget_b and rss > budget_b:
            killed = "host_oom"
            detail = (
                f"host memory budget exceeded: process tree RSS {rss / 1e9:.3f} GB > "
                f"cpu_mem_gb {budget} GB"
            )
        elif timeout_s and now - t0 > float(timeout_s):
            killed, detail = "timeout", f"run exceeded timeout_s={timeout_s}"
        elif step_timeout_s and last_step_t is not None:
            stuck = now - last_step_t
            took = (prog or {}).get("step_time_s") or 0.0
            if took > float(step_timeout_s) or stuck > float(step_timeout_s):
                killed = "timeout"
                detail = (
                    f"step exceeded step_timeout_s={step_timeout_s} (last step "
                    f"{took:.3f} s, {stuck:.1f} s since step {last_step})"
                )
        if killed:
            say(f"killing process group: {detail}")
            kill_group(proc)
            break
        time.sleep(POLL_S)
    rc = proc.wait()
    # the group leader (pgid == pid, new session) is gone: let tee flush, then no straggler
    # (a rank torchrun lost, a tee) may outlive it
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if killed is None and cancel.signum is not None:
        # scancel signals the whole step: the ranks may die before the loop sees the signal
        killed, detail = "cancelled", f"received signal {cancel.signum}"
    return {"rc": rc, "killed": killed, "detail": detail, "peak_tree_rss": peak,
            "rank_peaks": rank_peaks, "elapsed": time.monotonic() - t0}  # fmt: skip


# ----------------------------------------------------------------------------- record
def read_steps(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return []
    out = []
    for r in rows:
        try:
            out.append({"step": int(r["step"]), "phase": r["phase"],
                        "step_time_s": float(r["step_time_s"]),
                        "tokens_per_s": float(r["tokens_per_s"]),
                        "samples_per_s": float(r["samples_per_s"]), "loss": float(r["loss"])})  # fmt: skip
        except (KeyError, ValueError):
            continue
    return out


def percentile(vals: list[float], q: float) -> float:
    s = sorted(vals)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def read_rank_stats(tmp: Path) -> dict[int, dict]:
    out = {}
    for p in tmp.glob("rank*.stats.json"):
        try:
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
        except (OSError, ValueError, KeyError):
            continue
    return out


def read_logs(tmp: Path) -> tuple[dict[str, str], str]:
    logs = {}
    for p in sorted((tmp / "logs").glob("*.log")):
        try:
            logs[p.name] = p.read_text(errors="replace")
        except OSError:
            pass
    rank_text = "\n".join(v for k, v in logs.items() if k.startswith("rank"))
    return logs, rank_text


def classify(sup: dict, logs: dict[str, str], stats: dict[int, dict], world: int):
    """(outcome, excerpt) from supervision result, exit code and logs."""
    all_text = "\n".join(logs.values())
    if sup["killed"]:
        excerpt = logparse.error_excerpt(logs.get("launcher.log", "") or all_text)
        return sup["killed"], excerpt
    finished = sum(1 for s in stats.values() if s.get("finished"))
    if sup["rc"] == 0 and finished >= world:
        return "ok", None
    # failure: prefer the rank logs for root cause, then the launcher's summary
    rank_text = "\n".join(v for k, v in logs.items() if k.startswith("rank"))
    outcome, line = logparse.classify_text(rank_text)
    if outcome == "error":
        outcome, line = logparse.classify_text(all_text)
    if outcome == "error" and sup["rc"] in (-9, 137):
        outcome = "host_oom"  # SIGKILL without our doing: kernel OOM killer
    source = rank_text if line and line in rank_text else all_text
    excerpt = logparse.error_excerpt(source)
    if sup["rc"] == 0 and finished < world:
        excerpt = (excerpt or "") + f"\n(launcher exited 0 but {finished}/{world} ranks finished)"
    return outcome, excerpt


def compute_metrics(spec, repeat, sup, outcome, excerpt, steps, stats, logs, started, finished):
    measured = [r for r in steps if r["phase"] == "measured"]
    times = [r["step_time_s"] for r in measured]
    gbs, seq, world = int(spec["global_batch"]), int(spec["seq_len"]), int(spec["world_size"])
    s0 = stats.get(0, {})
    n_params = next((s.get("model_params") for s in stats.values() if s.get("model_params")), None)
    device_name = s0.get("device_name") or next(
        (s.get("device_name") for s in stats.values() if s.get("device_name")), None
    )
    m = {
        "schema_version": 1,
        "study": spec["study"],
        "cluster": spec["cluster"],
        "scenario": spec["scenario"],
        "base_scenario": spec.get("base_scenario", spec["scenario"]),
        "label": spec.get("label"),
        "sweep": spec.get("sweep") or {},
        "repeat": int(repeat),
        "outcome": outcome,
        "error_excerpt": excerpt if outcome != "ok" else None,
        "started_at": started,
        "finished_at": finished,
        "wall_time_s": round(sup["elapsed"], 3),
    }
    for k in SETUP_KEYS:
        m[k] = spec.get(k)
    m["gradient_checkpointing"] = bool(spec.get("gradient_checkpointing", False))
    m["model_params"] = n_params
    # A run that died (e.g. gpu_oom) wrote no stats: the cap is still in its log.
    m["gpu_mem_cap_gib"] = s0.get("gpu_mem_cap_gib") or logparse.gpu_mem_cap_gib(
        "\n".join(logs.values())
    )
    m["device_name"] = device_name

    speed = dict.fromkeys(
        ["step_time_s", "step_time_s_mean", "step_time_s_std", "step_time_s_p10",
         "step_time_s_p90", "tokens_per_s", "samples_per_s", "tflops_per_gpu", "mfu"]
    )  # fmt: skip
    peak = devices.peak_tflops(
        device_name if spec.get("accelerator") == "cuda" else None, spec.get("peak_tflops")
    )
    if times:
        med = statistics.median(times)
        speed.update(
            step_time_s=med,
            step_time_s_mean=statistics.fmean(times),
            step_time_s_std=statistics.stdev(times) if len(times) > 1 else 0.0,
            step_time_s_p10=percentile(times, 0.1),
            step_time_s_p90=percentile(times, 0.9),
            tokens_per_s=gbs * seq / med,
            samples_per_s=gbs / med,
        )
        if n_params:
            tf = devices.tflops_per_device(
                n_params, gbs * seq / med, world, bool(spec.get("gradient_checkpointing"))
            )
            speed["tflops_per_gpu"] = tf
            speed["mfu"] = devices.mfu(tf, peak)
    m["steps_measured"] = len(measured) if steps else None
    m.update(speed)
    m["peak_tflops"] = peak
    m["loss_first"] = measured[0]["loss"] if measured else None
    m["loss_last"] = measured[-1]["loss"] if measured else None

    def gib(v):
        return None if v is None else v / GIB

    def max_or_none(key):
        vals = [s.get(key) for s in stats.values() if s.get(key) is not None]
        return gib(max(vals)) if vals else None

    m["peak_gpu_allocated_gib"] = max_or_none("peak_gpu_allocated_bytes")
    m["peak_gpu_reserved_gib"] = max_or_none("peak_gpu_reserved_bytes")
    m["nvml_used_gib"] = max_or_none("nvml_used_bytes")
    # host RSS per rank: harness' own getrusage peak, else the runner's sampled peak
    local = socket.gethostname()
    per_rank, node_of = [], {}
    for r in range(world):
        v = max(stats.get(r, {}).get("host_peak_rss_bytes") or 0, sup["rank_peaks"].get(r, 0))
        per_rank.append(round(gib(v), 4) if v else None)
        node_of[r] = stats.get(r, {}).get("host") or (local if r in sup["rank_peaks"] else None)
    nodes = []
    for r in range(world):
        if node_of[r] is not None and node_of[r] not in nodes:
            nodes.append(node_of[r])
    per_node = [
        round(sum(per_rank[r] or 0 for r in range(world) if node_of[r] == n), 4) for n in nodes
    ]
    m["host_peak_rss_gib_per_rank"] = per_rank
    m["host_peak_rss_gib_per_node"] = per_node
    m["host_peak_rss_gib"] = max(per_node) if per_node else None
    nv = [s["nvme_bytes_used"] for s in stats.values() if s.get("nvme_bytes_used") is not None]
    m["nvme_bytes_used"] = int(sum(nv)) if nv else None
    rank0_log = logs.get("rank0.log", "")
    bd = logparse.breakdown_ms(rank0_log, skip_steps=int(spec.get("warmup_steps", 0)))
    m["breakdown_ms"] = bd if any(v is not None for v in bd.values()) else dict(BREAKDOWN_NULL)
    m["ds_config_sha256"] = sha256_file(spec["ds_config"])
    m["deepspeed_version"] = s0.get("deepspeed_version") or pkg_version("deepspeed")
    m["torch_version"] = s0.get("torch_version") or pkg_version("torch")
    m["slurm_job_id"] = os.environ.get("SLURM_JOB_ID")
    return m


def pkg_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def validate_metrics(m: dict) -> list[str]:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in v.iter_errors(m)]


# ----------------------------------------------------------------------------- provenance
def git_commit(path: Path) -> tuple[str | None, bool | None]:
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


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


def provenance(spec, lch, stats, cores) -> dict:
    import psutil

    repo = Path(__file__).resolve().parents[2]
    commit, dirty = git_commit(repo)
    s0 = stats.get(0, {})
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "host": socket.gethostname(),
        "hosts": sorted({s.get("host") for s in stats.values() if s.get("host")}),
        **gpu_info(),
        "cuda_version": s0.get("cuda_version"),
        "torch_version": s0.get("torch_version") or pkg_version("torch"),
        "deepspeed_version": s0.get("deepspeed_version") or pkg_version("deepspeed"),
        "transformers_version": pkg_version("transformers"),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": devices.cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cores_granted": cores,
        "ram_total_bytes": int(psutil.virtual_memory().total),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_job_nodelist": os.environ.get("SLURM_JOB_NODELIST"),
        "slurm_job_gpus": os.environ.get("SLURM_JOB_GPUS"),
        "slurm_cpus_on_node": os.environ.get("SLURM_CPUS_ON_NODE"),
        "git_commit": commit,
        "git_dirty": dirty,
        "ds_config": str(spec["ds_config"]),
        "ds_config_sha256": sha256_file(spec["ds_config"]),
        "launch_command": lch.command_line if lch else None,
        "launch_env": lch.env if lch else None,
        "rendezvous_host": lch.rdzv_host if lch else None,
        "rendezvous_port": lch.port if lch else None,
        "environment": allowed_env(),
    }


# ----------------------------------------------------------------------------- placement
def archive_dir(outdir: Path, spec: dict, repeat: int, finished_at: str, sha: str) -> Path:
    """results/<cluster>/<study>/archive/<scenario>/rep<K>/<finished_at>-<sha8>/"""
    study_dir = outdir.resolve().parent.parent
    stamp = re.sub(r"[^0-9TZ]", "", finished_at)
    return study_dir / "archive" / spec["scenario"] / f"rep{repeat}" / f"{stamp}-{sha[:8]}"


def move_into_place(tmp: Path, outdir: Path) -> None:
    old = None
    if outdir.exists():
        old = outdir.with_name(outdir.name + f".old-{os.getpid()}")
        os.replace(outdir, old)
    os.replace(tmp, outdir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def remove_interrupted_records(outdir: Path) -> list[Path]:
    """Temp records of runs whose runner is gone (node failure, SIGKILL): this run redoes them."""
    removed = []
    for path in outdir.parent.glob(outdir.name + ".tmp-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- main
def run(
    spec_path: str, repeat: int, outdir: str, strict: bool | None = None, cores: int | None = None
) -> int:
    spec = json.loads(Path(spec_path).read_text())
    strict = bool(spec.get("strict", False)) if strict is None else strict
    outdir_p = Path(outdir)
    outdir_p.parent.mkdir(parents=True, exist_ok=True)
    tmp = outdir_p.with_name(outdir_p.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    interrupted = remove_interrupted_records(outdir_p)
    (tmp / "logs").mkdir(parents=True)
    run_id = re.sub(r"[^A-Za-z0-9._-]", "_", f"{spec['scenario']}-rep{repeat}-{os.getpid()}")
    launcher_log = open(tmp / "logs" / "launcher.log", "ab", buffering=0)  # noqa: SIM115

    def say(msg: str) -> None:
        line = f"[runner {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        launcher_log.write((line + "\n").encode())

    for path in interrupted:
        say(f"removed the half record of an interrupted run: {path}")
    cancel = Cancelled()
    old_handlers = {s: signal.signal(s, cancel) for s in (signal.SIGTERM, signal.SIGINT)}
    started = now_iso()
    cores = cores or granted_cores()
    lch, sup = None, None
    try:
        lch = launch.build_launch(spec, spec_path, str(tmp), cores=cores, run_id=run_id)
        env = {**os.environ, **lch.env, "OFFLOAD_STUDY_RUN_ID": run_id}
        say(f"{spec['scenario']} rep{repeat}: {lch.command_line}")
        say("env: " + " ".join(f"{k}={v}" for k, v in sorted(lch.env.items())))
        proc = subprocess.Popen(
            lch.argv, env=env, stdout=launcher_log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        sup = supervise(proc, spec, tmp, cancel, say)
    except Exception as e:  # noqa: BLE001 - a launch failure is a recorded outcome too
        say(f"launch failed: {type(e).__name__}: {e}")
        sup = sup or {"rc": None, "killed": None, "detail": None, "peak_tree_rss": 0,
                      "rank_peaks": {}, "elapsed": 0.0}  # fmt: skip
    finished = now_iso()

    stats = read_rank_stats(tmp)
    logs, _ = read_logs(tmp)
    world = int(spec.get("world_size", 1))
    outcome, excerpt = classify(sup, logs, stats, world)
    steps = read_steps(tmp / "steps.csv")
    step_timeout = spec.get("step_timeout_s")
    if outcome == "ok" and step_timeout and any(r["step_time_s"] > step_timeout for r in steps):
        outcome = "timeout"
        excerpt = f"a step exceeded step_timeout_s={step_timeout}"
    if sup.get("detail"):
        excerpt = f"{sup['detail']}\n{excerpt or ''}".strip()
    if outcome != "ok" and not excerpt:
        excerpt = f"exit code {sup['rc']}"

    # NVMe swap files of a killed run: harness could not clean them
    if spec.get("nvme_path"):
        shutil.rmtree(os.path.join(spec["nvme_path"], f"offload-study-{run_id}"), True)

    metrics = compute_metrics(spec, repeat, sup, outcome, excerpt, steps, stats, logs,
                              started, finished)  # fmt: skip
    problems = validate_metrics(metrics)
    if problems:
        say("metrics.json does not validate: " + "; ".join(problems))
    if not (tmp / "steps.csv").exists():
        with open(tmp / "steps.csv", "w", newline="") as f:
            csv.writer(f).writerow(
                ["step", "phase", "step_time_s", "tokens_per_s", "samples_per_s", "loss"]
            )
    prov = provenance(spec, lch, stats, cores)
    prov["runner_exit_code_of_launcher"] = sup["rc"]
    prov["runner_peak_tree_rss_bytes"] = sup["peak_tree_rss"]
    prov["run_id"] = run_id
    prov["schema_problems"] = problems
    write_json(tmp / "metrics.json", metrics)
    write_json(tmp / "provenance.json", prov)
    say(
        f"outcome {outcome}"
        + (f", {metrics['tokens_per_s']:.1f} tokens/s" if metrics["tokens_per_s"] else "")
        + f", wall {metrics['wall_time_s']:.1f} s"
    )
    launcher_log.close()
    progress = tmp / "progress.json"
    if progress.exists():
        progress.unlink()

    sha = hashlib.sha256((tmp / "metrics.json").read_bytes()).hexdigest()
    arch = archive_dir(outdir_p, spec, repeat, finished, sha)
    arch.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tmp, arch, dirs_exist_ok=True)
    move_into_place(tmp, outdir_p)
    for s, h in old_handlers.items():
        signal.signal(s, h)
    if strict and outcome != "ok":
        return 1
    if problems and strict:
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run one training run and write its record.")
    p.add_argument("--spec", required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--outdir", required=True)
    p.add_argument("--strict", action="store_true", default=None, help="override spec strict")
    p.add_argument(
        "--cores", type=int, default=None,
        help="cores granted to this run (default: CPU affinity, capped by SLURM_CPUS_ON_NODE); "
        "OMP_NUM_THREADS = cores / ranks per node",
    )  # fmt: skip
    a = p.parse_args(argv)
    return run(a.spec, a.repeat, a.outdir, a.strict, a.cores)


if __name__ == "__main__":
    sys.exit(main())
