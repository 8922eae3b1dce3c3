"""May the runs go ahead? The one judgement, made where each answer can first be known.

:func:`admit` judges a :class:`Case` with a tuple of checks and returns every problem, each
with the key (or file) that causes it:

- :data:`STUDY` when the workflow is parsed (the Snakefile, before any job): input that passes
  the schema but makes no sense, what each engine says of its keys, the cluster fit, the host
  (offload_study.admission.study_checks). Any problem refuses the study, in one error with the
  schema's problems (:func:`admitted_plan`).
- :data:`CONFIGS` in rule ``plan`` (``python -m offload_study.admission.admit``), once the
  engines' configs are written: each engine's own parser, the op preflight, the prediction.
- :data:`LAUNCH` in the runner, just before it launches one run: its NVMe folder on the node
  that trains, the prediction, the free space for its swap files there, the op preflight. A
  problem there is recorded as the run's outcome (``Problem.outcome``), the run is not launched.

The walk is top-down: the planning stage expands (offload_study.planning.plan, pure), this
module admits, then the configs are written (rule engine_config).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from offload_study import engines
from offload_study.admission import preflight, study_checks
from offload_study.core import units
from offload_study.core.contracts import (
    Calibration,
    Prediction,
    RunSpec,
    read_calibration,
    read_json,
    read_run_spec,
    sha256_file,
    write_json,
    write_predictions,
)
from offload_study.core.study import (
    RefusedValue,
    SchemaRefused,
    StudyError,
    listed,
    load_cluster,
    nvme_dir_problem,
    study_source,
    unless_refused,
)
from offload_study.planning.plan import Plan, expand_plan
from offload_study.prediction import error_bands, predict


@dataclass(frozen=True)
class Problem:
    """One reason a study or run may not go ahead: the key path (or file) that causes it and
    what is wrong. ``outcome``: ``invalid`` refuses the study; at launch, what the refused run is
    recorded as (config_error, infeasible, op_build_error)."""

    key: str
    message: str
    outcome: str = "invalid"
    fix: str | None = None  # op_build_error: the fix, which leads the refused run's excerpt

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def problem(text: str, outcome: str = "invalid") -> Problem:
    """A Problem of a check's "key path: message" text."""
    key, sep, message = text.partition(": ")
    return Problem(key, message, outcome) if sep else Problem("study", text, outcome)


@dataclass(frozen=True)
class Case:
    """What admission judges: the runs, and what each stage knows of them."""

    runs: Sequence[RunSpec]
    study: dict | None = None  # None at launch: the runner has its run spec only
    cluster: dict | None = None
    #: scenario -> its engine's config (rule plan: the written configs, predict-only built)
    configs: Mapping[str, dict] = field(default_factory=dict)
    #: scenario -> its prediction (rule plan: plan.csv's rows; at launch: the plan's row)
    predictions: Mapping[str, Prediction] = field(default_factory=dict)


Check = Callable[[Case], list[Problem]]


def study_expansion(case: Case) -> list[Problem]:
    found = unless_refused(study_checks.study_problems, case.study, case.cluster, case.runs)
    return [problem(t) for t in found]


def study_host(case: Case) -> list[Problem]:
    found = unless_refused(study_checks.host_problems, case.study, case.cluster, case.runs)
    return [problem(t) for t in found]


def engine_parser(case: Case) -> list[Problem]:
    """Every run's config through its engine's own parser (DeepSpeed's: batch arithmetic,
    pydantic keys)."""
    problems = []
    for spec in case.runs:
        refused = engines.of(spec).config_problem(spec, case.configs[spec.scenario])
        if refused:
            where = spec.ds_config or "predict-only config"
            problems.append(Problem(f"{where} (scenario {spec.scenario!r})", refused))
    return problems


def op_preflight(case: Case) -> list[Problem]:
    """DeepSpeed ops each trained run needs that cannot be built on this machine."""
    result = preflight.check_runs(s for s in case.runs if not s.predict_only)
    return [
        Problem(f"scenario {name}", line, "op_build_error", result.fixes.get(name))
        for name, line in result.refusals.items()
    ]


def prediction(case: Case) -> list[Problem]:
    """Runs predicted not to fit their memory or NVMe budget (predict.refusal)."""
    problems = []
    for spec in case.runs:
        row = case.predictions.get(spec.scenario)
        refused = predict.refusal(spec, row) if row is not None else None
        if refused:
            problems.append(Problem(f"scenario {spec.scenario}", refused, "infeasible"))
    return problems


def node_path(case: Case) -> list[Problem]:
    """On the node that trains: can each run write its NVMe folder?"""
    return [
        Problem(f"nvme_path (scenario {s.scenario})", problem_text, "config_error")
        for s in case.runs
        if s.nvme_path and (problem_text := nvme_dir_problem(s.nvme_path))
    ]


