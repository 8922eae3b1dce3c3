"""Collect run records (metrics.json + steps.csv) into runs and per-scenario summary tables.

CLI::

    python -m offload_study.collect --baseline NAME_OR_EMPTY \
        --runs-csv runs.csv --runs-parquet runs.parquet --summary-csv summary.csv \
        results/<cluster>/<study>/<scenario>/rep<k>/metrics.json ...

A missing or unreadable metrics.json becomes a row with outcome "missing" / "error"; collecting
never crashes on a bad record. The table functions (:func:`build_runs`, :func:`summarize`, ...)
are pure: DataFrames / dicts in, DataFrames out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

#: The metrics.json contract (workflow/schemas/metrics.schema.json) decides the columns.
METRICS_SCHEMA = json.loads(
    (Path(__file__).resolve().parents[1] / "schemas" / "metrics.schema.json").read_text()
)["properties"]
#: Columns every runs table has (in the schema's order), whatever the records contain.
RUN_COLUMNS = [k for k in METRICS_SCHEMA if k not in ("schema_version", "breakdown_ms")]
#: Counts kept as nullable integers; every other numeric key of the schema becomes float64.
INTEGER_COLUMNS = [
    "repeat", "nodes", "gpus_per_node", "world_size", "micro_batch", "global_batch",
    "gradient_accumulation_steps",
]  # fmt: skip
FLOAT_COLUMNS = [
    k
    for k in RUN_COLUMNS
    if {"number", "integer"} & set(np.atleast_1d(METRICS_SCHEMA[k].get("type", [])))
    and k not in INTEGER_COLUMNS + ["seq_len"]
]
BREAKDOWN_KEYS = [
    "forward",
    "backward",
    "backward_inner",
    "backward_allreduce",
    "step",
    "optimizer_swap_in",
    "optimizer_swap_out",
]
BREAKDOWN_COLUMNS = [f"breakdown_ms.{k}" for k in BREAKDOWN_KEYS]
OUTCOMES = [
    "ok",
    "gpu_oom",
    "host_oom",
    "timeout",
    "cancelled",
    "dist_error",
    "config_error",
    "op_build_error",
    "error",
    "missing",
]
_LIST_COLUMNS = ("host_peak_rss_gib_per_node", "host_peak_rss_gib_per_rank")
_REP_RE = re.compile(r"^rep(\d+)$")


# --------------------------------------------------------------------------- reading records
def _path_identity(metrics_path: Path) -> dict:
    """Best-effort identity of a record from its path: .../<cluster>/<study>/<scenario>/rep<k>/."""
    rep_dir = metrics_path.parent
    ident: dict = {"record_dir": str(rep_dir)}
    m = _REP_RE.match(rep_dir.name)
    if m:
        ident["repeat"] = int(m.group(1))
        parts = rep_dir.parts
        if len(parts) >= 2:
            ident["scenario"] = parts[-2]
        if len(parts) >= 3:
            ident["study"] = parts[-3]
        if len(parts) >= 4:
            ident["cluster"] = parts[-4]
    return ident


def _run_spec_identity(metrics_path: Path, ident: dict) -> dict:
    """Fill setup columns of a missing record from configs/<scenario>.run.json when it exists."""
    scen = ident.get("scenario")
    if not scen:
        return {}
    spec_path = metrics_path.parent.parent.parent / "configs" / f"{scen}.run.json"
    try:
        spec = json.loads(spec_path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(spec, dict):
        return {}
    keep = set(RUN_COLUMNS) - {"outcome", "error_excerpt", "repeat"}
    return {k: v for k, v in spec.items() if k in keep}


def read_record(metrics_path: str | Path) -> dict:
    """Read one metrics.json into a flat dict; never raises.

    A missing file gives ``outcome="missing"``, unreadable JSON ``outcome="error"``; identity
    (scenario, repeat, ...) then comes from the path and the scenario's run spec when available.
    """
    p = Path(metrics_path)
    ident = _path_identity(p)
    try:
        text = p.read_text()
    except FileNotFoundError:
        rec = {**_run_spec_identity(p, ident), **ident}
        rec.update(outcome="missing", error_excerpt=f"metrics.json not found: {p}")
        return flatten_record(rec)
    except OSError as e:
        rec = {**_run_spec_identity(p, ident), **ident}
        rec.update(outcome="error", error_excerpt=f"cannot read {p}: {e}")
        return flatten_record(rec)
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"top level is {type(data).__name__}, not an object")
    except ValueError as e:
        rec = {**_run_spec_identity(p, ident), **ident}
        rec.update(outcome="error", error_excerpt=f"corrupt metrics.json ({p}): {e}")
        return flatten_record(rec)
    rec = dict(data)
    for k, v in ident.items():  # path identity only fills gaps
        if rec.get(k) in (None, ""):
            rec[k] = v
    rec["record_dir"] = ident["record_dir"]
    if not rec.get("outcome"):
        rec["outcome"] = "error"
        rec["error_excerpt"] = rec.get("error_excerpt") or "metrics.json has no outcome"
    return flatten_record(rec)


def flatten_record(rec: dict) -> dict:
    """Flatten ``breakdown_ms`` and ``sweep`` into ``breakdown_ms.<timer>`` / ``sweep.<knob>``.

    The ``sweep`` dict itself is kept as a JSON string (stable key order) so that rows group by it;
    list-valued memory columns become JSON strings too (CSV/Parquet friendly).
    """
    out = {k: v for k, v in rec.items() if k not in ("breakdown_ms", "sweep")}
    bd = rec.get("breakdown_ms")
    bd = bd if isinstance(bd, dict) else {}
    for k in BREAKDOWN_KEYS:
        out[f"breakdown_ms.{k}"] = _num(bd.get(k))
    for k, v in bd.items():
        if k not in BREAKDOWN_KEYS:
            out[f"breakdown_ms.{k}"] = _num(v)
    sweep = rec.get("sweep")
    sweep = sweep if isinstance(sweep, dict) else {}
    for k, v in sweep.items():
        out[f"sweep.{k}"] = v
    out["sweep"] = json.dumps(sweep, sort_keys=True, default=str)
    for k in _LIST_COLUMNS:
        if isinstance(out.get(k), (list, tuple)):
            out[k] = json.dumps(list(out[k]))
    return out


def _num(v) -> float:
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def read_steps(record_dir: str | Path) -> pd.DataFrame:
    """Measured steps of one run (steps.csv beside metrics.json); empty when absent/corrupt."""
    cols = ["step", "phase", "step_time_s", "tokens_per_s", "samples_per_s", "loss"]
    try:
        df = pd.read_csv(Path(record_dir) / "steps.csv")
    except (OSError, ValueError, pd.errors.ParserError):
        return pd.DataFrame(columns=cols)
    for c in cols:
        if c not in df.columns:
            df[c] = np.nan
    if df["phase"].notna().any():
        df = df[df["phase"].astype(str) == "measured"]
    for c in ("step_time_s", "tokens_per_s"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    return df[cols].reset_index(drop=True)


# --------------------------------------------------------------------------- runs table
def build_runs(records: Iterable[dict]) -> pd.DataFrame:
    """One row per run (flat records from :func:`read_record`), contract columns always present."""
    rows = list(records)
    df = pd.DataFrame(rows)
    extra = [c for c in df.columns if c not in RUN_COLUMNS + BREAKDOWN_COLUMNS + ["record_dir"]]
    sweep_cols = sorted(c for c in extra if c.startswith("sweep."))
    other_bd = sorted(c for c in extra if c.startswith("breakdown_ms."))
    rest = [c for c in extra if c not in sweep_cols and c not in other_bd]
    cols = RUN_COLUMNS + sweep_cols + BREAKDOWN_COLUMNS + other_bd + rest + ["record_dir"]
    df = df.reindex(columns=cols)
    if "sweep" in df:
        df["sweep"] = df["sweep"].astype("object").where(df["sweep"].notna(), "{}")
    df["outcome"] = df["outcome"].fillna("missing").astype(str)
    num_cols = [*FLOAT_COLUMNS, *BREAKDOWN_COLUMNS, *other_bd]
    for c in num_cols:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in INTEGER_COLUMNS:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    for c in ("slurm_job_id", "sweep", "label", "scenario", "base_scenario", "error_excerpt"):
        df[c] = df[c].astype("object").where(df[c].notna(), None)
        df[c] = df[c].map(lambda v: None if v is None else str(v))
    # sweep.<knob> columns may mix numbers and strings across scenarios; keep them as text
    # (parquet needs one type per column) unless every value is numeric.
    for c in sweep_cols:
        num = pd.to_numeric(df[c], errors="coerce")
        if num.notna().sum() == df[c].notna().sum():
            df[c] = num.astype("float64")
        else:
            df[c] = df[c].map(lambda v: None if v is None or v != v else str(v))
    for c in rest:  # unknown keys: make parquet-safe
        if df[c].map(lambda v: isinstance(v, (dict, list))).any():
            df[c] = df[c].map(
                lambda v: json.dumps(v, default=str) if isinstance(v, (dict, list)) else v
            )
    return df.reset_index(drop=True)


# --------------------------------------------------------------------------- statistics
def _bootstrap_run_medians(values: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """n_boot bootstrap medians of one run's step values (constant when only one value)."""
    values = values[np.isfinite(values)]
    if values.size == 0:
        return np.full(n_boot, np.nan)
    if values.size == 1:
        return np.full(n_boot, values[0])
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    return np.median(values[idx], axis=1)


