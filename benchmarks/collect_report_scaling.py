"""How long collect + report take over many run records in the real record format.

    python benchmarks/collect_report_scaling.py [--scenarios 250] [--repeats 4] [--keep DIR]

Plans a seed-like study (config/studies/seed.yaml plus one more base scenario, each swept over
gradient accumulation x reduce_bucket_size) with the real planner, writes its DeepSpeed configs,
run specs and plan.json, and one record per scenario x repeat: metrics.json (validated against
the metrics schema), steps.csv and provenance.json (the runner's keys), with plausible numbers
and a few failed runs. Then times the real CLIs, each in its own process as the rules call them:
``python -m offload_study.analysis.collect`` and ``python -m offload_study.analysis.report``. Target (issue
"newcomer"): collect + report over 1,000 records <= 15 s on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import numpy as np
import yaml

from offload_study.core import contracts
from offload_study.planning.plan import Plan, write_scenario_files

REPO_ROOT = Path(__file__).resolve().parents[1]  # this checkout

TARGET_S = 15.0
FAILURES = ["gpu_oom", "host_oom", "timeout", "dist_error"]
GAS = [1, 2, 4, 8, 16]
#: tokens/s of each base scenario at gas 1 on the cluster (a seed-table-like spread)
BASE_SPEED = {
    "zero3-8gpu-40gb": 8000.0,
    "offload-opt-8gpu-40gb": 5200.0,
    "offload-4gpu-40gb": 2800.0,
    "offload-2gpu-80gb": 1600.0,
    "nvme-2gpu-80gb": 700.0,
}


def bench_study(n_scenarios: int) -> dict:
    """seed.yaml with five base scenarios, each swept to n_scenarios / 5 expanded scenarios."""
    study = yaml.safe_load((REPO_ROOT / "config/studies/seed.yaml").read_text())
    study["study"] = f"bench-{n_scenarios}"
    study["max_runs"] = max(n_scenarios, 1000)  # the study key that allows more than 1000 runs
    extra = {
        **study["scenarios"][0],
        "name": "offload-opt-8gpu-40gb",
        "cpu_mem_gb": 256,
        "label": "ZeRO-3 + CPU optimizer offload (8 GPU)",
        "offload_optimizer": "cpu",
    }
    extra.pop("reference")
    study["scenarios"].insert(1, extra)
    per_base = max(1, n_scenarios // (len(study["scenarios"]) * len(GAS)))
    buckets = [int(5e7) * (i + 1) for i in range(per_base)]
    for scenario in study["scenarios"]:
        scenario["sweep"] = {"gradient_accumulation_steps": GAS, "reduce_bucket_size": buckets}
    return study


def write_plan(plan: Plan, results: Path) -> Path:
    """configs/<scenario>.json + .run.json and plan.json, as the plan rules leave them."""
    shas = {}
    for name in plan.scenarios:
        spec = plan.run_spec(name)
        ds_path = results / "configs" / f"{name}.json"
        write_scenario_files(spec, str(ds_path), str(results / "configs" / f"{name}.run.json"))
        shas[name] = contracts.sha256_file(ds_path)
    summary = {**plan.summary(), "configs_checked": True, "ds_config_sha256": shas}
    for scenario in summary["scenarios"]:  # plan.json paths relative to the repo; here absolute
        scenario["ds_config"] = str(results / "configs" / f"{scenario['name']}.json")
        scenario["run_spec"] = str(results / "configs" / f"{scenario['name']}.run.json")
    path = results / "plan.json"
    contracts.write_json(path, summary)
    return path


def speed(spec: dict) -> float:
    """Plausible tokens/s: offload pays a per-step cost that gradient accumulation hides."""
    base = BASE_SPEED[spec["base_scenario"]]
    gas = spec["gradient_accumulation_steps"]
    bucket = 1 + 0.02 * np.log2(spec["zero"]["reduce_bucket_size"] / 5e7)
    offload = (spec["offload_optimizer"], spec["offload_param"]) != ("none", "none")
    return base * bucket * (gas / (gas + 0.8) if offload else 1 + 0.02 * np.log2(gas))


def step_rows(spec: dict, tokens_per_s: float, rng: np.random.Generator) -> list[list]:
    """steps.csv rows: warm-up steps (slow), then measured steps with 2 % noise."""
    tokens = spec["global_batch"] * spec["seq_len"]
    rows = []
    for step in range(1, spec["warmup_steps"] + spec["steps"] + 1):
        warm = step <= spec["warmup_steps"]
        tps = tokens_per_s * (0.3 if warm else 1 + 0.02 * rng.standard_normal())
        t = tokens / tps
        phase = "warmup" if warm else "measured"
        rows.append(
            [
                step,
                phase,
                round(t, 6),
                round(tps, 3),
                round(spec["global_batch"] / t, 4),
                round(10.5 - 0.01 * step, 6),
            ]
        )
    return rows


def ok_metrics(spec: dict, rows: list[list]) -> dict:
    """The speed, memory and timer fields of an ok run, from its measured steps."""
    times = np.array([r[2] for r in rows if r[1] == "measured"])
    t = float(np.median(times))
    tps = spec["global_batch"] * spec["seq_len"] / t
    tflops = 8 * spec["model_params"] * tps / spec["world_size"] / 1e12
    offload = spec["offload_optimizer"] != "none"
    gpu = 34.0 * 8 / spec["world_size"] * (0.35 if spec["offload_param"] != "none" else 1)
    host = (300.0 if offload else 40.0) * spec["gpus_per_node"] / 8 + 20
    ms = 1000 * t  # per optimizer step, as DeepSpeed's timers sum them
    swap = 0.05 * ms if spec["offload_optimizer"] == "nvme" else None
    return {
        "steps_measured": len(times),
        "step_time_s": t,
        "step_time_s_mean": float(times.mean()),
        "step_time_s_std": float(times.std()),
        "step_time_s_p10": float(np.percentile(times, 10)),
        "step_time_s_p90": float(np.percentile(times, 90)),
        "tokens_per_s": tps,
        "samples_per_s": spec["global_batch"] / t,
        "tflops_per_gpu": tflops,
        "peak_tflops": 989.0,
        "mfu": tflops / 989.0,
        "loss_first": rows[spec["warmup_steps"]][5],
        "loss_last": rows[-1][5],
        "peak_gpu_allocated_gib": gpu,
        "peak_gpu_reserved_gib": gpu * 1.08,
        "nvml_used_gib": gpu * 1.12,
        "host_peak_rss_gib_per_rank": [host / spec["gpus_per_node"]] * spec["gpus_per_node"],
        "host_peak_rss_gib_per_node": [host],
        "host_peak_rss_gib": host,
        "nvme_bytes_used": int(9e10) if spec["offload_optimizer"] == "nvme" else None,
        "breakdown_ms": {
            "forward": 0.2 * ms,
            "backward": 0.45 * ms,
            "backward_inner": 0.35 * ms,
            "backward_allreduce": 0.1 * ms,
            "step": (0.25 if offload else 0.1) * ms,
            "optimizer_swap_in": swap,
            "optimizer_swap_out": swap,
        },
    }


def metrics_record(spec: dict, repeat: int, outcome: str, rows: list[list]) -> dict:
    """metrics.json of one run: the run spec's setup, then the measured fields (null if failed)."""
    setup = {k: spec[k] for k in contracts.METRICS_FIELDS if k in spec}
    empty = {k: None for k in contracts.METRICS_FIELDS}
    empty.update(
        host_peak_rss_gib_per_rank=[],
        host_peak_rss_gib_per_node=[],
        breakdown_ms=dict.fromkeys(contracts.BREAKDOWN_KEYS),
    )
    record = {
        **empty,
        **setup,
        "schema_version": 1,
        "repeat": repeat,
        "outcome": outcome,
        "started_at": "2026-01-01T00:00:00Z",
        "finished_at": "2026-01-01T00:01:00Z",
        "wall_time_s": 60.0 + 0.01 * repeat,
        "device_name": "NVIDIA H200",
        "ds_config_sha256": contracts.sha256_file(spec["ds_config"]),
        "deepspeed_version": "0.19.8",
        "torch_version": "2.11.0+cu130",
        "slurm_job_id": str(4000 + repeat),
    }
    if outcome == "ok":
        record.update(ok_metrics(spec, rows))
    else:
        record["error_excerpt"] = f"RuntimeError: {outcome} (benchmark record)\n  at step 1"
    return record