def free_gib(path: str) -> float:
    """Free GiB (for an unprivileged user) on the filesystem of ``path``, or of the nearest
    existing folder above it (the harness makes the rest)."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return units.bytes_to_gib(shutil.disk_usage(existing).free)


def node_nvme_space(case: Case) -> list[Problem]:
    """On the node that trains: room at each run's NVMe folder for its swap files (predicted)?
    DeepSpeed notices a full disk only when it reads a short swap file back, once it has
    started, built the model and swapped it out; this refuses the run before it launches.
    Within the model's error margin (predict.MARGINS) it goes ahead; ``force: true`` too."""
    problems = []
    for spec in case.runs:
        row = case.predictions.get(spec.scenario)
        need = row.nvme_gib if row is not None else None
        if not spec.nvme_path or need is None or spec.force:
            continue
        free = free_gib(spec.nvme_path)
        if need > free * (1 + predict.MARGINS["nvme"]):
            why = (
                f"{spec.nvme_path} has {free:.3g} GiB free on {os.uname().nodename}, the run's "
                f"swap files need {need:.3g} GiB (predicted); free space there, offload less, "
                "or force: true runs it anyway"
            )
            problems.append(Problem(f"nvme_path (scenario {spec.scenario})", why, "infeasible"))
    return problems


STUDY: tuple[Check, ...] = (study_expansion, study_host)
CONFIGS: tuple[Check, ...] = (engine_parser, op_preflight, prediction)
LAUNCH: tuple[Check, ...] = (node_path, prediction, node_nvme_space, op_preflight)


def admit(case: Case, checks: Sequence[Check] = STUDY) -> list[Problem]:
    """Every problem ``checks`` find in ``case``, in their order (empty: it may go ahead)."""
    return [found for check in checks for found in check(case)]


def refusal_text(problems: Sequence[Problem]) -> str:
    """One error for a refused study: the first problem, then every other one on its line."""
    return listed([str(p) for p in problems])


class Refused(StudyError):
    """A study admission refused; ``problems`` lists every reason. ``source``: the study file
    (or how the study was given), which the message names first."""

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        text = refusal_text(problems)
        super().__init__(f"{source}: {text}" if source else text)
        self.problems = list(problems)


def first_problem(err: StudyError) -> str:
    """The first reason of a refusal (a schema error has one; admission lists every one)."""
    return str(err.problems[0]) if isinstance(err, Refused) else str(err)


def admitted_plan(config, cluster_dir=None, source=None) -> Plan:
    """Expand the study (Plan), then admit it: the Plan, or :class:`Refused` naming every
    problem. What the Snakefile builds once, in the main Snakemake process.

    One error holds the schema's problems and admission's. Where the schema refuses the study,
    the :data:`STUDY` checks judge what it accepted (:func:`beside_the_schema`), and the schema's
    problems come first (the first of them is the one a single error would name)."""
    try:
        plan = Plan(config, cluster_dir=cluster_dir, source=source)
    except SchemaRefused as refused:
        if refused.schema_name != "study":
            raise  # the cluster description: the study is judged against it, so nothing more
        found = [problem(text) for text in refused.problems]
        beside = beside_the_schema(refused.checkable, cluster_dir)
        raise Refused(found + beside, refused.source) from None
    problems = admit(Case(plan.planned, plan.study, plan.cluster))
    if problems:
        raise Refused(problems, study_source(config, source))
    return plan


def beside_the_schema(study, cluster_dir=None) -> list[Problem]:
    """The :data:`STUDY` checks' problems of a study the schema refused (``study``: its checkable
    copy, core.study.checkable), on what the schema accepted:

    - each refused value is a stand-in whose every use raises, and the checks run through
      core.study.unless_refused: a check that reads a refused value is skipped, the others
      judge as on a valid study (study_checks says which units are skipped alone);
    - each scenario is expanded alone, so one holding a refused value loses only its own runs
      and the checks of the whole expansion (baseline, clashing names); a refused study key
      that every expansion computes with (global_batch, timeout_min, the model) leaves none;
    - the cluster description is loaded as usual; where the study's cluster key is refused,
      nothing is judged (every check judges against the cluster), and a cluster description
      the schema refuses adds its own problems instead;
    - a recommend block's candidates are left out (they are made from a valid study).

    Never raises for the study's sake: the schema's problems already refuse it."""
    if isinstance(study, RefusedValue) or isinstance(study["cluster"], RefusedValue):
        return []
    kwargs = {"cluster_dir": cluster_dir} if cluster_dir else {}
    try:
        cluster = load_cluster(study["cluster"], **kwargs)
    except SchemaRefused as err:
        return [problem(f"{err.source}: {text}") for text in err.problems]
    except StudyError as err:
        return [problem(str(err))]
    runs = unless_refused(_expand_each, study, cluster)
    try:
        return admit(Case(runs, study, cluster))
    except StudyError as err:  # this machine cannot judge (no DeepSpeed): said beside the rest
        return [problem(str(err))]


def _expand_each(study: dict, cluster: dict) -> list[RunSpec]:
    """Each scenario's runs, expanded one scenario at a time: one whose expansion reads a
    refused value has none."""
    alone = ({**study, "scenarios": [scenario]} for scenario in study["scenarios"])
    return [run for one in alone for run in unless_refused(expand_plan, one, cluster)]


