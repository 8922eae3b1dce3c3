"""Per-rank ZeRO-3 training program (run under torchrun, one process per rank).

    python -m offload_study.training.harness --spec RUN.json --out DIR [--run-id ID]

Reads the run spec (:class:`~offload_study.core.contracts.RunSpec`), builds the model inside
``deepspeed.zero.Init``, trains on seeded synthetic tokens (or a token file;
:mod:`offload_study.training.tokens`) for as many warm-up and measured optimizer steps as
:mod:`offload_study.training.steady` decides on rank 0 (broadcast to every rank after each step; fixed
mode: ``warmup_steps + steps``) and writes into DIR (file names and shapes:
:mod:`offload_study.core.contracts`):

- ``logs/rank<r>.log``   everything this rank prints (fd-level tee; also goes to the console),
- ``steps.csv``          rank 0: one :class:`~offload_study.core.contracts.StepRow` per step (with
  DeepSpeed's skipped-step flag, from ``engine.skipped_steps``, and the loss scale),
- ``progress.json``      rank 0: heartbeat for the runner's per-step timeout,
- ``rank<r>.stats.json`` every rank: once the device is set up (its GPU cap is then on record
  even if the rank dies later), again at the end with memory peaks, parameter count, NVMe peak
  (:mod:`offload_study.training.probes`).

NVMe swap files go to a run-private folder (``contracts.nvme_run_dir``; the DS config's nvme_path
is rewritten) that is sampled in the background for its peak size and removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from offload_study.core.contracts import (
    Progress,
    RankStats,
    RecordDir,
    RunSpec,
    StepRow,
    StepsWriter,
    nvme_run_dir,
    read_json,
    read_run_spec,
    write_progress,
    write_rank_stats,
)
from offload_study.planning import dsconfig, modes
from offload_study.training import probes, steady
from offload_study.training.supervise import die_with_parent
from offload_study.training.tokens import Batches


# --------------------------------------------------------------------------- process plumbing
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


def fmt_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}"


def say(message: str) -> None:
    print(f"[harness] {message}", flush=True)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def private_nvme_dir(spec: RunSpec, ds_config: dict, run_id: str) -> str | None:
    """This run's NVMe folder, written into the DS config; None when nothing goes to NVMe."""
    if not spec.nvme_path:
        return None
    nvme_dir = nvme_run_dir(spec.nvme_path, run_id)
    return nvme_dir if dsconfig.rewrite_nvme_path(ds_config, nvme_dir) else None


# --------------------------------------------------------------------------- model
def build_model(spec: RunSpec, ds_config: dict):
    import deepspeed
    import transformers

    pretrained = spec.model.source == "pretrained"
    if pretrained:
        config = transformers.AutoConfig.from_pretrained(spec.model.name_or_path)
    else:
        cfg = dict(spec.model.config)
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
            model = model_cls.from_pretrained(spec.model.name_or_path, config=config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_params(model) -> int:
    # under ZeRO-3 each parameter keeps its full size in ds_numel
    return int(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))


# --------------------------------------------------------------------------- training
@dataclass(frozen=True)
class StepResult:
    """One optimizer step as this rank saw it."""

    seconds: float
    loss: float  # averaged over micro-steps and ranks
    skipped: bool  # DeepSpeed skipped the optimizer step (non-finite gradients, fp16 overflow)
    loss_scale: float | None  # the optimizer's loss scale after the step (None: it has none)


def loss_scale(engine) -> float | None:
    """The ZeRO optimizer's current loss scale (fp16: dynamic; bf16/fp32: 1.0), None if absent."""
    for name in ("cur_scale", "loss_scale"):
        value = getattr(engine.optimizer, name, None)
        if value is not None:
            try:
                return float(value)
            except (TypeError, ValueError):
                continue
    return None


def one_step(engine, batches: Batches, gas: int, acc, world: int) -> StepResult:
    """One optimizer step (gas micro-steps), timed between two device synchronizations."""
    import torch

    skipped_before = engine.skipped_steps
    acc.synchronize()
    t0 = time.perf_counter()
    losses = []
    for _ in range(gas):
        ids = batches.next().to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    acc.synchronize()
    seconds = time.perf_counter() - t0
    loss_v = torch.stack(losses).mean()
    if world > 1:
        torch.distributed.all_reduce(loss_v)
        loss_v = loss_v / world
    skipped = engine.skipped_steps > skipped_before
    return StepResult(seconds, float(loss_v.item()), skipped, loss_scale(engine))


