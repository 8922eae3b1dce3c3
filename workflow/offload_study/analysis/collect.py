"""Collect run records (metrics.json + steps.csv) into runs and per-scenario summary tables.

CLI::

    python -m offload_study.analysis.collect --baseline NAME_OR_EMPTY \
        --runs-csv runs.csv --runs-parquet runs.parquet --summary-csv summary.csv \
        results/<cluster>/<study>/<scenario>/rep<k>/metrics.json ...

This module is the one reader of run records on the analysis side (metrics.json, steps.csv,
provenance.json, through :mod:`offload_study.core.contracts`) and the owner of the two tables it
writes (:func:`write_tables`, read back by :func:`read_table`). A missing or unreadable
metrics.json becomes a row with outcome "missing" / "error"; collecting never crashes on a bad
record. The table functions (:func:`build_runs`, :func:`summarize`, ...) are pure.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from offload_study.analysis import sanity
from offload_study.core import contracts, csvsafe, layout
from offload_study.training import placement

_METRICS = contracts.metrics_schema()["properties"]


def _types(key: str) -> set[str]:
    kind = _METRICS[key].get("type", [])
    return {kind} if isinstance(kind, str) else set(kind)


#: Columns every runs table has (in the schema's order), whatever the records contain.
RUN_COLUMNS = [
    k for k in _METRICS if k not in ("schema_version", "breakdown_ms", "step_breakdown_ms")
]
#: Integers every record has (never null): nullable integers. Other numbers become float64.
INTEGER_COLUMNS = [k for k in RUN_COLUMNS if _types(k) == {"integer"}]
FLOAT_COLUMNS = [
    k for k in RUN_COLUMNS if _types(k) & {"number", "integer"} and k not in INTEGER_COLUMNS
]
BREAKDOWN_COLUMNS = [f"breakdown_ms.{k}" for k in contracts.BREAKDOWN_KEYS]
#: The harness' own parts of a step (metrics.json step_breakdown_ms, either engine).
STEP_PARTS = list(_METRICS["step_breakdown_ms"]["properties"])
STEP_BREAKDOWN_COLUMNS = [f"step_breakdown_ms.{k}" for k in STEP_PARTS]
#: Outcomes of the records plus "missing" (no metrics.json), which only collect assigns.
OUTCOMES = [*contracts.OUTCOMES, "missing"]
#: Columns of every run that come from beside metrics.json: the machine it ran on
#: (:func:`machine_of`, from provenance.json), its record folder and how often it was re-run
#: after failures of the infrastructure (its archive: placement.retries_of).
RECORD_COLUMNS = ["machine", "record_dir", "retries"]
_TEXT_COLUMNS = (
    "slurm_job_id",
    "sweep",
    "label",
    "scenario",
    "base_scenario",
    "error_excerpt",
    "machine",
    "engine",
    "engine_version",
    "host_tree_measure",
)
_LIST_COLUMNS = (
    "host_peak_rss_gib_per_node",
    "host_peak_rss_gib_per_rank",
    "host_peak_tree_gib_per_node",
    "host_peak_tree_gib_per_rank",
)
#: The host memory per node that pages show and predictions are judged by: the ranks' process
#: trees (their worker processes counted), else, in a record from before the trees were
#: sampled, the ranks' own peaks (:func:`host_memory_gib`).
HOST_MEMORY_SOURCES = ("host_peak_tree_gib", "host_peak_rss_gib")
_REP_RE = re.compile(r"^rep(\d+)$")


# --------------------------------------------------------------------------- reading records
def _path_identity(metrics_path: Path) -> dict:
    """Best-effort identity of a record from its path: .../<cluster>/<study>/<scenario>/rep<k>/."""
    rep_dir = metrics_path.parent
    ident: dict = {"record_dir": str(rep_dir)}
    m = _REP_RE.match(rep_dir.name)
    if m:
        ident["repeat"] = int(m.group(1))
        names = ("scenario", "study", "cluster")
        ident.update(zip(names, reversed(rep_dir.parts[-4:-1]), strict=False))
    return ident


def _run_spec_identity(metrics_path: Path, ident: dict) -> dict:
    """Fill setup columns of a missing record from its run spec when it exists: the plan
    writes it to <study dir>/configs/<scenario>.run.json, beside the scenario folders."""
    scen = ident.get("scenario")
    if not scen:
        return {}
    study = layout.study_of_record(metrics_path.parent)
    spec = _read_json_object(Path(layout.run_spec_path(study, scen)))
    keep = set(RUN_COLUMNS) - {"outcome", "error_excerpt", "repeat"}
    return {k: v for k, v in (spec or {}).items() if k in keep}


def _read_json_object(path: Path) -> dict | None:
    try:
        data = contracts.read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _failed_record(p: Path, ident: dict, outcome: str, excerpt: str) -> dict:
    rec = {**_run_spec_identity(p, ident), **ident, "outcome": outcome, "error_excerpt": excerpt}
    return flatten_record(rec)


def read_record(metrics_path: str | Path) -> dict:
    """Read one metrics.json into a flat dict, with the ``machine`` the run ran on (from the
    provenance.json beside it: :func:`machine_of`); never raises.

    A missing file gives ``outcome="missing"``, unreadable JSON ``outcome="error"``; identity
    (scenario, repeat, ...) then comes from the path and the scenario's run spec when available.
    """
    p = Path(metrics_path)
    metrics = _read_metrics(p)
    return {
        **metrics,
        "host_memory_gib": host_memory_gib(metrics),
        "machine": machine_of(read_provenance(p.parent)),
        "retries": placement.retries_of(p.parent),
    }


def _read_metrics(p: Path) -> dict:
    ident = _path_identity(p)
    try:
        data = contracts.read_json(p)
    except FileNotFoundError:
        return _failed_record(p, ident, "missing", f"metrics.json not found: {p}")
    except OSError as e:
        return _failed_record(p, ident, "error", f"cannot read {p}: {e}")
    except ValueError as e:
        return _failed_record(p, ident, "error", f"corrupt metrics.json ({p}): {e}")
    if not isinstance(data, dict):
        why = f"top level is {type(data).__name__}, not an object"
        return _failed_record(p, ident, "error", f"corrupt metrics.json ({p}): {why}")
    rec = dict(data)
    for k, v in ident.items():  # path identity only fills gaps
        if rec.get(k) in (None, ""):
            rec[k] = v
    rec["record_dir"] = ident["record_dir"]
    rec.update(_same_allocation_columns(p.parent))
    if not rec.get("outcome"):
        rec["outcome"] = "error"
        rec["error_excerpt"] = rec.get("error_excerpt") or "metrics.json has no outcome"
    return flatten_record(rec)


#: Runs-table columns of a run's same-allocation pair record (``<record>/pair/``, study key
#: same_allocation_baseline): its scenario, outcome, tokens/s and folder. Only records that have
#: one get them, so a study without the option has the tables it had before.
SAME_ALLOCATION_COLUMNS = [
    "same_allocation_pair",
    "same_allocation_pair_outcome",
    "same_allocation_pair_tokens_per_s",
    "same_allocation_pair_dir",
]


def _same_allocation_columns(rep_dir: Path) -> dict:
    """The SAME_ALLOCATION_COLUMNS of a run's nested pair record ({} when it has none); a pair
    record without a readable metrics.json reads as outcome "error"."""
    pair = contracts.RecordDir(rep_dir).pair
    if not pair.root.is_dir():
        return {}
    data = _read_json_object(pair.metrics) or {}
    values = (
        data.get("scenario"),
        data.get("outcome") or "error",
        _num(data.get("tokens_per_s")),
        str(pair.root),
    )
    return dict(zip(SAME_ALLOCATION_COLUMNS, values, strict=True))


def flatten_record(rec: dict) -> dict:
    """Flatten ``breakdown_ms`` and ``sweep`` into ``breakdown_ms.<timer>`` / ``sweep.<knob>``.

    The ``sweep`` dict itself is kept as a JSON string (stable key order) so that rows group by it;
    list-valued memory columns become JSON strings too (CSV/Parquet friendly).
    """
    out = {k: v for k, v in rec.items() if k not in ("breakdown_ms", "step_breakdown_ms", "sweep")}
    parts = rec.get("step_breakdown_ms")
    parts = parts if isinstance(parts, dict) else {}
    out.update(
        {
            column: _num(parts.get(k))
            for k, column in zip(STEP_PARTS, STEP_BREAKDOWN_COLUMNS, strict=True)
        }
    )
    bd = rec.get("breakdown_ms")
    bd = bd if isinstance(bd, dict) else {}
    for k in contracts.BREAKDOWN_KEYS:
        out[f"breakdown_ms.{k}"] = _num(bd.get(k))
    for k, v in bd.items():
        if k not in contracts.BREAKDOWN_KEYS:
            out[f"breakdown_ms.{k}"] = _num(v)
    sweep = rec.get("sweep")
    sweep = sweep if isinstance(sweep, dict) else {}
    for k, v in sweep.items():
        out[f"sweep.{k}"] = v
    out["sweep"] = json.dumps(sweep, sort_keys=True, default=str)
    for k in _LIST_COLUMNS:
        if isinstance(out.get(k), (list, tuple)):
            out[k] = json.dumps(list(out[k]))
    if isinstance(out.get("modes"), dict):  # offload modes (nested, varying keys): JSON text
        out["modes"] = json.dumps(out["modes"], sort_keys=True)
    return out


def host_memory_gib(row: Mapping) -> float | None:
    """Peak host memory per node of a run or a scenario (GiB): its process trees' peak; a tree
    sampled without the rank's high-water mark as its floor (contracts.TREE_FLOORED: older
    records, and a scenario's summary row) can miss a peak between two samples, the model built
    on the host before it moves to the GPU, which the rank's own peak holds: the larger of the
    two then. The rank's own peak alone in a record from before the trees; None without both.
    A run's or scenario's row that has the figure (read_record, summarize) gives it."""
    given = _num(row.get("host_memory_gib"))
    if math.isfinite(given):
        return given
    tree, own = (_num(row.get(key)) for key in HOST_MEMORY_SOURCES)
    if not math.isfinite(tree):
        return own if math.isfinite(own) else None
    if str(row.get("host_tree_measure") or "").endswith(contracts.TREE_FLOORED):
        return tree
    return max(tree, own) if math.isfinite(own) else tree


def _num(v) -> float:
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def read_timed_steps(record_dir: str | Path) -> list[contracts.StepRow]:
    """The steps of one run that count towards its speed (steps.csv): measured, optimizer step
    not skipped (``StepRow.timed``); every step not skipped when no row names its phase. Empty
    when the file is absent or corrupt."""
    try:
        rows = contracts.read_steps(contracts.RecordDir(Path(record_dir)).steps)
    except (csv.Error, ValueError):  # binary junk or a broken quote: no steps, not a crash
        return []
    phased = any(r.phase for r in rows)
    return [r for r in rows if (r.timed if phased else not r.skipped)]


def read_step_speeds(record_dir: str | Path) -> np.ndarray:
    """tokens/s of each timed step of one run (:func:`read_timed_steps`)."""
    return np.array([r.tokens_per_s for r in read_timed_steps(record_dir)], dtype=float)


def read_provenance(record_dir: str | Path | None) -> dict | None:
    """provenance.json of one run (keys: contracts.PROVENANCE_FIELDS); None when unreadable."""
    return (
        _read_json_object(contracts.RecordDir(Path(record_dir)).provenance) if record_dir else None
    )


#: provenance.json fields that tell machines apart in a record without a boot_id (one written
#: before the runner recorded it): the host's name, kernel build, RAM, CPU and GPU. The name
#: alone does not tell (a cloud lease is "vm" on every machine; the kernel build and RAM
#: differ); versions and git_commit are left out: one machine runs several of them.
MACHINE_FIELDS = (
    "host",
    "platform",
    "ram_total_bytes",
    "cpu_model",
    "cpu_count",
    "gpu_model",
    "gpu_driver",
)


def machine_of(prov: Mapping | None) -> str | None:
    """The machine a run ran on (runs column ``machine``): ``boot:<boot_id>``, else
    ``fp:<12 hex of the sha256 of its MACHINE_FIELDS>``; None without provenance."""
    if not prov:
        return None
    if prov.get("boot_id"):
        return f"boot:{prov['boot_id']}"
    facts = json.dumps([prov.get(k) for k in MACHINE_FIELDS], default=str)
    return "fp:" + hashlib.sha256(facts.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- runs table
def build_runs(records: Iterable[dict]) -> pd.DataFrame:
    """One row per run (flat records from :func:`read_record`), contract columns always present."""
    df = pd.DataFrame(list(records))
    known = RUN_COLUMNS + BREAKDOWN_COLUMNS + STEP_BREAKDOWN_COLUMNS + RECORD_COLUMNS
    extra = [c for c in df.columns if c not in known]
    sweep_cols = sorted(c for c in extra if c.startswith("sweep."))
    other_bd = sorted(c for c in extra if c.startswith("breakdown_ms."))
    rest = [c for c in extra if c not in sweep_cols and c not in other_bd]
    cols = (
        RUN_COLUMNS
        + sweep_cols
        + BREAKDOWN_COLUMNS
        + STEP_BREAKDOWN_COLUMNS
        + other_bd
        + rest
        + RECORD_COLUMNS
    )
    df = df.reindex(columns=cols)
    df["sweep"] = df["sweep"].astype("object").where(df["sweep"].notna(), "{}")
    df["outcome"] = df["outcome"].fillna("missing").astype(str)
    for c in [*FLOAT_COLUMNS, *BREAKDOWN_COLUMNS, *STEP_BREAKDOWN_COLUMNS, *other_bd]:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in INTEGER_COLUMNS:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    for c in _TEXT_COLUMNS:
        df[c] = df[c].map(_text, na_action="ignore").astype("object").where(df[c].notna(), None)
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


def _text(v) -> str | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


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


def _run_draws(
    value: float, steps: Sequence[float] | None, n_boot: int, rng: np.random.Generator
) -> tuple[np.ndarray, bool]:
    """n_boot bootstrap medians of one run's measured steps, and whether it had steps; a run
    with fewer than two steps stands in with its metrics.json value (no spread)."""
    s = np.asarray([] if steps is None else steps, dtype=float)
    s = s[np.isfinite(s)]
    if s.size >= 2:
        return _bootstrap_run_medians(s, n_boot, rng), True
    return np.full(n_boot, value), False


def _median_of_resampled(per_run: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per bootstrap draw b: the median over rows resampled with replacement of per_run[:, b]
    (rows: repeats, or pairs of repeats); one row is its own draws."""
    r, n_boot = per_run.shape
    if r == 1:
        return per_run[0]
    pick = rng.integers(0, r, size=(n_boot, r))
    return np.median(per_run[pick, np.arange(n_boot)[:, None]], axis=1)


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
    runs = [
        _run_draws(v, steps, n_boot, rng)
        for v, steps, k in zip(rv, step_values, keep, strict=False)
        if k
    ]
    have_steps = any(had for _, had in runs)
    draws = _median_of_resampled(np.vstack([d for d, _ in runs]), rng)
    if len(runs) == 1:
        method = "steps" if have_steps else "none"
    else:
        method = "repeats+steps" if have_steps else "repeats"
    return float(np.median(rv[keep])), draws, method


