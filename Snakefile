# offload-study: DeepSpeed ZeRO-3 offload comparison studies.
#   snakemake -c 2                                   default study (config/config.yaml), this machine
#   snakemake -c 2 --configfile config/studies/X.yaml    another study
#   snakemake --profile slurm --configfile ...       on a SLURM login node
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/collect.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        f"reports/{PLAN.study['study']}/report.html",
