"""Sanity checks of the summary, as data: numbers that physics or the measurement says not to trust.

ReFrame style: :data:`CHECKS` is one table; each check has a name, a one-line meaning, a
tolerance (data: change it here, not in the functions) and a small pure function that sees one
scenario (:class:`Facts`) and returns why it fires, or None. :func:`flag` runs the table over a
summary (collect calls it) and gives the ``flags`` column of summary.csv (the names that fired,
';'-separated) and ``flag_details`` (JSON: name -> why). The report shows each flag's meaning
beside the number. Each check has a severity (data, like its tolerance): an *implausible* result
blocks the finding (the number is shown as measured, never stated as a finding, and nothing is
stated relative to it); a *caution* leaves the number standing with its CI and the flag beside it
(a noisy machine misses its CI target on every run: the CI then says how noisy). :func:`blocking`
is the one answer to "does this flags cell block a finding?" that every consumer asks.

"Beyond the CI" means the whole 95 % CI of the number lies past the comparison's median by more
than the tolerance: the effect is not noise of this measurement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from offload_study import engines
from offload_study.core import contracts, devices

#: metrics.json fields of the harness's adaptive measurement and skipped-step count (records from
#: before them lack them: the checks then fall back as their meaning says).
CI_TARGET_MET = "ci_target_met"
SKIPPED_MEASURED = "skipped_steps_measured"
_GAS = "gradient_accumulation_steps"
_SAME_BUT_GAS = tuple(k for k in contracts.SAME_SETTINGS_KEYS if k != _GAS)


@dataclass(frozen=True)
class Facts:
    """What a check sees of one scenario."""

    row: Mapping  # its summary row (collect's columns)
    peers: Mapping[str, Mapping]  # every scenario's summary row, by name (itself included)
    runs: pd.DataFrame = field(default_factory=pd.DataFrame)  # its runs, every outcome
    losses: list = field(default_factory=list)  # measured steps' losses of each ok run
    all_runs: pd.DataFrame = field(default_factory=pd.DataFrame)  # every scenario's runs
    step_times: Mapping[str, np.ndarray] = field(
        default_factory=dict
    )  # record_dir -> timed steps (s)


#: Severities of a check: an implausible result is not a finding; a caution is, with its CI.
IMPLAUSIBLE, CAUTION = "implausible", "caution"


@dataclass(frozen=True)
class Check:
    name: str
    meaning: str  # one line, shown beside a flagged number
    tolerance: float
    tolerance_text: str  # how the tolerance reads in the report
    test: Callable[[Facts, float], str | None]  # why it fires, or None
    severity: str  # IMPLAUSIBLE (blocks the finding) or CAUTION (the number stands)
    title: str = ""  # a few words for a page's tag ("step time not steady"); the name else

    def __post_init__(self):
        if self.severity not in (IMPLAUSIBLE, CAUTION):
            raise ValueError(
                f"sanity check {self.name}: severity {self.severity!r} is neither "
                f"{IMPLAUSIBLE!r} nor {CAUTION!r}"
            )


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _tps(v) -> str:
    return f"{_num(v):,.0f} tokens/s"


def _offloads_nothing(row: Mapping) -> bool:
    return contracts.offloads_nothing(row.get("offload_optimizer"), row.get("offload_param"))


def _ok(facts: Facts) -> pd.DataFrame:
    runs = facts.runs
    return runs[runs["outcome"] == "ok"] if "outcome" in runs else runs.iloc[0:0]


def _reps(runs: pd.DataFrame) -> str:
    return ", ".join(str(int(r)) if pd.notna(r) else "?" for r in runs.get("repeat", []))


# --------------------------------------------------------------------------- the checks
def accumulation_slower(facts: Facts, tol: float) -> str | None:
    """No offload, more gas than a peer with the same GPUs and micro-batch, and its whole CI
    below the peer's median: accumulation only removes optimizer steps per token."""
    row = facts.row
    high = _num(row.get("tokens_per_s_ci_high"))
    if not _offloads_nothing(row) or not math.isfinite(high):
        return None
    for peer in contracts.no_offload_pairs(row, facts.peers.values(), _SAME_BUT_GAS):
        fewer = _num(peer.get(_GAS)) < _num(row.get(_GAS))
        if fewer and high < _num(peer.get("tokens_per_s")) * (1 - tol):
            return (
                f"gas {_num(row[_GAS]):g}: {_tps(row['tokens_per_s'])}, 95% CI up to "
                f"{_tps(high)}, below the {_tps(peer['tokens_per_s'])} of gas "
                f"{_num(peer[_GAS]):g} ('{peer['scenario']}')"
            )
    return None


