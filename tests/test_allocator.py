"""offload_study.prediction.allocator: torch's caching allocator replayed, its rules one by one
and against the allocator traces recorded on an H200 (docs/results/h200-1gpu/allocator-traces-*)."""

import subprocess
import sys
from pathlib import Path

import pytest

from offload_study.prediction import allocator
from offload_study.prediction.allocator import MIB, Event

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "docs" / "results" / "h200-1gpu" / "allocator-traces-2026-12-02"


def test_sizes_round_to_512_bytes_and_segments_follow_the_pools():
    assert allocator.round_size(1) == 512
    assert allocator.round_size(513) == 1024
    assert allocator.segment_size(allocator.round_size(100)) == 2 * MIB  # small pool
    assert allocator.segment_size(3 * MIB) == 20 * MIB  # under 10 MiB: a 20 MiB segment
    assert allocator.segment_size(11 * MIB + 1) == 12 * MIB  # else rounded up to 2 MiB


def test_a_freed_block_is_reused_and_split_not_given_back():
    a = allocator.CachingAllocator()
    big = a.malloc(100 * MIB)
    a.release(big)
    small = a.malloc(30 * MIB)  # best fit: the cached 100 MiB block, split
    assert (a.reserved, a.allocated, small.offset) == (100 * MIB, 30 * MIB, 0)
    assert a.malloc(70 * MIB).offset == 30 * MIB  # the split's tail
    assert a.reserved == 100 * MIB


def test_free_neighbours_merge_but_segments_never_do():
    a = allocator.CachingAllocator()
    x, y = a.malloc(40 * MIB), a.malloc(40 * MIB)  # two segments
    a.release(x)
    a.release(y)
    a.malloc(80 * MIB)  # 80 MiB fits neither cached 40 MiB segment: a third segment
    assert a.reserved == 160 * MIB
    b = allocator.CachingAllocator()
    p = b.malloc(100 * MIB)
    b.release(p)
    q, r = b.malloc(50 * MIB), b.malloc(50 * MIB)  # both halves of the one segment
    b.release(q)
    b.release(r)  # merged again: one 100 MiB block
    assert b.malloc(100 * MIB).offset == 0 and b.reserved == 100 * MIB


def test_best_fit_takes_the_smallest_cached_block_that_holds_the_request():
    a = allocator.CachingAllocator()
    blocks = [a.malloc(n * MIB) for n in (64, 32, 48)]
    for b in blocks:
        a.release(b)
    got = a.malloc(40 * MIB)
    assert a.segments[got.segment].size == 48 * MIB


def test_streams_do_not_share_cached_blocks():
    a = allocator.CachingAllocator()
    a.release(a.malloc(50 * MIB, stream=0))
    a.malloc(50 * MIB, stream=7)
    assert a.reserved == 100 * MIB


def test_empty_cache_gives_back_only_segments_with_nothing_in_use():
    a = allocator.CachingAllocator()
    kept, gone = a.malloc(30 * MIB), a.malloc(30 * MIB)
    a.release(gone)
    a.empty_cache()
    assert a.reserved == 30 * MIB and a.segments_held == 1
    a.release(kept)
    assert a.malloc(30 * MIB).segment == kept.segment


def test_replay_reports_the_peak_and_what_was_cached_there():
    events = [
        Event("alloc", "loss", 100 * MIB, tag="forward 1"),
        Event("free", "loss"),
        Event("alloc", "state", 60 * MIB, tag="step 1"),  # lands in the cached loss block
        Event("alloc", "loss2", 100 * MIB, tag="forward 2"),  # so the loss needs a new one
    ]
    run = allocator.replay(events)
    assert run.reserved_peak_bytes == 200 * MIB
    assert run.allocated_peak_bytes == 160 * MIB
    assert run.peak.cached_free_by_tag == {"forward 1": 40 * MIB}


#: every recorded trace, on every cluster (docs/results/<cluster>/allocator-traces-*/)
ALL_TRACES = sorted(TRACES.parents[1].glob("*/allocator-traces*/*.trace.jsonl.gz"))
H100_TRACES = ROOT / "docs" / "results" / "h100-1gpu" / "allocator-traces-model-h-g-fsdp2"


def segments_at_the_reserved_peak(trace) -> list[allocator.Segment]:
    """The allocator's segments when the replay of ``trace`` reaches its reserved peak."""
    events = list(allocator.read_trace(trace))
    return allocator.segments_after(events, allocator.replay(events).peak.event_index)


def test_a_model_whose_gradients_fill_one_bucket_holds_one_on_the_reduction_stream():
    """Model H's 502M gradients fill one 5e8-element bucket and leave 2M for the second: the
    reduction stream holds one bucket's bytes at the peak, not two (the memory model's
    "the reduction stream's buckets")."""
    trace = H100_TRACES / "3-rec-deepspeed-cpu-cpu__mb-4-default.trace.jsonl.gz"
    segments = segments_at_the_reserved_peak(trace)
    # the reduction's, made in the backwards on a stream of its own (the forward's there gather)
    on_its_stream = sum(s.size for s in segments if s.stream and s.tag.startswith("backward"))
    one_bucket = 2 * 5e8
    assert 0.9 * one_bucket < on_its_stream < 1.5 * one_bucket


def test_cpu_offload_policy_keeps_blocks_of_the_root_units_fp32_size():
    """Model G (vocab 32,000, hidden 5,120) under CPUOffloadPolicy: free blocks of its head's
    fp32 size, made before the first step, cached at the reserved peak."""
    trace = H100_TRACES / "4-fsdp2-offload-default.trace.jsonl.gz"
    head_fp32 = allocator.round_size(4 * 32_000 * 5_120)
    free = [
        b.size
        for s in segments_at_the_reserved_peak(trace)
        if s.tag == "init 0"
        for b in s.blocks
        if b.free
    ]
    assert sum(abs(size - head_fp32) < 2 * MIB for size in free) == 3


@pytest.mark.parametrize("trace", ALL_TRACES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_replaying_a_recorded_trace_gives_the_reserved_peak_torch_measured(trace):
    measured = allocator.trace_result(trace)
    run = allocator.replay(allocator.read_trace(trace))
    assert run.reserved_peak_bytes / 2**30 == pytest.approx(
        measured["peak_gpu_reserved_gib"], rel=0.02
    )
    assert run.segments_peak == pytest.approx(measured["allocator"]["segments_peak"], abs=1)


def test_the_replay_benchmark_prints_every_trace():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "allocator_replay.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(list(TRACES.glob("*.trace.jsonl.gz")))  # the header and one each
    assert "default-gpu/offload-opt" in out
