"""What the report shows, as plain data: one view per scenario and the report's sections.

A scenario view is the scenario's summary row (collect's column names, unchanged) over which the
plan's setup for it is laid (what was asked for wins over what the records say), plus a few
display fields that no table has (``gpu_setup``, ``offload_kind``, ``plot_label``, ...).
Missing numbers are None, never NaN, so templates and plots test them one way.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from offload_study.analysis import collect, sanity
from offload_study.analysis.report import words
from offload_study.core import contracts, devices, verdict


class Row(dict):
    """A dict whose missing keys read as None: a scenario that never ran has no measured
    columns, and the template and plots treat "absent" and "not measured" alike."""

    def __missing__(self, key):
        return None


# --------------------------------------------------------------------------- formatting
def isnum(v) -> bool:
    try:
        return v is not None and not isinstance(v, bool) and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def fmt(v, digits: int = 1, suffix: str = "") -> str:
    """Number for humans; '—' for None/NaN."""
    if not isnum(v):
        return "—"
    x = float(v)
    if abs(x) >= 10000:
        return f"{x:,.0f}{suffix}"
    if 0 < abs(x) < 0.1 and digits > 0:
        return f"{x:.2g}{suffix}"
    return f"{x:,.{digits}f}{suffix}"


def fmt_sig(v, digits: int = 3, suffix: str = "") -> str:
    """A number without a CI to its first ``digits`` significant digits: 13,941 -> '13,900',
    21.38 -> '21.4', 0.0523 -> '0.0523'; '—' for None/NaN."""
    if not isnum(v):
        return "—"
    x = float(v)
    if x == 0:
        return f"0{suffix}"
    unit = 10.0 ** (math.floor(math.log10(abs(x))) - digits + 1)
    return verdict.rounded(x, unit) + suffix


def fmt_ci(v, lo, hi, suffix: str = "") -> str:
    """A number with its 95 % CI to the precision the CI supports (verdict.ci_unit): '13,900
    [13,200–14,500]'; without a CI three significant digits."""
    if not isnum(v):
        return "—"
    if not (isnum(lo) and isnum(hi)) or float(hi) <= float(lo):
        return fmt_sig(v, suffix=suffix)
    unit = verdict.ci_unit((float(hi) - float(lo)) / 2)
    at = lambda x: verdict.rounded(float(x), unit)  # noqa: E731
    return f"{at(v)}{suffix} [{at(lo)}–{at(hi)}{suffix}]"


def fmt_signed_pct(v) -> str:
    """A relative error in whole percents with its sign: '+14%', '-4%'; '0%' where it rounds
    to nothing (never '-0%')."""
    if not isnum(v):
        return "—"
    r = round(100 * float(v))
    return "0%" if r == 0 else f"{r:+d}%"


#: A module's dotted path in a record's text ("by offload_study.prediction.calibrate"): a page
#: names the tool by its last part.
_MODULE = re.compile(r"\boffload_study\.(?:\w+\.)*(\w+)")


def plain(text) -> str:
    """Text a record wrote for people, with module paths cut to the tool's name and cards named
    as the catalog names them (no vendor "80GB": pages speak GiB)."""
    return devices.card_names_in(_MODULE.sub(r"\1", str(text or "")))


def fmt_pct(v, digits: int = 0) -> str:
    return "—" if not isnum(v) else f"{100 * float(v):.{digits}f}%"


def fmt_bytes(v) -> str:
    if not isnum(v):
        return "—"
    x = float(v)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def count_of(n, noun: str) -> str:
    """'1 GPU', '8 GPUs', '? GPUs' (unknown count)."""
    if not isnum(n):
        return f"? {noun}s"
    return f"{int(n)} {noun}" if int(n) == 1 else f"{int(n)} {noun}s"


def short_count(n) -> str:
    """1345423360 -> '1.35B', 134105856 -> '134M' (three significant digits)."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def _clean(v):
    """NaN/NA -> None; numpy scalars -> Python numbers (the template compares them)."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    return v.item() if hasattr(v, "item") else v