def offload_faster(facts: Facts, tol: float) -> str | None:
    """Faster than its no-offload pair of the same settings, the paired CI wholly above 1."""
    row = facts.row
    low = _num(row.get("paired_ratio_ci_low"))
    if row.get("pair_kind") != "same-settings" or not low > 1 + tol:
        return None
    return f"{_num(row['paired_ratio']):.0%} of its pair '{row['pair']}', 95% CI from {low:.0%}"


def _effective_modes(cell) -> dict:
    """A run's effective modes from its ``modes`` cell (JSON text in the runs table, or the
    record's dict); {} when it has none."""
    if isinstance(cell, str):
        try:
            cell = json.loads(cell)
        except ValueError:
            return {}
    return (cell.get("effective") or {}) if isinstance(cell, dict) else {}


def host_without_workers(facts: Facts, tol: float) -> str | None:
    """Runs whose engine says they kept memory in worker processes, recorded before a rank's
    process tree was sampled: their host figure is the ranks' own peaks, short of the node's."""
    ok = _ok(facts)
    if not len(ok) or "modes" not in ok:
        return None
    tree = ok["host_peak_tree_gib"] if "host_peak_tree_gib" in ok else pd.Series(index=ok.index)
    rss = ok["host_peak_rss_gib"] if "host_peak_rss_gib" in ok else pd.Series(index=ok.index)
    try:
        engine = engines.get(contracts.engine_of(facts.row))
    except engines.UnknownEngine:
        return None  # records of an engine not installed here: nothing says it has workers
    short = ok[
        tree.map(_num).map(math.isnan).astype(bool)
        & rss.map(lambda v: math.isfinite(_num(v)))
        & ok["modes"].map(lambda m: engine.host_workers(_effective_modes(m)))
    ]
    if not len(short):
        return None
    return f"rep {_reps(short)}: the ranks' own peaks; their worker processes were not sampled"


def gpu_over_cap(facts: Facts, tol: float) -> str | None:
    """A run reserved more GPU memory than its per-process cap allows (the cap did not hold)."""
    runs = facts.runs
    if not {"peak_gpu_reserved_gib", "gpu_mem_cap_gib"} <= set(runs.columns):
        return None
    peak = pd.to_numeric(runs["peak_gpu_reserved_gib"], errors="coerce")
    cap = pd.to_numeric(runs["gpu_mem_cap_gib"], errors="coerce")
    over = runs[peak > cap * (1 + tol)]
    if over.empty:
        return None
    worst = (peak - cap)[over.index].idxmax()
    return f"rep {_reps(over)}: up to {peak[worst]:.1f} GiB reserved, cap {cap[worst]:.1f} GiB"


def ci_target_missed(facts: Facts, tol: float) -> str | None:
    """The runs say they stopped before their CI target; records without that field: the
    summary's 95 % CI half-width above the tolerance, or no CI at all."""
    ok = _ok(facts)
    said = ok[CI_TARGET_MET].dropna() if CI_TARGET_MET in ok else pd.Series(dtype=object)
    if len(said):
        missed = ok.loc[said.index][~said.astype(bool)]
        return f"rep {_reps(missed)}: stopped before the CI target" if len(missed) else None
    row = facts.row
    mid = _num(row.get("tokens_per_s"))
    lo, hi = _num(row.get("tokens_per_s_ci_low")), _num(row.get("tokens_per_s_ci_high"))
    if not math.isfinite(mid):
        return None  # nothing measured: no number to doubt
    if not (math.isfinite(lo) and math.isfinite(hi)) or mid <= 0:
        return "no CI (one run without measured steps)"
    half = (hi - lo) / 2 / mid
    return f"95% CI ±{half:.1%} of the median" if half > tol else None


