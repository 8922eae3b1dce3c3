from offload_study.across.bundle import SUFFIX, bundle_name


localrules:
    bundle,


# bundles/<study>--<cluster>.tar.gz: what another cluster needs to compare with this one.
BUNDLE = f"bundles/{bundle_name(PLAN.study['study'], PLAN.cluster['name'])}{SUFFIX}"


rule bundle:
    """One portable, checksummed file of this study on this cluster: records, logs, configs,
    provenance, tables, calibration (when made) and the report."""
    input:
        runs=rules.collect.output.runs,
        summary=rules.collect.output.summary,
        plan=rules.plan.output[0],
        report=rules.report.output.html,
    output:
        BUNDLE,
    log:
        # not under the study's results: the bundle carries those
        f"logs/bundle/{Path(BUNDLE).name}.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        cluster=PLAN.cluster["name"],
        study=PLAN.study["study"],
    shell:
        "python -m offload_study.across.bundle create --cluster {params.cluster:q} --study {params.study:q}"
        " --report {input.report:q} --out {output:q} > {log:q} 2>&1"
