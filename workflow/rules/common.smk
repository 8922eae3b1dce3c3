import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

sys.path.insert(
    0, f"{workflow.basedir}/workflow"
)  # the library, also without pip install -e

from offload_study.plan import Plan
from offload_study.resources import resource_callables, train_resources
from offload_study.study import StudyError

# A study given with --configfile replaces the default study instead of being merged into it
# (Snakemake merges key by key, which would leak the default study's scenarios and knobs).
if workflow.overwrite_configfiles:
    config.clear()
    config.update(workflow.config_settings.overwrite_config)

try:
    PLAN = Plan(
        config,
        source=", ".join(map(str, workflow.overwrite_configfiles))
        or "config/config.yaml",
    )
except StudyError as err:
    raise WorkflowError(f"invalid study: {err}") from None

RESULTS = PLAN.results_dir
SCENARIOS = PLAN.scenarios
REPEATS = PLAN.repeats


wildcard_constraints:
    scenario="|".join(map(re.escape, SCENARIOS)),
    rep=r"\d+",


def run_dirs():
    return expand(f"{RESULTS}/{{scenario}}/rep{{rep}}", scenario=SCENARIOS, rep=REPEATS)


REPORT_DIR = f"reports/{PLAN.study['study']}"


def other_cluster_summaries():
    """The same study's summaries from other clusters collected here, shown side by side."""
    here = Path(RESULTS)
    found = here.parent.parent.glob(f"*/{here.name}/summary.csv")
    return sorted(str(p) for p in found if p.parent != here)


def report_figure(name, title):
    return report(
        f"{REPORT_DIR}/figures/{name}.png",
        caption=f"../report/{name}.rst",
        category="Figures",
        labels={"figure": title},
    )


def train_threads(wildcards):
    """On one machine a run takes every core given to Snakemake, so runs never overlap (two
    runs sharing GPUs or cores would skew each other's numbers); under SLURM, its CPUs.
    """
    if PLAN.cluster["scheduler"] == "local":
        return workflow.cores
    run = PLAN.by_name[wildcards.scenario]
    return train_resources(run, PLAN.cluster)["cpus_per_task"]
