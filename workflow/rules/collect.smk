localrules:
    collect,


rule collect:
    """All run records -> one tidy table (failed runs included) and a per-scenario summary."""
    input:
        metrics=expand(
            f"{RECORD}/metrics.json",
            scenario=SCENARIOS,
            rep=REPEATS,
        ),
    output:
        runs=report(
            f"{RESULTS}/{layout.RUNS_CSV}",
            caption="../report/runs.rst",
            category="Tables",
            labels={"table": "runs (one row per run)"},
        ),
        parquet=f"{RESULTS}/{layout.RUNS_PARQUET}",
        summary=report(
            f"{RESULTS}/{layout.SUMMARY_CSV}",
            caption="../report/summary.rst",
            category="Tables",
            labels={"table": "summary (one row per scenario)"},
        ),
    log:
        f"{RESULTS}/logs/collect.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        baseline=PLAN.baseline or "",
    # `--baseline=`: a study without a baseline quotes to nothing, still the option's value
    shell:
        "python -m offload_study.analysis.collect --baseline={params.baseline:q} --runs-csv {output.runs:q}"
        " --runs-parquet {output.parquet:q} --summary-csv {output.summary:q} {input.metrics:q}"
        " > {log:q} 2>&1"
