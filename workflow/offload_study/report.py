"""Self-contained comparative HTML report of one study on one cluster.

CLI::

    python -m offload_study.report --runs runs.csv --summary summary.csv --plan plan.json \
        --out reports/<study>/report.html --figures-dir reports/<study>/figures \
        [--other-cluster-summary other/summary.csv ...]

The HTML has no external reference at all: CSS inline, figures as base64 PNG, DeepSpeed configs as
data: URI downloads, and a Content-Security-Policy that forbids any fetch. Figures are also written
to --figures-dir under fixed names (FIGURES) so Snakemake outputs always exist.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import hashlib
import html
import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from jinja2 import Environment, PackageLoader, select_autoescape  # noqa: E402

FIGURES = {
    "relative_speed": "relative_speed.png",
    "speed_vs_gpu_memory": "speed_vs_gpu_memory.png",
    "step_breakdown": "step_breakdown.png",
    "speed_vs_gas": "speed_vs_gas.png",
}
BREAKDOWN_PARTS = [  # (label, columns summed)
    ("forward", ["breakdown_ms.forward"]),
    ("backward", ["breakdown_ms.backward"]),
    ("optimizer step", ["breakdown_ms.step"]),
    ("swap in/out", ["breakdown_ms.optimizer_swap_in", "breakdown_ms.optimizer_swap_out"]),
]
PALETTE = {"none": "#4c72b0", "cpu": "#dd8452", "nvme": "#8172b3", "failed": "#c44e52"}


# --------------------------------------------------------------------------- small helpers
def _model_from_config(model: dict) -> str:
    """A one-line name for a model built from a transformers config: 'llama 24L h2048'."""
    cfg = model.get("config") or {}
    parts = [_s(cfg.get("model_type")) or "model from config"]
    if cfg.get("num_hidden_layers"):
        parts.append(f"{cfg['num_hidden_layers']}L")
    if cfg.get("hidden_size"):
        parts.append(f"h{cfg['hidden_size']}")
    return " ".join(parts)


def _isnum(v) -> bool:
    try:
        return v is not None and not isinstance(v, bool) and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _f(v) -> float:
    return float(v) if _isnum(v) else math.nan


def _s(v) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return str(v)


def fmt(v, digits: int = 1, suffix: str = "") -> str:
    """Number for humans; '—' for None/NaN."""
    if not _isnum(v):
        return "—"
    x = float(v)
    if abs(x) >= 10000:
        return f"{x:,.0f}{suffix}"
    if 0 < abs(x) < 0.1 and digits > 0:
        return f"{x:.2g}{suffix}"
    return f"{x:,.{digits}f}{suffix}"


def fmt_pct(v, digits: int = 0) -> str:
    return "—" if not _isnum(v) else f"{100 * float(v):.{digits}f}%"


def fmt_bytes(v) -> str:
    if not _isnum(v):
        return "—"
    x = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def _gb(v) -> str:
    return f"{float(v):g}GB" if _isnum(v) else "?"


def read_table(path: str | Path | None) -> pd.DataFrame:
    """CSV (or Parquet) to DataFrame; empty frame when missing or empty."""
    if not path:
        return pd.DataFrame()
    p = Path(path)
    try:
        if p.suffix == ".parquet":
            return pd.read_parquet(p)
        return pd.read_csv(p)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return pd.DataFrame()


def _read_json(path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, TypeError):
        return None
    return data if isinstance(data, dict) else None


def _data_uri(text: str, mime: str = "application/json") -> str:
    return f"data:{mime};base64," + base64.b64encode(text.encode()).decode()


def _png_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _dig(d: dict | None, *paths: str):
    """First non-empty value at any dotted path of a nested dict."""
    for p in paths:
        cur = d
        for part in p.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur not in (None, "", [], {}):
            return cur
    return None


# --------------------------------------------------------------------------- model
def build_scenarios(summary: pd.DataFrame, plan: dict) -> list[dict]:
    """Plan scenarios (in plan order) joined with their summary rows; extra rows appended."""
    rows = {}
    if not summary.empty and "scenario" in summary:
        for rec in summary.to_dict("records"):
            rows[str(rec["scenario"])] = rec
    out = []
    seen = set()
    for sc in plan.get("scenarios") or []:
        name = str(sc.get("name"))
        seen.add(name)
        out.append(_scenario_view(sc, rows.get(name)))
    for name, rec in rows.items():
        if name not in seen:
            out.append(_scenario_view({"name": name}, rec))
    return out


def _scenario_view(sc: dict, m: dict | None) -> dict:
    m = m or {}

    def pick(key):
        v = sc.get(key)
        if v not in (None, ""):
            return v
        w = m.get(key)
        return None if w is None or (isinstance(w, float) and math.isnan(w)) else w

    nodes = pick("nodes")
    gpn = pick("gpus_per_node")
    ws = m.get("world_size") if _isnum(m.get("world_size")) else None
    if ws is None and _isnum(nodes) and _isnum(gpn):
        ws = int(nodes) * int(gpn)
    v = {
        "name": str(sc.get("name")),
        "label": _s(sc.get("label")) or _s(m.get("label")) or str(sc.get("name")),
        "base_scenario": _s(sc.get("base_scenario")) or _s(m.get("base_scenario")),
        "sweep": sc.get("sweep") if isinstance(sc.get("sweep"), dict) else _loads(m.get("sweep")),
        "nodes": int(nodes) if _isnum(nodes) else None,
        "gpus_per_node": int(gpn) if _isnum(gpn) else None,
        "world_size": int(ws) if _isnum(ws) else None,
        "gpu_mem_gb": _f(pick("gpu_mem_gb")),
        "cpu_mem_gb": _f(pick("cpu_mem_gb")),
        "offload_optimizer": _s(pick("offload_optimizer")) or "?",
        "offload_param": _s(pick("offload_param")) or "?",
        "reference": sc.get("reference") if isinstance(sc.get("reference"), dict) else None,
        "ds_config": sc.get("ds_config"),
        "run_spec": sc.get("run_spec"),
        "has_summary": bool(m),
        "m": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()},
    }
    v["runs"] = int(m["runs"]) if _isnum(m.get("runs")) else 0
    v["n_ok"] = int(m["n_ok"]) if _isnum(m.get("n_ok")) else 0
    v["status"] = _s(m.get("status")) or "not run"
    v["outcomes"] = _s(m.get("outcomes")) or "no record"
    v["rel"] = _f(m.get("relative_speed"))
    v["rel_lo"] = _f(m.get("relative_speed_ci_low"))
    v["rel_hi"] = _f(m.get("relative_speed_ci_high"))
    v["tps"] = _f(m.get("tokens_per_s"))
    v["gpu_peak"] = _f(m.get("peak_gpu_allocated_gib"))
    v["host_peak"] = _f(m.get("host_peak_rss_gib_per_node_max"))
    if math.isnan(v["host_peak"]):
        v["host_peak"] = _f(m.get("host_peak_rss_gib"))
    v["is_baseline"] = str(m.get("is_baseline")).lower() == "true"
    v["offload_kind"] = _offload_kind(v["offload_optimizer"], v["offload_param"])
    v["unit"] = "ranks" if str(m.get("accelerator")) == "cpu" else "GPUs"
    if not _isnum(v["gpu_mem_gb"]):
        n = v["world_size"] or "?"
        v["gpu_setup"] = f"{n} {v['unit'][:-1] if n == 1 else v['unit']}"
    elif v["world_size"]:
        v["gpu_setup"] = f"{_gb(v['gpu_mem_gb'])} × {v['world_size']}"
    else:
        v["gpu_setup"] = _gb(v["gpu_mem_gb"])
    ref = v["reference"] or {}
    v["ref_speed"] = _f(ref.get("speed_pct"))
    return v


def _loads(s) -> dict:
    try:
        d = json.loads(s) if isinstance(s, str) else None
    except ValueError:
        d = None
    return d if isinstance(d, dict) else {}


def _offload_kind(opt: str, param: str) -> str:
    if "nvme" in (opt, param):
        return "nvme"
    if "cpu" in (opt, param):
        return "cpu"
    return "none"


def offload_text(v: dict) -> str:
    parts = []
    if v["offload_optimizer"] not in ("none", "?"):
        parts.append(f"optimizer→{v['offload_optimizer']}")
    if v["offload_param"] not in ("none", "?"):
        parts.append(f"params→{v['offload_param']}")
    return ", ".join(parts) or "no offload"


def verdicts(scen: list[dict], baseline: str | None, note: str | None) -> tuple[str, list[str]]:
    """(headline sentence, one sentence per other scenario)."""
    base = next((s for s in scen if s["name"] == baseline), None)
    lines = []
    if base is None or math.isnan(base["tps"]):
        why = note or "no baseline scenario"
        head = f"No relative speed: {why}."
        for s in scen:
            if not math.isnan(s["tps"]):
                lines.append(
                    f"{s['label']}: {fmt(s['tps'], 0)} tokens/s on "
                    f"{s['world_size'] or '?'} {s['unit']}"
                    + (f", peak {fmt(s['gpu_peak'])} GiB/GPU" if _isnum(s["gpu_peak"]) else "")
                    + "."
                )
            else:
                lines.append(f"{s['label']}: no successful run ({s['outcomes']}).")
        return head, lines
    use_gpu = _isnum(base["gpu_peak"])
    mem_key, mem_name = (
        ("gpu_peak", "GPU memory per GPU") if use_gpu else ("host_peak", "host memory per node")
    )
    head = (
        f"Baseline {base['label']}: {fmt(base['tps'], 0)} tokens/s on "
        f"{base['world_size'] or '?'} {base['unit']}"
        + (f", {fmt(base[mem_key])} GiB {mem_name}" if _isnum(base[mem_key]) else "")
        + "."
    )
    for s in scen:
        if s is base:
            continue
        if math.isnan(s["rel"]):
            lines.append(f"{s['label']}: no successful run ({s['outcomes']}).")
            continue
        t = f"{s['label']}: {fmt_pct(s['rel'])} of baseline speed"
        if _isnum(s[mem_key]) and _isnum(base[mem_key]) and base[mem_key] > 0:
            t += f" at {s[mem_key] / base[mem_key]:#.2g}× the {mem_name}"
        if s["world_size"] and base["world_size"] and s["world_size"] != base["world_size"]:
            t += f", on {s['world_size']} instead of {base['world_size']} {base['unit']}"
        if _isnum(s["ref_speed"]):
            t += f" (seed: ~{s['ref_speed']:g}%)"
        lines.append(t + ".")
    return head, lines


# --------------------------------------------------------------------------- figures
def _no_data(path: Path, title: str, why: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.axis("off")
    ax.text(0.5, 0.62, title, ha="center", va="center", fontsize=13, weight="bold")
    ax.text(0.5, 0.4, f"no data: {why}", ha="center", va="center", fontsize=11, color="#555")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(label: str, n: int = 34) -> str:
    return label if len(label) <= n else label[: n - 1] + "…"


def plot_relative_speed(scen: list[dict], baseline: str | None, path: Path) -> bool:
    have_rel = any(not math.isnan(s["rel"]) for s in scen)
    have_tps = any(not math.isnan(s["tps"]) for s in scen)
    if not scen or not (have_rel or have_tps):
        _no_data(path, "Training speed", "no successful run")
        return False
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(scen) + 1.4))
    labels = [_short(s["label"]) for s in scen]
    y = np.arange(len(scen))
    if have_rel:
        vals = [100 * s["rel"] if not math.isnan(s["rel"]) else 0 for s in scen]
        xlabel = f"training speed, % of baseline ({_short(baseline or '?', 30)})"
    else:
        vals = [s["tps"] if not math.isnan(s["tps"]) else 0 for s in scen]
        xlabel = "tokens/s (no baseline measured)"
    colors = [PALETTE["failed"] if s["n_ok"] == 0 else PALETTE[s["offload_kind"]] for s in scen]
    ax.barh(y, vals, color=colors, height=0.6)
    for i, s in enumerate(scen):
        if have_rel and not math.isnan(s["rel_lo"]) and not math.isnan(s["rel_hi"]):
            ax.errorbar(
                100 * s["rel"], i, xerr=[[100 * (s["rel"] - s["rel_lo"])],
                                         [100 * (s["rel_hi"] - s["rel"])]],
                color="black", capsize=3, lw=1,
            )  # fmt: skip
        if s["n_ok"] == 0:
            ax.text(1, i, f" failed: {s['outcomes']}", va="center", color=PALETTE["failed"])
        elif vals[i]:
            txt = f" {vals[i]:.0f}%" if have_rel else f" {vals[i]:,.0f}"
            ax.text(vals[i], i, txt, va="center", ha="left", fontsize=9)
        if have_rel and not math.isnan(s["ref_speed"]):
            ax.plot(s["ref_speed"], i, marker="D", color="black", ms=6, mfc="white", zorder=5)
    if have_rel and any(not math.isnan(s["ref_speed"]) for s in scen):
        ax.plot([], [], marker="D", color="black", mfc="white", ls="", label="seed (published)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, max(vals + [s["ref_speed"] for s in scen if _isnum(s["ref_speed"])]) * 1.22)
    ax.set_title("Training speed per scenario")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated when minimising x (memory) and maximising y (speed)."""
    idx = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 <= x and y2 >= y) and (x2 < x or y2 > y)
            for j, (x2, y2) in enumerate(points)
            if j != i
        )
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: points[i][0])


