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
        memory_tradeoff=report_figure("memory_tradeoff", "GPU vs host memory"),
        step_breakdown=report_figure("step_breakdown", "step-time breakdown"),
        speed_vs_gas=report_figure("speed_vs_gas", "speed vs gradient accumulation"),
        step_series=report_figure("step_series", "step time per run"),
        seed_share=report_figure("seed_share", "seed vs this cluster"),
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        figures=lambda wc, output: os.path.dirname(output.relative_speed),
        # a list: `:q` quotes each item (paths found on disk never reach the shell unquoted)
        others=lambda wc, input: [
            arg for p in input.others for arg in ("--other-cluster-summary", p)
        ],
    shell:
        "python -m offload_study.analysis.report --runs {input.runs:q} --summary {input.summary:q}"
        " --plan {input.plan:q} --out {output.html:q} --figures-dir {params.figures:q}"
        " {params.others:q} > {log:q} 2>&1"