def _ci(draws: np.ndarray) -> tuple[float, float]:
    d = draws[np.isfinite(draws)]
    if d.size == 0 or np.ptp(d) == 0 and d.size < 2:
        return math.nan, math.nan
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(lo), float(hi)


# --------------------------------------------------------------------------- summary table
#: Setup columns of a scenario: the first non-null value over its runs.
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
    "engine",
]
#: Measured columns of a scenario over its ok runs: (how to aggregate, columns).
SUMMARY_MEASURES = [
    ("median", ["step_time_s", "samples_per_s", "tflops_per_gpu", "mfu"]),
    (
        "max",
        [
            "peak_gpu_allocated_gib",
            "peak_gpu_reserved_gib",
            "nvml_used_gib",
            "host_peak_rss_gib",
            "host_peak_tree_gib",
            "host_memory_gib",
        ],
    ),
    ("per_node_max", ["host_peak_rss_gib_per_node"]),
    ("per_node_max", ["host_peak_tree_gib_per_node"]),
    ("max", ["nvme_bytes_used"]),
    ("median", ["loss_last"]),
    ("sum", ["skipped_steps_measured"]),  # records from before the harness counted them lack it
]
#: Columns of the step's parts, summarized by their median: DeepSpeed's timers, the harness'.
BREAKDOWN_PREFIXES = ("breakdown_ms.", "step_breakdown_ms.")
_EMPTY_SUMMARY = ["scenario", "runs", "relative_speed", "relative_speed_note"]


