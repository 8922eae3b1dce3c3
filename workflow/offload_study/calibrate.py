"""Calibrate a cluster: small real measurements of the rates the step-time model needs.

    python -m offload_study.calibrate --cluster NAME [--cluster-dir config/clusters] \\
        [--cores N] --out results/<cluster>/calibration.json

Measures, on the machine it runs on (a compute node of the cluster), each in bounded time:

- dense matmul TFLOP/s in bf16 on the accelerator (torch; on a CPU cluster, the CPU),
- CPU Adam parameters/s: DeepSpeed's ``DeepSpeedCPUAdam`` over a few million fp32 parameters
  with ``--cores`` threads (the cores a run gets),
- pinned host->device and device->host copy GB/s, and host->device from unpinned memory
  (cuda only),
- disk read and write GB/s at the cluster's ``nvme_path`` (O_DIRECT where the file system allows
  it, so the page cache does not stand in for the disk; a few small files).

The result is a :class:`~offload_study.contracts.Calibration`, written atomically, with its
provenance (host, versions, sizes, seconds). Collective bandwidth between GPUs is not measured
(it would need every GPU of a node); it stays null unless a shipped calibration
(config/calibration/<cluster>.json) gives it.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from offload_study.contracts import Calibration, write_calibration
from offload_study.provenance import pkg_version
from offload_study.study import CLUSTER_DIR, load_cluster

#: Sizes per accelerator: matmul side, CPU Adam parameters, copy bytes, disk bytes per file.
SIZES = {
    "cpu": {"matmul": 1024, "adam": 2_000_000, "copy": 0, "disk": 32 * 2**20},
    "cuda": {"matmul": 8192, "adam": 16_000_000, "copy": 512 * 2**20, "disk": 256 * 2**20},
}
#: Seconds each measurement repeats its operation for (after one warm-up run).
BUDGET_S = 0.3
DISK_FILES = 2


def timed(op: Callable[[], None], sync: Callable[[], None] = lambda: None) -> float:
    """Seconds per call of ``op``: one warm-up call, then calls for about BUDGET_S."""
    op()
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        op()
        calls += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= BUDGET_S:
            return elapsed / calls


def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def matmul_tflops(device: str, n: int) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / timed(lambda: torch.mm(a, b), _sync(device)) / 1e12


def cpu_adam_params_per_s(n_params: int, threads: int) -> float:
    """DeepSpeedCPUAdam (the optimizer of CPU offload) on one flat fp32 tensor."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(threads)
    param = torch.nn.Parameter(torch.randn(n_params))
    param.grad = torch.randn(n_params)
    optimizer = DeepSpeedCPUAdam([param], lr=1e-4)
    return n_params / timed(optimizer.step)


def copy_gb_s(nbytes: int) -> dict[str, float]:
    """Host<->device copies: pinned both ways, and host->device from unpinned memory."""
    import torch

    sync = _sync("cuda")
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # touch the pages: the first copy must not time page faults
    rate = {
        "h2d_gb_s": timed(lambda: device.copy_(pinned, non_blocking=True), sync),
        "d2h_gb_s": timed(lambda: pinned.copy_(device, non_blocking=True), sync),
        "pageable_h2d_gb_s": timed(lambda: device.copy_(pageable), sync),
    }
    return {key: nbytes / seconds / 1e9 for key, seconds in rate.items()}


def _open(path: Path, flags: int) -> tuple[int, bool]:
    """A file descriptor with O_DIRECT when the file system takes it (tmpfs does not)."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


def disk_gb_s(folder: str, nbytes: int) -> dict:
    """Write DISK_FILES files of ``nbytes`` (synced) and read them back, in a private temp
    folder under ``folder`` that is removed afterwards."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    block = mmap.mmap(-1, 4 * 2**20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(len(block)))
    with tempfile.TemporaryDirectory(prefix="offload-study-calibrate-", dir=folder) as tmp:
        files = [Path(tmp) / f"probe{i}" for i in range(DISK_FILES)]
        start = time.perf_counter()
        for path in files:
            fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            for _ in range(nbytes // len(block)):
                os.write(fd, block)
            os.fsync(fd)
            os.close(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for path in files:
            fd, _ = _open(path, os.O_RDONLY)
            while os.readv(fd, [block]) > 0:
                pass
            os.close(fd)
        read_s = time.perf_counter() - start
    total = DISK_FILES * (nbytes // len(block)) * len(block)
    return {
        "disk_write_gb_s": total / write_s / 1e9,
        "disk_read_gb_s": total / read_s / 1e9,
        "direct_io": direct,
        "disk_bytes": total,
    }


def calibrate(cluster: dict, cores: int) -> Calibration:
    """Measure this machine for ``cluster`` (a validated cluster description)."""
    import torch

    accelerator = cluster["accelerator"]
    device = "cuda" if accelerator == "cuda" else "cpu"
    sizes = SIZES[accelerator]
    started = time.perf_counter()
    torch.set_num_threads(cores)
    rates = {"matmul_tflops": matmul_tflops(device, sizes["matmul"])}
    rates["cpu_adam_params_per_s"] = cpu_adam_params_per_s(sizes["adam"], cores)
    if accelerator == "cuda":
        rates.update(copy_gb_s(sizes["copy"]))
    disk = disk_gb_s(cluster["nvme_path"], sizes["disk"]) if cluster.get("nvme_path") else {}
    provenance = {
        "host": platform.node(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch_version": torch.__version__,
        "deepspeed_version": pkg_version("deepspeed"),
        "cores": cores,
        "sizes": sizes,
        "direct_io": disk.get("direct_io"),
        "disk_path": cluster.get("nvme_path"),
        "seconds": round(time.perf_counter() - started, 2),
    }
    return Calibration(
        cluster=cluster["name"],
        accelerator=accelerator,
        source=f"measured by offload_study.calibrate on {platform.node()}",
        matmul_dtype="bf16",
        cpu_adam_threads=cores,
        disk_read_gb_s=disk.get("disk_read_gb_s"),
        disk_write_gb_s=disk.get("disk_write_gb_s"),
        provenance=provenance,
        **rates,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", required=True, help="cluster name (config/clusters/<name>.yaml)")
    p.add_argument("--cluster-dir", default=str(CLUSTER_DIR))
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", required=True, help="calibration.json to write")
    a = p.parse_args(argv)
    calibration = calibrate(load_cluster(a.cluster, a.cluster_dir), max(1, a.cores))
    write_calibration(a.out, calibration)
    print(f"calibrate: {a.out}: " + ", ".join(
        f"{k}={v:.4g}" for k, v in calibration.to_dict().items() if isinstance(v, float)
    ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
