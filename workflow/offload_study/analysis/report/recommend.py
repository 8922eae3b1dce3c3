"""The report's "recommended config" section (``templates/_recommend.html.j2``) and the page
``rule recommend`` writes (``reports/<cluster>/<study>/recommend.html``).

Both render recommend/recommendation.json (:func:`offload_study.prediction.recommend.decide`): the
winner (engine, offload and micro-batch in words) with its measured tokens/s and CI and its
memory, the best config of each engine beside it, what was measured and why, its margin over
the runner-up, its ratio to each reference (worded by the one verdict rule,
core.verdict.speed), why every other candidate lost, the search's device time; every scenario
named by its settings in words (the plan beside it), never by its file name. report.html shows the section when recommendation.json lies in
the study's results. The page adds, from the study's records (:func:`page_view`): the "use
this" sentence, the budget and whether the winner kept to it, the winner's engine config
inline and as a download (a data: URI: the page stays one self-contained file), its peak GPU
and host memory, its provenance, and the commands that re-run the search and re-render the page.

CLI (re-render a page from committed records, e.g. docs/results/<cluster>/<study>)::

    python -m offload_study.analysis.report.recommend --study-dir docs/results/h200-2gpu/X \
        --out reports/h200-2gpu/X/recommend.html
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import re
from collections.abc import Sequence
from pathlib import Path

from offload_study import engines
from offload_study.analysis import collect
from offload_study.analysis.report import html as pages
from offload_study.analysis.report import origin, views, words
from offload_study.core import contracts, devices, layout, verdict
from offload_study.core.contracts import read_json
from offload_study.prediction import error_bands

#: Where recommendation.json lies, relative to the study's results folder (beside plan.json).
RECOMMENDATION = Path(layout.RECOMMEND_DIR) / layout.RECOMMENDATION_JSON

#: The file name the winner's engine config downloads as (rule recommend's ds_config output).
DS_CONFIG_NAME = "recommended.ds_config.json"
#: A peak this far over the budget still counts as within it (the allocator rounds to 2 MiB).
BUDGET_SLACK_GIB = 0.01
#: The site's legend from reports/<cluster>/<study>/recommend.html (report.render's too).
LEGEND_HREF = "../../index.html#legend"

# The report's look (templates/report.html.j2): its colours, fonts, tables and verdict box.
_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="rendered" content="{{ generated }}">
<title>{{ recommend.study }} on {{ recommend.cluster }}: recommended config</title>
<style>
  :root { --fg:#1d2330; --muted:#5b6475; --line:#d9dee7; --bg:#f6f7fa; --accent:#4c72b0; }
  body { margin:0; font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Helvetica,
         Arial, sans-serif; color:var(--fg); }
  main { max-width: 1100px; margin: 0 auto; padding: 20px 28px 60px; }
  h1 { font-size: 24px; margin: 0 0 4px; }
  h2 { font-size: 18px; margin: 28px 0 8px; padding-bottom: 4px; border-bottom: 2px solid var(--line); }
  .sub, .small { color: var(--muted); } .small { font-size: 12px; }
  table { border-collapse: collapse; width: 100%; margin: 6px 0 10px; }
  th, td { border-bottom: 1px solid var(--line); padding: 6px 8px; text-align: left; vertical-align: top; }
  th { background: var(--bg); font-size: 13px; } .num { text-align: right; }
  .verdict { background: #eef3fb; border-left: 5px solid var(--accent); padding: 12px 16px;
             margin: 10px 0 18px; border-radius: 4px; }
  .verdict .head { font-size: 16px; font-weight: 600; margin: 0 0 4px; }
  .met { color: #1b7f3b; font-weight: 600; } .unmet { color: #c62828; font-weight: 600; }
  .note { color: #b26a00; } .noise { color: var(--muted); font-style: italic; }
  code { font-size: 12px; background: var(--bg); padding: 0 3px; border-radius: 3px; }
  pre { background: var(--bg); padding: 8px; overflow-x: auto; font-size: 12px; }
  details { margin: 6px 0; } summary { cursor: pointer; }
  footer { margin-top: 40px; color: var(--muted); font-size: 12px; }
</style></head>
<body><main><h1>{{ recommend.study }} <span class="sub">on {{ recommend.cluster }}</span></h1>
<p class="sub">The fastest measured configuration within a GPU-memory budget{% if page and page.model %}, {{ page.model }}{% endif %} · rendered {{ generated }} · <a href="{{ legend_href }}">how to read this page</a></p>
{% include "_recommend.html.j2" %}
<footer id="rerun">
{% if page and page.dirty %}<p class="note" id="dirty">{{ page.dirty }}</p>{% endif %}
<p>Re-run the search: <code>{{ rerun }}</code>{% if rerender %}<br>Re-render this page from its records: <code>{{ rerender }}</code>{% endif %}</p>
<p>Rendered {{ generated }} by offload-study · self-contained: the page loads nothing from elsewhere.</p>
</footer>
</main></body></html>
"""

