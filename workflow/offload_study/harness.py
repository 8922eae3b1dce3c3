"""Per-rank ZeRO-3 training program (run under torchrun, one process per rank).

    python -m offload_study.harness --spec RUN.json --out DIR [--run-id ID]

Reads the run spec (docs/design.md), builds the model inside ``deepspeed.zero.Init``, trains
``warmup_steps + steps`` optimizer steps on seeded synthetic tokens (or a token file) and writes
into DIR:

- ``logs/rank<r>.log``  everything this rank prints (fd-level tee; also goes to the console),
- ``steps.csv``         rank 0: step,phase,step_time_s,tokens_per_s,samples_per_s,loss,
- ``progress.json``     rank 0: heartbeat for the runner's per-step timeout,
- ``rank<r>.stats.json`` every rank: memory peaks, device name, parameter count, NVMe peak.

NVMe swap files go to a run-private folder ``<nvme_path>/offload-study-<run-id>`` (the DS config's
nvme_path is rewritten) that is sampled in the background for its peak size and removed at the end.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from offload_study import devices

STEPS_COLUMNS = ["step", "phase", "step_time_s", "tokens_per_s", "samples_per_s", "loss"]


# --------------------------------------------------------------------------- helpers (no torch)
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


def tee_output(log_path: Path) -> subprocess.Popen | None:
    """Send this process's fd 1 and 2 through `tee -a log_path` (console output is kept).

    fd-level, so C++/JIT-build output is captured too; tee outlives a crash of this process.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tee = subprocess.Popen(["tee", "-a", str(log_path)], stdin=subprocess.PIPE)
    except OSError:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(tee.stdin.fileno(), 1)
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    return tee


def rewrite_nvme_path(ds_config: dict, nvme_dir: str) -> bool:
    """Point every nvme offload block of a DS config at nvme_dir; True if any uses nvme."""
    zero = ds_config.get("zero_optimization", {}) or {}
    used = False
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        if isinstance(block, dict) and block.get("device") == "nvme":
            block["nvme_path"] = nvme_dir
            used = True
    return used


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def host_peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def fmt_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}"


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


# --------------------------------------------------------------------------- data
def load_token_file(path: str):
    """Token ids from .npy (any int dtype) or .bin (raw uint16, or int32 if name has 'int32')."""
    import numpy as np

    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
    else:
        dtype = np.int32 if "int32" in os.path.basename(path) else np.uint16
        arr = np.memmap(path, dtype=dtype, mode="r")
    return arr.reshape(-1)


class Batches:
    """Seeded micro-batches of (micro_batch, seq_len) token ids, different per rank."""

    def __init__(self, spec: dict, vocab_size: int, rank: int):
        import torch

        self.mb, self.seq = int(spec["micro_batch"]), int(spec["seq_len"])
        self.vocab = int(vocab_size)
        self.gen = torch.Generator().manual_seed(int(spec.get("seed", 0)) * 1000 + rank)
        data = spec.get("data") or {}
        self.tokens = None
        if data.get("token_file"):
            self.tokens = load_token_file(str(data["token_file"]))
            if len(self.tokens) <= self.seq:
                raise ValueError(f"token file {data['token_file']} shorter than seq_len {self.seq}")
            print(f"[harness] tokens from {data['token_file']}: {len(self.tokens)} ids", flush=True)

    def next(self):
        import numpy as np
        import torch

        if self.tokens is None:
            return torch.randint(0, self.vocab, (self.mb, self.seq), generator=self.gen)
        starts = torch.randint(0, len(self.tokens) - self.seq, (self.mb,), generator=self.gen)
        rows = [np.asarray(self.tokens[s : s + self.seq], dtype=np.int64) for s in starts.tolist()]
        ids = torch.from_numpy(np.stack(rows))
        return ids.clamp_(0, self.vocab - 1)


