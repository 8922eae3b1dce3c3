localrules:
    compare,


rule compare:
    """Cross-cluster comparison of bundles: the same scenarios side by side, what differs."""
    input:
        compare_bundles,
    output:
        f"reports/compare/{COMPARE_NAME}.html",
    log:
        f"logs/compare/{COMPARE_NAME}.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "python -m offload_study.across.compare --out {output:q} {input:q} > {log:q} 2>&1"
