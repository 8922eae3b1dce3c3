"""The plain loops beside the workflow (benchmarks/raw_fsdp2.py, benchmarks/memory_trace.py): the
FSDP2 loop trains on the CPU from a run spec the planner wrote; a recorded allocator trace,
written with the loop's phase markers, reads back through offload_study.prediction.allocator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runs import make_run

from offload_study.prediction import allocator

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import memory_trace  # noqa: E402


def test_a_trace_written_with_phase_markers_reads_back_by_phase(tmp_path):
    """torch.cuda.memory._snapshot()'s events, a marker block before each phase: every other
    allocation is tagged with the phase and micro-step it was made in; the markers are not."""
    mark = memory_trace.MARK_BYTES
    events = [
        {"action": "alloc", "addr": 1, "size": 4096, "stream": 0},
        {"action": "alloc", "addr": 2, "size": mark["forward"], "stream": 0},
        {"action": "alloc", "addr": 3, "size": 8192, "stream": 0},
        {"action": "alloc", "addr": 4, "size": mark["backward"] + 511, "stream": 0},  # rounded
        {"action": "alloc", "addr": 5, "size": 2048, "stream": 7},
        {"action": "free_completed", "addr": 3, "size": 8192, "stream": 0},
        {"action": "alloc", "addr": 6, "size": mark["forward"], "stream": 0},
        {"action": "alloc", "addr": 7, "size": 1024, "stream": 0},
    ]
    path = tmp_path / "run.trace.jsonl.gz"
    memory_trace.write({"device_traces": [[], events]}, 1, path)
    read = [(e.action, e.key, e.stream, e.tag) for e in allocator.read_trace(path)]
    assert read == [
        ("alloc", 1, 0, "init 0"),
        ("alloc", 3, 0, "forward 1"),
        ("alloc", 5, 7, "backward 1"),
        ("free", 3, 0, ""),
        ("alloc", 7, 0, "forward 2"),
    ]


def test_the_plain_fsdp2_loop_trains_on_the_cpu_from_the_planners_run_spec(tmp_path):
    """raw_fsdp2.py under torchrun, one gloo rank: the steps it was asked for, a finite loss,
    no GPU figures (--memory-trace records on a CUDA GPU only: asked here, nothing written)."""
    spec_path, _, spec = make_run(tmp_path, scenario={"engine": "fsdp2"})
    out, trace = tmp_path / "raw.json", tmp_path / "raw.trace.jsonl.gz"
    # --standalone: torchrun binds a port of its own choosing (none a neighbouring test can take)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    cmd += [
        str(BENCHMARKS / "raw_fsdp2.py"),
        "--spec",
        str(spec_path),
    ]
    cmd += ["--out", str(out), "--steps", "2", "--warmup", "1", "--memory-trace", str(trace)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tool"] == "raw_fsdp2" and result["scenario"] == spec.scenario
    assert len(result["step_times_s"]) == 3 and result["tokens_per_s"] > 0
    assert result["loss_last"] > 0 and result["peak_gpu_reserved_gib"] is None
    assert result["allocator"] is None and not trace.exists()