#: recommend.decide's words for a ratio to the winner ("(95% CI 92.5%–107.9%, within noise)",
#: or a verdict after it, ending the reason: "(95% CI 34.1%–53.2%), slower"): read back so that
#: a page words it by the current rule (core.verdict.speed), the one the report page uses,
#: whatever rule wrote the recommendation.
_WHY_RATIO = re.compile(
    r"([\d,]+) tokens/s = ([\d.]+)% of the winner \(95% CI ([\d.]+)%–([\d.]+)%"
    r"(?:, [^)]*)?\)(?:, [a-z][a-z ]*$)?"
)
_WHY_NO_RECORD = re.compile(r"outcome missing: metrics\.json not found: \S+")
_WHY_OUTCOME = re.compile(r"outcome (\w+)(?=[:,]|$)")


def why_words(why: str) -> str:
    """Why a scenario lost, as recommend.decide wrote it, in a reader's words: a ratio to the
    winner worded by today's verdict rule, an outcome in words (before the records' error
    excerpt), a run that left no record said so."""

    def ratio(m: re.Match) -> str:
        r, lo, hi = (float(x) / 100 for x in m.group(2, 3, 4))
        return (
            f"{m.group(1)} tokens/s, {verdict.ratio_text(r, lo, hi)} of the winner "
            f"({verdict.speed(r, lo, hi)})"
        )

    why = _WHY_NO_RECORD.sub("the run left no record", why)
    why = _WHY_RATIO.sub(ratio, why)
    return _WHY_OUTCOME.sub(lambda m: words.outcome(m.group(1)), why)


def scenario_words(plan: dict, name: str | None) -> str:
    """A scenario of the study by its settings in words (report.views' label), from the plan."""
    planned = next((s for s in plan.get("scenarios") or [] if s.get("name") == name), None)
    return views.scenario_view(planned or {"name": name or "?"}, None, None)["plot_label"]


def beside(plan_path: str | Path) -> dict | None:
    """recommendation.json of the study whose plan.json is ``plan_path`` (None: no search)."""
    path = Path(plan_path).parent / RECOMMENDATION
    if not path.is_file():
        return None
    plan = read_json(plan_path) if Path(plan_path).is_file() else {}
    return worded(read_json(path), plan)


