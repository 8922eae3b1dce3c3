"""DeepSpeed's ops: which builder makes each, what fixes a missing piece, and building them ahead.

DeepSpeed compiles its C++ ops just in time otherwise, which on a 2-core machine costs ~50 s
for cpu_adam and ~3 min for async_io inside the first timed run. :data:`FIXES` is the one place
that says how to repair a machine; the preflight's refusals and the outcome table's remedies
(:data:`offload_study.training.logparse.OUTCOME_PATTERNS`) both quote it.

A build killed mid-way leaves torch's build lock (``<extensions root>/<op>/lock``) behind, and
every later load of that op waits for it forever; :func:`remove_stale_lock` removes such a lock
before an op is loaded here (a lock whose build still runs is left alone).

    python -m offload_study.admission.ops [--accelerator cpu|cuda] [OP ...]     (default: every op)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

#: Op name -> DeepSpeed op-builder class name (each accelerator has its own implementation).
OP_BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "fused_adam": "FusedAdamBuilder",
    "async_io": "AsyncIOBuilder",
    "shm_comm": "ShareMemCommBuilder",
    "pin_memory": "PinMemoryBuilder",
}
#: DeepSpeed's own name of an op where it differs from ours (the name its logs use).
DEEPSPEED_NAMES = {"shm_comm": "deepspeed_shm_comm"}
#: Accelerator -> its DeepSpeed accelerator class (module, class name).
ACCELERATORS = {
    "cpu": ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator"),
    "cuda": ("deepspeed.accelerator.cuda_accelerator", "CUDA_Accelerator"),
}

#: The missing piece -> how to get it (each remedy ends by building the op ahead).
FIXES = {
    "libaio": "apt-get install libaio-dev (or conda install libaio; a private copy: "
    "CFLAGS=-I<dir>/include LDFLAGS=-L<dir>/lib)",
    "ninja": "pip install ninja (into the environment that trains)",
    "compiler": "apt-get install g++ (or set CXX to a C++ compiler)",
    "cuda_home": "install the CUDA toolkit (nvcc) of torch's CUDA version and set CUDA_HOME "
    "(e.g. module load cuda)",
    "cuda_mismatch": "use the CUDA toolkit of torch's CUDA version (or DS_SKIP_CUDA_CHECK=1)",
    "cuda_arch": "set TORCH_CUDA_ARCH_LIST to the GPUs' compute capability as X.Y without a "
    "suffix, e.g. TORCH_CUDA_ARCH_LIST=9.0 for H100/H200, where the runs start",
    "compile": "the first compiler error above names what is missing (a header: install its "
    "-dev package)",
    "incompatible": "run ds_report to see what DeepSpeed needs for it",
}


def our_name(deepspeed_name: str) -> str:
    """Our op name for the name DeepSpeed prints (deepspeed_shm_comm -> shm_comm)."""
    return next((k for k, v in DEEPSPEED_NAMES.items() if v == deepspeed_name), deepspeed_name)


def build_command(names: Iterable[str] = (), accelerator: str | None = None) -> str:
    """The command that builds the ops ``names`` ahead (every op when there are none)."""
    words = ["python -m offload_study.admission.ops"]
    words += [f"--accelerator {accelerator}"] if accelerator else []
    return " ".join(words + [our_name(n) for n in names if n])


def remedy(piece: str, op: str | None = None, accelerator: str | None = None) -> str:
    """``fix: <FIXES[piece]>, then <build command>``."""
    return f"fix: {FIXES[piece]}, then {build_command([op] if op else [], accelerator)}"


def op_builder(name: str, accelerator: str | None = None):
    """DeepSpeed's builder of op ``name`` for ``accelerator`` (None: the one DeepSpeed detects);
    None when that accelerator has no such op (shm_comm on CUDA)."""
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().create_op_builder(OP_BUILDERS[name])
    module, cls = ACCELERATORS[accelerator]
    return getattr(importlib.import_module(module), cls)().create_op_builder(OP_BUILDERS[name])


# --------------------------------------------------------------------------- stale build locks
#: Filesystems that other hosts may share: a lock there may be held by a build on another host,
#: which this host cannot see, so it counts as abandoned only after SHARED_LOCK_STALE_S.
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "fuse.sshfs", "wekafs"}
)
#: Longer than any op build seen (async_io ~3 min on 2 cores, CUDA builds ~10 min).
SHARED_LOCK_STALE_S = 30 * 60
#: Pause between the two looks at a lock: torch's FileBaton.release closes the lock file, then
#: removes it; a lock caught between the two is not abandoned and is gone at the second look.
RECHECK_S = 0.5


def extensions_root() -> Path:
    """torch's JIT build folder (torch.utils.cpp_extension._get_build_directory's rule)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if torch.version.hip:
        device = f"rocm{torch.version.hip.replace('.', '')}"
    else:
        device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root(), f"{py}_{device}")


def build_dir(name: str) -> Path:
    """Where torch's JIT build of op ``name`` (DeepSpeed's op name) happens and locks."""
    return extensions_root() / name


def _open_paths(proc: Path) -> set[str]:
    """The working directory and open files of one process of this host (what is readable)."""
    paths = set()
    with contextlib.suppress(OSError):  # gone meanwhile, or another user's
        paths.add(os.readlink(proc / "cwd"))
    with contextlib.suppress(OSError):
        paths.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
    return paths