def _as_dict(v) -> dict:
    if isinstance(v, dict):
        return v
    try:
        d = json.loads(v) if isinstance(v, str) else None
    except ValueError:
        d = None
    return d if isinstance(d, dict) else {}


def model_name(model: dict | None, params) -> str:
    """'llama2-7b (6.74B params)' for a preset or pretrained id, else a short architecture
    string from the config like 'Llama 1.35B'."""
    model = model or {}
    size = short_count(float(params)) if isnum(params) else None
    named = model.get("preset") or model.get("name_or_path")
    if named:
        return f"{named} ({size} params)" if size else str(named)
    kind = str((model.get("config") or {}).get("model_type") or "").capitalize()
    if not kind:
        return f"of {size} parameters" if size else "unknown"
    return f"{kind} {size}" if size else kind


# --------------------------------------------------------------------------- scenarios
def scenario_views(
    summary: pd.DataFrame, plan: dict, baseline: str | None, usable_gib: float | None = None
) -> list[Row]:
    """Plan scenarios (in plan order) joined with their summary rows; unplanned rows appended.
    ``usable_gib``: the GPU memory of the cluster's card as the runs saw it (an uncapped
    scenario's memory)."""
    rows = {}
    if not summary.empty and "scenario" in summary:
        rows = {str(r["scenario"]): r for r in summary.to_dict("records")}
    planned = [sc for sc in plan.get("scenarios") or [] if sc.get("name")]
    views = [scenario_view(sc, rows.get(str(sc["name"])), baseline, usable_gib) for sc in planned]
    seen = {v["scenario"] for v in views}
    views += [
        scenario_view({"name": n}, r, baseline, usable_gib)
        for n, r in rows.items()
        if n not in seen
    ]
    common = {c["name"] for c in common_cautions(views)}
    labels = {v["scenario"]: v["plot_label"] for v in views}
    for v in views:  # a caution said once at the top is not repeated on each row
        v["row_flags"] = [f for f in v["flag_list"] if f["name"] not in common]
        v["pair_text"], v["pair_label"] = _pair_text(v, labels), labels.get(v["pair"], v["pair"])
    return views


def common_cautions(views: list[Row]) -> list[dict]:
    """The cautions (flags that do not block) that most measured scenarios carry: the page says
    each once, at the top, with its meaning, and names the measured scenarios without it; the
    rows then show only the flags in which they differ."""
    measured = [v for v in views if v["tokens_per_s"] is not None]
    counts: dict[str, dict] = {}
    for v in measured:
        for f in v["flag_list"]:
            if not f["blocks"]:
                counts.setdefault(f["name"], {"flag": f, "on": []})["on"].append(v)
    return [
        {
            "name": name,
            "title": c["flag"]["title"],
            "meaning": c["flag"]["meaning"],
            "n": len(c["on"]),
            "of": len(measured),
            "without": [v["plot_label"] for v in measured if v not in c["on"]],
        }
        for name, c in counts.items()
        if len(c["on"]) >= 2 and 2 * len(c["on"]) > len(measured)
    ]


def scenario_view(
    planned: dict, row: dict | None, baseline: str | None, usable_gib: float | None = None
) -> Row:
    """One scenario: its summary row, the plan's setup laid over it, and display fields."""
    v = Row({k: _clean(x) for k, x in (row or {}).items()})
    v.update({k: x for k, x in planned.items() if x not in (None, "") and k != "name"})
    v["scenario"] = str(planned["name"])
    v["label"] = words.reader_label(str(v["label"] or ""), v["scenario"])
    v["usable_gib"] = usable_gib
    v["sweep"] = _as_dict(v["sweep"])
    v["reference"] = v["reference"] if isinstance(v["reference"], dict) else None
    for k in ("nodes", "gpus_per_node", "world_size", "runs", "n_ok"):
        v[k] = int(v[k]) if isnum(v[k]) else None
    if v["world_size"] is None and v["nodes"] and v["gpus_per_node"]:
        v["world_size"] = v["nodes"] * v["gpus_per_node"]
    v["runs"], v["n_ok"] = v["runs"] or 0, v["n_ok"] or 0
    v["status"] = v["status"] or "not run"
    v["outcomes"] = v["outcomes"] or "no record"
    v["offload_optimizer"] = str(v["offload_optimizer"] or "?")
    v["offload_param"] = str(v["offload_param"] or "?")
    v["is_baseline"] = v["scenario"] == baseline
    v.update(_display_fields(v))
    return v