def bootstrap_median(
    run_values: Sequence[float],
    step_values: Sequence[Sequence[float] | None],
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, np.ndarray, str]:
    """Median tokens/s of a scenario and its bootstrap distribution.

    Hierarchical bootstrap: resample repeats with replacement, and inside each resampled repeat
    resample its measured steps; the statistic is the median over repeats of each repeat's median
    step tokens/s. ``run_values[i]`` (metrics.json's tokens_per_s) stands in for a run without
    steps. Returns (point estimate = median of run_values, bootstrap draws, method label).
    """
    rv = np.asarray([_num(v) for v in run_values], dtype=float)
    keep = np.isfinite(rv)
    if not keep.any():
        return math.nan, np.full(n_boot, np.nan), "none"
    rng = np.random.default_rng(seed)
    point = float(np.median(rv[keep]))
    per_run = []
    have_steps = False
    for v, steps, k in zip(rv, step_values, keep, strict=False):
        if not k:
            continue
        s = np.asarray([] if steps is None else steps, dtype=float)
        s = s[np.isfinite(s)]
        if s.size >= 2:
            have_steps = True
            per_run.append(_bootstrap_run_medians(s, n_boot, rng))
        else:
            per_run.append(np.full(n_boot, v))
    per_run_arr = np.vstack(per_run)  # (R, B)
    r = per_run_arr.shape[0]
    if r == 1:
        draws = per_run_arr[0]
        method = "steps" if have_steps else "none"
    else:
        pick = rng.integers(0, r, size=(n_boot, r))
        draws = np.median(per_run_arr[pick, np.arange(n_boot)[:, None]], axis=1)
        method = "repeats+steps" if have_steps else "repeats"
    return point, draws, method


