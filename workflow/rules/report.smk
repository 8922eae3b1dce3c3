localrules:
    report,


rule report:
    """Self-contained comparative HTML report (+ the figures as PNG files)."""
    input:
        runs=rules.collect.output.runs,
        summary=rules.collect.output.summary,
        plan=rules.plan.output[0],
        others=other_cluster_summaries(),
    output:
        html=report(
            f"{REPORT_DIR}/report.html",
            caption="../report/report.rst",
            category="Report",
            labels={"report": PLAN.study["study"]},
        ),
        relative_speed=report_figure("relative_speed", "relative speed"),
        speed_vs_gpu_memory=report_figure("speed_vs_gpu_memory", "speed vs memory"),
        step_breakdown=report_figure("step_breakdown", "step-time breakdown"),
        speed_vs_gas=report_figure("speed_vs_gas", "speed vs gradient accumulation"),
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        figures=lambda wc, output: os.path.dirname(output.relative_speed),
        others=lambda wc, input: " ".join(
            f"--other-cluster-summary {p}" for p in input.others
        ),
    shell:
        "python -m offload_study.report --runs {input.runs} --summary {input.summary}"
        " --plan {input.plan} --out {output.html} --figures-dir {params.figures} {params.others}"
        " > {log} 2>&1"