def builds_in(folder: Path) -> list[int]:
    """PIDs of this host's processes building in ``folder``: the one that holds its lock open
    (torch's FileBaton keeps the lock file it created open until the build ends) or one working
    there (torch runs ninja, and ninja the compiler, in the build folder)."""
    wanted = {os.path.realpath(folder), os.path.realpath(folder / "lock")}
    procs = Path("/proc").glob("[0-9]*")
    return [int(p.name) for p in procs if int(p.name) != os.getpid() and _open_paths(p) & wanted]


def filesystem_type(path: Path, mounts: str | None = None) -> str:
    """Type of the filesystem holding ``path``: its deepest mount point in ``mounts`` (the text
    of /proc/self/mounts; the last of stacked mounts wins)."""
    mounts = Path("/proc/self/mounts").read_text() if mounts is None else mounts
    target, deepest, kind = os.path.realpath(path), "", "unknown"
    for line in mounts.splitlines():
        point, fstype = line.split()[1].replace("\\040", " "), line.split()[2]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(deepest):
            deepest, kind = point, fstype
    return kind


def stale_lock_reason(folder: Path) -> str | None:
    """Why the build lock in ``folder`` is abandoned (its build was killed), or None: there is
    none, or its build may still run (then torch's wait is right)."""
    try:
        age_s = time.time() - (folder / "lock").stat().st_mtime
    except FileNotFoundError:
        return None
    if not Path("/proc/self/fd").is_dir() or builds_in(folder):
        return None  # a build runs there (or, without /proc, this host's processes are unseen)
    if filesystem_type(folder) in NETWORK_FILESYSTEMS and age_s < SHARED_LOCK_STALE_S:
        return None  # a build on another host may hold it
    return f"no process on this host holds it or builds there ({age_s / 60:.0f} min old)"


def remove_stale_lock(name: str) -> Path | None:
    """Remove the abandoned build lock of op ``name`` (see :func:`stale_lock_reason`); returns
    the lock removed, None when there was none to remove."""
    folder = build_dir(name)
    reason = stale_lock_reason(folder)
    if reason is None:
        return None
    time.sleep(RECHECK_S)
    if stale_lock_reason(folder) is None:
        return None
    (folder / "lock").unlink(missing_ok=True)
    print(f"removed the stale build lock {folder / 'lock'}: {reason}", file=sys.stderr)
    return folder / "lock"


def clear_stale_locks(names: Iterable[str], accelerator: str | None = None) -> list[Path]:
    """Remove the abandoned build locks of the ops ``names`` (the ones this accelerator has):
    a run about to load them would wait on each forever. Returns the locks removed."""
    removed = []
    for name in names:
        builder = op_builder(name, accelerator)
        lock = remove_stale_lock(builder.name) if builder is not None else None
        removed += [lock] if lock else []
    return removed


def build_ops(names: list[str], accelerator: str | None = None) -> dict[str, float]:
    """Load (JIT-build when needed) each op, after removing its stale build lock; seconds it
    took, per op this accelerator has."""
    seconds = {}
    for name in names:
        builder = op_builder(name, accelerator)
        if builder is None:
            continue
        remove_stale_lock(builder.name)
        start = time.perf_counter()
        builder.load()
        seconds[name] = time.perf_counter() - start
    return seconds


#: Free host memory (GiB) below which the ops build one after the other: at once, async_io's
#: ninja (cores + 2 compilers) and one or two compilers per other op run side by side, ~1.7 GiB
#: each (8 of them on the 2-core machine).
AT_ONCE_MIN_FREE_GIB = 16


def _say_ready(seconds: dict[str, float]) -> None:
    for name, secs in seconds.items():
        print(f"{name}: ready in {secs:.1f} s", flush=True)


def build_ops_at_once(names: list[str], accelerator: str | None = None) -> dict[str, float]:
    """:func:`build_ops`, each op in its own process at the same time: most ops are one or two
    sources that keep one core busy (cpu_adam, fused_adam, shm_comm), and building them beside
    async_io's many sources uses the cores the serial build leaves idle (on the 2-core dev
    machine 296 s, against 389 s one after the other a day before; 470 s at another hour: its
    speed varies, docs/benchmarks.md "make test's wall time"). One after the other
    where less than AT_ONCE_MIN_FREE_GIB is free: each compiler process holds up to ~1.7 GiB.
    Prints each as it is ready; an op that fails to build raises after the others finished."""
    from offload_study.prediction.calibrate import host_bytes_free  # its one reader of memory

    seconds, failed = {}, {}
    if len(names) < 2 or host_bytes_free() < AT_ONCE_MIN_FREE_GIB * 2**30:
        seconds = build_ops(names, accelerator)
        _say_ready(seconds)
        return seconds
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that imported torch
    with concurrent.futures.ProcessPoolExecutor(len(names), mp_context=spawn) as pool:
        jobs = {pool.submit(build_ops, [name], accelerator): name for name in names}
        for job in concurrent.futures.as_completed(jobs):
            try:
                done = job.result()
            except Exception as exc:  # noqa: BLE001 (reported with its op, raised below)
                failed[jobs[job]] = exc
                continue
            _say_ready(done)
            seconds.update(done)
    if failed:
        raise RuntimeError("; ".join(f"{n}: {e}" for n, e in failed.items()))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--accelerator",
        choices=sorted(ACCELERATORS),
        default=None,
        help="whose ops to build (default: the one DeepSpeed detects, or DS_ACCELERATOR)",
    )
    names = sorted(OP_BUILDERS) + sorted(DEEPSPEED_NAMES.values())
    parser.add_argument("ops", nargs="*", choices=names, default=sorted(OP_BUILDERS))
    args = parser.parse_args(argv)
    build_ops_at_once([our_name(o) for o in args.ops], args.accelerator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
