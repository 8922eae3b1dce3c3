"""Tests of offload_study.report on records written by test_collect's helper."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_collect import CLUSTER, STUDY, make_record, run_collect_cli, seed_like_records

from offload_study import collect as C
from offload_study import report as R

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


def assert_figures(figs: Path) -> None:
    for name in R.FIGURES.values():
        p = figs / name
        assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_full_report(tmp_path):
    paths = seed_like_records(tmp_path)
    html, figs, _ = build_report(tmp_path, paths)
    assert_self_contained(html)
    assert_figures(figs)
    assert 'id="headline-table"' in html and "ZeRO-3 + Offload (4 GPU)" in html
    assert "40GB × 8" in html and "~35%" in html  # measured setup and seed reference
    assert "35%" in html  # measured relative speed (2800/8000)
    assert html.count("data:image/png;base64,") == 4
    assert "host_oom" in html and "Killed: host memory exceeded 512GB" in html  # failures shown
    assert "of baseline speed at 0.41× the GPU memory per GPU" in html  # verdict
    assert 'download="zero3-8gpu.json"' in html and "matches the run records" not in html
    assert "node001" in html and "deadbeef" in html  # provenance
    assert "speed_vs_gas.png" in html


def test_escaping(tmp_path):
    evil = "<script>alert('x')</script>"
    paths = [
        make_record(tmp_path, "base", label=evil),
        make_record(tmp_path, "bad", outcome="error", error_excerpt=f"Traceback {evil} & more"),
    ]
    html, figs, _ = build_report(tmp_path, paths, labels={"base": evil, "bad": "B & <b>"})
    assert "<script>" not in html
    assert "&lt;script&gt;" in html
    assert "B &amp; &lt;b&gt;" in html
    assert_self_contained(html)


def test_one_scenario(tmp_path):
    html, figs, _ = build_report(tmp_path, [make_record(tmp_path, "solo", label="Solo run")])
    assert "Solo run" in html and "100%" in html
    assert_figures(figs)


def test_all_failed(tmp_path):
    paths = [
        make_record(tmp_path, "a", outcome="gpu_oom"),
        make_record(tmp_path, "b", outcome="timeout", offload_optimizer="cpu"),
    ]
    html, figs, _ = build_report(tmp_path, paths)
    assert "gpu_oom" in html and "timeout" in html
    assert "No relative speed" in html
    assert_figures(figs)
    assert "(no data)" in html


def test_missing_baseline_and_missing_records(tmp_path):
    paths = [
        make_record(tmp_path, "off", offload_optimizer="cpu", tokens_per_s=500),
        tmp_path / "results" / CLUSTER / STUDY / "off" / "rep1" / "metrics.json",
    ]
    html, figs, _ = build_report(tmp_path, paths)
    assert "No relative speed: no baseline" in html
    assert "missing" in html and "500 tokens/s" in html
    assert_figures(figs)


def test_nans_and_no_gpu_memory(tmp_path):
    paths = [
        make_record(tmp_path, "base", peak_gpu_gib=None, breakdown={}, steps=False),
        make_record(tmp_path, "off", offload_optimizer="cpu", tokens_per_s=300, peak_gpu_gib=None,
                    host_rss_gib=None),
    ]  # fmt: skip
    html, figs, _ = build_report(tmp_path, paths)
    assert "30%" in html and "—" in html
    assert_figures(figs)


def test_gas_sweep_and_other_cluster(tmp_path):
    paths = []
    for gas in (1, 2, 4, 8):
        name = f"off-sw-gas{gas}"
        paths.append(
            make_record(tmp_path, name, gas=gas, offload_optimizer="cpu",
                        tokens_per_s=200 * gas ** 0.5, sweep={"gradient_accumulation_steps": gas})
        )  # fmt: skip
    paths.insert(0, make_record(tmp_path, "base", tokens_per_s=1000))
    other = tmp_path / "other" / "summary.csv"
    other.parent.mkdir()
    _, s2 = C.collect(paths[:2], n_boot=50)
    s2["cluster"] = "big-gpu-cluster"
    s2.to_csv(other, index=False)
    html, figs, _ = build_report(tmp_path, paths, others=[other])
    assert 'id="clusters-table"' in html and "big-gpu-cluster" in html
    assert "(no data)" not in html
    assert_figures(figs)


def test_empty_inputs(tmp_path):
    (tmp_path / "runs.csv").write_text("")
    (tmp_path / "summary.csv").write_text("")
    (tmp_path / "plan.json").write_text(json.dumps({"study": "s", "cluster": "c", "scenarios": []}))
    out = tmp_path / "r" / "report.html"
    R.main(
        ["--runs", str(tmp_path / "runs.csv"), "--summary", str(tmp_path / "summary.csv"),
         "--plan", str(tmp_path / "plan.json"), "--out", str(out),
         "--figures-dir", str(tmp_path / "f")]
    )  # fmt: skip
    assert out.exists()
    assert_figures(tmp_path / "f")


def test_pareto_front():
    pts = [(10, 100), (5, 40), (6, 30), (20, 90), (2, 10)]
    assert R.pareto_front(pts) == [4, 1, 0]


@pytest.mark.parametrize(
    "v,exp", [(None, "—"), (float("nan"), "—"), (1.234, "1.2"), (12345, "12,345")]
)
def test_fmt(v, exp):
    assert R.fmt(v) == exp
