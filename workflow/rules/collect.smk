localrules:
    collect,


rule collect:
    """All run records -> one tidy table (failed runs included) and a per-scenario summary."""
    input:
        metrics=expand(
            f"{RESULTS}/{{scenario}}/rep{{rep}}/metrics.json", scenario=SCENARIOS, rep=REPEATS
        ),
    output:
        runs=f"{RESULTS}/runs.csv",
        parquet=f"{RESULTS}/runs.parquet",
        summary=f"{RESULTS}/summary.csv",
    params:
        baseline=PLAN.baseline or "",
    log:
        f"{RESULTS}/logs/collect.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "python -m offload_study.collect --baseline '{params.baseline}' --runs-csv {output.runs}"
        " --runs-parquet {output.parquet} --summary-csv {output.summary} {input.metrics} > {log} 2>&1"