def _display_fields(v: Row) -> dict:
    unit = "rank" if v["accelerator"] == "cpu" else "GPU"
    cap = float(v["gpu_mem_gb"]) if isnum(v["gpu_mem_gb"]) else None
    offloads = (v["offload_optimizer"], v["offload_param"])
    kind = "nvme" if "nvme" in offloads else "cpu" if "cpu" in offloads else "none"
    sweep_text = words.sweep_words(v["scenario"], v["sweep"])
    return {
        "flag_list": sanity.parse_flags(v["flags"], v["flag_details"]),
        "blocking": sanity.blocking(v["flags"]),  # implausible: its numbers are no finding
        "pair_verdict": _speed_verdict(v, "paired_ratio"),
        "speed_verdict": _speed_verdict(v, "relative_speed"),
        "unit": unit,
        "gpu_setup": words.gpu_setup(
            v["world_size"], cap, v["usable_gib"] if unit == "GPU" else None, unit
        ),
        # a CPU rank has no GPU memory: a cap on it is a budget no one enforced
        "memory_level_gib": (cap if cap is not None else v["usable_gib"])
        if unit == "GPU"
        else None,
        "host_budget": words.gib(v["cpu_mem_gb"]) if isnum(v["cpu_mem_gb"]) else "—",
        "offload_kind": kind,
        "offload_text": _offload_words(*offloads),
        "flops_word": "HFU" if v["gradient_checkpointing"] in (True, "True", "true", 1) else "MFU",
        "outcome_words": words.outcomes(v["outcomes"]),
        "sweep_text": sweep_text,
        "plot_label": f"{v['label']}; {sweep_text}" if sweep_text else v["label"],
        "reference_speed_pct": (v["reference"] or {}).get("speed_pct"),
        "host_memory_gib": collect.host_memory_gib(v),
    }


def _offload_words(optimizer: str, param: str) -> str:
    """'offloads the optimizer and the parameters to the CPU', 'no offload'."""
    where: dict[str, list[str]] = {}
    for what, to in (("the optimizer", optimizer), ("the parameters", param)):
        if to not in ("none", "?", "", None):
            where.setdefault("NVMe" if to == "nvme" else to.upper(), []).append(what)
    if not where:
        return "no offload"
    return "offloads " + "; ".join(f"{' and '.join(w)} to the {to}" for to, w in where.items())


def _pair_text(v: Row, labels: dict[str, str]) -> str:
    """Which pair the paired ratio uses, in a few words, and whose runs of it: the short ones
    made in each run's own job, when ``pairing`` says so."""
    pair = labels.get(v["pair"], v["pair"])
    text = {
        "self": "itself (no offload)",
        "same-settings": f"{pair}, same settings",
        "study baseline": f"the study baseline, {pair}",
    }.get(v["pair_kind"], "none")
    return text + (", same allocation" if v["pairing"] == "same allocation" else "")


def _speed_verdict(v: Row, column: str) -> str | None:
    """The one verdict rule (core.verdict.speed) on a ratio column and its CI; None where
    the ratio is not measured."""
    if not isnum(v[column]):
        return None
    return verdict.speed(v[column], v[f"{column}_ci_low"], v[f"{column}_ci_high"])


