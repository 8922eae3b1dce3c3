import re
import sys

from snakemake.exceptions import WorkflowError

sys.path.insert(
    0, f"{workflow.basedir}/workflow"
)  # the library, also without pip install -e

from offload_study.plan import Plan
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
