# offload-study: DeepSpeed ZeRO-3 offload comparison studies.
#   snakemake -c 2                                   default study (config/config.yaml), this machine
#   snakemake -c 2 --configfile config/studies/X.yaml    another study (replaces the default one)
#   snakemake --profile slurm --configfile ...       on a SLURM login node
import gc

from snakemake.utils import min_version

min_version("9.0")

DEFAULT_STUDY = "config/config.yaml"

# A study given with --configfile REPLACES the default study: Snakemake would merge the two key by
# key (leaking the default's scenarios' knobs, model, ...). `config` already holds what
# --configfile/--config gave when the Snakefile starts, so the default is read only when no study
# (no `study` key) was given. Unlike --replace-workflow-config, this also holds in the jobs that
# Snakemake spawns (e.g. on SLURM), which get --configfiles/--config but not that flag.
if "study" in config:
    STUDY_SOURCE = f"the study '{config['study']}' given with --configfile"
else:
    STUDY_SOURCE = DEFAULT_STUDY

    configfile: DEFAULT_STUDY


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


rule all:
    default_target: True
    input:
        f"reports/{PLAN.study['study']}/report.html",


# Everything made while parsing (Snakemake's modules and rules, the plan of every run) lives as
# long as this process: moved out of the cyclic garbage collector's reach, it is no longer
# traversed on every full collection while Snakemake builds the job graph (~20% of the CPU time
# of a dry run of a 1,000-run study; benchmarks/dryrun_overhead.py).
gc.freeze()
