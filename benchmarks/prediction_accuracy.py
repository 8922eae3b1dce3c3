"""How well the plan's predictions (offload_study.prediction.predict) match measured runs.

    python benchmarks/prediction_accuracy.py [--cpu-study-dir results/local-cpu/default-cpu \\
        --cpu-study config/config.yaml --cpu-calibration results/local-cpu/calibration.json]

Every committed GPU record (docs/results: the H200 studies) and, when given, the records of a
CPU study run here: each record's study is planned again with the real planner, its scenario's
run spec checked against the record's own setup (micro-batch, accumulation, offloads, GPUs,
sequence, dtype), and the prediction made from the DeepSpeed config the run used and the
cluster's calibration (config/calibration/<cluster>.json for the H200 machines). Targets (issue
"predict before you spend"): peak GPU memory within 10 % and step time within 25 % of measured.
DeepSpeed's own estimator (model states only) is shown beside the prediction.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from offload_study.analysis import collect
from offload_study.core.contracts import read_calibration, read_json
from offload_study.planning.plan import Plan
from offload_study.prediction import predict

REPO_ROOT = Path(__file__).resolve().parents[1]  # this checkout

TARGETS = {"gpu": 0.10, "step": 0.25}
#: committed record folder -> the study that made it
GPU_RECORDS = {
    "docs/results/h200-1gpu/model-a": "config/studies/h200-1gpu.yaml",
    "docs/results/h200-1gpu/model-b-nvme": "config/studies/h200-1gpu-nvme.yaml",
    "docs/results/default-gpu": "config/studies/default-gpu.yaml",
    "docs/results/h200-2gpu/seed-2gpu": "config/studies/seed-2gpu.yaml",
    # the newer offload modes (issue 15): partial offload, SuperOffload, ZenFlow, pin_memory off
    "docs/results/h200-1gpu/modes-h200": "config/studies/modes-h200.yaml",
    "docs/results/h200-1gpu/recommend-h200-1gpu-16g": "config/studies/recommend-h200-1gpu-16g.yaml",
}
SAME = ("micro_batch", "gradient_accumulation_steps", "offload_optimizer", "offload_param",
        "world_size", "seq_len", "dtype")  # fmt: skip


def error(predicted, measured) -> float | None:
    if predicted is None or not measured or measured != measured:  # NaN: not measured
        return None
    return predicted / measured - 1


def record_rows(record_dir: Path, study: Path, calibration: Path) -> list[dict]:
    """One row per record of ``record_dir``: what was measured and what is predicted."""
    plan = Plan(str(study), cluster_dir=REPO_ROOT / "config" / "clusters")
    cal = read_calibration(calibration)
    rows = []
    for metrics in sorted(record_dir.glob("*/rep*/metrics.json")):
        m = collect.read_record(metrics)
        spec = plan.by_name.get(m["scenario"])
        if spec is None or any(getattr(spec, k) != m[k] for k in SAME):
            print(f"skipped {metrics}: the study no longer plans this setup", file=sys.stderr)
            continue
        ds_config = read_json(record_dir / "configs" / f"{m['scenario']}.json")
        memory = predict.predict_memory(spec, ds_config)
        times = predict.step_time(spec, ds_config, cal)
        ds = predict.deepspeed_estimate(spec)
        rows.append({
            "record": f"{record_dir.name}/{m['scenario']}/rep{m['repeat']}",
            "kind": "GPU" if spec.accelerator == "cuda" else "CPU",
            "outcome": m["outcome"], "offload": f"{spec.offload_optimizer}/{spec.offload_param}",
            "gpu": (memory.gpu_gib if spec.accelerator == "cuda" else None,
                    m["peak_gpu_allocated_gib"]),
            "ds_gpu": (ds[0] if spec.accelerator == "cuda" else None, m["peak_gpu_allocated_gib"]),
            "host": (memory.host_gib, m["host_peak_rss_gib"]),
            "step": (times.total, m["step_time_s"]), "bound": times.bound,
            # the verdict without force (the 40 GiB OOM run is forced on purpose)
            "feasible": predict.predict(replace(spec, force=False), ds_config, cal).feasible,
        })  # fmt: skip
    return rows


def _cell(pair) -> str:
    predicted, measured = pair
    err = error(predicted, measured)
    if predicted is None:
        return "—"
    if err is None:
        return f"{predicted:.2f} / —"
    return f"{predicted:.2f} / {measured:.2f} ({err:+.0%})"


def print_table(rows: list[dict]) -> None:
    print(
        "| record | outcome | offload opt/param | GPU GiB pred / meas | DeepSpeed estimator "
        "GiB | host GiB | step s | bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        outcome = r["outcome"] if r["feasible"] else f"{r['outcome']} (predicted infeasible)"
        print(
            f"| {r['record']} | {outcome} | {r['offload']} | {_cell(r['gpu'])} | "
            f"{_cell(r['ds_gpu'])} | {_cell(r['host'])} | {_cell(r['step'])} | {r['bound']} |"
        )


def summary_lines(rows: list[dict], kind: str) -> list[str]:
    """One line per target (and per DeepSpeed-estimator offload kind) over ``rows``."""
    lines = []
    for key, what in (("gpu", "peak GPU memory"), ("step", "step time")):
        errs = [e for r in rows if (e := error(*r[key])) is not None]
        if not errs:
            continue
        hits = sum(abs(e) <= TARGETS[key] for e in errs)
        verdict = "MET" if hits == len(errs) else "MISSED"
        lines.append(
            f"{kind} {what}: {hits}/{len(errs)} records within {TARGETS[key]:.0%} "
            f"(worst {max(errs, key=abs):+.1%}) -> target {verdict}"
        )
    for offload in sorted({r["offload"] for r in rows}):
        errs = [
            e for r in rows if r["offload"] == offload and (e := error(*r["ds_gpu"])) is not None
        ]
        if errs:
            lines.append(
                f"{kind} DeepSpeed's estimator, offload {offload}: mean GPU error "
                f"{sum(errs) / len(errs):+.0%} over {len(errs)} records"
            )
    # a run that failed or was cancelled measured its host memory before its peak
    host = [e for r in rows if r["outcome"] == "ok" and (e := error(*r["host"])) is not None]
    if host:
        lines.append(
            f"{kind} host memory (no target): worst {max(host, key=abs):+.1%} over {len(host)}"
        )
    return lines


def calibration_lines(path: Path, label: str = "CPU") -> list[str]:
    """What a measured calibration says of itself: its rates and the spread of their samples
    (offload_study.prediction.calibrate records the range of each measurement)."""
    cal = read_calibration(path)
    spread = cal.provenance.get("spread", {})
    lines = [f"{label} calibration {path}: {cal.source}, {cal.provenance.get('measured_at')}"]
    for key, summary in spread.items():
        lines.append(
            f"  {key}: median {summary['median']:.4g}, range {summary['low']:.4g}-"
            f"{summary['high']:.4g} ({summary['spread_pct']:.0f} %, {summary['samples']} samples)"
        )
    for ranks, plain in (cal.zero3_layer_s or {}).items():
        variants = {"none/none": plain, **plain.get("offload", {})}
        lines += [
            f"  host s, {ranks} rank(s), offload {offload}: "
            + ", ".join(f"{k} {costs[k]:.4f}" for k in ("forward", "backward", "rest"))
            for offload, costs in variants.items()
        ]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-study-dir", type=Path, help="results/<cluster>/<study> of a CPU run")
    ap.add_argument("--cpu-study", type=Path, default=REPO_ROOT / "config" / "config.yaml")
    ap.add_argument(
        "--cpu-calibration", type=Path, help="default: <cpu-study-dir>/../calibration.json"
    )
    ap.add_argument(
        "--gpu-calibration", action="append", default=[], metavar="CLUSTER=PATH",
        help="a GPU cluster's calibration instead of config/calibration/<cluster>.json (e.g. "
        "one measured by `python -m offload_study.prediction.calibrate`); repeatable",
    )  # fmt: skip
    a = ap.parse_args(argv)
    chosen = dict(item.split("=", 1) for item in a.gpu_calibration)
    rows = []
    for folder, study in GPU_RECORDS.items():
        cluster = Plan(str(REPO_ROOT / study)).cluster["name"]
        shipped = REPO_ROOT / "config" / "calibration" / f"{cluster}.json"
        rows += record_rows(REPO_ROOT / folder, REPO_ROOT / study,
                            Path(chosen.get(cluster, shipped)))  # fmt: skip
    for cluster, path in chosen.items():
        print("\n".join(calibration_lines(Path(path), label=cluster)))
    if a.cpu_study_dir:
        cal = a.cpu_calibration or a.cpu_study_dir.parent / "calibration.json"
        rows += record_rows(a.cpu_study_dir, a.cpu_study, cal)
    print_table(rows)
    print()
    for kind in ("GPU", "CPU"):
        for line in summary_lines([r for r in rows if r["kind"] == kind], kind):
            print(line)
    if a.cpu_study_dir:
        print("\n".join(calibration_lines(cal)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