def worded(recommendation: dict, plan: dict | None = None) -> dict:
    """recommendation.json with each ratio's verdict by the one rule (core.verdict.speed):
    records decided before that rule said "beyond CI" / "within noise"; ``names``: each
    scenario it names in words (from ``plan``), the others' why-not in words."""

    def one(r):  # a ratio never measured ("no pair") keeps its word
        if not r or r.get("ratio") is None:
            return r
        return {**r, "verdict": verdict.speed(r["ratio"], r["ci_low"], r["ci_high"])}

    selection = recommendation.get("selection") or {}
    named = [
        recommendation.get("winner"),
        recommendation.get("runner_up"),
        *(r.get("of") for r in recommendation.get("vs_references") or []),
        *(o.get("scenario") for o in recommendation.get("others") or []),
        *(b.get("scenario") for b in recommendation.get("best_of_engines") or []),
        *(
            (b.get("best_predicted") or {}).get("scenario")
            for b in recommendation.get("best_of_engines") or []
        ),
        *(m.get("scenario") for m in recommendation.get("measured") or []),
        *(b.get("best") for b in selection.get("bands") or []),
        *(sc.get("name") for sc in (plan or {}).get("scenarios") or []),
    ]
    names = {n: scenario_words(plan or {}, n) for n in named if n}

    def said(text: str | None) -> str:
        return _in_words(why_words(text or ""), names)

    others = [{**o, "why": said(o.get("why"))} for o in recommendation.get("others") or []]
    ended = recommendation.get("search_ended")
    return {
        **recommendation,
        "margin": one(recommendation.get("margin")),
        "others": others,
        "vs_references": [one(r) for r in recommendation.get("vs_references") or []],
        "names": names,
        "search_ended": _in_words(ended, names) if ended else ended,
        "engines_view": [
            _engine_view(b, names, said) for b in recommendation.get("best_of_engines") or []
        ],
        "measured_view": [
            {
                "config": names.get(m["scenario"], m["scenario"]),
                "why": said(m["why"]),
                "result": said(m["result"]),
            }
            for m in recommendation.get("measured") or []
        ],
        "selection_text": selection_words(selection, names),
        "left_out_view": [f"{o['label']}: {o['why']}" for o in selection.get("left_out") or []],
    }


def _engine_view(best: dict, names: dict[str, str], said) -> dict:
    """One engine's best config for the page: the engine, its offload and micro-batch in words
    (the candidate's words less the engine's label), speed and memory, measured or predicted."""
    engine = engines.label(best["engine"])

    def config(scenario: str | None) -> str:
        words = names.get(scenario, scenario) if scenario else "—"
        return words.removeprefix(f"{engine} — ")

    unmeasured = best.get("best_predicted")
    return {
        **best,
        "engine_label": engine,
        "config": config(best["scenario"]),
        "why": said(best["why"]) if best.get("why") else None,
        "unmeasured_best": unmeasured
        and f"its best predicted config, {config(unmeasured['scenario'])}, "
        f"{said(unmeasured['why'])}",
    }


def selection_words(selection: dict, names: dict[str, str]) -> str | None:
    """What was measured and why, in a sentence (None for a search that did not say)."""
    bands = selection.get("bands") or []
    if not bands or not bands[0]:
        return None
    first, measured = bands[0], selection.get("measured", 0)
    head = f"{measured} of {selection.get('candidates', '?')} candidates measured"
    best = names.get(first["best"], first["best"])
    if first.get("floor_tokens_per_s") is None:
        why = (
            f"no step-time error band is known, so the best {first['chosen']} predicted "
            f"were, the best of each engine first, then of each offload mode"
        )
    else:
        why = (
            f"the prediction's step time errs by up to "
            f"{error_bands.text(first['step_time_band'])}, so every feasible candidate "
            f"predicted within that of the best predicted one ({best}, "
            f"{first['best_tokens_per_s']:,.0f} tokens/s), at least "
            f"{first['floor_tokens_per_s']:,.0f} tokens/s, may be the fastest; "
            f"{first['in_band']} were predicted within it"
        )
        if first["in_band"] > first["chosen"]:
            why += (
                f"; the budget (recommend.{first['limited_by']}: {first['limit_value']}) "
                f"let the best predicted {first['chosen']} of them be measured, the best of "
                "each engine first, then of each offload mode"
            )
        if first.get("engine_best"):
            why += (
                f"; and the best predicted of each engine with no candidate within it "
                f"({first['engine_best']}), since the prediction errs most between engines"
            )
    rounds = len([b for b in bands if b])
    again = f"; {rounds - 1} more round(s) followed, none having run ok" if rounds > 1 else ""
    return f"{head}: {why}{again}."