def agree(decision: steady.Decision | None, world: int, device) -> steady.Decision:
    """Rank 0's decision on every rank: all ranks must run the same steps, or collectives hang."""
    if world == 1:
        return decision
    import torch

    codes = (decision or steady.Decision("warmup")).encode()
    shared = torch.tensor(codes, dtype=torch.int64, device=device)
    torch.distributed.broadcast(shared, src=0)
    return steady.Decision.decode(shared.tolist())


@dataclass(frozen=True)
class Trained:
    steps: int
    measured_s: float  # this rank's seconds in measured steps
    stop_reason: str | None
    warmup_settled: bool | None  # rank 0 only


def train(engine, spec: RunSpec, record: RecordDir, rank: int, world: int, acc) -> Trained:
    """Warm-up and measured optimizer steps as :mod:`offload_study.training.steady` decides on rank 0;
    rank 0 writes steps.csv and progress.json (its total: the step budget)."""
    batches = Batches(spec, int(engine.module.config.vocab_size), rank)
    tracker = steady.Tracker(spec)  # rank 0's decides; on the others it gives budget, first phase
    total, phase, measured_s = tracker.budget, tracker.phase, 0.0
    steps_csv = StepsWriter(record.steps) if rank == 0 else None
    if rank == 0:
        write_progress(record, Progress(step=0, total=total, time=time.time(), phase="start"))
    engine.train()
    decision, step = steady.Decision(phase), 0
    while decision.stop is None and step < total:
        step += 1
        done = one_step(engine, batches, spec.gradient_accumulation_steps, acc, world)
        measured_s += done.seconds if phase == "measured" else 0.0
        decision = agree(tracker.observe(done.seconds, done.skipped) if rank == 0 else None,
                         world, engine.device)  # fmt: skip
        if steps_csv:
            report_step(steps_csv, record, spec, step, total, phase, done, decision)
        phase = decision.phase
    if steps_csv:
        steps_csv.close()
    return Trained(step, measured_s, decision.stop, tracker.warmup_settled if rank == 0 else None)


def report_step(steps_csv: StepsWriter, record: RecordDir, spec: RunSpec, step: int, total: int,
                phase: str, done: StepResult, decision: steady.Decision) -> None:  # fmt: skip
    """Rank 0: the step's row, the heartbeat, a console line."""
    tokens = spec.global_batch * spec.seq_len
    row = StepRow(step, phase, done.seconds, tokens / done.seconds,
                  spec.global_batch / done.seconds, done.loss, int(done.skipped),
                  done.loss_scale)  # fmt: skip
    steps_csv.write(row)
    write_progress(record, Progress(step, total, time.time(), phase, done.seconds))
    skip = " SKIPPED (overflow)" if done.skipped else ""
    stop = f" -> stop: {decision.stop}" if decision.stop else ""
    say(f"step {step}/{total} {phase} time {done.seconds:.3f} s tokens/s {row.tokens_per_s:.1f} "
        f"loss {done.loss:.4f}{skip} ETA <= {fmt_eta(done.seconds * (total - step))}{stop}")  # fmt: skip
    if not math.isfinite(done.loss):
        say(f"WARNING non-finite loss at step {step}")


# --------------------------------------------------------------------------- main
def describe_measure(spec: RunSpec) -> str:
    m = spec.measure
    if m.mode == "fixed":
        return f"{spec.warmup_steps} warm-up + {spec.steps} measured steps (fixed)"
    return (f"adaptive: warm-up {m.min_warmup_steps}-{m.max_warmup_steps} steps until step times "
            f"settle, then {m.min_steps}-{m.max_steps} steps (<= {m.max_measure_s:g} s) until the "
            f"median's 95 % CI is within +-{m.target_ci_pct:g} %")  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="run spec JSON (docs/design.md)")
    p.add_argument("--out", required=True, help="output folder (shared by all ranks)")
    p.add_argument("--ds-config", default=None, help="DeepSpeed config (default: spec ds_config)")
    p.add_argument("--run-id", default=None, help="unique id (NVMe sub-folder name)")
    return p.parse_args(argv)