def non_finite_loss(facts: Facts, tol: float) -> str | None:
    """A measured step's loss is NaN or infinite: the run did not train."""
    bad = sum(int(np.count_nonzero(~np.isfinite(np.asarray(x, dtype=float)))) for x in facts.losses)
    return f"{bad} measured step(s) with a NaN or infinite loss" if bad > tol else None


def many_skipped(facts: Facts, tol: float) -> str | None:
    """More than the tolerance of the measured steps were skipped (non-finite gradients)."""
    ok = _ok(facts)
    if SKIPPED_MEASURED not in ok or "steps_measured" not in ok:
        return None
    skipped = pd.to_numeric(ok[SKIPPED_MEASURED], errors="coerce").sum()
    measured = pd.to_numeric(ok["steps_measured"], errors="coerce").sum()  # skipped included
    if not skipped or not measured or skipped / measured <= tol:
        return None
    return f"{skipped:g} of {measured:g} measured steps skipped"


def other_gpu(facts: Facts, tol: float) -> str | None:
    """Some of this scenario's ok runs ran on another GPU model than most of the study's ok runs
    (a partition of mixed cards): its speed and memory are not comparable with theirs."""
    every = facts.all_runs if len(facts.all_runs) else facts.runs
    ok = every[every["outcome"] == "ok"] if "outcome" in every else every.iloc[0:0]
    if "device_name" not in ok:
        return None
    kinds = ok["device_name"].map(devices.card_name).dropna()
    counts = kinds.value_counts()
    if len(counts) <= tol:
        return None
    usual = counts.index[0] if counts.iloc[0] > counts.iloc[1] else None
    mine = _ok(facts)
    mine_kinds = mine["device_name"].map(devices.card_name)  # the same columns as ok's
    odd = mine[mine_kinds.notna() & mine_kinds.ne(usual)]
    if odd.empty:
        return None
    spread = ", ".join(f"{n} on {kind}" for kind, n in counts.items())
    ran_on = ", ".join(sorted(set(mine_kinds[odd.index])))
    return f"rep {_reps(odd)} ran on {ran_on}; the study's ok runs ran {spread}"


def _last_losses(runs: pd.DataFrame) -> dict[int, tuple[float, float]]:
    """repeat -> (step of the last measured loss, that loss) of ok runs."""
    ok = runs[runs["outcome"] == "ok"] if "outcome" in runs else runs.iloc[0:0]
    cols = ("repeat", "steps_warmup", "steps_measured", "loss_last")
    if ok.empty or not set(cols) <= set(ok.columns):
        return {}
    num = {c: pd.to_numeric(ok[c], errors="coerce") for c in cols}
    step = num["steps_warmup"] + num["steps_measured"]
    return {
        int(r): (s, v)
        for r, s, v in zip(num["repeat"], step, num["loss_last"], strict=True)
        if pd.notna(r) and pd.notna(s) and math.isfinite(v)
    }


def loss_parity(facts: Facts, tol: float) -> str | None:
    """The last measured loss differs from the no-offload pair's (same settings, same repeat,
    same step) by more than the tolerance: the offload mode changed what training computes
    (ZenFlow's selective updates do by design). A pair of another engine is not judged: engines
    draw the random model's weights differently (DeepSpeed's zero.Init partition by partition on
    the accelerator), so their losses differ from the first step, whatever the offload does."""
    row, runs = facts.row, facts.all_runs
    pair = row.get("pair")
    if row.get("pair_kind") != "same-settings" or "scenario" not in runs:
        return None
    if contracts.engine_of(facts.peers.get(pair, {})) != contracts.engine_of(row):
        return None
    mine, theirs = _last_losses(facts.runs), _last_losses(runs[runs["scenario"] == pair])
    same = [
        (k, mine[k], theirs[k])
        for k in sorted(set(mine) & set(theirs))
        if mine[k][0] == theirs[k][0] and theirs[k][1]
    ]
    if not same:
        return None
    diffs = [a[1] / b[1] - 1 for _, a, b in same]
    k, a, b = same[int(np.argmax(np.abs(diffs)))]
    if float(np.median(np.abs(diffs))) <= tol:
        return None
    return (
        f"loss {a[1]:.4f} vs {b[1]:.4f} of '{pair}' at step {a[0]:g} (rep {k}, "
        f"{a[1] / b[1] - 1:+.1%})"
    )