def summarize(
    runs: pd.DataFrame,
    steps: dict[str, np.ndarray] | None = None,
    baseline: str | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    losses: dict[str, np.ndarray] | None = None,
    step_times: dict[str, np.ndarray] | None = None,
) -> pd.DataFrame:
    """One row per scenario (order of first appearance in ``runs``).

    ``steps`` maps a run's ``record_dir`` to its measured steps' tokens/s (from
    :func:`read_step_speeds`); runs without steps use their metrics.json tokens_per_s only.
    ``losses`` maps it to those steps' losses (the non-finite-loss check), ``step_times`` to
    their step times (the not-steady check).
    ``baseline`` is a scenario name; empty or None: :func:`contracts.choose_baseline` picks.
    Two speed ratios: ``relative_speed`` against the study baseline (the seed's table), and
    ``paired_ratio`` against the scenario's pair (:func:`choose_pairs`, :func:`paired_ratio`).
    Either is NaN with the reason in its note when it has no ok partner. ``flags`` names the
    sanity checks that fired (:mod:`offload_study.analysis.sanity`). Aggregates are computed per column
    over all scenarios at once (groupby), not per scenario: a 250-scenario study took seconds
    the other way.
    """
    if runs.empty:
        return pd.DataFrame(columns=_EMPTY_SUMMARY)
    runs = runs.reset_index(drop=True).assign(scenario=runs["scenario"].fillna("(unknown)"))
    order = pd.Index(dict.fromkeys(runs["scenario"]), name="scenario")
    ok = runs[runs["outcome"] == "ok"]
    setup = _setup_columns(runs, order)
    speed, draws = _speed_columns(ok, order, steps or {}, n_boot, seed)
    summary = pd.concat(
        [
            setup,
            _outcome_columns(runs, order),
            speed,
            _measure_columns(ok, order, [c for c in runs if c.startswith(BREAKDOWN_PREFIXES)]),
        ],
        axis=1,
    ).reset_index()
    offloads = setup[["offload_optimizer", "offload_param"]].astype(str)
    base = contracts.choose_baseline(
        list(order),
        baseline,
        dict(zip(order, offloads.itertuples(index=False, name=None), strict=True)),
    )
    summary["is_baseline"] = summary["scenario"] == base
    summary["baseline"] = base
    rel, lo, hi, notes = _relative(summary, draws, base)
    summary = summary.assign(
        relative_speed=rel,
        relative_speed_ci_low=lo,
        relative_speed_ci_high=hi,
        relative_speed_note=notes,
    )
    summary = pd.concat(
        [summary, _pair_columns(summary, ok, steps or {}, base, n_boot, seed)], axis=1
    )
    flags = sanity.flag(summary, runs, losses or {}, step_times or {})
    return pd.concat([summary, flags], axis=1)


