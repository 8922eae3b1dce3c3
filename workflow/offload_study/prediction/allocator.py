"""torch's CUDA caching allocator, replayed: what a sequence of allocations and frees reserves.

A GPU run's reserved memory (what a per-process cap limits) is not its allocated peak: freed
blocks stay cached in the segments torch got from cudaMalloc, and a request that fits no cached
free block makes a new segment even when the cached bytes would suffice. This module replays
the allocator's rules (torch 2.11, ``c10/cuda/CUDACachingAllocator.cpp``, default settings) over
a sequence of events and reports the reserved peak and what was cached at that moment:

- sizes are rounded up to 512 B; requests of at most 1 MiB use the small pool, others the large;
- a new segment is 2 MiB for the small pool, 20 MiB for a request under 10 MiB, else the request
  rounded up to 2 MiB; segments are never merged with one another;
- a request takes the smallest cached free block of its pool and stream that holds it (best
  fit, then the lowest address) and splits it when the remainder is at least 512 B (small pool)
  or more than 1 MiB (large pool);
- a freed block merges with its free neighbours in the same segment.

:func:`read_trace` reads the events that ``--memory-trace`` of benchmarks/raw_deepspeed.py or
raw_fsdp2.py writes (torch.cuda.memory._snapshot()'s device traces); :func:`replay` runs them.
Pure Python, no GPU.
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

KIB, MIB = 1024, 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize
SMALL_REQUEST = 1 * MIB  # kSmallSize: at most this goes to the small pool
SMALL_SEGMENT = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT = 20 * MIB  # kLargeBuffer: the segment of a request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-nbytes // MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """The cudaMalloc a request makes when no cached block holds it (nbytes already rounded)."""
    if nbytes <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * -(-nbytes // ROUND_LARGE)


@dataclass
class Block:
    segment: int  # the segment's id
    offset: int
    size: int
    free: bool = True
    tag: str = ""  # who asked for it (an event's tag), for the account at the peak


@dataclass
class Segment:
    size: int
    small: bool
    stream: int
    tag: str
    blocks: list[Block] = field(default_factory=list)  # in address order


@dataclass(frozen=True)
class Event:
    """One allocator event: ``alloc`` (``key`` names the block for its ``free``), ``free`` or
    ``empty_cache``."""

    action: str
    key: int | str
    size: int = 0
    stream: int = 0
    tag: str = ""


@dataclass
class Peak:
    reserved_bytes: int = 0
    allocated_bytes: int = 0  # at the reserved peak
    event_index: int = -1
    #: segment tag -> cached free bytes at the reserved peak
    cached_free_by_tag: dict[str, int] = field(default_factory=dict)


@dataclass
class Replay:
    """The outcome of :func:`replay`."""

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    segments_peak: int  # the most segments held at once (torch: segment.all.peak)
    peak: Peak


class CachingAllocator:
    """The allocator's state: segments, their blocks, and the free blocks by pool."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        # per (small pool?, stream): sorted (size, segment, offset) of free blocks
        self.free: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}
        self.reserved = 0
        self.allocated = 0
        self.segments_held = 0

    def malloc(self, nbytes: int, stream: int = 0, tag: str = "") -> Block:
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        pool = self.free.setdefault((small, stream), [])
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, seg_id, offset = pool.pop(i)
            block = self._block_at(seg_id, offset)
        else:
            block = self._new_segment(segment_size(size), small, stream, tag)
        self._split(block, size, small, stream)
        block.free, block.tag = False, tag
        self.allocated += block.size
        return block

    def release(self, block: Block) -> None:
        """The block returns to its pool, merged with free neighbours."""
        seg = self.segments[block.segment]
        self.allocated -= block.size
        block.free = True
        i = seg.blocks.index(block)
        for j in (i + 1, i - 1):  # the next one first: merging the previous shifts the index
            if 0 <= j < len(seg.blocks) and seg.blocks[j].free:
                other = seg.blocks[j]
                self._unlist(other, seg)
                block.offset, block.size = min(block.offset, other.offset), block.size + other.size
                seg.blocks.remove(other)
        self._list(block, seg)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every segment with no block in use goes back to CUDA."""
        for seg in self.segments:
            if seg.size and all(b.free for b in seg.blocks):
                for b in seg.blocks:
                    self._unlist(b, seg)
                self.reserved -= seg.size
                self.segments_held -= 1
                seg.blocks, seg.size = [], 0

    def _new_segment(self, size: int, small: bool, stream: int, tag: str) -> Block:
        seg = Segment(size, small, stream, tag)
        self.segments.append(seg)
        block = Block(len(self.segments) - 1, 0, size)
        seg.blocks.append(block)
        self.reserved += size
        self.segments_held += 1
        return block

    def _split(self, block: Block, size: int, small: bool, stream: int) -> None:
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            seg = self.segments[block.segment]
            tail = Block(block.segment, block.offset + size, rest)
            seg.blocks.insert(seg.blocks.index(block) + 1, tail)
            block.size = size
            self._list(tail, seg)

    def _list(self, block: Block, seg: Segment) -> None:
        bisect.insort(
            self.free.setdefault((seg.small, seg.stream), []),
            (block.size, block.segment, block.offset),
        )

    def _unlist(self, block: Block, seg: Segment) -> None:
        self.free[(seg.small, seg.stream)].remove((block.size, block.segment, block.offset))

    def _block_at(self, seg_id: int, offset: int) -> Block:
        return next(b for b in self.segments[seg_id].blocks if b.offset == offset)

    def cached_free_by_tag(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for seg in self.segments:
            cached = sum(b.size for b in seg.blocks if b.free)
            if cached:
                out[seg.tag] = out.get(seg.tag, 0) + cached
        return out


def _apply(alloc: CachingAllocator, live: dict, e: Event) -> None:
    """One event on ``alloc``; ``live`` maps the keys of blocks in use to their blocks."""
    if e.action == "alloc":
        live[e.key] = alloc.malloc(e.size, e.stream, e.tag)
    elif e.action == "free" and e.key in live:
        alloc.release(live.pop(e.key))
    elif e.action == "empty_cache":
        alloc.empty_cache()


def segments_after(events: Iterable[Event], index: int) -> list[Segment]:
    """The segments held once ``events`` up to ``index`` (included) have run (e.g. a replay's
    ``peak.event_index``: what the reserved peak is made of)."""
    alloc, live = CachingAllocator(), {}
    for i, e in enumerate(events):
        if i > index:
            break
        _apply(alloc, live, e)
    return [seg for seg in alloc.segments if seg.size]


def replay(events: Iterable[Event]) -> Replay:
    """Run ``events`` through a fresh allocator; the reserved peak and what made it."""
    alloc, live = CachingAllocator(), {}
    peak, allocated_peak, segments_peak = Peak(), 0, 0
    for i, e in enumerate(events):
        _apply(alloc, live, e)
        allocated_peak = max(allocated_peak, alloc.allocated)
        segments_peak = max(segments_peak, alloc.segments_held)
        if alloc.reserved > peak.reserved_bytes:
            peak = Peak(alloc.reserved, alloc.allocated, i)
            peak.cached_free_by_tag = alloc.cached_free_by_tag()
    return Replay(peak.reserved_bytes, allocated_peak, segments_peak, peak)


def read_trace(path: Path, free_action: str = "free_completed") -> Iterator[Event]:
    """The allocations and frees of a recorded trace (one JSON object per line, gzipped), each
    tagged with the phase its run was in (the markers benchmarks/memory_trace.py leaves). A
    block is free for reuse when its streams are done with it (``free_completed``, the replay's
    view); torch's allocated count drops when the tensor dies (``free_requested``)."""
    phase, micro_step = "init", 0
    with gzip.open(path, "rt") as lines:
        for line in lines:
            row = json.loads(line)
            if row.get("phase") and row["action"] == "alloc":
                phase = row["phase"]
                micro_step += phase == "forward"
                continue
            if row["action"] == "alloc":
                yield Event(
                    "alloc", row["addr"], row["size"], row["stream"], f"{phase} {micro_step}"
                )
            elif row["action"] == free_action:
                yield Event("free", row["addr"])
            elif row["action"] == "segment_free":  # only empty_cache() gives segments back
                yield Event("empty_cache", 0)


def trace_result(trace: Path) -> dict:
    """The result JSON raw_deepspeed.py wrote beside ``trace`` (its measured peaks)."""
    return json.loads(trace.with_name(trace.name.replace(".trace.jsonl.gz", ".json")).read_text())
