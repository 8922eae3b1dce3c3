"""Per-rank training program (run under torchrun, one process per rank), for every engine.

    python -m offload_study.training.harness --spec RUN.json --out DIR [--run-id ID]

Reads the run spec (:class:`~offload_study.core.contracts.RunSpec`), builds the run's engine
(the registry's :class:`~offload_study.engines.Trainer` of scenario key ``engine``: DeepSpeed
ZeRO-3, PyTorch FSDP2, ...; offload_study.engines), trains on seeded synthetic
tokens (or a token file; :mod:`offload_study.training.tokens`) for as many warm-up and measured
optimizer steps as :mod:`offload_study.training.steady` decides on rank 0 (broadcast to every
rank after each step; fixed mode: ``warmup_steps + steps``) and writes into DIR (file names and
shapes: :mod:`offload_study.core.contracts`), the same records for every engine:

- ``logs/rank<r>.log``   everything this rank prints (fd-level tee; also goes to the console),
- ``steps.csv``          rank 0: one :class:`~offload_study.core.contracts.StepRow` per step
  (forward, backward and optimizer seconds, the engine's skipped-step flag and loss scale),
- ``progress.json``      rank 0: heartbeat for the runner's per-step timeout,
- ``rank<r>.stats.json`` every rank: once the device is set up (its GPU cap is then on record
  even if the rank dies later), again at the end with memory peaks, parameter count, NVMe peak
  (:mod:`offload_study.training.probes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from offload_study import engines
from offload_study.core.contracts import (
    Progress,
    RankStats,
    RecordDir,
    RunSpec,
    StepRow,
    StepsWriter,
    read_run_spec,
    write_progress,
    write_rank_stats,
)
from offload_study.planning import modes
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


# --------------------------------------------------------------------------- the engine
def make_engine(spec: RunSpec, config: dict | None, stats: RankStats, is_cuda: bool):
    """The run's engine (the registry's trainer of spec.engine), its process group started."""
    return engines.of(spec).trainer(spec, config, stats, is_cuda)


# --------------------------------------------------------------------------- training
@dataclass(frozen=True)
class StepResult:
    """One optimizer step as this rank saw it, timed between two device synchronizations; its
    parts summed over the micro-steps (see :class:`PartClock`)."""

    seconds: float
    loss: float  # averaged over micro-steps and ranks
    skipped: bool  # the engine skipped the optimizer step (non-finite gradients, fp16 overflow)
    loss_scale: float | None  # the optimizer's loss scale after the step (None: it has none)
    forward_s: float
    backward_s: float
    optimizer_s: float


def one_step(engine: engines.Trainer, batches: Batches, gas: int, world: int) -> StepResult:
    """One optimizer step (gas micro-steps) as a plain loop runs it: a device synchronization
    before and after, none inside, so what overlaps in the authors' loops (a CPU optimizer
    stepping the last layers while the GPU still runs the backward) overlaps here too."""
    import torch

    skipped_before = engine.skipped_steps
    clock = PartClock(engine)
    losses = []
    for micro in range(gas):
        ids = batches.next().to(engine.device)
        loss = engine.forward(ids)
        clock.lap("forward")
        engine.backward(loss)
        clock.lap("backward")
        engine.step(boundary=micro == gas - 1)
        clock.lap("optimizer")
        losses.append(loss.detach().float())
    seconds = clock.total()
    loss_v = torch.stack(losses).mean()
    if world > 1:
        torch.distributed.all_reduce(loss_v)
        loss_v = loss_v / world
    skipped = engine.skipped_steps > skipped_before
    return StepResult(
        seconds,
        float(loss_v.item()),
        skipped,
        engine.loss_scale(),
        **{f"{part}_s": s for part, s in clock.parts.items()},
    )


class PartClock:
    """Seconds per part of a step. On a GPU each lap records a device event and nothing
    waits: a part is the device time between two events, and what a part hides behind the
    next one (gradient copies, a CPU optimizer's first tensors) is not counted twice. On a
    CPU, where every call returns when its work is done, each lap reads the host clock. The
    parts add up to the step's time within one kernel launch."""

    def __init__(self, engine: engines.Trainer):
        self._engine = engine
        self.parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._laps: list[tuple[str, object]] = []
        import torch

        engine.synchronize()
        self._events = torch.device(engine.device).type == "cuda"
        self._start = self._mark = time.perf_counter()
        self._first = self._event() if self._events else None

    def _event(self):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, part: str) -> None:
        if self._events:
            self._laps.append((part, self._event()))
            return
        now = time.perf_counter()
        self.parts[part] += now - self._mark
        self._mark = now

    def total(self) -> float:
        """The step's seconds: host clock from the first synchronization to the last."""
        self._engine.synchronize()
        if self._events:
            self._mark = time.perf_counter()
            before = self._first
            for part, event in self._laps:
                self.parts[part] += before.elapsed_time(event) / 1000.0
                before = event
        return self._mark - self._start


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


def train(
    engine: engines.Trainer, spec: RunSpec, record: RecordDir, rank: int, world: int
) -> Trained:
    """Warm-up and measured optimizer steps as :mod:`offload_study.training.steady` decides on rank 0;
    rank 0 writes steps.csv and progress.json (its total: the step budget)."""
    batches = Batches(spec, engine.vocab_size, rank)
    tracker = steady.Tracker(spec)  # rank 0's decides; on the others it gives budget, first phase
    total, phase, measured_s = tracker.budget, tracker.phase, 0.0
    steps_csv = StepsWriter(record.steps) if rank == 0 else None
    if rank == 0:
        write_progress(record, Progress(step=0, total=total, time=time.time(), phase="start"))
    engine.train()
    decision, step = steady.Decision(phase), 0
    while decision.stop is None and step < total:
        step += 1
        done = one_step(engine, batches, spec.gradient_accumulation_steps, world)
        measured_s += done.seconds if phase == "measured" else 0.0
        decision = agree(
            tracker.observe(done.seconds, done.skipped) if rank == 0 else None, world, engine.device
        )
        if steps_csv:
            report_step(steps_csv, record, spec, step, total, phase, done, decision)
        phase = decision.phase
    if steps_csv:
        steps_csv.close()
    return Trained(step, measured_s, decision.stop, tracker.warmup_settled if rank == 0 else None)