def _ci(draws: np.ndarray) -> tuple[float, float]:
    d = draws[np.isfinite(draws)]
    if d.size == 0 or np.ptp(d) == 0 and d.size < 2:
        return math.nan, math.nan
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(lo), float(hi)


def choose_baseline(runs: pd.DataFrame, requested: str | None = None) -> str | None:
    """The requested baseline, else the first scenario with no offload at all (None if none)."""
    if requested:
        return requested
    if runs.empty:
        return None
    df = runs[runs["scenario"].notna()]
    none = df[
        (df["offload_optimizer"].astype(str) == "none")
        & (df["offload_param"].astype(str) == "none")
    ]
    if none.empty:
        return None
    return str(none["scenario"].iloc[0])


def _first(series: pd.Series):
    s = series.dropna()
    return s.iloc[0] if len(s) else None


def _max(series: pd.Series) -> float:
    s = pd.to_numeric(series, errors="coerce").dropna()
    return float(s.max()) if len(s) else math.nan


def _median(series: pd.Series) -> float:
    s = pd.to_numeric(series, errors="coerce").dropna()
    return float(s.median()) if len(s) else math.nan


def _per_node_max(values: pd.Series) -> float:
    """Max host RSS per node over runs (host_peak_rss_gib_per_node holds JSON lists)."""
    best = math.nan
    for v in values.dropna():
        try:
            lst = json.loads(v) if isinstance(v, str) else list(v)
        except (ValueError, TypeError):
            continue
        nums = [_num(x) for x in lst if np.isfinite(_num(x))]
        if nums:
            best = max(nums) if math.isnan(best) else max(best, max(nums))
    return best


