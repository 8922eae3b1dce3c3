"""Minimal raw FSDP2 training loop: the fidelity reference for the workflow's fsdp2 numbers.

    OMP_NUM_THREADS=$(nproc) torchrun --nproc_per_node 1 benchmarks/raw_fsdp2.py \\
        --spec results/<cluster>/<study>/configs/<scenario>.run.json --out raw.json

What ``benchmarks/raw_deepspeed.py`` is for DeepSpeed: reads the run spec the workflow wrote
(an ``engine: fsdp2`` scenario) and does what the harness' FSDP2 engine
(``offload_study.training.fsdp2``) does, with nothing of the workflow in the process (no runner,
no tee, no progress/stat files, no per-part synchronizations): the transformers config from the
spec, random init on the CPU, gradient checkpointing, ``fully_shard`` per decoder layer then the
root with a ``MixedPrecisionPolicy`` (param_dtype the study's, reduce in fp32) and, when the spec
offloads both, ``CPUOffloadPolicy(pin_memory)``, and when it offloads the optimizer alone,
torchao's ``CPUOffloadOptimizer`` (fused CPU AdamW, the weights on the GPU: the folder
engines/fsdp2_cpu_optimizer); else torch AdamW, fused on the GPU, foreach on the CPU;
the same seeded synthetic tokens (``torch.Generator`` seeded ``seed * 1000 + rank``), and
``warmup + steps`` optimizer steps (gas micro-steps each, the loss divided by gas) with a
device synchronize before and after each. tokens/s = global_batch x seq_len / median measured
step time (as in metrics.json). Rank 0 prints one JSON line and writes it to --out.

``--memory-trace`` records torch's allocator events as ``raw_deepspeed.py --memory-trace`` does
(benchmarks/memory_trace.py), for benchmarks/allocator_replay.py.

An adaptive spec has no step counts: --warmup and --steps (default 3 and 8) then give them.
On a CPU machine the mesh is "cpu" over gloo (bf16 compute on a CPU is slow but works).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import memory_trace  # beside this script

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="configs/<scenario>.run.json of the workflow")
    p.add_argument("--out", required=True, help="JSON result file (rank 0)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default: spec, else 8)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: spec, else 3)")
    p.add_argument(
        "--memory-trace",
        default=None,
        metavar="FILE.jsonl.gz",
        help="record torch's allocator events from before the model is built to the end, the "
        "loop's phases marked, and write them (offload_study.prediction.allocator reads them)",
    )
    return p.parse_args(argv)


def build(spec: dict, mesh, torch):
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cfg = dict(spec["model"]["config"])
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config)
    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = int(sum(p.numel() for p in model.parameters()))
    compute = DTYPES[spec["dtype"]]
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=getattr(torch, compute) if compute else None, reduce_dtype=torch.float32
        ),
    }
    devices = (spec.get("offload_optimizer"), spec.get("offload_param"))
    offload = {("none", "none"): None, ("cpu", "cpu"): "policy", ("cpu", "none"): "optimizer"}[
        devices
    ]
    if offload == "policy":
        pin = spec.get("accelerator") == "cuda" and spec.get("pin_memory") is not False
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model, n_params, offload


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    spec = json.loads(Path(args.spec).read_text())
    if spec.get("model", {}).get("source", "config") != "config":
        raise SystemExit("raw_fsdp2.py: only model source 'config' (random init) is supported")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    seed = int(spec.get("seed", 0))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    is_cuda = spec.get("accelerator") == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if is_cuda else torch.device("cpu")
    if is_cuda:
        torch.cuda.set_device(local_rank)
    tracing = is_cuda and args.memory_trace
    if tracing:
        memory_trace.start(torch)
    dist.init_process_group("nccl" if is_cuda else "gloo")
    mesh = init_device_mesh(device.type, (world,))
    model, n_params, offload = build(spec, mesh, torch)
    impl = {"fused": True} if is_cuda and offload != "policy" else {"foreach": True}
    opt_cls = torch.optim.AdamW if spec["optimizer"]["type"] == "AdamW" else torch.optim.Adam
    hyper = {"lr": spec["optimizer"]["lr"], "weight_decay": spec["optimizer"]["weight_decay"]}
    if offload == "optimizer":  # torchao's own example: the optimizer class, fused CPU AdamW
        from torchao.optim import CPUOffloadOptimizer

        optimizer = CPUOffloadOptimizer(model.parameters(), opt_cls, **hyper, **impl)
    else:
        optimizer = opt_cls(model.parameters(), **hyper, **impl)
    scaler = None
    if spec["dtype"] == "fp16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device=device.type)

    def sync():
        if is_cuda:
            torch.cuda.synchronize(device)

    def mark(phase: str) -> None:  # the trace's phases (memory_trace.MARK_BYTES)
        if tracing:
            memory_trace.mark(torch, device, phase)

    mb, seq, gas = (
        int(spec["micro_batch"]),
        int(spec["seq_len"]),
        int(spec["gradient_accumulation_steps"]),
    )
    gbs, vocab = int(spec["global_batch"]), int(model.config.vocab_size)
    warmup = args.warmup if args.warmup is not None else spec.get("warmup_steps") or 3
    steps = args.steps if args.steps is not None else spec.get("steps") or 8
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    init_s = time.time() - t_start

    # ---- timed loop: nothing but FSDP2 and the optimizer between the synchronizes
    model.train()
    times, losses = [], []
    for _step in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        step_losses = []
        for _ in range(gas):
            ids = torch.randint(0, vocab, (mb, seq), generator=gen).to(device)
            mark("forward")
            loss = model(input_ids=ids, labels=ids).loss
            scaled = loss / gas
            mark("backward")
            (scaler.scale(scaled) if scaler else scaled).backward()
            step_losses.append(loss.detach().float())
        mark("step")
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("end")
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(torch.stack(step_losses).mean().item()))
    # ----

    measured = times[warmup:]
    med = statistics.median(measured)
    gib = 2**30
    peak_allocated = torch.cuda.max_memory_allocated(device) / gib if is_cuda else None
    peak_reserved = torch.cuda.max_memory_reserved(device) / gib if is_cuda else None
    result = {
        "scenario": spec["scenario"],
        "study": spec["study"],
        "cluster": spec["cluster"],
        "tool": "raw_fsdp2",
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
        "optimizer": f"{type(optimizer).__name__} ({next(iter(impl))})",
        "model_params": n_params,
        "loss_first": losses[warmup] if steps else None,
        "loss_last": losses[-1] if losses else None,
        "init_s": round(init_s, 3),
        "wall_s": round(time.time() - t_start, 3),
        # UTC as the workflow's records stamp theirs: which of a pair's two loops ran first
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device_name": torch.cuda.get_device_name(device) if is_cuda else None,
        "peak_gpu_allocated_gib": peak_allocated,
        "peak_gpu_reserved_gib": peak_reserved,
        # the caching allocator's own account of its slack (torch.cuda.memory_stats)
        "allocator": memory_trace.allocator_stats(torch, local_rank) if is_cuda else None,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__,
        "spec": str(args.spec),
    }
    if tracing and rank == 0:
        memory_trace.write(torch.cuda.memory._snapshot(), local_rank, Path(args.memory_trace))
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