def provenance_record(spec: dict, repeat: int) -> dict:
    """provenance.json with the runner's keys and values shaped like a real H200 run's."""
    record = {k: None for k in contracts.PROVENANCE_FIELDS}
    gpus = [
        {"index": i, "name": "NVIDIA H200", "memory_total_bytes": 150754820096}
        for i in range(spec["gpus_per_node"])
    ]
    record.update(
        host="gpu-node-01",
        hosts=["gpu-node-01"],
        gpu_model="NVIDIA H200",
        gpu_count=len(gpus),
        gpu_driver="580.159.04",
        gpus=gpus,
        cuda_version="13.0",
        torch_version="2.11.0+cu130",
        deepspeed_version="0.19.8",
        transformers_version="5.17.0",
        python_version="3.12.3",
        platform="Linux-6.18-x86_64-with-glibc2.39",
        cpu_model="Intel(R) Xeon(R) Processor",
        cpu_count=128,
        cpu_affinity=list(range(128)),
        cores_granted=128,
        ram_total_bytes=601295421440,
        git_commit="0" * 40,
        git_dirty=False,
        ds_config=spec["ds_config"],
        ds_config_sha256=contracts.sha256_file(spec["ds_config"]),
        launch_command=f"python -m torch.distributed.run --nproc_per_node {len(gpus)} ...",
        launch_env={"OMP_NUM_THREADS": "16"},
        rendezvous_host="127.0.0.1",
        rendezvous_port=29500 + repeat,
        environment={"CUDA_HOME": "/usr/local/cuda"},
        runner_exit_code_of_launcher=0,
        runner_peak_tree_rss_bytes=int(3e10),
        run_id=f"{spec['scenario']}-rep{repeat}-1",
        schema_problems=[],
    )
    return record


