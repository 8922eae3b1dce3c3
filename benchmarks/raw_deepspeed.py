"""Minimal raw DeepSpeed training loop: the fidelity reference for the workflow's numbers.

    OMP_NUM_THREADS=$(nproc) torchrun --nproc_per_node 1 benchmarks/raw_deepspeed.py \\
        --spec results/<cluster>/<study>/configs/<scenario>.run.json --out raw.json

Reads the run spec and the DeepSpeed config the workflow generated (``spec["ds_config"]``) and
does what ``offload_study.training.harness`` does, with nothing of the workflow in the process (no
runner, no tee, no progress/stat files, no memory sampling): the transformers config from the
spec, random init under ``deepspeed.zero.Init``, gradient checkpointing, ``deepspeed.initialize``
with the same config, the same seeded synthetic tokens (``torch.Generator`` seeded
``seed * 1000 + rank``, shape micro_batch x seq_len), and ``warmup_steps + steps`` optimizer steps
(``gradient_accumulation_steps`` micro-steps each) with an accelerator synchronize before and
after each. tokens/s = global_batch x seq_len / median measured step time (as in metrics.json).
Rank 0 prints one JSON line and writes it to --out.

Launch it like the workflow launches the harness: torchrun, one process per GPU, and
OMP_NUM_THREADS = cores / ranks (torchrun's default of 1 would slow DeepSpeed's CPU Adam).
On a CPU machine: DS_ACCELERATOR=cpu. NVMe swap files go to a private folder under the spec's
nvme_path, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import memory_trace  # beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="configs/<scenario>.run.json of the workflow")
    p.add_argument("--out", required=True, help="JSON result file (rank 0)")
    p.add_argument("--ds-config", default=None, help="DeepSpeed config (default: spec ds_config)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default: spec)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: spec)")
    p.add_argument("--log-level", default="info", help="DeepSpeed log level (harness: info)")
    p.add_argument(
        "--memory-trace",
        default=None,
        metavar="FILE.jsonl.gz",
        help="record torch's allocator events from before the model is built to the end "
        "and write them (offload_study.prediction.allocator reads them)",
    )
    p.add_argument(
        "--phase-times",
        action="store_true",
        help="time the parts of ZeRO-3's optimizer step (PHASES, an accelerator synchronize "
        "around each) and the forward, backward and step of each micro-step",
    )
    return p.parse_args(argv)


#: the parts of DeepSpeed ZeRO-3's optimizer step (stage3.py ``step``) that --phase-times times
PHASES = (
    "_overflow_check_and_loss_scale_update",
    "_get_norm_groups",
    "_prepare_sub_group",
    "unscale_and_clip_grads",
    "_optimizer_step",
    "_reassign_or_swap_out_partitioned_parameters",
    "_release_sub_group",
    "_post_step",
)


def phase_medians(steps: list[dict[str, float]]) -> dict[str, float] | None:
    """Each part's median seconds per step over ``steps`` (None without steps)."""
    names = sorted({name for step in steps for name in step})
    return {n: statistics.median(s.get(n, 0.0) for s in steps) for n in names} if steps else None


def time_phases(optimizer, sync, totals: dict[str, float]) -> None:
    """Wrap ``optimizer``'s PHASES (those it has) so each call adds its seconds to ``totals``."""

    def timed(name, method):
        def call(*args, **kwargs):
            sync()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            sync()
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
            return result

        return call

    for name in PHASES:
        method = getattr(optimizer, name, None)
        if method is not None:
            setattr(optimizer, name, timed(name, method))