def _in_words(text: str, names: dict[str, str]) -> str:
    """``text`` (recommend.decide's) with each scenario name it holds in words."""
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", names[name], text)
    return text


def page_view(recommendation: dict, study_dir: str | Path | None) -> dict | None:
    """What the page shows beyond recommendation.json, from the winner's records in the study
    folder (results/<cluster>/<study> or a committed copy); None without a winner or folder."""
    winner = recommendation.get("winner")
    if not winner or study_dir is None:
        return None
    study = Path(study_dir)
    records = sorted(p.parent for p in study.glob(f"{winner}/rep*/{contracts.METRICS_FILE}"))
    memory = winner_memory(records)
    planned = _plan_scenario(study, winner)
    host_budget = planned.get("cpu_mem_gb")
    plan = read_json(study / layout.PLAN_JSON) if (study / layout.PLAN_JSON).is_file() else {}
    gpus = planned.get("world_size") or int(planned.get("gpus_per_node") or 1) * int(
        planned.get("nodes") or 1
    )
    unit = "rank" if _accelerator(records) == "cpu" else "GPU"
    return {
        "memory": memory,
        "host_budget_gib": host_budget,
        # a CPU rank has no GPU memory: its budget is the host's alone
        "budget_met": budget_met(
            memory, recommendation["gpu_mem_gb"] if unit == "GPU" else None, host_budget
        ),
        "ds_config": _ds_config(Path(layout.ds_config_path(study, winner))),
        "provenance": winner_provenance(records),
        "model": views.model_name(plan.get("model"), plan.get("model_params")),
        "gpus": views.count_of(gpus, unit),
        "unit": unit,
        "dirty": _dirty(study),
    }


def _accelerator(records: Sequence[Path]) -> str | None:
    """The accelerator the winner's runs ran on ("cuda", "cpu"), as their records say."""
    for record in records:
        return read_json(record / contracts.METRICS_FILE).get("accelerator")
    return None


def _dirty(study: Path) -> str | None:
    """origin.dirty over every run of the search (its provenance.json files)."""
    import pandas as pd

    dirs = sorted(str(p.parent) for p in study.glob(f"*/rep*/{contracts.PROVENANCE_FILE}"))
    return origin.dirty(pd.DataFrame({"record_dir": dirs})) if dirs else None


def winner_memory(records: Sequence[Path]) -> dict:
    """The largest peak of the winner's ok runs: GPU allocated and reserved per GPU, host per
    node (GiB; None where no run measured it)."""
    keys = ("peak_gpu_allocated_gib", "peak_gpu_reserved_gib", "host_memory_gib")
    peaks: dict[str, float | None] = dict.fromkeys(keys)
    for rec in records:
        metrics = read_json(rec / contracts.METRICS_FILE)
        metrics["host_memory_gib"] = collect.host_memory_gib(metrics)
        if metrics.get("outcome") != "ok":
            continue
        for k in keys:
            if views.isnum(metrics.get(k)):
                peaks[k] = max(float(metrics[k]), peaks[k] or 0.0)
    return peaks


def budget_met(memory: dict, gpu_budget_gib: float | None, host_budget_gib: float | None) -> str:
    """ "met", "exceeded" or "not measured": the winner's peak reserved GPU memory (what the cap
    limits; allocated where reserved was not measured) and its host peak against the budget
    (``gpu_budget_gib`` None: CPU ranks, judged on the host alone)."""
    gpu = memory["peak_gpu_reserved_gib"] or memory["peak_gpu_allocated_gib"]
    host = memory["host_memory_gib"]
    if (gpu if gpu_budget_gib is not None else host) is None:
        return "not measured"
    over_gpu = gpu_budget_gib is not None and gpu > gpu_budget_gib + BUDGET_SLACK_GIB
    over_host = bool(host_budget_gib and host and host > host_budget_gib + BUDGET_SLACK_GIB)
    return "exceeded" if over_gpu or over_host else "met"