def write_records(plan: Plan, results: Path, repeats: int, seed: int = 0) -> list[Path]:
    """One record per scenario x repeat; about 4 % fail. Returns the metrics.json paths."""
    rng = np.random.default_rng(seed)
    metrics_ok = jsonschema.Draft202012Validator(contracts.metrics_schema())
    provenance_ok = jsonschema.Draft202012Validator(contracts.provenance_schema())
    paths = []
    for name in plan.scenarios:
        spec = plan.run_spec(name)
        spec["ds_config"] = str(results / "configs" / f"{name}.json")
        for repeat in range(repeats):
            failed = rng.random() < 0.04
            outcome = str(rng.choice(FAILURES)) if failed else "ok"
            rows = [] if failed else step_rows(spec, speed(spec) * rng.normal(1, 0.03), rng)
            metrics = metrics_record(spec, repeat, outcome, rows)
            provenance = provenance_record(spec, repeat)
            metrics_ok.validate(metrics)
            provenance_ok.validate(provenance)
            record = contracts.RecordDir(results / name / f"rep{repeat}")
            record.root.mkdir(parents=True)
            contracts.write_json(record.metrics, metrics)
            contracts.write_json(record.provenance, provenance)
            contracts.write_steps(record.steps, rows)
            paths.append(record.metrics)
    return paths


def timed(argv: list[str]) -> float:
    """Seconds one CLI takes in a fresh interpreter (imports included, as a rule runs it)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"{' '.join(argv[:1])} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return seconds


def run_collect_and_report(plan_json: Path, paths: list[Path], out: Path) -> tuple[float, float]:
    """Seconds of the collect CLI and of the report CLI, outputs under out/."""
    collect_s = timed(
        [
            "offload_study.analysis.collect",
            "--baseline",
            "",
            "--runs-csv",
            str(out / "runs.csv"),
            "--runs-parquet",
            str(out / "runs.parquet"),
            "--summary-csv",
            str(out / "summary.csv"),
            *map(str, paths),
        ]
    )
    report_s = timed(
        [
            "offload_study.analysis.report",
            "--runs",
            str(out / "runs.csv"),
            "--summary",
            str(out / "summary.csv"),
            "--plan",
            str(plan_json),
            "--out",
            str(out / "report.html"),
            "--figures-dir",
            str(out / "figures"),
        ]
    )
    return collect_s, report_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", type=int, default=250, help="expanded scenarios (÷ 25)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="time the CLIs this many times")
    parser.add_argument("--keep", type=Path, help="write the records here and keep them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="collect-report-") as tmp:
        root = args.keep or Path(tmp)
        plan = Plan(bench_study(args.scenarios), cluster_dir=REPO_ROOT / "config/clusters")
        results = root / "results" / plan.cluster["name"] / plan.study["study"]
        plan_json = write_plan(plan, results)
        paths = write_records(plan, results, args.repeats)
        print(
            f"{len(paths)} records ({len(plan.scenarios)} scenarios x {args.repeats} repeats) "
            f"under {results}"
        )
        print(
            f"{'run':>4} {'collect s':>10} {'report s':>9} {'total s':>8}  target <= {TARGET_S:g} s"
        )
        for i in range(args.runs):
            collect_s, report_s = run_collect_and_report(plan_json, paths, root / "out")
            total = collect_s + report_s
            verdict = "ok" if total <= TARGET_S else "OVER"
            print(f"{i + 1:>4} {collect_s:>10.2f} {report_s:>9.2f} {total:>8.2f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