def worded_ratio(word: str | None, ratio_text: str, of: str) -> str:
    """A ratio with its verdict, one way everywhere: 'slower: 74% [68%–82%] of baseline speed',
    'no difference shown from baseline speed: 100% [97%–103%]', 'inconclusive: 70% [64%–110%]
    of baseline speed (the CI is too wide to decide)'."""
    if word == verdict.NO_DIFFERENCE:
        return f"{word} from {of}: {ratio_text}"
    if word == verdict.INCONCLUSIVE:
        why = "the CI is too wide to decide" if "[" in ratio_text else "no CI"
        return f"{word}: {ratio_text} of {of} ({why})"
    return f"{word}: {ratio_text} of {of}" if word else f"{ratio_text} of {of}"


def _ratio_text(ratio, lo, hi) -> str:
    return verdict.ratio_text(ratio, lo, hi)


def verdicts(views: list[Row], baseline: str | None, note: str | None) -> tuple[str, list[str]]:
    """(headline sentence, one sentence per other scenario). A number with a blocking sanity
    flag (implausible) is never stated as a finding, nor anything relative to it; a caution
    leaves it standing with its CI and the caution named; each ratio carries its verdict
    (core.verdict.speed: faster, slower, no difference shown or inconclusive)."""
    base = next((v for v in views if v["scenario"] == baseline), None)
    blocked = {v["scenario"] for v in views if v["blocking"]}
    if base is None or base["tokens_per_s"] is None:
        return f"No relative speed: {note or 'no baseline scenario'}.", [
            _blocked_line(v) or _absolute_line(v, blocked) for v in views
        ]
    mem, mem_name = ("peak_gpu_allocated_gib", "GPU memory per GPU")
    if base[mem] is None:
        mem, mem_name = ("host_memory_gib", "host memory per node")
    head = f"Baseline {base['plot_label']}: {tokens_text(base)} tokens/s on " + (
        count_of(base["world_size"], base["unit"])
        + (f", {fmt(base[mem])} GiB {mem_name}" if base[mem] is not None else "")
    )
    if base["blocking"]:
        head += ". Flagged, so no ratio to it is stated: " + _flag_text(base) + "."
    else:
        head += _caution_clause(base) + "."
    lines = [_blocked_line(v) or _relative_line(v, base, mem, mem_name, blocked) for v in views]
    return head, [line for v, line in zip(views, lines, strict=True) if v is not base]


#: A baseline whose speed CI reaches further than this share of its median either side is
#: called out beside it: every ratio to it carries that spread.
WIDE_BASELINE_HALF_WIDTH = 0.05


def baseline_spread(views: list[Row], baseline: str | None, bound: str | None) -> str | None:
    """The sentence a reader needs when the baseline itself was measured widely: how wide, and
    (``bound``: the plan's predicted bound in words, e.g. "dispatch 0.48 s of 0.525 s") why."""
    base = next((v for v in views if v["scenario"] == baseline), None)
    keys = ("tokens_per_s", "tokens_per_s_ci_low", "tokens_per_s_ci_high")
    if base is None or any(base[k] is None for k in keys):
        return None
    median, low, high = (base[k] for k in keys)
    half = max(median - low, high - median) / median
    if half <= WIDE_BASELINE_HALF_WIDTH:
        return None
    text = (
        f"The baseline's speed is wide: its 95% CI reaches {half:.0%} from its median, and "
        "every ratio to it carries that spread"
    )
    if bound and bound.startswith("dispatch"):
        text += (
            f"; its step is predicted bound by the host's dispatch of kernels ({bound}), "
            "which follows the host's load from run to run"
        )
    return text + "."


def tokens_text(v: Row) -> str:
    return fmt_ci(v["tokens_per_s"], v["tokens_per_s_ci_low"], v["tokens_per_s_ci_high"])


def _flag_text(v: Row) -> str:
    return "; ".join(
        f"{f['title']} ({f['detail']})" if f["detail"] else f["title"] for f in v["flag_list"]
    )