def start_rank(args) -> tuple[RunSpec, dict, RecordDir, RankStats]:
    """Tee this rank's output, read spec and DS config; the rank's first stats."""
    record = RecordDir(Path(args.out))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tee_output(record.rank_log(rank))
    host = os.uname().nodename
    say(f"rank {rank}/{world} local_rank {local_rank} pid {os.getpid()} host {host}")
    spec = read_run_spec(args.spec)
    ds_config = read_json(args.ds_config or spec.ds_config)
    run_id = args.run_id or os.environ.get("OFFLOAD_STUDY_RUN_ID") or f"{os.getppid()}"
    # before torch starts its threads, which inherit the affinity (study key bind_cores)
    bound = modes.bind_cores(spec.modes, local_rank, spec.gpus_per_node)
    if bound is not None:
        say(f"bound to cores {bound}")
    stats = RankStats(rank=rank, local_rank=local_rank, world_size=world, host=host,
                      pid=os.getpid(), nvme_dir=private_nvme_dir(spec, ds_config, run_id),
                      bound_cores=bound)  # fmt: skip
    return spec, ds_config, record, stats


def stop_nvme(stats: RankStats, sampler: probes.DirSizeSampler | None, world: int) -> RankStats:
    """Peak NVMe usage, then (once every rank let go of its swap files) remove the folder."""
    import torch

    if sampler is not None:
        stats = dataclasses.replace(stats, nvme_bytes_used=sampler.stop())
    if world > 1:
        torch.distributed.barrier()
    if stats.nvme_dir and stats.local_rank == 0:
        shutil.rmtree(stats.nvme_dir, ignore_errors=True)
        stats = dataclasses.replace(stats, nvme_cleaned=not os.path.exists(stats.nvme_dir))
    return stats


def main(argv=None) -> int:
    t_start = time.time()
    die_with_parent()  # no rank trains on once its torchrun is gone (see supervise)
    spec, ds_config, record, stats = start_rank(parse_args(argv))
    seed_everything(spec.seed)
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    deepspeed.utils.set_log_level_from_string("info")
    acc = get_accelerator()
    is_cuda = acc.device_name() == "cuda"
    stats = dataclasses.replace(
        stats, **probes.set_up_device(spec, is_cuda, stats.local_rank),
        cuda_version=torch.version.cuda, torch_version=torch.__version__,
        deepspeed_version=deepspeed.__version__,
    )  # fmt: skip
    write_rank_stats(record, stats)  # the GPU cap is on record even if this rank dies later
    deepspeed.init_distributed()
    sampler = None
    if stats.nvme_dir and stats.local_rank == 0:
        os.makedirs(stats.nvme_dir, exist_ok=True)
        sampler = probes.DirSizeSampler(stats.nvme_dir).start()

    model = build_model(spec, ds_config)
    stats = dataclasses.replace(stats, model_params=count_params(model))
    say(f"model params: {stats.model_params}")
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    stats = dataclasses.replace(stats, modes=modes.effective(engine))
    say(f"effective modes: {stats.modes}")
    write_rank_stats(record, stats)  # on record even if training fails
    say(f"training: {describe_measure(spec)}, gas {spec.gradient_accumulation_steps}, global "
        f"batch {spec.global_batch}, init took {time.time() - t_start:.1f} s")  # fmt: skip
    trained = train(engine, spec, record, stats.rank, stats.world_size, acc)
    stats = dataclasses.replace(
        stats, **probes.gpu_memory_peaks(is_cuda, stats.local_rank),
        host_peak_rss_bytes=probes.host_peak_rss_bytes(), steps_done=trained.steps,
        train_time_s=trained.measured_s, stop_reason=trained.stop_reason,
        warmup_settled=trained.warmup_settled,
    )  # fmt: skip
    if stats.world_size > 1:
        torch.distributed.barrier()
    del engine, optimizer, model  # let go of the NVMe swap buffers before the folder goes
    stats = stop_nvme(stats, sampler, stats.world_size)
    stats = dataclasses.replace(stats, finished=True, wall_time_s=time.time() - t_start)
    write_rank_stats(record, stats)
    say(f"rank {stats.rank} done in {stats.wall_time_s:.1f} s")
    try:
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
