rule train:
    """One scenario x repeat: a real DeepSpeed run; failures become an outcome in metrics.json."""
    input:
        spec=f"{RESULTS}/configs/{{scenario}}.run.json",
        ds_config=f"{RESULTS}/configs/{{scenario}}.json",
        # Ordering only: train after every config passed DeepSpeed's parser (ancient: no re-runs).
        plan=ancient(f"{RESULTS}/plan.json"),
    output:
        metrics=f"{RESULTS}/{{scenario}}/rep{{rep}}/metrics.json",
        steps=f"{RESULTS}/{{scenario}}/rep{{rep}}/steps.csv",
        provenance=f"{RESULTS}/{{scenario}}/rep{{rep}}/provenance.json",
    log:
        f"{RESULTS}/logs/train/{{scenario}}.rep{{rep}}.log",
    conda:
        "../../envs/train.yaml"
    threads: train_threads
    resources:
        # GPUs, CPUs, memory, runtime, partition/account/... from the cluster description.
        **resource_callables(lambda wc: PLAN.by_name[wc.scenario], PLAN.cluster),
    params:
        outdir=subpath(output.metrics, parent=True),
    shell:
        "python -m offload_study.runner --spec {input.spec} --repeat {wildcards.rep}"
        " --outdir {params.outdir} --cores {threads} > {log} 2>&1"
