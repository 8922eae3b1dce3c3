"""Calibrate a cluster: small real measurements of the rates the step-time model needs.

    python -m offload_study.prediction.calibrate --cluster NAME [--cluster-dir config/clusters] \\
        [--cores N] --out results/<cluster>/calibration.json

Measures, on the machine it runs on (a compute node of the cluster), each in bounded time:

- dense matmul TFLOP/s in bf16 on the accelerator (torch; on a CPU cluster, the CPU),
- CPU Adam parameters/s: DeepSpeed's ``DeepSpeedCPUAdam`` over one flat fp32 tensor with
  ``--cores`` threads (the cores a run gets),
- pinned host->device and device->host copy GB/s, and host->device from unpinned memory
  (cuda only),
- disk read and write GB/s at the cluster's ``nvme_path`` (O_DIRECT where the file system allows
  it, so the page cache does not stand in for the disk; a few small files),
- on a GPU cluster, SuperOffload's synchronous step through DeepSpeed's own CPU Adam worker
  (:func:`superoffload_step_at`; DeepSpeed refuses SuperOffload without CUDA),
- on a CPU cluster, what a tiny model's step time is made of beyond its FLOPs, under each
  engine that has a probe (:attr:`offload_study.engines.Engine.host_probe`): the host seconds
  of one Llama decoder layer (eager ops, autograd and the engine's hooks and collectives; the
  real engine on a Llama of 1 and of 3 layers, hidden size 64) per forward and backward, and of
  the rest of a micro-step, at two sequence lengths (the host time of a layer grows with its
  activations), with 1 rank and with 2 ranks (a lone rank has nothing to reduce) of one thread
  each, and in the 2-rank gloo group the latency and bandwidth of an all-gather.

Rates are stable on a shared machine because every working set is at least
:data:`SIZE_OVER_CACHE` times the last-level cache (read from sysfs: a cache-resident size
measured 30x faster than the same call on a training-sized tensor), the op runs once to warm up
(first-touch pages, thread pools, kernels) and then :data:`REPEATS` timed samples give the median;
their range is recorded (``provenance["spread"]``) so that a noisy calibration shows.

The result is a :class:`~offload_study.core.contracts.Calibration`, written atomically, with its
provenance (host, versions, sizes, seconds, spreads). Collective bandwidth between GPUs is not
measured (it would need every GPU of a node); it stays null unless a shipped calibration
(config/calibration/<cluster>.json) gives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from offload_study import engines
from offload_study.core import units
from offload_study.core.contracts import Calibration, write_calibration
from offload_study.core.study import CLUSTER_DIR, load_cluster
from offload_study.engines.deepspeed.model import SUPEROFFLOAD_CORES_PERC
from offload_study.engines.deepspeed.probe import PROBE_MICRO_BATCH, probe_config
from offload_study.prediction.shared import MMAP_THRESHOLD_BYTES

#: Every working set (matmul operands, Adam's four fp32 arrays, copy buffers) is at least this
#: many times the last-level cache, so that the rate is the one of memory, not of the cache.
SIZE_OVER_CACHE = 4
#: A GPU's matmul rate is measured on squares of this side, bf16, random data, whatever the
#: study: the size of the shipped H200 figures the step model's efficiency is fitted against
#: (config/calibration/h200-*.json; predict.FITS["cuda"]), so that a lease's own rate scales
#: the FLOPs as the machine does, not as a model's shapes do (an H200 measured 646-680 at a
#: layer's shapes, 706-720 at a 14592 side, 677-690 at this one: docs/benchmarks.md).
GPU_MATMUL_SIDE = 8192
#: Timed samples per measurement (after one warm-up call); the median is the rate.
REPEATS = 5
#: Each sample repeats its op for at least this long (one call when a call takes longer).
MIN_SAMPLE_S = 0.05
#: Disk probe: bytes per file per accelerator kind, files.
DISK_BYTES = {"cpu": 32 * 2**20, "cuda": 256 * 2**20}
DISK_FILES = 2
#: Host-time probe: a Llama small enough that its FLOPs do not count, built with 1 and 3 layers;
#: micro-batch, micro-steps per timed sample, samples.
PROBE_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
PROBE_LAYERS = (1, 3)
PROBE_BATCH, PROBE_CALLS, PROBE_REPEATS = PROBE_MICRO_BATCH, 5, 7
#: Sequence lengths the probe runs each engine at: a layer's host time grows with the elements
#: its eager ops touch (measured, one rank: forward + backward 4.6-5.3 ms at 2 x 32 tokens of
#: hidden 64, 7.7-11.8 ms at 2 x 128, 10.6-21 ms at 2 x 128 of hidden 128), the FLOPs still
#: negligible (0.1 ms at the larger one).
PROBE_SEQS = (32, 128)
PROBE_TIMEOUT_S = 300
#: Ranks per node the probe runs with: one (nothing to reduce), two (gloo between them).
PROBE_RANKS = (1, 2)


def _cache_bytes(text: str) -> int:
    unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * unit


def last_level_cache_bytes() -> int:
    """The last-level cache of the whole machine (sysfs): the largest level's size times its
    instances (an EPYC has one L3 per chiplet, a threaded op spans them); 32 MiB when sysfs
    does not say."""
    instances: dict[int, dict[str, int]] = {}  # level -> cpus sharing one instance -> bytes
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((index / "level").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
            size = _cache_bytes((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        instances.setdefault(level, {})[shared] = size
    if not instances:
        return 32 * 2**20
    return sum(instances[max(instances)].values())


def sizes(accelerator: str, cache_bytes: int) -> dict[str, int]:
    """Matmul side, CPU Adam parameters and copy bytes, each past SIZE_OVER_CACHE x the cache
    (a GPU's matmul and copies at least the sizes that reach its peak)."""
    floor = SIZE_OVER_CACHE * cache_bytes
    side = 256 * math.ceil(math.sqrt(floor / (3 * 2)) / 256)  # three bf16 operands
    return {
        "matmul": GPU_MATMUL_SIDE if accelerator == "cuda" else side,
        "adam": math.ceil(floor / 16),  # parameter, gradient, two moments: 16 B in fp32
        "copy": max(floor, 512 * 2**20) if accelerator == "cuda" else 0,
        "disk": DISK_BYTES[accelerator],
    }


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median of the samples, the fastest and the slowest."""

    median: float
    fastest: float
    slowest: float
    samples: int
    calls_per_sample: int

    @classmethod
    def of(cls, per_call: list[float], calls: int) -> Timing:
        """From the seconds per call of each sample."""
        return cls(statistics.median(per_call), min(per_call), max(per_call), len(per_call), calls)

    def summary(self) -> dict:
        """Seconds per call at the median, with the range of the samples."""
        return {
            "median": self.median,
            "low": self.fastest,
            "high": self.slowest,
            "spread_pct": round(100 * (self.slowest - self.fastest) / self.median, 1),
            "samples": self.samples,
            "calls_per_sample": self.calls_per_sample,
        }

    def rate(self, work: float) -> dict:
        """``work`` per second at the median, with the range of the samples."""
        return {
            "median": work / self.median,
            "low": work / self.slowest,
            "high": work / self.fastest,
            "spread_pct": round(100 * (self.slowest - self.fastest) / self.median, 1),
            "samples": self.samples,
            "calls_per_sample": self.calls_per_sample,
        }


def measure(
    op: Callable[[], object],
    sync: Callable[[], None] = lambda: None,
    repeats: int = REPEATS,
    min_sample_s: float = MIN_SAMPLE_S,
    calls: int | None = None,
) -> Timing:
    """Time ``op``: one warm-up call, one call to size the samples, then ``repeats`` samples
    of as many calls as last ``min_sample_s``, or of ``calls`` calls (collectives: every rank
    must make the same number)."""
    op()
    sync()
    start = time.perf_counter()
    op()
    sync()
    if calls is None:
        calls = max(1, math.ceil(min_sample_s / max(time.perf_counter() - start, 1e-9)))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            op()
        sync()
        per_call.append((time.perf_counter() - start) / calls)
    return Timing.of(per_call, calls)


#: Until-stable sampling (:func:`measure_until_stable`): the last STABLE_WINDOW samples within
#: STABLE_SPREAD of their median, at most STABLE_MAX_SAMPLES samples.
STABLE_WINDOW, STABLE_SPREAD, STABLE_MAX_SAMPLES = 5, 0.03, 25
#: ... and for at most this many seconds (a loaded machine never settles: the spread says so)
STABLE_MAX_S = 10.0


def measure_until_stable(
    op: Callable[[], object],
    sync: Callable[[], None] = lambda: None,
    window: int = STABLE_WINDOW,
    spread: float = STABLE_SPREAD,
    max_samples: int = STABLE_MAX_SAMPLES,
    min_sample_s: float = MIN_SAMPLE_S,
    max_s: float = STABLE_MAX_S,
) -> tuple[Timing, bool]:
    """(the Timing of the last ``window`` samples, whether they settled): samples as
    :func:`measure` takes them, one more at a time until the relative range of the last
    ``window`` is under ``spread`` (a machine warming up, or another job's burst, shows as a
    drift the first samples carry), at most ``max_samples`` and, past ``window`` samples,
    ``max_s`` seconds."""
    op()
    sync()
    start = time.perf_counter()
    op()
    sync()
    calls = max(1, math.ceil(min_sample_s / max(time.perf_counter() - start, 1e-9)))
    per_call: list[float] = []
    began = time.perf_counter()
    while len(per_call) < max_samples:
        start = time.perf_counter()
        for _ in range(calls):
            op()
        sync()
        per_call.append((time.perf_counter() - start) / calls)
        last = per_call[-window:]
        if len(last) == window and (max(last) - min(last)) / statistics.median(last) < spread:
            return Timing.of(last, calls), True
        if len(last) == window and time.perf_counter() - began > max_s:
            break
    return Timing.of(per_call[-window:], calls), False


def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def matmul_tflops(device: str, n: int) -> dict:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return measure(lambda: torch.mm(a, b), _sync(device)).rate(2 * n**3 / 1e12)


#: the CPU optimizers whose rates a calibration holds: DeepSpeedCPUAdam (ZeRO-3's CPU offload)
#: and torch's AdamW with foreach (the CPU step of FSDP2's offload)
CPU_OPTIMIZERS = ("DeepSpeedCPUAdam", "torch AdamW")


def _cpu_optimizer(kind: str, param):
    if kind == "DeepSpeedCPUAdam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam([param], lr=1e-4)
    import torch

    return torch.optim.AdamW([param], lr=1e-4, foreach=True)


def partition_layout(n_params: int, sub_group: int | None = None, pinned: bool = False) -> list:
    """A rank's offloaded partition of ``n_params`` as DeepSpeed's ZeRO-3 holds it: fp32 masters
    of ``sub_group`` parameters each (one flat tensor without), each with its fp32 gradient,
    in pinned memory when ``pinned`` (offload_optimizer.pin_memory on a GPU)."""
    import torch

    groups, size = [], sub_group or n_params
    for start in range(0, n_params, size):
        master = torch.nn.Parameter(torch.randn(min(size, n_params - start)))
        master.grad = torch.randn(master.numel())
        if pinned:
            master.data, master.grad = master.data.pin_memory(), master.grad.pin_memory()
        groups.append(master)
    return groups


def _rate(op, n_params: int, until_stable: bool, sync=lambda: None) -> dict:
    """``n_params`` per second of ``op``: :func:`measure`, or until stable with the spread and
    whether it settled."""
    if not until_stable:
        return measure(op, sync).rate(n_params)
    timing, settled = measure_until_stable(op, sync, min_sample_s=0.0)
    return {**timing.rate(n_params), "settled": settled, "params": n_params}


def adam_rate(
    kind: str, n_params: int, threads: int, until_stable: bool = False, groups: list | None = None
) -> dict:
    """Parameters per second of the CPU optimizer ``kind`` (CPU_OPTIMIZERS) on one flat fp32
    tensor of ``n_params`` (16 B per parameter: parameter, gradient, two moments), or over
    ``groups`` (:func:`partition_layout`) one sub-group per call as stage3.py's
    ``_optimizer_step`` swaps them in. ``until_stable``: sampled until the samples settle
    (:func:`measure_until_stable`), with the spread and whether it settled."""
    import torch

    torch.set_num_threads(threads)
    groups = groups or partition_layout(n_params)
    optimizer = _cpu_optimizer(kind, groups[0])

    def step() -> None:
        for master in groups:
            optimizer.param_groups[0]["params"] = [master]
            optimizer.step()

    return _rate(step, n_params, until_stable)


def cpu_adam_params_per_s(n_params: int, threads: int) -> dict:
    """DeepSpeedCPUAdam (the optimizer of CPU offload) on one flat fp32 tensor."""
    return adam_rate("DeepSpeedCPUAdam", n_params, threads)


def torch_adam_params_per_s(n_params: int, threads: int) -> dict:
    """torch AdamW with foreach, on the same flat fp32 tensor as DeepSpeedCPUAdam."""
    return adam_rate("torch AdamW", n_params, threads)


def fp16_check_elems_per_s(n_elems: int, threads: int, until_stable: bool = False) -> dict:
    """Elements per second of DeepSpeed's fp16 overflow check over a host gradient buffer of
    ``n_elems`` with ``threads`` cores (stage3.py ``has_overflow``: ``isinf(buffer).any()``
    and ``isnan(buffer).any()``, both every step). ATen's isinf makes an fp16 copy of |x| and
    a bool mask, isnan another mask: fresh memory each step, as in the run."""
    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(n_elems, dtype=torch.float16)

    def check() -> bool:
        return bool(torch.isinf(buffer).any() | torch.isnan(buffer).any())

    if not until_stable:
        return measure(check).rate(n_elems)
    timing, settled = measure_until_stable(check, min_sample_s=0.0)
    return {**timing.rate(n_elems), "settled": settled, "elements": n_elems}


def step_passes_at(
    n_params: int,
    threads: int,
    accelerator: str,
    until_stable: bool = True,
    groups: list | None = None,
) -> dict:
    """Parameters per second of the host passes DeepSpeed's ZeRO-3 step makes over each
    offloaded sub-group beside CPU Adam, on ``n_params`` (over ``groups``, the run's layout:
    :func:`partition_layout`) with ``threads`` cores:

    - grad_unscale: ``unscale_and_clip_grads`` multiplies the fp32 gradients in place, every
      step, at a loss scale of 1 too;
    - master_copy: ``_reassign_or_swap_out_partitioned_parameters`` copies the updated fp32
      master into the bf16 partition; on the host when the parameters are offloaded;
    - master_upload (cuda): the same copy into a partition on the GPU (parameters not
      offloaded): the whole ``copy_`` of another dtype across devices, as the run calls it."""
    import torch

    torch.set_num_threads(threads)
    groups = groups or partition_layout(n_params)
    bf16 = [torch.empty(m.numel(), dtype=torch.bfloat16) for m in groups]
    out = {
        "grad_unscale_params_per_s": _rate(
            lambda: [m.grad.mul_(1.0) for m in groups], n_params, until_stable
        ),
        "master_copy_params_per_s": _rate(
            lambda: [b.copy_(m.data) for b, m in zip(bf16, groups, strict=True)],
            n_params,
            until_stable,
        ),
    }
    if accelerator == "cuda":
        bf16 = [b.to("cuda") for b in bf16]
        out["master_upload_params_per_s"] = _rate(
            lambda: [b.copy_(m.data) for b, m in zip(bf16, groups, strict=True)],
            n_params,
            until_stable,
            _sync("cuda"),
        )
    return out


#: Parameters of the one sub-group whose round trip through the worker is the cost per
#: sub-group (small enough that its copies and Adam take microseconds).
SUPEROFFLOAD_TINY_GROUP = 4096
#: Seconds the rank waits for one sub-group's result before the probe gives up.
SUPEROFFLOAD_WAIT_S = 120.0


def _superoffload_sync_step(worker, groups: list, result_key: str, first_id: int = 0) -> None:
    """SuperOffload's step with ``gradient_clipping`` set (superoffload_stage3
    ``_step_with_clipping``), each sub-group in turn: the rank unscales its fp32 gradient, puts
    master and gradient on the worker's queue, polls for the result every millisecond as
    ``_wait_for_single_async_result`` does, and copies the updated master into its own. The
    worker keeps Adam's moments per sub-group id: sub-groups of other sizes take other ids."""
    for index, master in enumerate(groups, start=first_id):
        master.grad.mul_(1.0)
        worker.async_step(0, index, master.data, master.grad.data, lr=1e-4)
        waited = time.monotonic()
        while (result := worker.get_result()) is None:
            if not worker.cpuadam_process.is_alive():
                code = worker.cpuadam_process.exitcode
                raise RuntimeError(f"SuperOffload's CPU Adam worker died (exit code {code})")
            if time.monotonic() - waited > SUPEROFFLOAD_WAIT_S:
                raise RuntimeError(
                    f"SuperOffload's CPU Adam worker sent no result in {SUPEROFFLOAD_WAIT_S:.0f} s"
                )
            time.sleep(0.001)
        master.data.copy_(result[result_key], non_blocking=True)