#: A line through the timed steps must explain at least this share of their spread (R²) for their
#: drift to count as a trend, not noise: one slow step among quiet ones moves a line too.
TREND_FIT_R2 = 0.7
#: The stop reason of a run that met its CI target (steady.py): nothing capped it.
TARGET_MET = "target_met"


def drift(times: np.ndarray) -> tuple[float, float]:
    """(change of a least-squares line across the steps as a share of their median, the line's
    R²) of step times in order; (0, 0) for fewer than 3 steps or no spread."""
    times = np.asarray(times, dtype=float)
    times = times[np.isfinite(times)]
    if len(times) < 3 or np.ptp(times) == 0:
        return 0.0, 0.0
    x = np.arange(len(times))
    slope, cut = np.polyfit(x, times, 1)
    residual = times - (slope * x + cut)
    r2 = 1 - float(residual @ residual) / float(((times - times.mean()) ** 2).sum())
    return float(slope * (len(times) - 1) / np.median(times)), r2


def not_steady(facts: Facts, tol: float) -> str | None:
    """An ok run that a step or time cap stopped (not its CI target) while its step time still
    moved: a line through its timed steps changes by more than the tolerance across them and
    explains most of their spread (:data:`TREND_FIT_R2`). Its median depends on when it stopped."""
    ok = _ok(facts)
    for r in ok.to_dict("records"):
        times = facts.step_times.get(r.get("record_dir"))
        if times is None or r.get("stop_reason") == TARGET_MET:
            continue
        change, r2 = drift(times)
        if abs(change) > tol and r2 >= TREND_FIT_R2:
            rep = int(r["repeat"]) if pd.notna(r.get("repeat")) else "?"
            return (
                f"repeat {rep}: step time {times[0]:.3g} → {times[-1]:.3g} s over "
                f"{len(times)} timed steps, a trend of {change:+.0%}"
            )
    return None


CHECKS: tuple[Check, ...] = (
    Check(
        "accumulation-slower-per-token",
        "no offload, yet more gradient accumulation measured slower per token beyond the CI "
        "(accumulation only removes optimizer steps)",
        0.02,
        "2% of the peer's median",
        accumulation_slower,
        IMPLAUSIBLE,
        "slower with more accumulation",
    ),
    Check(
        "offload-faster-than-pair",
        "offload measured faster than its no-offload pair of the same settings beyond the "
        "paired CI (offloading adds transfers, removes no work)",
        0.02,
        "2% above 1",
        offload_faster,
        IMPLAUSIBLE,
        "offload faster than no offload",
    ),
    Check(
        "gpu-over-cap",
        "a run reserved more GPU memory than the scenario's per-process cap",
        0.01,
        "1% of the cap",
        gpu_over_cap,
        IMPLAUSIBLE,
        "GPU memory over its cap",
    ),
    Check(
        "host-without-workers",
        "the run kept memory in worker processes (SuperOffload's CPU Adam holds the Adam "
        "moments), but its record predates the sampling of a rank's process tree: the host "
        "figure is the ranks' own, short of what the node held",
        0,
        "every process of the run counted",
        host_without_workers,
        CAUTION,
        "host memory without its workers",
    ),
    Check(
        "ci-target-missed",
        "the measurement stopped before its CI target (older records: CI wider than the "
        "tolerance, or none)",
        0.05,
        "CI half-width 5% of the median",
        ci_target_missed,
        CAUTION,
        "CI target missed",
    ),
    Check(
        "non-finite-loss",
        "a measured step's loss is NaN or infinite",
        0,
        "no step",
        non_finite_loss,
        IMPLAUSIBLE,
        "loss not finite",
    ),
    Check(
        "many-skipped-steps",
        "many measured optimizer steps were skipped (non-finite gradients: an fp16 loss scale"
        " overflowing, or a NaN loss)",
        0.1,
        "10% of measured steps",
        many_skipped,
        CAUTION,
        "many skipped steps",
    ),
    Check(
        "other-gpu",
        "the study's runs ran on more than one GPU model, and this scenario's on another than "
        "most of them (a partition of mixed cards): not comparable with the rest",
        1,
        "one GPU model per study",
        other_gpu,
        IMPLAUSIBLE,
        "ran on another GPU",
    ),
    Check(
        "loss-parity",
        "the loss differs from its no-offload pair's at the same step (same settings and "
        "repeat): the mode changed the updates (e.g. ZenFlow)",
        0.02,
        "2% of the pair's loss (median over repeats)",
        loss_parity,
        IMPLAUSIBLE,
        "loss differs from its pair",
    ),
    Check(
        "not-steady",
        "the step time was still moving when a step or time cap stopped the measurement: "
        "its median depends on when it stopped",
        0.10,
        f"a line through the timed steps changes by more than 10% of their median, "
        f"R² ≥ {TREND_FIT_R2:g}",
        not_steady,
        CAUTION,
        "step time not steady",
    ),
)
MEANINGS: dict[str, str] = {c.name: c.meaning for c in CHECKS}
TITLES: dict[str, str] = {c.name: c.title or c.name for c in CHECKS}
SEVERITIES: dict[str, str] = {c.name: c.severity for c in CHECKS}