SUMMARY_SETUP = [
    "study",
    "cluster",
    "base_scenario",
    "label",
    "sweep",
    "nodes",
    "gpus_per_node",
    "world_size",
    "accelerator",
    "device_name",
    "gpu_mem_gb",
    "cpu_mem_gb",
    "offload_optimizer",
    "offload_param",
    "micro_batch",
    "gradient_accumulation_steps",
    "global_batch",
    "seq_len",
    "dtype",
    "gradient_checkpointing",
    "model_params",
]


def summarize(
    runs: pd.DataFrame,
    steps: dict[str, pd.DataFrame] | None = None,
    baseline: str | None = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per scenario (order of first appearance in ``runs``).

    ``steps`` maps a run's ``record_dir`` to its measured steps (from :func:`read_steps`); runs
    without steps use their metrics.json tokens_per_s only. ``baseline`` is a scenario name; empty
    or None picks :func:`choose_baseline`'s default. Relative speed is NaN, with the reason in
    ``relative_speed_note``, when the baseline has no ok run.
    """
    steps = steps or {}
    cols_out: list[dict] = []
    if runs.empty:
        return pd.DataFrame(columns=["scenario", "runs", "relative_speed", "relative_speed_note"])
    runs = runs.copy()
    runs["scenario"] = runs["scenario"].fillna("(unknown)")
    base = choose_baseline(runs, baseline)
    draws_by_scen: dict[str, np.ndarray] = {}
    order = list(dict.fromkeys(runs["scenario"]))
    for i, scen in enumerate(order):
        g = runs[runs["scenario"] == scen]
        ok = g[g["outcome"] == "ok"]
        row: dict = {"scenario": scen}
        for c in SUMMARY_SETUP:
            row[c] = _first(g[c]) if c in g else None
        row["runs"] = len(g)
        row["n_ok"] = len(ok)
        row["n_failed"] = len(g) - len(ok)
        counts = g["outcome"].value_counts()
        for o in OUTCOMES:
            row[f"n_{o}"] = int(counts.get(o, 0))
        row["outcomes"] = ", ".join(f"{o}:{n}" for o, n in counts.items())
        if len(ok) == len(g):
            row["status"] = "ok"
        elif len(ok):
            row["status"] = "partial"
        else:
            row["status"] = "failed"
        failed = g[g["outcome"] != "ok"]
        row["first_failure_outcome"] = _first(failed["outcome"]) if len(failed) else None
        row["error_excerpt"] = _first(failed["error_excerpt"]) if len(failed) else None
        step_lists = []
        for rd in ok.get("record_dir", pd.Series([None] * len(ok))):
            st = steps.get(rd) if rd is not None else None
            step_lists.append(None if st is None or st.empty else st["tokens_per_s"].to_numpy())
        point, draws, method = bootstrap_median(
            ok["tokens_per_s"].tolist(), step_lists, n_boot=n_boot, seed=seed + i
        )
        draws_by_scen[scen] = draws
        lo, hi = _ci(draws) if method != "none" else (math.nan, math.nan)
        row.update(
            tokens_per_s=point,
            tokens_per_s_ci_low=lo,
            tokens_per_s_ci_high=hi,
            ci_method=method,
            step_time_s=_median(ok["step_time_s"]),
            samples_per_s=_median(ok["samples_per_s"]),
            tflops_per_gpu=_median(ok["tflops_per_gpu"]),
            mfu=_median(ok["mfu"]),
            peak_gpu_allocated_gib=_max(ok["peak_gpu_allocated_gib"]),
            peak_gpu_reserved_gib=_max(ok["peak_gpu_reserved_gib"]),
            nvml_used_gib=_max(ok["nvml_used_gib"]),
            host_peak_rss_gib=_max(ok["host_peak_rss_gib"]),
            host_peak_rss_gib_per_node_max=_per_node_max(ok["host_peak_rss_gib_per_node"]),
            nvme_bytes_used=_max(ok["nvme_bytes_used"]),
            loss_last=_median(ok["loss_last"]),
        )
        for c in [c for c in runs.columns if c.startswith("breakdown_ms.")]:
            row[c] = _median(ok[c])
        row["is_baseline"] = scen == base
        cols_out.append(row)
    summary = pd.DataFrame(cols_out)
    summary["baseline"] = base
    rel, lo, hi, notes = _relative(summary, draws_by_scen, base)
    summary["relative_speed"] = rel
    summary["relative_speed_ci_low"] = lo
    summary["relative_speed_ci_high"] = hi
    summary["relative_speed_note"] = notes
    return summary


def _relative(summary: pd.DataFrame, draws: dict[str, np.ndarray], base: str | None):
    n = len(summary)
    nan = [math.nan] * n
    if base is None:
        note = "no baseline: no scenario without offload and none configured"
        return nan, nan, nan, [note] * n
    if base not in set(summary["scenario"]):
        return nan, nan, nan, [f"baseline '{base}' has no run in this study"] * n
    brow = summary[summary["scenario"] == base].iloc[0]
    if brow["n_ok"] == 0 or not np.isfinite(brow["tokens_per_s"]):
        reason = brow["outcomes"] or "no runs"
        return nan, nan, nan, [f"baseline '{base}' has no ok run ({reason})"] * n
    bpoint, bdraws = brow["tokens_per_s"], draws[base]
    rel, los, his, notes = [], [], [], []
    for _, r in summary.iterrows():
        val = r["tokens_per_s"] / bpoint if np.isfinite(r["tokens_per_s"]) else math.nan
        rel.append(val)
        if r["scenario"] == base:
            los.append(1.0 if np.isfinite(val) else math.nan)
            his.append(1.0 if np.isfinite(val) else math.nan)
            notes.append("baseline")
            continue
        if np.isfinite(val):
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = draws[r["scenario"]] / bdraws
            lo, hi = _ci(ratio)
            notes.append(f"relative to '{base}'")
        else:
            lo = hi = math.nan
            notes.append(f"no ok run ({r['outcomes']})")
        los.append(lo)
        his.append(hi)
    return rel, los, his, notes


# --------------------------------------------------------------------------- CLI
def collect(
    metrics_paths: Sequence[str | Path], baseline: str | None = None, n_boot: int = 2000
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read records from disk and return (runs, summary)."""
    records = [read_record(p) for p in metrics_paths]
    runs = build_runs(records) if records else build_runs([{"outcome": "missing"}]).iloc[0:0]
    steps = {
        rd: read_steps(rd)
        for rd, o in zip(runs["record_dir"], runs["outcome"], strict=False)
        if rd is not None and o == "ok"
    }
    return runs, summarize(runs, steps, baseline=baseline or None, n_boot=n_boot)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offload_study.collect", description=__doc__)
    ap.add_argument("--baseline", default="", help="baseline scenario ('' = first without offload)")
    ap.add_argument("--runs-csv", required=True)
    ap.add_argument("--runs-parquet", required=True)
    ap.add_argument("--summary-csv", required=True)
    ap.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples for the CIs")
    ap.add_argument("metrics", nargs="*", help="metrics.json files (missing ones become rows)")
    a = ap.parse_args(argv)
    runs, summary = collect(a.metrics, baseline=a.baseline or None, n_boot=a.n_boot)
    for p in (a.runs_csv, a.runs_parquet, a.summary_csv):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    runs.to_csv(a.runs_csv, index=False)
    runs.to_parquet(a.runs_parquet, index=False)
    summary.to_csv(a.summary_csv, index=False)
    n_ok = int((runs["outcome"] == "ok").sum()) if len(runs) else 0
    base = summary["baseline"].iloc[0] if "baseline" in summary and len(summary) else None
    print(f"collect: {len(runs)} runs ({n_ok} ok), {len(summary)} scenarios, baseline={base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