def admitted_runs(study: dict, cluster: dict) -> list[RunSpec]:
    """expand_plan's runs of a loaded study with its expansion admitted (:class:`Refused`
    otherwise); not the host checks: these specs may be for a machine other than this one."""
    runs = expand_plan(study, cluster)
    problems = admit(Case(runs, study, cluster), (study_expansion,))
    if problems:
        raise Refused(problems)
    return runs


def at_launch(spec: RunSpec, plan_outdir: str | Path) -> Problem | None:
    """The runner's question just before it launches ``spec``: the first problem (recorded as
    its outcome, nothing launched), or None. ``plan_outdir``: the record folder whose study's
    plan.csv holds the run's prediction (else the same prediction is made here)."""
    row = predict.launch_prediction(spec, plan_outdir)
    case = Case([spec], predictions={spec.scenario: row} if row else {})
    return next(iter(admit(case, LAUNCH)), None)


# --------------------------------------------------------------------------- rule plan
def predict_plan(plan: dict, pairs, calibration: str | None, plan_csv: str) -> dict:
    """plan.csv (one prediction per scenario, predict-only ones too) and what plan.json says of
    it (predicted GPU-hours, the calibration used)."""
    cal = read_calibration(calibration) if calibration else None
    rows = [predict.predict(s, c, cal, plan["repeats"], with_own_estimate=True) for s, c in pairs]
    labelled = cal is not None and any(s.accelerator == "cuda" for s, _ in pairs)
    band = error_bands.bands(cal.calibrated) if labelled else {}
    if labelled:  # every row says how its step time was predicted, with its error band
        said = {
            "calibration": error_bands.label(cal.calibrated),
            "step_time_band": band["step_time"],
        }
        rows = [dataclasses.replace(r, **said) for r in rows]
    write_predictions(plan_csv, rows)
    summary = predict.summarize(rows, calibration, cal)
    if labelled:
        summary |= {"calibrated": cal.calibrated, "error_bands": band}
    if labelled and not cal.calibrated:
        summary["summary"] = uncalibrated_line(cal, band) + "\n" + summary["summary"]
    return {"plan_csv": plan_csv, **summary}


def uncalibrated_line(cal: Calibration, band: dict) -> str:
    """The terminal's warning for a plan made from the GPU catalog's values."""
    model = cal.provenance.get("catalog_model", "its GPU model")
    return (
        f"plan: UNCALIBRATED predictions for cluster {cal.cluster!r} ({model}: GPU catalog"
        f" values, no calibration measured): step time {error_bands.text(band['step_time'])},"
        f" GPU memory {error_bands.text(band['gpu_allocated'])}, host memory"
        f" {error_bands.text(band['host'])}; measure it on a node with its GPU:"
        " snakemake calibrate (with --profile slurm for a SLURM cluster)"
    )


def predict_only_configs(plan: dict) -> list[tuple[RunSpec, dict]]:
    """(run spec, engine config) of each predict-only scenario of a plan summary."""
    specs = [
        RunSpec.from_dict(s["spec"], "plan: predict_only") for s in plan.get("predict_only", [])
    ]
    return [(spec, engines.of(spec).build_config(spec)) for spec in specs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Admit the written engine configs (each engine's parser, the op preflight, "
        "the prediction) and write plan.json"
    )
    parser.add_argument("--plan-json", required=True, help="plan summary written by the workflow")
    parser.add_argument("--out", required=True, help="validated plan to write")
    parser.add_argument("--plan-csv", help="plan.csv to write: predictions per scenario")
    parser.add_argument("--calibration", help="the cluster's calibration.json (step times)")
    parser.add_argument("specs", nargs="+", help="run specs (configs/<scenario>.run.json)")
    args = parser.parse_args(argv)
    plan = read_json(args.plan_json)
    specs = [read_run_spec(path) for path in args.specs]
    pairs = [(spec, read_json(spec.ds_config)) for spec in specs] + predict_only_configs(plan)
    case = Case([s for s, _ in pairs], configs={s.scenario: c for s, c in pairs})
    refused = admit(case, (engine_parser,))
    if refused:
        print("\n".join(map(str, refused)), file=sys.stderr)
        return 1
    plan["preflight"], lines, stops = preflight.plan_gate(specs, plan["preflight"])
    if lines:
        print("\n".join(lines), file=sys.stderr)
    if stops:  # an op DeepSpeed cannot build here: nothing trains (study key preflight)
        return 1
    plan["configs_checked"] = True
    plan["ds_config_sha256"] = {spec.scenario: sha256_file(spec.ds_config) for spec in specs}
    if args.plan_csv:  # plan.csv's feasible/reason: predict.refusal, the check LAUNCH repeats
        plan["prediction"] = predict_plan(plan, pairs, args.calibration, args.plan_csv)
        print(plan["prediction"]["summary"])
    write_json(args.out, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