# --------------------------------------------------------------------------- model
def build_model(spec: dict, ds_config: dict):
    import deepspeed
    import transformers

    m = spec["model"]
    pretrained = m.get("source", "config") == "pretrained"
    if pretrained:
        config = transformers.AutoConfig.from_pretrained(m["name_or_path"])
    else:
        cfg = dict(m["config"])
        model_type = cfg.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **cfg)
    config.use_cache = False
    # Resolve (import) the model class *before* zero.Init: zero.Init patches torch.Tensor.__new__,
    # and transformers' lazy module import then pulls in torch._dynamo, which fails with
    # "TypeError: Signature mismatch between <function get_new_tensor_fn_for_dtype...>".
    import torch._dynamo  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        if pretrained:
            model = model_cls.from_pretrained(m["name_or_path"], config=config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_params(model) -> int:
    # under ZeRO-3 each parameter keeps its full size in ds_numel
    return int(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="run spec JSON (docs/design.md)")
    p.add_argument("--out", required=True, help="output folder (shared by all ranks)")
    p.add_argument("--ds-config", default=None, help="DeepSpeed config (default: spec ds_config)")
    p.add_argument("--run-id", default=None, help="unique id (NVMe sub-folder name)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _tee = tee_output(out / "logs" / f"rank{rank}.log")
    t_start = time.time()
    print(
        f"[harness] rank {rank}/{world} local_rank {local_rank} pid {os.getpid()} "
        f"host {os.uname().nodename}",
        flush=True,
    )

    spec = json.loads(Path(args.spec).read_text())
    ds_path = args.ds_config or spec["ds_config"]
    ds_config = json.loads(Path(ds_path).read_text())
    run_id = args.run_id or os.environ.get("OFFLOAD_STUDY_RUN_ID") or f"{os.getppid()}"

    nvme_dir = None
    if spec.get("nvme_path"):
        nvme_dir = os.path.join(spec["nvme_path"], f"offload-study-{run_id}")
        if not rewrite_nvme_path(ds_config, nvme_dir):
            nvme_dir = None

    stats: dict = {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "finished": False,
    }
    stats_path = out / f"rank{rank}.stats.json"

    import numpy as np
    import torch

    seed = int(spec.get("seed", 0))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.utils.set_log_level_from_string("info")
    acc = get_accelerator()
    is_cuda = acc.device_name() == "cuda"

    # GPU memory cap (the card the scenario stands for)
    gpu_mem_cap_gib = None
    if is_cuda:
        torch.cuda.set_device(local_rank)
        props = torch.cuda.get_device_properties(local_rank)
        total = props.total_memory
        stats["device_name"] = props.name
        stats["gpu_total_bytes"] = int(total)
        # Cards are sold by binary size (an "A100 40GB" has 40960 MiB), so the cap is in GiB; a
        # scenario asking for the cluster's own card size (or more) runs uncapped.
        want = spec.get("gpu_mem_gb")
        card = spec.get("cluster_gpu_mem_gb")
        if want and (card is None or want < card) and want * 2**30 < total:
            torch.cuda.set_per_process_memory_fraction(want * 2**30 / total, local_rank)
            gpu_mem_cap_gib = float(want)
            print(
                f"[harness] GPU memory capped to {gpu_mem_cap_gib:.2f} GiB of "
                f"{total / 2**30:.2f} GiB",
                flush=True,
            )
    else:
        stats["device_name"] = devices.cpu_model()
    stats["gpu_mem_cap_gib"] = gpu_mem_cap_gib
    stats["cuda_version"] = torch.version.cuda
    stats["torch_version"] = torch.__version__
    stats["deepspeed_version"] = deepspeed.__version__

    deepspeed.init_distributed()
    sampler = None
    if nvme_dir and local_rank == 0:
        os.makedirs(nvme_dir, exist_ok=True)
        sampler = DirSizeSampler(nvme_dir).start()
    stats["nvme_dir"] = nvme_dir

    model = build_model(spec, ds_config)
    n_params = count_params(model)
    stats["model_params"] = n_params
    print(f"[harness] model params: {n_params}", flush=True)
    engine, _opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    vocab = int(model.config.vocab_size)
    batches = Batches(spec, vocab, rank)
    device = engine.device
    gas = int(spec["gradient_accumulation_steps"])
    warmup, steps = int(spec.get("warmup_steps", 0)), int(spec["steps"])
    total_steps = warmup + steps
    gbs = int(spec["global_batch"])
    tokens_per_step = gbs * int(spec["seq_len"])

    steps_file = None
    writer = None
    if rank == 0:
        steps_file = open(out / "steps.csv", "w", newline="")  # noqa: SIM115
        writer = csv.writer(steps_file)
        writer.writerow(STEPS_COLUMNS)
        steps_file.flush()
        write_json_atomic(
            out / "progress.json",
            {"step": 0, "total": total_steps, "time": time.time(), "phase": "start"},
        )
    print(
        f"[harness] training: {warmup} warm-up + {steps} measured steps, gas {gas}, "
        f"global batch {gbs}, init took {time.time() - t_start:.1f} s",
        flush=True,
    )

    engine.train()
    measured_time = 0.0
    for step in range(1, total_steps + 1):
        phase = "warmup" if step <= warmup else "measured"
        acc.synchronize()
        t0 = time.perf_counter()
        losses = []
        for _ in range(gas):
            ids = batches.next().to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        acc.synchronize()
        dt = time.perf_counter() - t0
        loss_v = torch.stack(losses).mean()
        if world > 1:
            torch.distributed.all_reduce(loss_v)
            loss_v = loss_v / world
        loss_f = float(loss_v.item())
        if phase == "measured":
            measured_time += dt
        eta = dt * (total_steps - step)
        if rank == 0:
            writer.writerow(
                [
                    step,
                    phase,
                    f"{dt:.6f}",
                    f"{tokens_per_step / dt:.3f}",
                    f"{gbs / dt:.4f}",
                    f"{loss_f:.6f}",
                ]
            )
            steps_file.flush()
            write_json_atomic(
                out / "progress.json",
                {
                    "step": step,
                    "total": total_steps,
                    "time": time.time(),
                    "phase": phase,
                    "step_time_s": dt,
                },
            )
            print(
                f"[harness] step {step}/{total_steps} {phase} time {dt:.3f} s "
                f"tokens/s {tokens_per_step / dt:.1f} loss {loss_f:.4f} ETA {fmt_eta(eta)}",
                flush=True,
            )
        if not math.isfinite(loss_f):
            print(f"[harness] WARNING non-finite loss at step {step}", flush=True)

    if steps_file:
        steps_file.close()

    # memory figures
    if is_cuda:
        stats["peak_gpu_allocated_bytes"] = int(torch.cuda.max_memory_allocated(local_rank))
        stats["peak_gpu_reserved_bytes"] = int(torch.cuda.max_memory_reserved(local_rank))
        stats["nvml_used_bytes"] = nvml_used_bytes(torch.cuda.current_device())
    else:
        stats["peak_gpu_allocated_bytes"] = None
        stats["peak_gpu_reserved_bytes"] = None
        stats["nvml_used_bytes"] = None
    stats["host_peak_rss_bytes"] = host_peak_rss_bytes()
    stats["steps_done"] = total_steps
    stats["train_time_s"] = measured_time

    if world > 1:
        torch.distributed.barrier()
    del engine, _opt, model
    if sampler is not None:
        stats["nvme_bytes_used"] = sampler.stop()
    if world > 1:
        torch.distributed.barrier()
    if nvme_dir and local_rank == 0:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        stats["nvme_cleaned"] = not os.path.exists(nvme_dir)
    stats["finished"] = True
    stats["wall_time_s"] = time.time() - t_start
    write_json_atomic(stats_path, stats)
    print(f"[harness] rank {rank} done in {stats['wall_time_s']:.1f} s", flush=True)
    try:
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