def _blocked_line(v: Row) -> str | None:
    if not v["blocking"] or v["tokens_per_s"] is None:
        return None
    return f"{v['plot_label']}: flagged, not a finding: {_flag_text(v)}."


def _caution_clause(v: Row) -> str:
    """'; caution: CI target missed' for the cautions of a number that stands (those the page
    says once at the top for most scenarios left out: common_cautions)."""
    flags = v["flag_list"] if v["row_flags"] is None else v["row_flags"]
    names = [f["title"] for f in flags if not f["blocks"]]
    return f"; caution: {', '.join(names)}" if names else ""


def _absolute_line(v: Row, blocked: set[str]) -> str:
    if v["tokens_per_s"] is None:
        return f"{v['plot_label']}: no successful run ({v['outcome_words']})."
    peak = v["peak_gpu_allocated_gib"]
    return (
        f"{v['plot_label']}: {tokens_text(v)} tokens/s on "
        f"{count_of(v['world_size'], v['unit'])}"
        + (f", peak {fmt(peak)} GiB per GPU" if peak is not None else "")
        + _pair_clause(v, blocked)
        + _caution_clause(v)
        + "."
    )


def _relative_line(v: Row, base: Row, mem: str, mem_name: str, blocked: set[str]) -> str:
    if v["relative_speed"] is None:
        return f"{v['plot_label']}: no successful run ({v['outcome_words']})."
    rel = (v["relative_speed"], v["relative_speed_ci_low"], v["relative_speed_ci_high"])
    if base["scenario"] in blocked:
        t = f"{v['plot_label']}: {tokens_text(v)} tokens/s (the baseline is flagged)"
    else:
        t = f"{v['plot_label']}: {worded_ratio(v['speed_verdict'], _ratio_text(*rel), 'baseline speed')}"
    if v[mem] is not None and isnum(base[mem]) and base[mem] > 0:
        t += f" at {v[mem] / base[mem]:#.2g}× the {mem_name}"
    if v["world_size"] and base["world_size"] and v["world_size"] != base["world_size"]:
        t += f", on {v['world_size']} instead of {count_of(base['world_size'], base['unit'])}"
    return t + _pair_clause(v, blocked) + _caution_clause(v) + "."


def _pair_clause(v: Row, blocked: set[str]) -> str:
    """'; slower: 76% [70%–82%] of its no-offload pair, X (same settings)', with the verdict
    of core.verdict; nothing stated against a pair whose number is blocked (a caution on it
    does not block)."""
    if v["pair_kind"] != "same-settings" or not isnum(v["paired_ratio"]):
        return ""
    if v["pair"] in blocked:
        return f"; its no-offload pair, {v['pair_label']}, is flagged, so no paired ratio is stated"
    ratio = (v["paired_ratio"], v["paired_ratio_ci_low"], v["paired_ratio_ci_high"])
    where = ", same allocation" if v["pairing"] == "same allocation" else ""
    of = f"its no-offload pair, {v['pair_label']} (same settings{where})"
    return "; " + worded_ratio(v["pair_verdict"], _ratio_text(*ratio), of)


# --------------------------------------------------------------------------- sections
def setup_line(plan: dict, runs: pd.DataFrame, hardware: str | None = None) -> str:
    """Model, sequence length, precision, repeats and the hardware, from the plan (the run
    spec's model), the records (model_params as the runs measured it) and ``hardware`` (what
    the records say the runs ran on: origin.hardware); the cluster's own description without
    it."""
    params = plan.get("model_params")
    if not isnum(params) and "model_params" in runs:
        params = (
            runs["model_params"].dropna().median() if runs["model_params"].notna().any() else None
        )
    repeats = plan.get("repeats")
    parts = [
        f"model {model_name(plan.get('model'), params)}" if plan.get("model") or params else None,
        f"sequences of {int(plan['seq_len']):,} tokens" if plan.get("seq_len") else None,
        plan.get("dtype"),
        (count_of(repeats, "repeat") + " of each scenario" if repeats else None),
        hardware or plan.get("cluster_description"),
    ]
    return " · ".join(str(x) for x in parts if x)