def _setup_columns(runs: pd.DataFrame, order: pd.Index) -> pd.DataFrame:
    setup = runs.reindex(columns=["scenario", *SUMMARY_SETUP]).astype("object")
    first = setup.groupby("scenario", sort=False).first().reindex(order)
    return first.astype("object").where(first.notna(), None)


def _outcome_columns(runs: pd.DataFrame, order: pd.Index) -> pd.DataFrame:
    """Run counts per outcome, status and the first failure of each scenario."""
    rows = []
    for _, g in runs.groupby("scenario", sort=False):
        counts = Counter(g["outcome"])
        n_ok = counts.get("ok", 0)
        failed = g[g["outcome"] != "ok"]
        retried = int(pd.to_numeric(g.get("retries", 0), errors="coerce").fillna(0).sum())
        rows.append(
            {
                "runs": len(g),
                "n_ok": n_ok,
                "n_failed": len(g) - n_ok,
                **{f"n_{o}": counts.get(o, 0) for o in OUTCOMES},
                "n_retried": retried,
                "outcomes": ", ".join(
                    [f"{o}:{n}" for o, n in counts.most_common()]
                    + [f"retried:{retried}"] * bool(retried)
                ),
                "status": "ok" if n_ok == len(g) else "partial" if n_ok else "failed",
                "first_failure_outcome": _first(failed["outcome"]),
                "error_excerpt": _first(failed["error_excerpt"]),
            }
        )
    return pd.DataFrame(rows, index=order)


