"""benchmarks/fidelity_table.py: pairs found by path, ratios and their interval, memory compared."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_pair(
    results: Path, scenario: str, rep: int, workflow: float, plain: float, raw_fields=None, **fields
) -> None:
    study = results / "h200-1gpu" / "a-study"
    record = {
        "study": "a-study",
        "label": "ZeRO-3, no offload",
        "repeat": rep,
        "engine": "deepspeed",
        "offload_optimizer": "none",
        "offload_param": "none",
        "gradient_accumulation_steps": 1,
        "tokens_per_s": workflow,
        "peak_gpu_allocated_gib": 24.8483,
        **fields,
    }
    raw = {"scenario": scenario, "tokens_per_s": plain, "peak_gpu_allocated_gib": 24.8483}
    raw.update(raw_fields or {})
    (study / scenario / f"rep{rep}").mkdir(parents=True, exist_ok=True)
    (study / scenario / f"rep{rep}" / "metrics.json").write_text(json.dumps(record))
    (study / "device-logs" / "raw-deepspeed").mkdir(parents=True, exist_ok=True)
    (study / "device-logs" / "raw-deepspeed" / f"{scenario}.rep{rep}.json").write_text(
        json.dumps(raw)
    )


def test_pairs_are_judged_per_path_with_their_interval(tmp_path):
    write_pair(tmp_path, "zero3", 0, 9_000.0, 10_000.0)
    write_pair(tmp_path, "zero3", 1, 11_000.0, 10_000.0)
    superseded = tmp_path / "h200-1gpu" / "a-study" / "superseded" / "raw-deepspeed"
    superseded.mkdir(parents=True)
    (superseded / "zero3.rep0.json").write_text(json.dumps({"tokens_per_s": 1.0}))
    script = ROOT / "benchmarks" / "fidelity_table.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    run = "| a-study | ZeRO-3, no offload, repeat"
    assert f"{run} 0 | no GPU | 9,000 | 10,000 | 0.900 | yes | workflow |" in out
    assert f"{run} 1 | no GPU | 11,000 | 10,000 | 1.100 | yes | workflow |" in out
    # geometric mean of 0.9 and 1.1, t-interval with one degree of freedom
    assert "| ZeRO-3: optimizer none, parameters none, gas 1 | 2 | 0.995 | [0.278, 3.560] |" in out


def test_a_mode_is_its_own_path_beside_plain_optimizer_offload(tmp_path):
    offload = {"offload_optimizer": "cpu", "label": "optimizer offload"}
    write_pair(tmp_path, "opt", 0, 5_000.0, 5_000.0, **offload)
    modes = {"effective": {"super_offload": True, "offload_optimizer_ratio": 0.8}}
    write_pair(tmp_path, "super", 0, 3_000.0, 3_000.0, **offload, modes=modes)
    script = ROOT / "benchmarks" / "fidelity_table.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "| ZeRO-3: optimizer cpu, parameters none, gas 1 | 1 | 1.000 | one pair |" in out
    super_path = "ZeRO-3: optimizer cpu, parameters none, SuperOffload, 0.8 of the optimizer on"
    assert f"| {super_path} the CPU, gas 1 | 1 | 1.000 | one pair |" in out


def test_a_pair_says_which_loop_ran_first(tmp_path):
    """A plain loop stamped with an earlier start than the workflow's run ran first; one stamped
    later, or not stamped (run_study.sh's only order before the stamps), ran second."""
    starts = {"started_at": "2026-12-04T20:15:16Z"}
    write_pair(tmp_path, "a", 0, 1.0, 1.0, {"started_at": "2026-12-04T20:14:00Z"}, **starts)
    write_pair(tmp_path, "b", 0, 1.0, 1.0, {"started_at": "2026-12-04T20:16:30Z"}, **starts)
    write_pair(tmp_path, "c", 0, 1.0, 1.0, **starts)
    script = ROOT / "benchmarks" / "fidelity_table.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    firsts = [line.rsplit("|", 2)[1].strip() for line in out.splitlines() if "repeat 0" in line]
    assert firsts == ["plain loop", "workflow", "workflow"]


def test_a_cpu_pair_has_no_gpu_memory_to_compare(tmp_path):
    none = {"peak_gpu_allocated_gib": None}
    write_pair(tmp_path, "cpu", 0, 1.0, 1.0, none, **none)
    script = ROOT / "benchmarks" / "fidelity_table.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "| 1.000 | no GPU | workflow |" in out


def test_a_path_on_two_gpu_models_is_also_judged_per_model(tmp_path):
    """Pairs of one path on two machines' cards pool in the path's row, and each card's pairs get
    a row of their own beside it; a path on one card gets none."""
    h100, h200 = {"device_name": "NVIDIA H100 80GB HBM3"}, {"device_name": "NVIDIA H200"}
    write_pair(tmp_path, "nvme", 0, 1_000.0, 1_000.0, **h100)
    write_pair(tmp_path, "nvme", 1, 1_020.0, 1_000.0, **h100)
    write_pair(tmp_path, "nvme", 2, 900.0, 1_000.0, **h200)
    write_pair(tmp_path, "nvme", 3, 920.0, 1_000.0, **h200)
    write_pair(tmp_path, "alone", 0, 1.0, 1.0, label="alone", offload_param="cpu", **h200)
    script = ROOT / "benchmarks" / "fidelity_table.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "| a-study | ZeRO-3, no offload, repeat 0 | H100 SXM | 1,000 |" in out
    path = "ZeRO-3: optimizer none, parameters none, gas 1"
    assert f"| {path} | 4 | 0.959 |" in out
    assert f"| {path} | H100 SXM | 2 | 1.010 | [0.891, 1.145] |" in out
    assert f"| {path} | H200 | 2 | 0.910 | [0.791, 1.046] |" in out
    assert "parameters cpu, gas 1 | H200 |" not in out
