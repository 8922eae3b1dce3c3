localrules:
    report,


rule report:
    input:
        runs=rules.collect.output.runs,
        summary=rules.collect.output.summary,
        plan=rules.plan.output[0],
    output:
        html=f"reports/{PLAN.study['study']}/report.html",
    params:
        figures=f"reports/{PLAN.study['study']}/figures",
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "python -m offload_study.report --runs {input.runs} --summary {input.summary}"
        " --plan {input.plan} --out {output.html} --figures-dir {params.figures} > {log} 2>&1"