def _first(series: pd.Series):
    s = series.dropna()
    return s.iloc[0] if len(s) else None


def _speed_columns(ok, order, steps, n_boot, seed) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """Median tokens/s with its bootstrap CI per scenario, and the bootstrap draws."""
    rows, draws = {}, {}
    by_scenario = dict(tuple(ok.groupby("scenario", sort=False)))
    for i, scen in enumerate(order):
        g = by_scenario.get(scen, ok.iloc[0:0])
        step_lists = [steps.get(rd) for rd in g["record_dir"]]
        point, draws[scen], method = bootstrap_median(
            g["tokens_per_s"].tolist(), step_lists, n_boot=n_boot, seed=seed + i
        )
        lo, hi = _ci(draws[scen]) if method != "none" else (math.nan, math.nan)
        rows[scen] = {
            "tokens_per_s": point,
            "tokens_per_s_ci_low": lo,
            "tokens_per_s_ci_high": hi,
            "ci_method": method,
        }
    return pd.DataFrame.from_dict(rows, orient="index").reindex(order), draws


def _measure_columns(ok: pd.DataFrame, order: pd.Index, breakdown: list[str]) -> pd.DataFrame:
    by = ok.groupby("scenario", sort=False)
    parts = []
    for how, wanted in [*SUMMARY_MEASURES, ("median", breakdown)]:
        cols = [c for c in wanted if c in ok]
        if not cols:
            continue
        if how == "per_node_max":
            nodes = ok[cols[0]].map(_list_max, na_action="ignore").astype("float64")
            parts.append(nodes.groupby(ok["scenario"]).max().rename(f"{cols[0]}_max"))
        elif how == "sum":  # NaN, not 0, for a scenario whose runs have no value
            parts.append(by[cols].sum(min_count=1).astype("float64"))
        else:
            parts.append(by[cols].agg(how).astype("float64"))
    return pd.concat(parts, axis=1).reindex(order)