def failures(runs: pd.DataFrame, views: list[Row]) -> list[dict]:
    """Every run that is not ok, then every planned scenario without any record."""
    labels = {v["scenario"]: v["plot_label"] for v in views}
    out = []
    if "outcome" in runs:
        for r in runs[runs["outcome"].astype(str) != "ok"].to_dict("records"):
            r = Row({k: _clean(x) for k, x in r.items()})
            out.append(
                {
                    "scenario": str(r["scenario"] or "?"),
                    "label": labels.get(r["scenario"], r["label"] or ""),
                    "repeat": _repeat(r),
                    "outcome": words.outcome(r["outcome"]),
                    "excerpt": r["error_excerpt"] or "(no error excerpt)",
                }
            )
    recorded = set(runs["scenario"].astype(str)) if "scenario" in runs else set()
    out += [
        {
            "scenario": v["scenario"],
            "label": v["plot_label"],
            "repeat": "—",
            "outcome": "not run",
            "excerpt": "no run record was collected for this scenario",
        }
        for v in views
        if v["scenario"] not in recorded
    ]
    return out


def sanity_rows(views: list[Row]) -> list[dict]:
    """The sanity table (sanity.CHECKS), each check with its severity (whether it blocks the
    finding) and the scenarios it flagged and why."""
    return [
        {
            "name": c.name,
            "title": c.title or c.name,
            "meaning": c.meaning,
            "tolerance": c.tolerance_text,
            "severity": c.severity,
            "blocks": bool(sanity.blocking(c.name)),
            "flagged": [
                {"scenario": v["scenario"], "label": v["plot_label"], "detail": f["detail"]}
                for v in views
                for f in v["flag_list"]
                if f["name"] == c.name
            ],
        }
        for c in sanity.CHECKS
    ]


#: Why a run's measurement ended (steady.py's stop reasons) in words.
STOP_WORDS = {
    "fixed": "its fixed steps",
    "target_met": "CI target met",
    "max_steps": "step cap",
    "max_time": "time cap",
    "target_unreachable": "CI target out of reach",
}

#: The step-breakdown columns of a run (DeepSpeed's wall-clock timers, medians over the measured
#: steps): which part of the step moved between repeats or machines, beside its speed.
RUN_BREAKDOWN = (
    ("forward", "breakdown_ms.forward"),
    ("backward", "breakdown_ms.backward"),
    ("optimizer step", "breakdown_ms.step"),
)


def run_rows(runs: pd.DataFrame, views: list[Row]) -> list[dict]:
    """One row per run record, in the order the runs started: its speed, the CI of its own
    median, how its warm-up and measurement ended, and its step breakdown. Repeat beside repeat,
    this shows what moved (the GPU side: forward and backward; the host side: an offloaded
    optimizer step), which the medians of the summary hide."""
    labels = {v["scenario"]: v["plot_label"] for v in views}
    records = [Row({k: _clean(x) for k, x in r.items()}) for r in runs.to_dict("records")]
    records.sort(key=lambda r: (str(r["started_at"] or "~"), str(r["scenario"]), _repeat(r)))
    machine = _machine_letters([r["machine"] for r in records])
    return [
        {
            "scenario": str(r["scenario"] or "?"),
            "label": labels.get(r["scenario"], r["label"] or ""),
            "repeat": _repeat(r),
            "ok": r["outcome"] == "ok",
            "outcome": words.outcome(r["outcome"]),
            "started": r["started_at"] or "—",
            "tokens_per_s": r["tokens_per_s"],
            "step_time_s": r["step_time_s"],
            "ci_pct": r["step_time_ci_pct"],
            "warmup": r["steps_warmup"],
            "settled": r["warmup_settled"],
            "measured": r["steps_measured"],
            "stop": STOP_WORDS.get(r["stop_reason"], r["stop_reason"] or "—"),
            "machine": machine.get(r["machine"]),
            "breakdown": [r[col] for _, col in RUN_BREAKDOWN],
        }
        for r in records
    ]