def superoffload_step_at(n_params: int, accelerator: str, groups: list | None = None) -> dict:
    """What SuperOffload's synchronous step costs on the host, through DeepSpeed's own worker
    (``SuperOffloadCPUOptimizer``: a spawned process running CPU Adam, fed tensors in shared
    memory over a queue, bound to DeepSpeed's default share of the cores; this process, the
    rank, is bound to the rest while it runs). Measured over ``groups`` (:func:`partition_layout`
    of ``n_params``, pinned on a GPU as the run holds them) and as the round trip of one tiny
    sub-group: ``superoffload_sub_group_s`` is the cost per sub-group (queue, polling),
    ``superoffload_step_params_per_s`` the rate of the rest (the unscale, the tensors handed
    over in shared memory, the worker's gradient copy and CPU Adam, the copy back)."""
    from deepspeed.runtime.superoffload.superoffload_utils import (
        ResultKeys,
        SuperOffloadCPUOptimizer,
    )

    groups = groups or partition_layout(n_params, pinned=accelerator == "cuda")
    tiny = partition_layout(SUPEROFFLOAD_TINY_GROUP)
    adam = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}
    affinity = os.sched_getaffinity(0)
    worker = SuperOffloadCPUOptimizer(
        adam,
        cpuadam_cores_perc=SUPEROFFLOAD_CORES_PERC,
        max_grad_numel=max(m.numel() for m in groups),
        pin_memory=accelerator == "cuda",
    )
    try:
        key = ResultKeys.UPDATED_PARAM
        per_group = measure(lambda: _superoffload_sync_step(worker, tiny, key, len(groups)))
        step = measure(lambda: _superoffload_sync_step(worker, groups, key))
    finally:
        worker.close()
        os.sched_setaffinity(0, affinity)  # the worker bound this process to the rank's cores
    # what the step takes beyond its sub-groups' round trips (at least a hundredth of it)
    beyond = [
        max(s - len(groups) * per_group.median, s / 100)
        for s in (step.median, step.fastest, step.slowest)
    ]
    rate = Timing(*beyond, step.samples, step.calls_per_sample).rate(n_params)
    return {
        "superoffload_step_params_per_s": {**rate, "sub_groups": len(groups)},
        "superoffload_sub_group_s": per_group.summary(),
    }