def _list_max(value) -> float:
    """Largest number of a JSON list (host_peak_rss_gib_per_node); NaN when none."""
    try:
        nums = [_num(x) for x in (json.loads(value) if isinstance(value, str) else value)]
    except (ValueError, TypeError):
        return math.nan
    nums = [x for x in nums if math.isfinite(x)]
    return max(nums) if nums else math.nan


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
    for scen, tps, outcomes in summary[["scenario", "tokens_per_s", "outcomes"]].itertuples(
        index=False
    ):
        val = tps / bpoint if np.isfinite(tps) else math.nan
        lo = hi = math.nan
        if scen == base:
            lo = hi = 1.0
            notes.append("baseline")
        elif np.isfinite(val):
            with np.errstate(divide="ignore", invalid="ignore"):
                lo, hi = _ci(draws[scen] / bdraws)
            notes.append(f"relative to '{base}'")
        else:
            notes.append(f"no ok run ({outcomes})")
        rel.append(val)
        los.append(lo)
        his.append(hi)
    return rel, los, his, notes


# --------------------------------------------------------------------------- pairs
#: How a scenario's paired ratio was taken (summary column ``pair_kind``): ``self`` (it offloads
#: nothing: it is the reference of its settings), ``same-settings`` (the no-offload scenario with
#: its GPUs, micro-batch and gas: the same tokens per optimizer step), ``study baseline`` (no such
#: scenario with an ok run; the study's baseline stands in) or ``none``.
PAIR_KINDS = ("self", "same-settings", "study baseline", "none")
#: Which runs of the pair a ratio divides by (summary column ``pairing``; None: no ratio taken):
#: the pair's short run made in the same job as each run (study key same_allocation_baseline),
#: or the pair scenario's own run of the same repeat.
PAIRINGS = ("same allocation", "pair scenario")
PAIR_COLUMNS = [
    "pair",
    "pair_kind",
    "pair_note",
    "paired_ratio",
    "paired_ratio_ci_low",
    "paired_ratio_ci_high",
    "paired_repeats",
    "pairing",
]


@dataclass(frozen=True)
class Pair:
    scenario: str | None  # the scenario compared with (None: kind "none")
    kind: str  # one of PAIR_KINDS
    note: str  # why this pair, for humans


def choose_pairs(rows: Sequence[Mapping], baseline: str | None) -> dict[str, Pair]:
    """Each scenario's comparison partner, from summary rows (in study order).

    The first no-offload scenario with the same settings and an ok run (one with the same
    ``gpu_mem_gb`` first); failing that the study baseline, with the reason in the note.
    """
    by_name = {r["scenario"]: r for r in rows}
    base = by_name.get(baseline or "")
    return {r["scenario"]: _pair_of(r, contracts.no_offload_pairs(r, rows), base) for r in rows}


def _pair_of(row: Mapping, same: list[Mapping], base: Mapping | None) -> Pair:
    if contracts.offloads_nothing(row["offload_optimizer"], row["offload_param"]):
        return Pair(row["scenario"], "self", "no offload: the reference of its settings")
    ok = [c for c in same if c["n_ok"]]
    if ok:
        return Pair(
            ok[0]["scenario"], "same-settings", "no offload, same GPUs, micro-batch and gas"
        )
    why = (
        f"its no-offload pair '{same[0]['scenario']}' has no ok run ({same[0]['outcomes']})"
        if same
        else "no scenario without offload has its GPUs, micro-batch and gas"
    )
    if base is not None and base["n_ok"] and base["scenario"] != row["scenario"]:
        return Pair(base["scenario"], "study baseline", f"{why}; the study baseline instead")
    return Pair(None, "none", f"{why}, and no other study baseline with an ok run")


def paired_ratio(
    mine: pd.DataFrame, theirs: pd.DataFrame, steps: Mapping, n_boot: int, seed: int
) -> tuple[float, float, float, int, str]:
    """My tokens/s over my pair's, run for run: (ratio, CI low, CI high, pairs, how paired).

    Repeat k of a scenario is paired with repeat k of its pair when both ran on one machine
    (there they ran close in time: plan.run_order; between machines the speed of one GPU kind
    drifts 10-35 %); repeats ok in only one of the two, or run on different machines, are left
    out (:func:`_pairable_repeats`). The ratio is the median over pairs of the runs' tokens/s
    ratio; the 95 % CI bootstraps pairs and, inside each run, its measured steps.
    ``mine``/``theirs``: ok runs (repeat, tokens_per_s, record_dir, machine when known);
    ``steps``: record_dir -> measured steps' tokens/s.
    """
    a, b = _runs_by_repeat(mine), _runs_by_repeat(theirs)
    common, how = _pairable_repeats(a, b)
    if not common:
        return math.nan, math.nan, math.nan, 0, how
    rng = np.random.default_rng(seed)
    per_pair = []
    for k in common:
        mine_k, theirs_k = (
            _run_draws(r.tokens_per_s, steps.get(r.record_dir), n_boot, rng)[0]
            for r in (a[k], b[k])
        )
        per_pair.append(mine_k / theirs_k)
    point = float(np.median([a[k].tokens_per_s / b[k].tokens_per_s for k in common]))
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = _ci(_median_of_resampled(np.vstack(per_pair), rng))
    return point, lo, hi, len(common), how