def winner_provenance(records: Sequence[Path]) -> dict | None:
    """GPU, driver, CUDA runtime, torch, engine version and commit of the winner's first run
    (the engine and its version as its metrics.json names them)."""
    for rec in records:
        path = rec / contracts.PROVENANCE_FILE
        if path.is_file():
            prov = read_json(path)
            metrics = read_json(rec / contracts.METRICS_FILE)
            commit = (prov.get("git_commit") or "—")[:12] + (
                " with uncommitted changes" if prov.get("git_dirty") else ""
            )
            return {
                "GPU": devices.card_name(prov.get("gpu_model")),
                "driver": prov.get("gpu_driver"),
                "CUDA runtime": prov.get("cuda_version"),
                "torch": prov.get("torch_version"),
                "engine version": origin.engine_version(metrics),
                "commit": commit,
                "host": prov.get("host"),
            }
    return None


def _ds_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    text = json.dumps(read_json(path), indent=2)
    uri = "data:application/json;base64," + base64.b64encode(text.encode()).decode()
    return {"text": text, "uri": uri, "name": DS_CONFIG_NAME, "source": str(path)}


def _plan_scenario(study: Path, name: str) -> dict:
    path = study / layout.PLAN_JSON
    plan = read_json(path) if path.is_file() else {}
    return next((s for s in plan.get("scenarios", []) if s.get("name") == name), {})


def terminal_line(
    recommendation: dict, page: str | Path, study_dir: str | Path | None = None
) -> str:
    """The search's answer in one line for the terminal, in the page's words: the winner's
    engine, offload and micro-batch and its measured speed, or that nothing ran ok; and where
    the page is."""
    plan_path = Path(study_dir) / layout.PLAN_JSON if study_dir else None
    plan = read_json(plan_path) if plan_path and plan_path.is_file() else {}
    winner = recommendation.get("winner")
    if not winner:
        return f"recommend: no candidate ran ok within the budget; why each lost: {page}"
    speed = recommendation.get("tokens_per_s")
    measured = f" at {speed:,.0f} tokens/s measured" if speed else ""
    return f"recommend: use {scenario_words(plan, winner)}{measured}; the page: {page}"


def write_page(recommendation: dict, out: str | Path, study_dir: str | Path | None = None) -> None:
    """The standalone recommendation page; ``study_dir``: the study's records (the winner's
    memory, config and provenance come from there)."""
    plan_path = Path(study_dir) / layout.PLAN_JSON if study_dir else None
    plan = read_json(plan_path) if plan_path and plan_path.is_file() else {}
    study, cluster = recommendation.get("study") or "?", recommendation.get("cluster") or "?"
    rerender = f"{origin.rerender_command(study_dir, out)} recommend"
    html = (
        pages.environment()
        .from_string(_PAGE)
        .render(
            recommend=worded(recommendation, plan),
            page=page_view(recommendation, study_dir),
            rerun=origin.rerun_command(
                study, cluster, "recommend", study_file=plan.get("study_file")
            ),
            rerender=rerender if study_dir else None,
            legend_href=LEGEND_HREF,
            generated=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        )
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(html, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.analysis.report.recommend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--study-dir", required=True, help="the study's records (with recommend/)")
    ap.add_argument("--out", required=True, help="recommend.html to write")
    a = ap.parse_args(argv)
    path = Path(a.study_dir) / RECOMMENDATION
    if not path.is_file():
        raise SystemExit(f"recommend: no {path}")
    write_page(read_json(path), a.out, a.study_dir)
    print(f"recommend: wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
