"""torch's CUDA allocator in a plain training loop (raw_deepspeed.py, raw_fsdp2.py): its own
account of its slack, and with ``--memory-trace`` its events as offload_study.prediction.allocator
reads them: one JSON line per event, gzipped, the loop's phases marked by blocks of sizes no
training run asks for."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

#: the phase markers' sizes in a memory trace: small-pool blocks no training run asks for
MARK_BYTES = {
    "forward": 777 * 512 + 1,
    "backward": 779 * 512 + 1,
    "step": 781 * 512 + 1,
    "end": 783 * 512 + 1,
}
#: a trace holds the size asked for or the size rounded to 512 B (torch versions differ)
PHASE_OF_MARK = {s: phase for phase, n in MARK_BYTES.items() for s in (n, n + 511)}


def allocator_stats(torch, device: int) -> dict:
    """What torch's caching allocator says of its reserved memory beyond the allocated: the
    peak of free pieces of split blocks (fragmentation), segments, retries after a failed
    cudaMalloc (a cache flush), and OOMs."""
    s = torch.cuda.memory_stats(device)
    return {
        "inactive_split_peak_gib": s.get("inactive_split_bytes.all.peak", 0) / 2**30,
        "segments_peak": s.get("segment.all.peak"),
        "large_pool_reserved_peak_gib": s.get("reserved_bytes.large_pool.peak", 0) / 2**30,
        "small_pool_reserved_peak_gib": s.get("reserved_bytes.small_pool.peak", 0) / 2**30,
        "num_alloc_retries": s.get("num_alloc_retries"),
        "num_ooms": s.get("num_ooms"),
    }


def start(torch) -> None:
    """Record every allocator event from now on. No stacks: Python frames taken in the
    backward's recomputation crash torch 2.11 (SystemError in DeepSpeed's
    LinearFunctionForZeroStage3.apply); phases are marked instead (:func:`mark`)."""
    torch.cuda.memory._record_memory_history(context=None, max_entries=5_000_000)


def mark(torch, device, phase: str) -> None:
    """A phase marker in the trace: a block of MARK_BYTES[phase], made and freed."""
    torch.empty(MARK_BYTES[phase], dtype=torch.uint8, device=device)


def write(snapshot: dict, device: int, path: Path) -> None:
    """One JSON line per allocator event of ``device`` (torch.cuda.memory._snapshot()'s
    device_traces): action (alloc, free_requested, free_completed, segment_alloc, segment_free,
    oom, ...), address, size in bytes, stream; a marker's block (MARK_BYTES) becomes its phase."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as out:
        for e in snapshot["device_traces"][device]:
            row = {k: e.get(k) for k in ("action", "addr", "size", "stream")}
            phase = PHASE_OF_MARK.get(row["size"])
            out.write(json.dumps({**row, "phase": phase} if phase else row) + "\n")