def host_memory_gib() -> dict:
    """This process's resident host memory now and at its peak so far (/proc: VmRSS, VmHWM)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) * 1024 / 2**30, 3)
    return {"rss": fields.get("VmRSS"), "peak": fields.get("VmHWM")}


def nvme_rewrite(ds_config: dict, nvme_dir: str) -> bool:
    used = False
    for key in ("offload_optimizer", "offload_param"):
        block = ds_config.get("zero_optimization", {}).get(key)
        if isinstance(block, dict) and block.get("device") == "nvme":
            block["nvme_path"] = nvme_dir
            used = True
    return used


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    spec = json.loads(Path(args.spec).read_text())
    ds_config = json.loads(Path(args.ds_config or spec["ds_config"]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != int(spec["world_size"]):
        print(
            f"[raw] WARNING: WORLD_SIZE {world} != spec world_size {spec['world_size']}", flush=True
        )

    nvme_dir = None
    if spec.get("nvme_path"):
        nvme_dir = os.path.join(spec["nvme_path"], f"raw-deepspeed-{os.getppid()}")
        if not nvme_rewrite(ds_config, nvme_dir):
            nvme_dir = None

    import random

    import numpy as np
    import torch

    seed = int(spec.get("seed", 0))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    import deepspeed
    import transformers

    # where the host memory comes from: the resident set after each stage of the run
    host_by_stage = {"imports": host_memory_gib()}
    from deepspeed.accelerator import get_accelerator

    deepspeed.utils.set_log_level_from_string(args.log_level)
    acc = get_accelerator()
    is_cuda = acc.device_name() == "cuda"
    device_name = None
    cap_gib = None
    if is_cuda:
        torch.cuda.set_device(local_rank)
        props = torch.cuda.get_device_properties(local_rank)
        device_name = props.name
        want = spec.get("gpu_mem_gb")
        if want and want * 1e9 < props.total_memory:
            torch.cuda.set_per_process_memory_fraction(want * 1e9 / props.total_memory, local_rank)
            cap_gib = want * 1e9 / 2**30
    if is_cuda and args.memory_trace:
        memory_trace.start(torch)
    deepspeed.init_distributed()
    if nvme_dir and local_rank == 0:
        os.makedirs(nvme_dir, exist_ok=True)

    # model: the same construction as the harness (config source only)
    m = spec["model"]
    if m.get("source", "config") != "config":
        raise SystemExit("raw_deepspeed.py: only model source 'config' (random init) is supported")
    cfg = dict(m["config"])
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    import torch._dynamo  # noqa: F401  (before zero.Init, see offload_study.training.harness.build_model)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # resolve the class before zero.Init patches torch
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    host_by_stage["model built"] = host_memory_gib()
    n_params = int(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )

    mb, seq = int(spec["micro_batch"]), int(spec["seq_len"])
    gas = int(spec["gradient_accumulation_steps"])
    gbs = int(spec["global_batch"])
    vocab = int(model.config.vocab_size)
    warmup = int(spec.get("warmup_steps", 0)) if args.warmup is None else args.warmup
    steps = int(spec["steps"]) if args.steps is None else args.steps
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    device = engine.device
    host_by_stage["deepspeed.initialize"] = host_memory_gib()
    init_s = time.time() - t_start

    def mark(phase: str) -> None:
        """A phase marker in the memory trace: a block of MARK_BYTES[phase], made and freed."""
        if is_cuda and args.memory_trace:
            memory_trace.mark(torch, device, phase)

    phases: dict[str, float] = {}
    phase_steps: list[dict[str, float]] = []
    if args.phase_times:
        time_phases(engine.optimizer, acc.synchronize, phases)

    def part(name: str, call):
        """``call()``, its seconds added to ``phases[name]`` (with --phase-times)."""
        if not args.phase_times:
            return call()
        acc.synchronize()
        start = time.perf_counter()
        result = call()
        acc.synchronize()
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return result

    # ---- timed loop: nothing but DeepSpeed between the synchronizes
    engine.train()
    times, losses = [], []
    for _step in range(warmup + steps):
        acc.synchronize()
        t0 = time.perf_counter()
        step_losses = []
        phases.clear()
        for _ in range(gas):
            ids = torch.randint(0, vocab, (mb, seq), generator=gen).to(device)
            mark("forward")
            loss = part("forward", lambda ids=ids, e=engine: e(input_ids=ids, labels=ids).loss)
            mark("backward")
            part("backward", lambda loss=loss, e=engine: e.backward(loss))
            mark("step")
            part("step", engine.step)
            mark("end")
            step_losses.append(loss.detach().float())
        acc.synchronize()
        times.append(time.perf_counter() - t0)
        phase_steps.append(dict(phases))
        if len(times) == 1:
            host_by_stage["first step"] = host_memory_gib()
        losses.append(float(torch.stack(step_losses).mean().item()))
    # ----

    measured = times[warmup:]
    med = statistics.median(measured)
    result = {
        "scenario": spec["scenario"],
        "study": spec["study"],
        "cluster": spec["cluster"],
        "tool": "raw_deepspeed",
        "tokens_per_s": gbs * seq / med,
        "samples_per_s": gbs / med,
        "step_time_s_median": med,
        "step_time_s_mean": statistics.fmean(measured),
        "step_time_s_min": min(measured),
        "step_time_s_max": max(measured),
        "step_times_s": [round(t, 6) for t in times],
        "warmup_steps": warmup,
        "steps": steps,
        "world_size": world,
        "micro_batch": mb,
        "gradient_accumulation_steps": gas,
        "global_batch": gbs,
        "seq_len": seq,
        "offload_optimizer": spec.get("offload_optimizer"),
        "offload_param": spec.get("offload_param"),
        "model_params": n_params,
        "loss_first": losses[warmup] if steps else None,
        "loss_last": losses[-1] if losses else None,
        "init_s": round(init_s, 3),
        "wall_s": round(time.time() - t_start, 3),
        # UTC as the workflow's records stamp theirs: which of a pair's two loops ran first
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device_name": device_name,
        "gpu_mem_cap_gib": cap_gib,
        "peak_gpu_allocated_gib": (
            torch.cuda.max_memory_allocated(local_rank) / 2**30 if is_cuda else None
        ),
        "peak_gpu_reserved_gib": (
            torch.cuda.max_memory_reserved(local_rank) / 2**30 if is_cuda else None
        ),
        # the caching allocator's own account of its slack (torch.cuda.memory_stats)
        "allocator": memory_trace.allocator_stats(torch, local_rank) if is_cuda else None,
        "host_memory_gib_by_stage": {**host_by_stage, "end": host_memory_gib()},
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__,
        "deepspeed_version": deepspeed.__version__,
        "transformers_version": transformers.__version__,
        "spec": str(args.spec),
        # --phase-times: seconds per measured step of each part, the median over the steps
        "phase_s_median": phase_medians(phase_steps[warmup:]) if args.phase_times else None,
    }
    if is_cuda and args.memory_trace and rank == 0:
        memory_trace.write(torch.cuda.memory._snapshot(), local_rank, Path(args.memory_trace))
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    del engine, model
    if nvme_dir and local_rank == 0:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    try:
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