def copy_gb_s(nbytes: int) -> dict[str, dict]:
    """Host<->device copies: pinned both ways, and host->device from unpinned memory."""
    import torch

    sync = _sync("cuda")
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # touch the pages: the first copy must not time page faults
    timings = {
        "h2d_gb_s": measure(lambda: device.copy_(pinned, non_blocking=True), sync),
        "d2h_gb_s": measure(lambda: pinned.copy_(device, non_blocking=True), sync),
        "pageable_h2d_gb_s": measure(lambda: device.copy_(pageable), sync),
    }
    return {key: timing.rate(nbytes / 1e9) for key, timing in timings.items()}


#: The fresh allocation the page-fault probe writes: twice glibc's mmap threshold, so mapped
#: from the OS every call.
FRESH_PAGES_BYTES = 2 * MMAP_THRESHOLD_BYTES


def page_fault_gb_s(device: str, nbytes: int = FRESH_PAGES_BYTES) -> dict:
    """Host memory the OS maps on its first write, GB/s of pages: a copy of ``nbytes`` from
    ``device`` into a new host tensor less the same copy into a touched one, on one thread.
    FSDP2 copies gradients to the host this way (``.to("cpu")``, blocking, from the one thread
    that calls it); the copy's wait for each fresh page is what this prices."""
    import torch

    sync = _sync(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.ones(nbytes, dtype=torch.uint8, device=device)
        touched = torch.empty(nbytes, dtype=torch.uint8)
        touched.fill_(1)
        fresh = measure(lambda: torch.empty(nbytes, dtype=torch.uint8).copy_(source), sync)
        again = measure(lambda: touched.copy_(source), sync)
    finally:
        torch.set_num_threads(threads)
    # the faults' share, at least a hundredth of the copy (a host that maps pages for free)
    faults = [max(f - again.median, f / 100) for f in (fresh.median, fresh.fastest, fresh.slowest)]
    rate = Timing(*faults, fresh.samples, fresh.calls_per_sample).rate(nbytes / 1e9)
    return {"page_fault_gb_s": {**rate, "bytes": nbytes}}


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


# --------------------------------------------------------------------------- workload shapes
@dataclass(frozen=True)
class Workload:
    """The sizes a study's runs use (:func:`workload_of`): the CPU Adam partition (parameters of
    the largest offloaded partition per rank), the matmul shapes of one decoder layer (M, K, N)
    at the largest micro-batch x sequence, and the copy sizes of its reduce buckets (bytes)."""

    adam_params: int
    matmul_shapes: tuple[tuple[int, int, int], ...]
    copy_bytes: tuple[int, ...]
    # zero_optimization.sub_group_size of the run with that partition: DeepSpeed holds the
    # partition in sub-groups of about this many parameters, and each pass of its step loops
    # over them (on two H200 leases CPU Adam over pinned 1e8-parameter sub-groups of a 1.91e9
    # partition ran 21 % and 3 % slower than over one flat tensor: benchmarks/step_passes.py)
    sub_group_params: int | None = None


def layer_matmuls(tokens: int, hidden: int, ffn: int, kv: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of a Llama decoder layer's projections: q and o (hidden x hidden), k and v
    (hidden x kv), gate and up (hidden x ffn), down (ffn x hidden)."""
    return (
        [(tokens, hidden, hidden)] * 2
        + [(tokens, hidden, kv)] * 2
        + [(tokens, hidden, ffn)] * 2
        + [(tokens, ffn, hidden)]
    )


def engine_versions() -> dict[str, str | None]:
    """The installed version of every engine, by name (what the rates were measured with)."""
    from offload_study import engines

    return {e.name: e.versions(lambda _: None)["engine_version"] for e in engines.engines()}


def workload_of(study: str, cluster_dir: str) -> Workload | None:
    """The shapes of ``study``'s planned runs (None when no run has a known Llama shape)."""
    from offload_study import engines
    from offload_study.planning.plan import Plan
    from offload_study.prediction.shared import model_shape

    plan = Plan(study, cluster_dir=cluster_dir)
    adam, sub_group, shapes, copies = 0, None, set(), set()
    for spec in plan.runs:
        shape = model_shape(spec)
        if shape is None:
            continue
        engine = engines.of(spec)
        layout = engine.model.calibration_layout(spec, engine.build_config(spec))
        if layout is None:
            continue
        if layout.optimizer_params > adam:
            adam, sub_group = layout.optimizer_params, layout.sub_group_params
        kv = shape.hidden * shape.kv_heads // shape.heads
        tokens = spec.micro_batch * spec.seq_len
        shapes.update(layer_matmuls(tokens, shape.hidden, shape.ffn, kv))
        copies.add(layout.copy_bytes)
    if not adam:
        return None
    return Workload(adam, tuple(sorted(shapes)), tuple(sorted(copies)), sub_group)


def matmul_tflops_at(device: str, shapes: tuple[tuple[int, int, int], ...]) -> dict:
    """bf16 matmul TFLOP/s over a layer's shapes: their FLOPs over their summed median times
    (each shape until stable), so a layer's mix of large and thin products is weighted as a
    training step weights it."""
    import torch

    flops = seconds = 0.0
    per_shape, settled = {}, True
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        timing, ok = measure_until_stable(lambda a=a, b=b: torch.mm(a, b), _sync(device))
        flops, seconds, settled = flops + 2 * m * k * n, seconds + timing.median, settled and ok
        per_shape[f"{m}x{k}x{n}"] = timing.rate(2 * m * k * n / 1e12)
        del a, b
    rate = flops / seconds / 1e12
    spreads = [v["spread_pct"] for v in per_shape.values()]
    return {
        "median": rate,
        "low": min(v["low"] for v in per_shape.values()),
        "high": max(v["high"] for v in per_shape.values()),
        "spread_pct": max(spreads),
        "samples": min(v["samples"] for v in per_shape.values()),
        "calls_per_sample": 1,
        "settled": settled,
        "shapes": per_shape,
    }


def workload_matmul(device: str, shapes: tuple[tuple[int, int, int], ...]) -> dict:
    """The matmul rate a prediction takes: on a CPU at the layer's shapes (its step model
    fits no efficiency); on a GPU at GPU_MATMUL_SIDE, what the fitted efficiency is a share
    of, with the layer's shapes measured beside it for the record (``layer_shapes``)."""
    if device == "cpu":
        return matmul_tflops_at(device, shapes)
    return {
        **matmul_tflops(device, GPU_MATMUL_SIDE),
        "side": GPU_MATMUL_SIDE,
        "layer_shapes": matmul_tflops_at(device, shapes),
    }


def copies_at(sizes: tuple[int, ...], pageable_bytes: int) -> dict[str, dict]:
    """Pinned copies both ways at each bucket size (the rate is the smallest bucket's: every
    gradient crosses in buckets of that size at most), and host->device from unpinned memory
    at ``pageable_bytes`` (the fp32 master of the partition, capped), each until stable."""
    import torch

    sync, out, by_size = _sync("cuda"), {}, {}
    for nbytes in sizes:
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        h2d, ok_h = measure_until_stable(
            lambda d=device, h=pinned: d.copy_(h, non_blocking=True), sync
        )
        d2h, ok_d = measure_until_stable(
            lambda d=device, h=pinned: h.copy_(d, non_blocking=True), sync
        )
        by_size[nbytes] = {
            "h2d_gb_s": {**h2d.rate(nbytes / 1e9), "settled": ok_h},
            "d2h_gb_s": {**d2h.rate(nbytes / 1e9), "settled": ok_d},
        }
    smallest = by_size[min(by_size)]
    out.update(
        {
            k: {**v, "bytes_by_size": {str(n): by_size[n][k]["median"] for n in by_size}}
            for k, v in smallest.items()
        }
    )
    device = torch.empty(pageable_bytes, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(pageable_bytes, dtype=torch.uint8)
    pageable.fill_(1)  # touch the pages: the first copy must not time page faults
    timing, ok = measure_until_stable(lambda: device.copy_(pageable), sync)
    out["pageable_h2d_gb_s"] = {**timing.rate(pageable_bytes / 1e9), "settled": ok}
    return out


def host_bytes_free() -> int:
    """MemAvailable of /proc/meminfo (bytes); 8 GiB when it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def workload_spread(workload: Workload, accelerator: str, cores: int) -> dict:
    """The rates at the workload's sizes (cuda: matmul on the GPU, copies; both: CPU Adam),
    CPU Adam's partition capped at a quarter of the free host memory (16 B per parameter)."""
    device = "cuda" if accelerator == "cuda" else "cpu"
    adam = min(workload.adam_params, host_bytes_free() // (4 * 16))
    spread = {
        "matmul_tflops": workload_matmul(device, workload.matmul_shapes),
        "torch_adam_params_per_s": adam_rate("torch AdamW", adam, cores, until_stable=True),
        "fp16_check_elems_per_s": fp16_check_elems_per_s(adam, cores, until_stable=True),
    }
    # DeepSpeed's step over the partition as the run holds it: sub-groups, pinned on a GPU
    groups = partition_layout(adam, workload.sub_group_params, pinned=accelerator == "cuda")
    spread["cpu_adam_params_per_s"] = adam_rate("DeepSpeedCPUAdam", adam, cores, True, groups)
    spread.update(step_passes_at(adam, cores, accelerator, groups=groups))
    if accelerator == "cuda":  # DeepSpeed refuses SuperOffload elsewhere; last: it moves the
        # groups into shared memory
        spread.update(superoffload_step_at(adam, accelerator, groups))
    del groups
    if accelerator == "cuda":
        pageable = min(4 * workload.adam_params, 2 * 2**30)
        spread.update(copies_at(workload.copy_bytes, pageable))
    return spread


# --------------------------------------------------------------------------- host-time probe
def _interleaved(steps: dict[tuple, Callable[[], float]]) -> dict[tuple, tuple[Timing, Timing]]:
    """(forward, micro-step) of each model: two warm-up micro-steps each (ZeRO-3 records its
    trace), then samples of PROBE_CALLS taken in turn, so that a change in the machine's load
    falls on every engine and size alike."""
    forward = {key: [] for key in steps}
    whole = {key: [] for key in steps}
    for step in [*steps.values(), *steps.values()]:
        step()
    for _ in range(PROBE_REPEATS):
        for key, step in steps.items():
            start = time.perf_counter()
            forward_s = sum(step() for _ in range(PROBE_CALLS))
            whole[key].append((time.perf_counter() - start) / PROBE_CALLS)
            forward[key].append(forward_s / PROBE_CALLS)
    return {
        key: (Timing.of(forward[key], PROBE_CALLS), Timing.of(whole[key], PROBE_CALLS))
        for key in steps
    }


def _slope_costs(few: tuple[int, tuple], many: tuple[int, tuple]) -> dict[str, float]:
    """A layer's forward and backward (with the step) and the rest of a micro-step, from the
    (layers, (forward, micro-step)) timings of two engines: the slope and the intercept."""
    (n_few, (fwd_few, step_few)), (n_many, (fwd_many, step_many)) = few, many
    forward = (fwd_many.median - fwd_few.median) / (n_many - n_few)
    whole = (step_many.median - step_few.median) / (n_many - n_few)
    costs = {
        "forward": forward,
        "backward": whole - forward,
        "rest": step_few.median - n_few * whole,
    }
    return {k: max(v, 0.0) for k, v in costs.items()}


def _size_costs(small: dict[str, float], large: dict[str, float]) -> dict[str, float]:
    """The costs at the smaller probe size with how they grow (never shrink) with the size: a
    layer's per element of its activations (tokens x hidden), the rest per token."""
    tokens = [PROBE_BATCH * seq for seq in PROBE_SEQS]
    elements = [t * PROBE_LLAMA["hidden_size"] for t in tokens]
    grow = {
        "forward_per_element": (large["forward"] - small["forward"]) / (elements[1] - elements[0]),
        "backward_per_element": (large["backward"] - small["backward"])
        / (elements[1] - elements[0]),
        "rest_per_token": (large["rest"] - small["rest"]) / (tokens[1] - tokens[0]),
    }
    return {
        **small,
        "layer_elements": elements[0],
        "tokens": tokens[0],
        **{k: max(v, 0.0) for k, v in grow.items()},
    }


def _layer_costs(torch, dist, device: str) -> dict:
    """Host seconds of one Llama decoder layer under each engine with a probe, at sizes where its
    FLOPs do not count (eager ops, autograd, the engine's hooks and collectives): a forward, a
    backward (with the step), and the rest of a micro-step (embeddings, norm, head, loss), from
    models of 1 and 3 layers, the slope and the intercept, at each of :data:`PROBE_SEQS`
    (:func:`_size_costs`); every engine's samples taken in turn."""
    from transformers import LlamaConfig, LlamaForCausalLM

    probed = [engine for engine in engines.engines() if engine.host_probe is not None]
    steps = {}
    for engine in probed:
        for layers in PROBE_LAYERS:
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**PROBE_LLAMA, num_hidden_layers=layers))
            step = engine.host_probe(model, device)
            for seq in PROBE_SEQS:
                tokens = torch.randint(0, PROBE_LLAMA["vocab_size"], (PROBE_BATCH, seq))
                steps[engine.name, seq, layers] = functools.partial(step, tokens)
    timings = _interleaved(steps)
    ranks = str(dist.get_world_size())

    def costs(name: str) -> dict:
        sized = [
            _slope_costs(
                *sorted((n, t) for (e, q, n), t in timings.items() if (e, q) == (name, seq))
            )
            for seq in PROBE_SEQS
        ]
        return {ranks: _size_costs(*sized)}

    return {
        "values": {"layer_host_s": {engine.name: costs(engine.name) for engine in probed}},
        "spread": {
            f"{engines.label(e)}, {ranks} rank(s), seq {q}, {n} layer(s): {name}": t.summary()
            for (e, q, n), (fwd, whole) in timings.items()
            for name, t in (("forward", fwd), ("micro-step", whole))
        },
    }


def _allgather_costs(torch, dist) -> dict:
    """Latency of a small all-gather and the bandwidth of a large one (bf16, like ZeRO-3's)."""
    world = dist.get_world_size()
    timings = {}
    for numel, calls in ((1024, 50), (2**21, 5)):
        part = torch.ones(numel, dtype=torch.bfloat16)
        out = torch.empty(world * numel, dtype=torch.bfloat16)
        timings[numel] = measure(
            lambda out=out, part=part: dist.all_gather_into_tensor(out, part), calls=calls
        )
    small, large = timings[1024], timings[2**21]
    received = 2 * 2**21 * (world - 1)  # what each rank receives of the large one
    return {
        "values": {
            "collective_latency_s": small.median,
            "interconnect_gb_s": received / max(large.median - small.median, 1e-9) / 1e9,
        },
        "spread": {"all-gather 2 KiB": small.summary(), "all-gather 4 MiB": large.summary()},
    }


def probe_rank(out: str) -> None:
    """One rank of the probe (run by torchrun, see :func:`host_time_probe`); rank 0 writes ``out``."""
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # gloo for CPU ranks; a GPU's probe (benchmarks/device/run_step_phases.sh, PROBE=1) is
    # a measurement of the GPU's host time per layer, over NCCL as its runs
    cpu = os.environ.get("DS_ACCELERATOR") == "cpu"
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    # the one-rank probe is a fresh CPU process: the runtime there first (a process of its own,
    # calibrate.runtime_probe, would cost a CPU cluster's calibration ~35 s more on 2 cores)
    alone = dist.get_world_size() == 1
    runtime = {"values": _runtime_gib(torch, deepspeed)} if alone else {}
    layers = _layer_costs(torch, dist, "cpu" if cpu else "cuda")
    gather = _allgather_costs(torch, dist) if not alone else {}
    if dist.get_rank() == 0:
        result = {
            key: {**layers[key], **gather.get(key, {}), **runtime.get(key, {})}
            for key in ("values", "spread")
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def resident_bytes() -> int:
    """This process's resident host memory now (VmRSS: the peak, ru_maxrss, would hold the
    moments before too)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # kB -> bytes
    raise RuntimeError("no VmRSS in /proc/self/status")


def _runtime_gib(torch, deepspeed) -> dict[str, float]:
    """What a training rank holds on the host beside its model, at the two moments
    offload_study.engines.deepspeed.model.rank_host_parts compares: when ``deepspeed.initialize`` returns (ZeRO-3, a tiny
    Llama built under ``zero.Init`` on the accelerator, as the harness builds its model) and
    after its first optimizer step (the kernels and libraries a step loads on first use), GiB.
    Measured first thing in a fresh process (its distributed group up), before anything else
    the process holds."""
    import torch._dynamo  # noqa: F401  (before zero.Init, as offload_study.training.harness)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = probe_config()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(LlamaConfig(**PROBE_LLAMA, num_hidden_layers=PROBE_LAYERS[0]))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    at_init = resident_bytes()
    tokens = torch.randint(0, PROBE_LLAMA["vocab_size"], (PROBE_BATCH, PROBE_SEQS[0]))
    tokens = tokens.to(engine.device)
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    return {
        "runtime_at_init_gib": units.bytes_to_gib(at_init),
        "runtime_gib": units.bytes_to_gib(resident_bytes()),
    }


def runtime_rank(out: str) -> None:
    """The rank of :func:`runtime_probe` (torchrun, a fresh process on the accelerator):
    :func:`_runtime_gib`, written to ``out``."""
    import deepspeed
    import torch

    cpu = os.environ.get("DS_ACCELERATOR") == "cpu"
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    Path(out).write_text(json.dumps(_runtime_gib(torch, deepspeed)))
    torch.distributed.destroy_process_group()


def _torchrun_module(ranks: int, flag: str, env: dict) -> tuple[dict | None, str]:
    """Run this module with ``flag OUT`` under torchrun, ``ranks`` processes on this machine:
    (what rank 0 wrote to OUT, or None, and the command's stderr)."""
    from offload_study.training.launch import default_torchrun

    with tempfile.TemporaryDirectory(prefix="offload-study-probe-") as tmp:
        out = Path(tmp) / "probe.json"
        # --standalone: the rendezvous binds a port of its own choosing, so no port chosen here
        # can be taken by another process before torchrun binds it
        cmd = [
            *default_torchrun(),
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            "-m",
            "offload_study.prediction.calibrate",
            flag,
            str(out),
        ]
        res = subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
        # Rank 0 writes its result before the group is torn down; a crash in the teardown
        # (seen once: "terminate called without an active exception") leaves a whole result.
        if not out.is_file():
            return None, f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}"
        return json.loads(out.read_text()), res.stderr


def runtime_probe(accelerator: str) -> tuple[dict | None, str | None]:
    """(:func:`runtime_rank`'s GiB, None), or (None, why): a fresh process, since this one holds
    the rates' buffers (a CPU cluster's comes from the one-rank host-time probe instead). The
    prediction falls back on predict.FITS's measured values."""
    try:
        runtime, stderr = _torchrun_module(1, "--runtime-probe", {"DS_ACCELERATOR": accelerator})
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as err:
        runtime, stderr = None, str(err)
    if runtime is None:
        print(f"calibrate: runtime probe: {stderr[-2000:]}", file=sys.stderr)
        return None, stderr[-2000:]
    return runtime, None


def host_time_probe(ranks: int) -> dict:
    """Run :func:`probe_rank` in a gloo group of ``ranks`` processes of one thread each; its
    ``values`` and ``spread``. One thread, though a one-rank run gets two on 2 cores: a second
    OpenMP thread makes every small op a parallel region that waits for a descheduled peer on a
    busy machine, by amounts no calibration made minutes before a run can know (measured on the
    2 shared cores, tiny Llama without DeepSpeed: 45 ms per forward and backward with one thread,
    median 0.3-1.6 s with two at load 3-4; a 2-thread one-rank probe gave 0.002 and 0.034 s per
    layer forward in runs minutes apart, the 1-thread one 0.002-0.004). The FLOPs that a
    second thread would split are counted at the calibrated matmul rate."""
    probe, stderr = _torchrun_module(
        ranks, "--probe", {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    )
    if probe is None:
        raise RuntimeError(f"host-time probe: {stderr}")
    return probe


def probe_costs(ranks: int, attempts: int = 2) -> tuple[dict | None, str | None]:
    """(host_time_probe's result, None), or (None, why) when every attempt failed: the probe feeds
    predictions, which must not stop a study (predict then uses its pre-probe constant)."""
    why = None
    for _ in range(attempts):
        try:
            return host_time_probe(ranks), None
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as err:
            why = str(err)[-2000:]
            print(f"calibrate: {why}", file=sys.stderr)
    return None, why


# --------------------------------------------------------------------------- calibration
def calibrate(cluster: dict, cores: int, workload: Workload | None = None) -> Calibration:
    """Measure this machine for ``cluster`` (a validated cluster description); with a
    ``workload`` (:func:`workload_of`) the rates at its sizes, each until stable."""
    import torch

    accelerator = cluster["accelerator"]
    device = "cuda" if accelerator == "cuda" else "cpu"
    if accelerator == "cpu":  # DeepSpeed's ops as a CPU run builds them (launch.build_env)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cache = last_level_cache_bytes()
    size = sizes(accelerator, cache)
    started = time.perf_counter()
    torch.set_num_threads(cores)
    if workload is not None:
        spread = workload_spread(workload, accelerator, cores)
    else:
        spread = {
            "matmul_tflops": matmul_tflops(device, size["matmul"]),
            "cpu_adam_params_per_s": cpu_adam_params_per_s(size["adam"], cores),
            "torch_adam_params_per_s": torch_adam_params_per_s(size["adam"], cores),
            "fp16_check_elems_per_s": fp16_check_elems_per_s(size["adam"], cores),
            **step_passes_at(size["adam"], cores, accelerator, until_stable=False),
        }
        if accelerator == "cuda":
            spread.update(copy_gb_s(size["copy"]))
            spread.update(superoffload_step_at(size["adam"], accelerator))
    spread.update(page_fault_gb_s(device))
    rates = {key: summary["median"] for key, summary in spread.items()}
    probe_errors = {}
    if accelerator == "cpu":  # the ranks of a CPU run talk over gloo; hooks run on its cores
        rates["layer_host_s"] = {}
        for ranks in PROBE_RANKS:
            probe, why = probe_costs(ranks)
            if probe is None:
                probe_errors[ranks] = why
                continue
            for engine, by_ranks in probe["values"].pop("layer_host_s").items():
                rates["layer_host_s"].setdefault(engine, {}).update(by_ranks)
            rates.update(probe["values"])
            spread.update(probe["spread"])
        rates["layer_host_s"] = rates["layer_host_s"] or None
    if accelerator != "cpu":  # a CPU cluster's one-rank host-time probe measured it
        runtime, why = runtime_probe(accelerator)
        rates.update(runtime or {})
        if why:
            probe_errors["runtime"] = why
    disk = disk_gb_s(cluster["nvme_path"], size["disk"]) if cluster.get("nvme_path") else {}
    provenance = {
        "host": platform.node(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch_version": torch.__version__,
        "engine_versions": engine_versions(),
        "cores": cores,
        "last_level_cache_bytes": cache,
        "sizes": size if workload is None else dataclasses.asdict(workload),
        "spread": spread,
        "probe_errors": probe_errors,
        "direct_io": disk.get("direct_io"),
        "disk_path": cluster.get("nvme_path"),
        "seconds": round(time.perf_counter() - started, 2),
    }
    return Calibration(
        cluster=cluster["name"],
        accelerator=accelerator,
        source=f"measured by offload_study.prediction.calibrate on {platform.node()}",
        matmul_dtype="bf16",
        cpu_adam_threads=cores,
        disk_read_gb_s=disk.get("disk_read_gb_s"),
        disk_write_gb_s=disk.get("disk_write_gb_s"),
        provenance=provenance,
        **rates,
    )


def missing_accelerator(cluster: dict) -> str | None:
    """Why this machine cannot calibrate ``cluster`` (it lacks the cluster's accelerator), or
    None: a CUDA cluster is measured only where torch sees a CUDA GPU."""
    import torch

    if cluster["accelerator"] != "cuda" or torch.cuda.is_available():
        return None
    return (
        f"calibrate: cluster {cluster['name']!r} has accelerator cuda "
        f"({cluster.get('gpu_model') or 'GPU model not given'}), and this machine "
        f"({platform.node()}) has no CUDA GPU (torch {torch.__version__}: "
        "torch.cuda.is_available() is False); nothing measured. Calibrate on a node of the "
        "cluster: `snakemake calibrate --profile slurm` sends the job to one (for a local "
        "cluster, run it on the machine with the GPU). Until then `snakemake plan` predicts "
        "from the GPU catalog, labelled uncalibrated."
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", help="cluster name (config/clusters/<name>.yaml)")
    p.add_argument("--cluster-dir", default=str(CLUSTER_DIR))
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", help="calibration.json to write")
    p.add_argument(
        "--study",
        help="measure at this study's sizes: CPU Adam at its partition, matmul at its layer "
        "shapes (a GPU's recorded beside its rate at GPU_MATMUL_SIDE, which predictions use), "
        "copies at its reduce buckets, until stable",
    )
    p.add_argument("--probe", help=argparse.SUPPRESS)  # one rank of host_time_probe (torchrun)
    p.add_argument("--runtime-probe", help=argparse.SUPPRESS)  # runtime_probe's rank
    a = p.parse_args(argv)
    if a.probe:
        probe_rank(a.probe)
        return 0
    if a.runtime_probe:
        runtime_rank(a.runtime_probe)
        return 0
    if not (a.cluster and a.out):
        p.error("--cluster and --out are required")
    cluster = load_cluster(a.cluster, a.cluster_dir)
    missing = missing_accelerator(cluster)
    if missing:  # never measure a cluster's rates on a machine that lacks its accelerator
        print(missing, file=sys.stderr)
        return 2
    workload = workload_of(a.study, a.cluster_dir) if a.study else None
    calibration = calibrate(cluster, max(1, a.cores), workload)
    write_calibration(a.out, calibration)
    rates = calibration.to_dict().items()
    print(
        f"calibrate: {a.out}: "
        + ", ".join(f"{k}={v:.4g}" for k, v in rates if isinstance(v, float))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