class RepeatRun(NamedTuple):
    """The ok run of one repeat of a scenario, as :func:`paired_ratio` pairs it."""

    tokens_per_s: float
    record_dir: str
    machine: str | None  # runs column ``machine``; None: unknown


def _runs_by_repeat(ok: pd.DataFrame) -> dict[int, RepeatRun]:
    """repeat -> its ok run with a speed (the first run of a repeat)."""
    machines = ok["machine"] if "machine" in ok else pd.Series(None, index=ok.index)
    out: dict[int, RepeatRun] = {}
    for rep, tps, rd, machine in zip(
        ok["repeat"], ok["tokens_per_s"], ok["record_dir"], machines, strict=True
    ):
        if pd.notna(rep) and math.isfinite(_num(tps)) and _num(tps) > 0:
            known = machine if isinstance(machine, str) else None
            out.setdefault(int(rep), RepeatRun(float(tps), rd, known))
    return out


def _pairable_repeats(a: dict[int, RepeatRun], b: dict[int, RepeatRun]) -> tuple[list[int], str]:
    """The repeats to pair (ok in both, not known to have run on different machines) and how
    they were paired, for the note. A pair with one machine unknown is kept (as before
    machines were known) and named; one with both unknown (no provenance) is not."""
    both = sorted(set(a) & set(b))
    machines = {k: (a[k].machine, b[k].machine) for k in both}
    apart = [k for k, (ma, mb) in machines.items() if None not in (ma, mb) and ma != mb]
    common = [k for k in both if k not in apart]
    unknown = [k for k in common if (machines[k][0] is None) != (machines[k][1] is None)]
    notes = [
        (sorted(set(a) ^ set(b)), "ok in only one of the two"),
        (apart, "on different machines"),
        (unknown, "paired though the machine of one run is unknown"),
    ]
    how = f"{len(common)} pair(s) by repeat" + "".join(
        f"; rep {', '.join(map(str, reps))} {what}" for reps, what in notes if reps
    )
    return common, how


def _pair_columns(summary, ok, steps, baseline, n_boot, seed) -> pd.DataFrame:
    """The PAIR_COLUMNS of every scenario (rows in summary order). A scenario whose runs made
    ok same-allocation pair runs is paired with those (:func:`same_allocation_runs`), else with
    its pair scenario's runs."""
    rows = summary.to_dict("records")
    by_scenario = dict(tuple(ok.groupby("scenario", sort=False)))
    empty = ok.iloc[0:0]
    out = []
    for i, (row, pair) in enumerate(zip(rows, choose_pairs(rows, baseline).values(), strict=True)):
        ratio = lo = hi = math.nan
        n, note, pairing = 0, pair.note, None
        mine = by_scenario.get(row["scenario"], empty)
        same_alloc, failed = same_allocation_runs(mine), _failed_same_allocation(mine)
        if not row["n_ok"]:
            note = f"{note}; no ok run ({row['outcomes']})"
        elif pair.kind == "self":
            ratio = lo = hi = 1.0
            n = int(row["n_ok"])
        elif len(same_alloc):
            pair = Pair(
                same_alloc["scenario"].iloc[0],
                "same-settings",
                "no offload, same GPUs, micro-batch and gas, run in the same job",
            )
            ratio, lo, hi, n, how = paired_ratio(mine, same_alloc, steps, n_boot, seed + i)
            failed = f"; same-allocation pair runs not ok: {failed}" if failed else ""
            note, pairing = f"{pair.note}; {how}{failed}", "same allocation"
        elif pair.scenario is not None:
            theirs = by_scenario.get(pair.scenario, empty)
            ratio, lo, hi, n, how = paired_ratio(mine, theirs, steps, n_boot, seed + i)
            failed = f"; no same-allocation pair run ok ({failed})" if failed else ""
            note, pairing = f"{note}; {how}{failed}", "pair scenario"
        out.append(
            dict(
                zip(
                    PAIR_COLUMNS,
                    (pair.scenario, pair.kind, note, ratio, lo, hi, n, pairing),
                    strict=True,
                )
            )
        )
    return pd.DataFrame(out, columns=PAIR_COLUMNS, index=summary.index)


