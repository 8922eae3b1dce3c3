"""What the harness measures and sets on its rank: device and GPU cap, cores and threads, memory
peaks (its own and its process tree's), NVMe usage.

torch is imported inside the functions that need it (the folder sampler and the pure cap rule
work without it).
"""

from __future__ import annotations

import os
import resource
import threading
import time

from offload_study.core import devices, units
from offload_study.core.contracts import GPU_CAP_LOG_PREFIX, TREE_FLOORED, RunSpec


# --------------------------------------------------------------------------- GPU cap
def gpu_cap_bytes(spec: RunSpec, card_bytes: int) -> int | None:
    """The per-process cap (bytes) for the card the scenario stands for; None: run uncapped.

    Cards are sold by binary size (an "A100 40GB" has 40960 MiB), so gpu_mem_gb is GiB
    (:mod:`offload_study.core.units`); a scenario asking for the cluster's own card size (or
    more) runs uncapped.
    """
    want, card = spec.gpu_mem_bytes, spec.cluster_gpu_mem_bytes
    if want and (card is None or want < card) and want < card_bytes:
        return want
    return None


def gpu_cap(spec: RunSpec, card_bytes: int) -> tuple[float | None, dict]:
    """(torch's ``set_per_process_memory_fraction`` argument, None: uncapped; the RankStats
    fields that record the card and the cap). torch multiplies the fraction by the card's total
    memory, so the cap in bytes over the card's bytes caps it at exactly the cap."""
    cap_bytes = gpu_cap_bytes(spec, card_bytes)
    fraction = cap_bytes / card_bytes if cap_bytes is not None else None
    cap_gib = units.bytes_to_gib(cap_bytes) if cap_bytes is not None else None
    return fraction, {"gpu_total_bytes": card_bytes, "gpu_mem_cap_gib": cap_gib}


def set_up_device(spec: RunSpec, is_cuda: bool, local_rank: int) -> dict:
    """Select this rank's device and cap its memory; RankStats fields describing it."""
    if not is_cuda:
        return {"device_name": devices.cpu_model(), "gpu_mem_cap_gib": None}
    import torch

    torch.cuda.set_device(local_rank)
    props = torch.cuda.get_device_properties(local_rank)
    total = int(props.total_memory)
    fraction, recorded = gpu_cap(spec, total)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, local_rank)
        cap_gib, total_gib = recorded["gpu_mem_cap_gib"], units.bytes_to_gib(total)
        print(f"{GPU_CAP_LOG_PREFIX}{cap_gib:.2f} GiB of {total_gib:.2f} GiB", flush=True)
    return {"device_name": props.name, **recorded}


