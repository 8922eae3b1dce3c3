# On one machine the runs go one at a time (TRAIN_THREADS is every core) and Snakemake starts the
# ready job of highest priority first: so they start in the study's run_order. Unlike an
# order-only input, a priority never re-runs a finished run when the order changes (a scenario
# added). Under SLURM the runs go to parallel allocations: no order.
TRAIN_PRIORITY = (
    (lambda wildcards: PLAN.run_priority(wildcards.scenario, wildcards.rep))
    if PLAN.cluster["scheduler"] == "local"
    else 0
)


rule train:
    """One scenario x repeat: a real DeepSpeed run; failures become an outcome in metrics.json."""
    input:
        spec=layout.run_spec_path(RESULTS, "{scenario}"),
        ds_config=layout.ds_config_path(RESULTS, "{scenario}"),
        # Ordering only: train after every config passed DeepSpeed's parser (ancient: no re-runs).
        plan=ancient(f"{RESULTS}/plan.json"),
    output:
        metrics=f"{RECORD}/metrics.json",
        steps=f"{RECORD}/steps.csv",
        provenance=f"{RECORD}/provenance.json",
    log:
        f"{RESULTS}/logs/train/{{scenario}}.rep{{rep}}.log",
    priority: TRAIN_PRIORITY
    conda:
        "../../envs/train.yaml"
    threads: TRAIN_THREADS
    resources:
        **TRAIN_RESOURCES,
    params:
        outdir=subpath(output.metrics, parent=True),
    shell:
        "python -m offload_study.training.runner --spec {input.spec:q} --repeat {wildcards.rep:q}"
        " --outdir {params.outdir:q} --cores {threads} > {log:q} 2>&1"