def _machine_letters(machines: list) -> dict:
    """Machine A, B, ... in the order runs started, where a study's runs came from more than
    one machine (collect's ``machine`` column); none where they came from one."""
    seen = list(dict.fromkeys(m for m in machines if m))
    return {m: chr(ord("A") + i) for i, m in enumerate(seen)} if len(seen) > 1 else {}


def _repeat(run: Row) -> str:
    return str(int(run["repeat"])) if isnum(run["repeat"]) else "?"


#: A scenario's files on a page: (kind as a reader says it, plan key, downloaded as).
CONFIG_FILES = (("config", "ds_config", ".json"), ("run spec", "run_spec", ".run.json"))


def config_blocks(views: list[Row], runs: pd.DataFrame) -> list[dict]:
    """Each scenario's engine config and run spec (text, download link, sha256), and whether
    the config's sha256 is the one the run records name. The paths are the plan's, found
    beside a moved plan by render (committed records)."""
    shas: dict[str, set[str]] = {}
    if {"scenario", "ds_config_sha256"} <= set(runs.columns):
        for scen, sha in runs[["scenario", "ds_config_sha256"]].dropna().itertuples(index=False):
            shas.setdefault(str(scen), set()).add(str(sha))
    out = []
    for v in views:
        files = [
            _config_file(kind, v[key], f"{v['scenario']}{suffix}")
            for kind, key, suffix in CONFIG_FILES
            if v[key]
        ]
        for f in files:
            if f["kind"] == CONFIG_FILES[0][0] and f.get("sha") and v["scenario"] in shas:
                f["match"] = f["sha"] in shas[v["scenario"]]
        out.append({"name": v["scenario"], "label": v["plot_label"], "files": files})
    return out


def _config_file(kind: str, path: str, download: str) -> dict:
    try:
        raw = Path(path).read_text()
    except OSError:
        return {"kind": kind, "text": None, "match": None}
    try:
        text = json.dumps(json.loads(raw), indent=2)
    except ValueError:
        text = raw
    uri = "data:application/json;base64," + base64.b64encode(raw.encode()).decode()
    sha = contracts.sha256_file(path, missing_ok=True)
    return {"kind": kind, "text": text, "download": download, "match": None, "sha": sha, "uri": uri}


def other_clusters(cluster: str, views: list[Row], paths: Sequence[str]) -> dict | None:
    """The same study's summary on other clusters beside this one, scenario by scenario."""
    if not paths:
        return None
    tables = {cluster: {v["scenario"]: v for v in views}}
    for p in paths:
        df = collect.read_table(p)
        name = (
            str(df["cluster"].dropna().iloc[0])
            if "cluster" in df and df["cluster"].notna().any()
            else None
        )
        name = name or Path(p).parent.parent.name or str(p)
        while name in tables:
            name += "'"
        tables[name] = {v["scenario"]: v for v in scenario_views(df, {}, None)}
    names = list(dict.fromkeys(n for t in tables.values() for n in t))
    rows = []
    for n in names:
        label = next(t[n]["plot_label"] for t in tables.values() if n in t)
        cells = [_cluster_cell(t.get(n)) for t in tables.values()]
        rows.append({"name": n, "label": label, "cells": cells})
    return {"clusters": list(tables), "rows": rows}


def _cluster_cell(v: Row | None) -> dict:
    if v is None:
        return {
            "relative_speed": "—",
            "tokens_per_s": "—",
            "peak_gpu_allocated_gib": "—",
            "status": "absent",
        }
    return {
        "relative_speed": verdict.ratio_text(
            v["relative_speed"], v["relative_speed_ci_low"], v["relative_speed_ci_high"]
        ),
        "tokens_per_s": tokens_text(v),
        "peak_gpu_allocated_gib": fmt(v["peak_gpu_allocated_gib"]),
        "status": v["status"],
    }