def plot_speed_vs_memory(scen: list[dict], path: Path) -> bool:
    use_rel = any(not math.isnan(s["rel"]) for s in scen)
    ykey = "rel" if use_rel else "tps"
    gpu = [s for s in scen if _isnum(s["gpu_peak"]) and _isnum(s[ykey])]
    if gpu:
        pts, xkey, xlabel = gpu, "gpu_peak", "peak GPU memory allocated per GPU (GiB)"
    else:
        pts = [s for s in scen if _isnum(s["host_peak"]) and _isnum(s[ykey])]
        xkey, xlabel = "host_peak", "peak host memory per node (GiB) — no GPU memory measured"
    if not pts:
        _no_data(path, "Speed vs memory", "no successful run with memory measured")
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    xs = [s[xkey] for s in pts]
    ys = [100 * s[ykey] if use_rel else s[ykey] for s in pts]
    front = pareto_front(list(zip(xs, ys, strict=True)))
    if len(front) > 1:
        ax.step([xs[i] for i in front], [ys[i] for i in front], where="post", color="#999",
                ls="--", lw=1.2, label="Pareto front")  # fmt: skip
    for i, s in enumerate(pts):
        on = i in front
        ax.scatter(xs[i], ys[i], s=110 if on else 60, color=PALETTE[s["offload_kind"]],
                   edgecolor="black" if on else "none", zorder=3)  # fmt: skip
        ax.annotate(_short(s["label"], 28), (xs[i], ys[i]), textcoords="offset points",
                    xytext=(7, 5), fontsize=8)  # fmt: skip
    for kind in dict.fromkeys(s["offload_kind"] for s in pts):
        ax.scatter([], [], color=PALETTE[kind], label=f"offload: {kind}")
    ax.legend(fontsize=8, loc="best")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training speed (% of baseline)" if use_rel else "tokens/s")
    ax.set_xlim(0, max(xs) * 1.3)
    ax.set_ylim(0, max(ys) * 1.15)
    ax.set_title("Speed vs memory (up-left is better; ringed = Pareto-optimal)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_breakdown(scen: list[dict], path: Path) -> bool:
    rows = []
    for s in scen:
        m = s["m"]
        total = 1000 * _f(m.get("step_time_s"))
        parts = {}
        for name, cols in BREAKDOWN_PARTS:
            vals = [_f(m.get(c)) for c in cols]
            vals = [v for v in vals if not math.isnan(v)]
            if name == "backward" and not vals:
                inner = [
                    _f(m.get(c))
                    for c in ("breakdown_ms.backward_inner", "breakdown_ms.backward_allreduce")
                ]
                vals = [v for v in inner if not math.isnan(v)]
            parts[name] = sum(vals) if vals else 0.0
        known = sum(parts.values())
        if math.isnan(total) and known == 0:
            continue
        parts["other / unattributed"] = max(total - known, 0.0) if not math.isnan(total) else 0.0
        rows.append((s["label"], parts))
    if not rows:
        _no_data(path, "Step-time breakdown", "no step time or DeepSpeed timers recorded")
        return False
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(rows) + 1.6))
    colors = [*sns.color_palette("Set2", 4), (0.8, 0.8, 0.8)]
    left = np.zeros(len(rows))
    names = [n for n, _ in BREAKDOWN_PARTS] + ["other / unattributed"]
    for k, name in enumerate(names):
        vals = np.array([p[name] for _, p in rows])
        ax.barh(range(len(rows)), vals, left=left, color=colors[k], label=name, height=0.6)
        left += vals
    ax.set_yticks(range(len(rows)), [_short(lab) for lab, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("median time per optimizer step (ms, rank 0)")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title("Where the step time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_speed_vs_gas(runs: pd.DataFrame, scen: list[dict], path: Path) -> bool:
    need = {"gradient_accumulation_steps", "tokens_per_s", "outcome"}
    if runs.empty or not need <= set(runs.columns):
        _no_data(path, "Speed vs gradient accumulation", "no runs")
        return False
    ok = runs[runs["outcome"] == "ok"].copy()
    ok["gas"] = pd.to_numeric(ok["gradient_accumulation_steps"], errors="coerce")
    ok["tps"] = pd.to_numeric(ok["tokens_per_s"], errors="coerce")
    ok = ok.dropna(subset=["gas", "tps"])
    if ok["gas"].nunique() < 2:
        _no_data(path, "Speed vs gradient accumulation", "gradient_accumulation_steps never varies")
        return False
    labels = {s["name"]: s["label"] for s in scen}
    key = (
        "base_scenario"
        if "base_scenario" in ok and ok["base_scenario"].notna().all()
        else "scenario"
    )
    ok["config"] = ok[key].map(lambda n: _short(labels.get(n, str(n)), 30))
    fig, ax = plt.subplots(figsize=(7.5, 4.3))
    sns.lineplot(data=ok, x="gas", y="tps", hue="config", marker="o", errorbar=None, ax=ax)
    sns.scatterplot(data=ok, x="gas", y="tps", hue="config", legend=False, alpha=0.5, ax=ax)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ok["gas"].unique()), [f"{g:g}" for g in sorted(ok["gas"].unique())])
    ax.set_xlabel("gradient accumulation steps")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    within = ok.groupby("config")["gas"].nunique().max() > 1
    ax.set_title(
        "Speed vs gradient accumulation (seed: ≥ 8 hides offload transfers)"
        if within
        else "Speed vs gradient accumulation (gas differs only between configurations)",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_figures(runs: pd.DataFrame, scen: list[dict], figdir: Path, baseline) -> list[dict]:
    figdir.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="notebook")
    specs = [
        ("relative_speed", "Relative training speed", plot_relative_speed, (scen, baseline)),
        ("speed_vs_gpu_memory", "Speed vs memory tradeoff", plot_speed_vs_memory, (scen,)),
        ("step_breakdown", "Step-time breakdown", plot_breakdown, (scen,)),
        ("speed_vs_gas", "Speed vs gradient accumulation", plot_speed_vs_gas, (runs, scen)),
    ]
    out = []
    for key, title, fn, args in specs:
        p = figdir / FIGURES[key]
        try:
            has = fn(*args, p)
        except Exception as e:  # a plotting bug must not lose the whole report
            plt.close("all")
            _no_data(p, title, f"plot failed ({type(e).__name__}: {e})"[:90])
            has = False
        out.append({"key": key, "title": title, "file": p.name, "uri": _png_uri(p), "has": has})
    return out


# --------------------------------------------------------------------------- sections
def failures(runs: pd.DataFrame, scen: list[dict]) -> list[dict]:
    out = []
    labels = {s["name"]: s["label"] for s in scen}
    if not runs.empty and "outcome" in runs:
        bad = runs[runs["outcome"].astype(str) != "ok"]
        for r in bad.to_dict("records"):
            out.append(
                {
                    "scenario": _s(r.get("scenario")) or "?",
                    "label": labels.get(_s(r.get("scenario")), _s(r.get("label")) or ""),
                    "repeat": _s(r.get("repeat")) or "?",
                    "outcome": _s(r.get("outcome")),
                    "excerpt": _s(r.get("error_excerpt")) or "(no error excerpt)",
                    "record_dir": _s(r.get("record_dir")) or "",
                }
            )
    run_scen = set(runs["scenario"].astype(str)) if "scenario" in runs else set()
    for s in scen:
        if s["name"] not in run_scen:
            out.append(
                {
                    "scenario": s["name"],
                    "label": s["label"],
                    "repeat": "—",
                    "outcome": "not run",
                    "excerpt": "no run record was collected for this scenario",
                    "record_dir": "",
                }
            )
    return out


def provenance_rows(runs: pd.DataFrame) -> list[dict]:
    out = []
    if runs.empty:
        return out
    for r in runs.to_dict("records"):
        rd = _s(r.get("record_dir"))
        prov = _read_json(Path(rd) / "provenance.json") if rd else None
        slurm = _s(r.get("slurm_job_id")) or _s(
            _dig(prov, "slurm_job_id", "slurm.job_id", "slurm.SLURM_JOB_ID", "SLURM_JOB_ID")
        )
        gpus = _dig(prov, "gpus", "gpu_names", "gpu.names", "cuda.devices")
        if isinstance(gpus, list):
            names = [g.get("name", str(g)) if isinstance(g, dict) else str(g) for g in gpus]
            uniq = list(dict.fromkeys(names))
            gpus = ", ".join(f"{len(names)}× {u}" if len(uniq) == 1 else u for u in uniq)
        out.append(
            {
                "scenario": _s(r.get("scenario")) or "?",
                "repeat": _s(r.get("repeat")) or "?",
                "outcome": _s(r.get("outcome")) or "?",
                "host": _s(_dig(prov, "host", "hostname", "node", "host.name")) or "—",
                "slurm": slurm or "—",
                "device": _s(r.get("device_name")) or _s(gpus) or "—",
                "torch": _s(r.get("torch_version"))
                or _s(_dig(prov, "versions.torch", "torch_version"))
                or "—",
                "deepspeed": _s(r.get("deepspeed_version"))
                or _s(_dig(prov, "versions.deepspeed", "deepspeed_version"))
                or "—",
                "git": (_s(_dig(prov, "git_commit", "git.commit", "git")) or "—")[:12],
                "sha": (_s(r.get("ds_config_sha256")) or "—")[:12],
                "started": _s(r.get("started_at")) or "—",
                "json": json.dumps(prov, indent=2, default=str) if prov else None,
            }
        )
    return out


def config_blocks(scen: list[dict], runs: pd.DataFrame) -> list[dict]:
    shas = {}
    if not runs.empty and {"scenario", "ds_config_sha256"} <= set(runs.columns):
        for n, g in runs.groupby("scenario"):
            shas[str(n)] = {str(x) for x in g["ds_config_sha256"].dropna()}
    out = []
    for s in scen:
        blk = {"name": s["name"], "label": s["label"], "files": []}
        for kind, p in (("DeepSpeed config", s["ds_config"]), ("run spec", s["run_spec"])):
            if not p:
                continue
            try:
                raw = Path(p).read_text()
            except OSError:
                blk["files"].append({"kind": kind, "path": p, "text": None})
                continue
            try:
                text = json.dumps(json.loads(raw), indent=2)
            except ValueError:
                text = raw
            sha = hashlib.sha256(raw.encode()).hexdigest()
            match = None
            if kind == "DeepSpeed config" and shas.get(s["name"]):
                match = sha in shas[s["name"]]
            blk["files"].append(
                {
                    "kind": kind,
                    "path": p,
                    "text": text,
                    "uri": _data_uri(raw),
                    "download": f"{s['name']}{'.run' if kind == 'run spec' else ''}.json",
                    "sha": sha,
                    "match": match,
                }
            )
        out.append(blk)
    return out


def other_clusters(this_cluster: str, scen: list[dict], paths: Sequence[str]) -> dict | None:
    if not paths:
        return None
    clusters = [this_cluster]
    tables = {this_cluster: {s["name"]: s for s in scen}}
    for p in paths:
        df = read_table(p)
        name = None
        if "cluster" in df and df["cluster"].notna().any():
            name = str(df["cluster"].dropna().iloc[0])
        name = name or Path(p).parent.parent.name or str(p)
        while name in tables:
            name += "'"
        clusters.append(name)
        tables[name] = {
            str(r["scenario"]): _scenario_view({"name": r["scenario"]}, r)
            for r in df.to_dict("records")
            if "scenario" in r
        }
    names = list(dict.fromkeys(n for t in tables.values() for n in t))
    rows = []
    for n in names:
        lab = next((t[n]["label"] for t in tables.values() if n in t), n)
        cells = []
        for c in clusters:
            s = tables[c].get(n)
            if s is None:
                cells.append({"rel": "—", "tps": "—", "mem": "—", "status": "absent"})
            else:
                cells.append(
                    {
                        "rel": fmt_pct(s["rel"]),
                        "tps": fmt(s["tps"], 0),
                        "mem": fmt(s["gpu_peak"]),
                        "status": s["status"],
                    }
                )
        rows.append({"name": n, "label": lab, "cells": cells})
    return {"clusters": clusters, "rows": rows}


# --------------------------------------------------------------------------- render
def _versions() -> dict:
    import jinja2
    import matplotlib as mpl

    from offload_study import __version__

    return {
        "offload-study": __version__,
        "python": platform.python_version(),
        "pandas": pd.__version__,
        "seaborn": sns.__version__,
        "matplotlib": mpl.__version__,
        "jinja2": jinja2.__version__,
    }


def render(
    runs: pd.DataFrame,
    summary: pd.DataFrame,
    plan: dict,
    figures_dir: str | Path,
    other_summaries: Sequence[str] = (),
) -> str:
    """Render the report HTML (writes the figures into figures_dir)."""
    scen = build_scenarios(summary, plan)
    baseline = None
    if not summary.empty and "baseline" in summary and summary["baseline"].notna().any():
        baseline = str(summary["baseline"].dropna().iloc[0])
    baseline = baseline or _s(plan.get("baseline"))
    note = None
    if not summary.empty and "relative_speed_note" in summary:
        notes = summary["relative_speed_note"].dropna().astype(str)
        bad = [n for n in notes if n.startswith(("no baseline", "baseline '"))]
        note = bad[0] if bad else None
    if not scen:
        note = "no scenario in the plan and no run collected"
    head, lines = verdicts(scen, baseline, note)
    figs = make_figures(runs, scen, Path(figures_dir), baseline)
    cluster = _s(plan.get("cluster")) or (
        str(summary["cluster"].dropna().iloc[0])
        if "cluster" in summary and summary["cluster"].notna().any()
        else "?"
    )
    n_runs = len(runs)
    n_ok = int((runs["outcome"] == "ok").sum()) if "outcome" in runs else 0
    env = Environment(
        loader=PackageLoader("offload_study", "templates"),
        autoescape=select_autoescape(["html", "j2", "html.j2"], default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(fmt=fmt, pct=fmt_pct, bytes=fmt_bytes)
    tpl = env.get_template("report.html.j2")
    base_view = next((s for s in scen if s["name"] == baseline), None)
    model = plan.get("model") if isinstance(plan.get("model"), dict) else {}
    setup = [
        f"model {_s(model.get('preset')) or _s(model.get('name_or_path')) or _model_from_config(model)}"
        + (
            f" ({float(plan['model_params']) / 1e6:,.1f} M params)"
            if _isnum(plan.get("model_params"))
            else ""
        )
        if model or _isnum(plan.get("model_params"))
        else None,
        f"seq_len {plan['seq_len']}" if plan.get("seq_len") else None,
        _s(plan.get("dtype")),
        f"{plan['repeats']} repeat(s)" if plan.get("repeats") else None,
        _s(plan.get("cluster_description")),
    ]
    return tpl.render(
        study=_s(plan.get("study")) or "?",
        cluster=cluster,
        description=_s(plan.get("description")) or "",
        setup_line=" · ".join(x for x in setup if x),
        baseline=baseline,
        baseline_label=base_view["label"] if base_view else None,
        baseline_note=note,
        verdict_head=head,
        verdict_lines=lines,
        scenarios=scen,
        offload_text=offload_text,
        figures=figs,
        failures=failures(runs, scen),
        provenance=provenance_rows(runs),
        configs=config_blocks(scen, runs),
        others=other_clusters(cluster, scen, other_summaries),
        n_runs=n_runs,
        n_ok=n_ok,
        any_reference=any(s["reference"] for s in scen),
        versions=_versions(),
        generated=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        escape=html.escape,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offload_study.report", description=__doc__)
    ap.add_argument("--runs", required=True, help="runs.csv (or .parquet) from collect")
    ap.add_argument("--summary", required=True, help="summary.csv from collect")
    ap.add_argument("--plan", required=True, help="plan.json (study, scenarios, references)")
    ap.add_argument("--out", required=True, help="report.html to write")
    ap.add_argument("--figures-dir", required=True, help="folder for the PNG figures")
    ap.add_argument(
        "--other-cluster-summary",
        action="append",
        default=[],
        help="summary.csv of the same study on another cluster (repeatable)",
    )
    a = ap.parse_args(argv)
    plan = _read_json(a.plan) or {}
    text = render(
        read_table(a.runs), read_table(a.summary), plan, a.figures_dir, a.other_cluster_summary
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"report: wrote {out} ({len(text) // 1024} KiB) and figures in {a.figures_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
