localrules:
    compare,


rule compare:
    """Cross-cluster comparison of bundles: the same scenarios side by side, what differs."""
    input:
        compare_bundles,
    output:
        f"reports/compare/{compare_name(COMPARE_BUNDLES) or 'compare'}.html",
    log:
        f"logs/compare/{compare_name(COMPARE_BUNDLES) or 'compare'}.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "python -m offload_study.compare --out {output} {input} > {log} 2>&1"