# --------------------------------------------------------------------------- cores and threads
def cpu_ranges(cpus) -> str:
    """CPU numbers as ranges, the way taskset and SLURM write them: {0, 1, 2, 3, 8} -> "0-3,8"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in runs)


def cores_and_threads() -> dict:
    """RankStats fields of where and how wide this rank runs: the cores it may use, torch's
    intra- and inter-op threads, OMP_NUM_THREADS and MKL_NUM_THREADS as it saw them. Read once
    the engine is built: DeepSpeed's SuperOffload pins the rank to a share of the cores then."""
    import torch

    return {
        "cpu_affinity": cpu_ranges(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
    }


# --------------------------------------------------------------------------- memory peaks
def host_peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB -> bytes


# ------------------------------------------------------------------------ the rank's process tree
def uss_bytes(pid: int) -> int | None:
    """Unique set size of a process: the pages only it maps (psutil reads /proc/<pid>/smaps);
    None where unreadable."""
    import psutil

    try:
        return int(psutil.Process(pid).memory_full_info().uss)
    except (psutil.Error, AttributeError):
        return None


def rss_bytes(pid: int) -> int | None:
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def vm_hwm_bytes(pid: int) -> int | None:
    """The kernel's high-water mark of a process's resident set since its exec (or since its
    mark was reset): VmHWM of /proc/<pid>/status. Unlike ru_maxrss it is not carried across
    exec, so a rank does not inherit the peak of the launcher that forked it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            line = next((x for x in fh if x.startswith("VmHWM:")), None)
    except OSError:
        return None
    return int(line.split()[1]) * 1024 if line else None  # kB -> bytes


def reset_vm_hwm(pid: int) -> None:
    """Restart the high-water mark at the current resident set (Linux: clear_refs 5), so the
    mark counts from now; where the kernel refuses, it counts from the process's exec."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


class HostMemorySampler:
    """Samples the host memory of this process and of its process tree (itself and every
    descendant: DeepSpeed SuperOffload's optimizer worker holds the Adam moments) in a
    background thread and keeps both peaks (bytes).

    The rank counts its resident set (RSS, the figure every record has), each descendant its
    unique set (``measure`` "rss+uss": the pages only the worker maps, so a library the rank
    has mapped already is not counted twice); a descendant whose smaps is unreadable counts its
    RSS (``measure`` "rss", an upper bound). Reading smaps walks the process's page tables
    (about 20 ms per GiB resident on a slow host): the thread waits ``interval_s``, and at
    least DUTY times the last sample's own time, between samples, so it takes a small share of
    one core whatever the size of the processes, off the training thread.

    A peak shorter than the interval (the model built on the host before it moves to the GPU)
    can fall between samples: the tree's peak is at least the rank's own high-water mark
    (VmHWM, counted from the sampler's start), which the kernel keeps at every page.
    """

    DUTY = 50  # waits >= 50x a sample's time: at most 2 % of one core

    def __init__(self, interval_s: float = 1.0, pid: int | None = None, unique: bool = True):
        self.pid, self.interval_s = pid or os.getpid(), interval_s
        self.measure = "rss+uss" if unique and uss_bytes(self.pid) is not None else "rss"
        self.own_peak = self.tree_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-memory-sampler", daemon=True)

    def child_size(self, pid: int) -> int:
        """Bytes a descendant adds, as ``measure`` counts them (0: it is gone)."""
        got = uss_bytes(pid) if self.measure == "rss+uss" else None
        return got if got is not None else rss_bytes(pid) or 0

    def sample(self) -> None:
        import psutil

        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            children = []
        own = rss_bytes(self.pid) or 0
        tree = own + sum(self.child_size(child.pid) for child in children)
        self.own_peak, self.tree_peak = max(self.own_peak, own), max(self.tree_peak, tree)

    def _run(self) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            began = time.monotonic()
            self.sample()
            wait = max(self.interval_s, self.DUTY * (time.monotonic() - began))

    def start(self) -> HostMemorySampler:
        reset_vm_hwm(self.pid)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """RankStats fields of the tree's peak (a last sample taken now)."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()
        hwm = vm_hwm_bytes(self.pid)
        self.own_peak = max(self.own_peak, hwm or 0)
        self.tree_peak = max(self.tree_peak, self.own_peak)
        measure = self.measure + (TREE_FLOORED if hwm is not None else "")
        return {"host_peak_tree_bytes": self.tree_peak, "host_tree_measure": measure}


def nvml_used_bytes(device_index: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML absent / no GPU
        return None


def gpu_memory_peaks(is_cuda: bool, local_rank: int) -> dict:
    """RankStats fields of GPU memory: torch's peaks and what NVML sees (None on CPU)."""
    if not is_cuda:
        return dict.fromkeys(
            ("peak_gpu_allocated_bytes", "peak_gpu_reserved_bytes", "nvml_used_bytes")
        )
    import torch

    return {
        "peak_gpu_allocated_bytes": int(torch.cuda.max_memory_allocated(local_rank)),
        "peak_gpu_reserved_bytes": int(torch.cuda.max_memory_reserved(local_rank)),
        "nvml_used_bytes": nvml_used_bytes(torch.cuda.current_device()),
    }


# --------------------------------------------------------------------------- NVMe usage
def dir_size(path: str | os.PathLike) -> int:
    """Bytes of all regular files under path (0 if absent); tolerant of files vanishing."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


class DirSizeSampler:
    """Samples the size of a folder in a background thread and keeps the peak."""

    def __init__(self, path: str | os.PathLike, interval_s: float = 0.2):
        self.path, self.interval_s, self.peak = str(path), interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvme-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, dir_size(self.path))
            self._stop.wait(self.interval_s)

    def start(self) -> DirSizeSampler:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        self.peak = max(self.peak, dir_size(self.path))
        return self.peak