def report_step(
    steps_csv: StepsWriter,
    record: RecordDir,
    spec: RunSpec,
    step: int,
    total: int,
    phase: str,
    done: StepResult,
    decision: steady.Decision,
) -> None:
    """Rank 0: the step's row, the heartbeat, a console line."""
    tokens = spec.global_batch * spec.seq_len
    row = StepRow(
        step,
        phase,
        done.seconds,
        tokens / done.seconds,
        spec.global_batch / done.seconds,
        done.loss,
        int(done.skipped),
        done.loss_scale,
        done.forward_s,
        done.backward_s,
        done.optimizer_s,
    )
    steps_csv.write(row)
    write_progress(record, Progress(step, total, time.time(), phase, done.seconds))
    skip = " SKIPPED (overflow)" if done.skipped else ""
    stop = f" -> stop: {decision.stop}" if decision.stop else ""
    say(
        f"step {step}/{total} {phase} time {done.seconds:.3f} s tokens/s {row.tokens_per_s:.1f} "
        f"loss {done.loss:.4f}{skip} ETA <= {fmt_eta(done.seconds * (total - step))}{stop}"
    )
    if not math.isfinite(done.loss):
        say(f"WARNING non-finite loss at step {step}")


# --------------------------------------------------------------------------- main
def describe_measure(spec: RunSpec) -> str:
    m = spec.measure
    if m.mode == "fixed":
        return f"{spec.warmup_steps} warm-up + {spec.steps} measured steps (fixed)"
    return (
        f"adaptive: warm-up {m.min_warmup_steps}-{m.max_warmup_steps} steps until step times "
        f"settle, then {m.min_steps}-{m.max_steps} steps (<= {m.max_measure_s:g} s) until the "
        f"median's 95 % CI is within +-{m.target_ci_pct:g} %"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="run spec JSON (docs/design.md)")
    p.add_argument("--out", required=True, help="output folder (shared by all ranks)")
    p.add_argument(
        "--ds-config", default=None, help="the engine's config (default: spec ds_config)"
    )
    p.add_argument("--run-id", default=None, help="unique id (NVMe sub-folder name)")
    return p.parse_args(argv)


def start_rank(args) -> tuple[RunSpec, dict | None, RecordDir, RankStats]:
    """Tee this rank's output, read spec and its engine's config; the rank's first stats."""
    record = RecordDir(Path(args.out))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tee_output(record.rank_log(rank))
    host = os.uname().nodename
    say(f"rank {rank}/{world} local_rank {local_rank} pid {os.getpid()} host {host}")
    spec = read_run_spec(args.spec)
    run_id = args.run_id or os.environ.get("OFFLOAD_STUDY_RUN_ID") or f"{os.getppid()}"
    config, nvme_dir = engines.of(spec).start_rank(spec, args.ds_config, run_id)
    # before torch starts its threads, which inherit the affinity (study key bind_cores)
    bound = modes.bind_cores(spec.modes, local_rank, spec.gpus_per_node)
    if bound is not None:
        say(f"bound to cores {bound}")
    stats = RankStats(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        host=host,
        pid=os.getpid(),
        nvme_dir=nvme_dir,
        bound_cores=bound,
        engine=spec.engine,
    )
    return spec, config, record, stats


def main(argv=None) -> int:
    t_start = time.time()
    die_with_parent()  # no rank trains on once its torchrun is gone (see supervise)
    spec, config, record, stats = start_rank(parse_args(argv))
    host_memory = probes.HostMemorySampler().start()  # the rank and its worker processes
    seed_everything(spec.seed)
    import torch

    is_cuda = spec.accelerator == "cuda" and torch.cuda.is_available()
    stats = dataclasses.replace(
        stats,
        **probes.set_up_device(spec, is_cuda, stats.local_rank),
        cuda_version=torch.version.cuda,
        torch_version=torch.__version__,
    )
    write_rank_stats(record, stats)  # the GPU cap is on record even if this rank dies later
    engine = make_engine(spec, config, stats, is_cuda)
    stats = dataclasses.replace(stats, model_params=engine.model_params, **engine.versions())
    say(f"engine {spec.engine}, model params: {stats.model_params}")
    stats = dataclasses.replace(stats, modes=engine.effective_modes(), **probes.cores_and_threads())
    say(f"effective modes: {stats.modes}")
    write_rank_stats(record, stats)  # on record even if training fails
    say(
        f"training: {describe_measure(spec)}, gas {spec.gradient_accumulation_steps}, global "
        f"batch {spec.global_batch}, init took {time.time() - t_start:.1f} s"
    )
    trained = train(engine, spec, record, stats.rank, stats.world_size)
    stats = dataclasses.replace(
        stats,
        **probes.gpu_memory_peaks(is_cuda, stats.local_rank),
        host_peak_rss_bytes=probes.host_peak_rss_bytes(),
        **host_memory.stop(),
        steps_done=trained.steps,
        train_time_s=trained.measured_s,
        stop_reason=trained.stop_reason,
        warmup_settled=trained.warmup_settled,
    )
    if stats.world_size > 1:
        torch.distributed.barrier()
    stats = engine.close(stats)  # lets go of what the engine holds (DeepSpeed: the NVMe folder)
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
