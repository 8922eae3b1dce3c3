import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

sys.path.insert(
    0, f"{workflow.basedir}/workflow"
)  # the library, also without pip install -e

from offload_study.prediction import recommend as recommend_search
from offload_study.across.bundle import BundleError, compare_name
from offload_study.core import layout
from offload_study.admission.admit import admitted_plan
from offload_study.planning import candidates
from offload_study.planning.plan import Plan
from offload_study.planning.resources import rule_resources, train_resources
from offload_study.core.study import StudyError
from offload_study.training.placement import retry_failed_runs

try:
    # Expand, then admit (every problem, one error), in the main Snakemake process only: a job
    # (a run: directive's subprocess, a job submitted to SLURM) parses this file again, and
    # its study was admitted before it was scheduled (Snakemake's workflow.is_main_process:
    # exec mode default, not subprocess or remote). STUDY_SOURCE: set by the Snakefile.
    if workflow.is_main_process:
        PLAN = admitted_plan(config, source=STUDY_SOURCE)
    else:
        PLAN = Plan(config, source=STUDY_SOURCE)
    # Each run's resources (GPUs, CPUs, memory, runtime, partition, ...) from the cluster
    # description, computed once here.
    RESOURCES_BY_SCENARIO = {
        name: train_resources(run, PLAN.cluster) for name, run in PLAN.by_name.items()
    }
except StudyError as err:
    raise WorkflowError(f"invalid study: {err}") from None

RESULTS = PLAN.results_dir  # results/<cluster>/<study> (offload_study.core.layout)
# one run's record folder, as a pattern over the scenario and repeat wildcards
RECORD = layout.record_dir(RESULTS, "{scenario}", "{rep}")
SCENARIOS = PLAN.scenarios
REPEATS = PLAN.repeats


if workflow.is_main_process:
    # The retry policy (docs/internals.md, "Retry policy"; outcome.RETRY_POLICY): a record that the
    # infrastructure failed, within the study's retries budget, leaves its place for the archive
    # now, so that Snakemake finds its outputs missing and runs it again; other failed records
    # stay, each with why. A dry run only says what it would do.
    for note in retry_failed_runs(
        RESULTS,
        [(s, r) for s in SCENARIOS for r in REPEATS],
        PLAN.study["retries"],
        # the API's output settings say -n at parse time (workflow.dryrun does not, yet)
        move=not workflow.output_settings.dryrun,
    ):
        if note.retryable:  # re-run now, or not any more (budget spent): say which
            print(f"retry policy: {note}", file=sys.stderr)


wildcard_constraints:
    # Not an alternation of the scenario names: Snakemake copies the constraint into every
    # output pattern, and 1,000 names there cost seconds per dry run. A name no scenario has
    # is refused by scenario_of().
    scenario=r"[^/]+",
    rep=r"\d+",


def scenario_of(wildcards):
    """The job's scenario; a target naming no scenario of the study fails here."""
    if wildcards.scenario not in PLAN.by_name:
        why = candidates.why_not_here(PLAN.study, PLAN.cluster, wildcards.scenario)
        raise WorkflowError(
            f"no scenario {wildcards.scenario!r} in study {PLAN.study['study']!r}"
            + (f": {why}" if why else "")
        )
    return wildcards.scenario


TRAIN_RESOURCES = rule_resources(RESOURCES_BY_SCENARIO, PLAN.cluster, scenario_of)
# On one machine a run takes every core given to Snakemake, so runs never overlap (two runs
# sharing GPUs or cores would skew each other's numbers); under SLURM, its CPUs.
TRAIN_THREADS = (
    workflow.cores
    if PLAN.cluster["scheduler"] == "local"
    else TRAIN_RESOURCES["cpus_per_task"]
)


# reports/<cluster>/<study>: a study run on another cluster is never shadowed by ours
REPORT_DIR = PLAN.report_dir


def other_cluster_summaries():
    """The same study's summaries from other clusters collected here, shown side by side."""
    return layout.other_cluster_summaries(PLAN.cluster["name"], PLAN.study["study"])


def report_figure(name, title):
    return report(
        f"{REPORT_DIR}/figures/{name}.png",
        caption=f"../report/{name}.rst",
        category="Figures",
        labels={"figure": title},
    )


# Bundles given with --config compare='[a.tar.gz, b.tar.gz]' (or a --configfile with `compare:`)
COMPARE_BUNDLES = config.get("compare") or []
try:  # their file names name the compare page: plain bundle names only
    COMPARE_NAME = compare_name(COMPARE_BUNDLES) or "compare"
except BundleError as err:
    raise WorkflowError(f"compare: {err}") from None


def compare_bundles(wildcards):
    """The bundles to compare; asking for `compare` without two of them fails here."""
    if len(COMPARE_BUNDLES) < 2:
        raise WorkflowError(
            "compare: give two or more bundles, the first the reference: "
            "--config compare='[bundles/a.tar.gz, bundles/b.tar.gz]'"
        )
    return COMPARE_BUNDLES


# `snakemake recommend` (rules/recommend.smk): the checkpoint's rounds
RECOMMEND_DIR = f"{RESULTS}/{layout.RECOMMEND_DIR}"


def recommend_round(r):
    """Round r's selected.json: asking the checkpoint makes Snakemake run round r first."""
    return checkpoints.recommend_select.get(round=r).output[0]


def recommend_round_inputs(wc):
    """Round r > 0 reads round r - 1's selection and the records of every run so far."""
    r = int(wc.round)
    if r == 0:
        return {}
    rounds = [recommend_round(k) for k in range(r)]
    return {"previous": rounds[-1], "metrics": rounds_records(rounds)}


def rounds_records(rounds):
    """metrics.json of the runs the given rounds chose."""
    return [
        rec
        for sel in rounds
        for rec in recommend_search.selected_records(sel, RESULTS, REPEATS)
    ]