def same_allocation_runs(mine: pd.DataFrame) -> pd.DataFrame:
    """The ok same-allocation pair runs made in the jobs of ``mine`` (ok runs of one scenario),
    as runs of their own: scenario, repeat (the run's), tokens_per_s, record_dir and machine
    (the run's: one job ran both)."""
    if "same_allocation_pair_outcome" not in mine:
        return pd.DataFrame(columns=["scenario", "repeat", "tokens_per_s", "record_dir", "machine"])
    made = mine[mine["same_allocation_pair_outcome"] == "ok"]
    return pd.DataFrame(
        {
            "scenario": made["same_allocation_pair"],
            "repeat": made["repeat"],
            "tokens_per_s": made["same_allocation_pair_tokens_per_s"],
            "record_dir": made["same_allocation_pair_dir"],
            "machine": made.get("machine"),
        }
    )


def _failed_same_allocation(mine: pd.DataFrame) -> str:
    """'oom:2, timeout:1': the outcomes of the same-allocation pair runs of ``mine`` that were
    not ok ('' when none failed or none were made)."""
    if "same_allocation_pair_outcome" not in mine:
        return ""
    counts = Counter(o for o in mine["same_allocation_pair_outcome"].dropna() if o != "ok")
    return ", ".join(f"{o}:{n}" for o, n in counts.most_common())


# --------------------------------------------------------------------------- table files
def collect(
    metrics_paths: Sequence[str | Path], baseline: str | None = None, n_boot: int = 2000
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read records from disk and return (runs, summary)."""
    records = [read_record(p) for p in metrics_paths]
    runs = build_runs(records) if records else build_runs([{"outcome": "missing"}]).iloc[0:0]
    measured = {
        rd: read_timed_steps(rd)
        for rd, o in zip(runs["record_dir"], runs["outcome"], strict=False)
        if rd is not None and o == "ok"
    }
    if "same_allocation_pair_dir" in runs:  # the nested pair records' steps (their CIs)
        pairs = same_allocation_runs(runs[runs["outcome"] == "ok"])["record_dir"]
        measured.update({rd: read_timed_steps(rd) for rd in pairs})
    steps = {rd: np.array([r.tokens_per_s for r in rows]) for rd, rows in measured.items()}
    losses = {rd: np.array([r.loss for r in rows]) for rd, rows in measured.items()}
    times = {rd: np.array([r.step_time_s for r in rows]) for rd, rows in measured.items()}
    return runs, summarize(
        runs, steps, baseline=baseline or None, n_boot=n_boot, losses=losses, step_times=times
    )


def write_tables(runs: pd.DataFrame, summary: pd.DataFrame, runs_csv, runs_parquet, summary_csv):
    """runs.csv, runs.parquet (same rows) and summary.csv."""
    for p in (runs_csv, runs_parquet, summary_csv):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    csvsafe.write_frame(runs, runs_csv)  # a person opens these: no cell may run as a formula
    runs.to_parquet(runs_parquet, index=False)
    csvsafe.write_frame(summary, summary_csv)


def read_table(path: str | Path | None) -> pd.DataFrame:
    """runs or summary table written by :func:`write_tables` (CSV or Parquet by suffix); an
    empty frame when the file is missing or empty (a study with no scenario still reports)."""
    if not path:
        return pd.DataFrame()
    p = Path(path)
    try:
        return pd.read_parquet(p) if p.suffix == ".parquet" else csvsafe.read_frame(p)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return pd.DataFrame()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.analysis.collect", description=__doc__
    )
    ap.add_argument("--baseline", default="", help="baseline scenario ('' = first without offload)")
    ap.add_argument("--runs-csv", required=True)
    ap.add_argument("--runs-parquet", required=True)
    ap.add_argument("--summary-csv", required=True)
    ap.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples for the CIs")
    ap.add_argument("metrics", nargs="*", help="metrics.json files (missing ones become rows)")
    a = ap.parse_args(argv)
    runs, summary = collect(a.metrics, baseline=a.baseline or None, n_boot=a.n_boot)
    write_tables(runs, summary, a.runs_csv, a.runs_parquet, a.summary_csv)
    n_ok = int((runs["outcome"] == "ok").sum()) if len(runs) else 0
    base = summary["baseline"].iloc[0] if "baseline" in summary and len(summary) else None
    print(f"collect: {len(runs)} runs ({n_ok} ok), {len(summary)} scenarios, baseline={base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
