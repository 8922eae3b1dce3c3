# offload-study: DeepSpeed ZeRO-3 offload comparison studies.
#   snakemake -c 2                                           default study (config/config.yaml)
#   snakemake -c 2 --config study_file=config/studies/X.yaml     another study (replaces it)
#   snakemake --profile slurm --config study_file=... cluster=<name>   on a SLURM login node
# --config study_file is read as data only (offload_study.core.yamlsafe). A --configfile is read by
# Snakemake's own loader, which runs the file's Python when it sets `__use_yte__: true` (YAML
# template engine) before this file starts, and no public interface lets a workflow see those
# files again: --configfile is for trusted files only (offload_study/planning/studyfile.py).
import gc
import shlex
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

min_version("9.0")

# the library, also without pip install -e
LIBRARY = f"{workflow.basedir}/workflow"
sys.path.insert(0, LIBRARY)
# The rules' shell commands (`python -m offload_study...`, here or in a SLURM job) run this
# checkout's library too, not the version a shared site environment was installed from: the
# code that planned a run is the code that runs it. (Snakemake's own prefix, kept: bash strict.)
# Snakemake formats the prefix like a shell command: braces doubled.
LIBRARY_SH = shlex.quote(LIBRARY).replace("{", "{{").replace("}", "}}")
shell.prefix(
    "set -euo pipefail; export PYTHONPATH="
    + LIBRARY_SH
    + "${{PYTHONPATH:+:$PYTHONPATH}}; "
)

from offload_study.planning.studyfile import study_config
from offload_study.core.study import StudyError

# The study replaces `config` (the documented way: the config dict may be changed by Python
# code here): a study file never merges with the default study (its scenarios, model, ...
# would leak in). Jobs submitted to SLURM get the same --config/--configfile and choose the
# same study the same way (unlike --replace-workflow-config, which they do not get).
try:
    STUDY, STUDY_SOURCE = study_config(config)
except StudyError as err:
    raise WorkflowError(f"invalid study: {err}") from None
config.clear()
config.update(STUDY)


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/collect.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bundle.smk"
include: "workflow/rules/compare.smk"
include: "workflow/rules/check.smk"
include: "workflow/rules/publish.smk"
include: "workflow/rules/recommend.smk"


rule all:
    default_target: True
    input:
        f"{REPORT_DIR}/report.html",
        # every record, though the report needs them: Snakemake (since 7.7) makes a missing
        # file again only when a target or a job that runs needs it, so a record the retry
        # policy took out while the report stands would otherwise never be made again
        expand(f"{RECORD}/metrics.json", scenario=SCENARIOS, rep=REPEATS),


# The end of a successful run (never a dry run; the main process only, not a job): the study's
# headline table and the report's path; Snakemake prints the full log's path after it
# (.snakemake/log/). A table that cannot be read must not turn a finished run into a failed one.
onsuccess:
    from offload_study.analysis.report import terminal

    try:
        print(terminal.summary_text(RESULTS, f"{REPORT_DIR}/report.html"))
    except (OSError, ValueError, KeyError) as err:
        print(f"(no headline table: {err}); report: {REPORT_DIR}/report.html")


# Everything made while parsing (Snakemake's modules and rules, the plan of every run) lives as
# long as this process: moved out of the cyclic garbage collector's reach, it is no longer
# traversed on every full collection while Snakemake builds the job graph (~20% of the CPU time
# of a dry run of a 1,000-run study; benchmarks/dryrun_overhead.py).
gc.freeze()