def severity(name: str) -> str:
    """A check's severity; a name this table does not know (a summary from another version)
    counts as implausible: nothing here vouches for its number."""
    return SEVERITIES.get(name, IMPLAUSIBLE)


# --------------------------------------------------------------------------- the table, applied
def flag(
    summary: pd.DataFrame,
    runs: pd.DataFrame,
    losses: Mapping[str, np.ndarray],
    step_times: Mapping[str, np.ndarray] | None = None,
) -> pd.DataFrame:
    """``flags`` (names, ';'-separated, '' when none) and ``flag_details`` (JSON name -> why)
    of every summary row, in its order and index. ``losses``: record_dir -> measured losses;
    ``step_times``: record_dir -> timed step times (s), in step order."""
    rows = summary.to_dict("records")
    peers = {r["scenario"]: r for r in rows}
    by_scenario = dict(tuple(runs.groupby("scenario", sort=False))) if "scenario" in runs else {}
    flags, details = [], []
    for row in rows:
        mine = by_scenario.get(row["scenario"], runs.iloc[0:0])
        ok_dirs = mine.loc[mine["outcome"] == "ok", "record_dir"] if len(mine) else []
        facts = Facts(
            row, peers, mine, [losses[d] for d in ok_dirs if d in losses], runs, step_times or {}
        )
        fired = {c.name: why for c in CHECKS if (why := c.test(facts, c.tolerance))}
        flags.append(";".join(fired))
        details.append(json.dumps(fired) if fired else "")
    return pd.DataFrame({"flags": flags, "flag_details": details}, index=summary.index)


def flag_names(flags) -> list[str]:
    """The check names of a summary row's ``flags`` cell (';'-separated; as read back from
    summary.csv an empty cell may be NaN)."""
    return [n for n in (flags if isinstance(flags, str) else "").split(";") if n]


def blocking(flags) -> list[str]:
    """The names in a ``flags`` cell that block a finding (implausible or unknown checks); []
    when the number stands (no flag, or cautions only)."""
    return [n for n in flag_names(flags) if severity(n) == IMPLAUSIBLE]


def parse_flags(flags, details) -> list[dict]:
    """[{name, meaning, detail, severity, blocks}] of a summary row's ``flags`` /
    ``flag_details`` cells (as read back from summary.csv: empty cells may be NaN)."""
    names, blocks = flag_names(flags), set(blocking(flags))
    try:
        why = json.loads(details) if isinstance(details, str) and details else {}
    except ValueError:
        why = {}
    return [
        {
            "name": n,
            "meaning": MEANINGS.get(n, "unknown check"),
            "detail": why.get(n, ""),
            "severity": severity(n),
            "blocks": n in blocks,
            "title": TITLES.get(n, n),
        }
        for n in names
    ]
