localrules:
    engine_config,
    catalog_calibration,
    plan_summary,
    plan,


rule engine_config:
    """One engine config (DeepSpeed's JSON, FSDP2's settings) and run spec per (expanded) scenario."""
    output:
        ds_config=layout.ds_config_path(RESULTS, "{scenario}"),
        spec=layout.run_spec_path(RESULTS, "{scenario}"),
    log:
        f"{RESULTS}/logs/engine_config/{{scenario}}.log",
    params:
        # A changed scenario re-plans (and re-runs) that scenario alone.
        spec=lambda wc: PLAN.run_spec(scenario_of(wc)),
    run:
        from offload_study.planning.plan import write_scenario_files

        write_scenario_files(params.spec, output.ds_config, output.spec)


# The plan rule's input as a path, not rules.plan_summary.output[0]: in a rule that names another
# rule's output, Snakemake hashes the whole `specs` list once per spec while it builds the job
# (a million file hashes at 1,000 runs).
PLAN_SUMMARY = f"{RESULTS}/plan.unchecked.json"


rule plan_summary:
    output:
        PLAN_SUMMARY,
    log:
        f"{RESULTS}/logs/plan_summary.log",
    params:
        # a function: evaluated for this job only, not each time a job parses the workflow
        summary=lambda wc: PLAN.summary(),
    run:
        from offload_study.core.contracts import write_json

        write_json(output[0], params.summary)


CALIBRATION_MEASURED = layout.measured_calibration(PLAN.cluster["name"])
CALIBRATION_CATALOG = layout.catalog_calibration(PLAN.cluster["name"])


# measured, else shipped, else (CUDA) the GPU catalog's uncalibrated values, else measure
CALIBRATION = layout.planning_calibration(PLAN.cluster)
# Calibration runs once per cluster, on a node like the first run's (not per scenario): with the
# slurm profile, a node with the cluster's GPUs.
CALIBRATION_NODE = RESOURCES_BY_SCENARIO[SCENARIOS[0]] if SCENARIOS else {}
# A GPU cluster's rates are measured at the sizes and shapes of the study that asks for them
# (calibrate --study: CPU Adam at its partition, matmuls at its layers, copies at its buckets),
# when that study is a file; a CPU cluster's at calibrate's fixed, cache-sized sizes.
CALIBRATION_STUDY = (
    ["--study", STUDY_SOURCE]
    if PLAN.cluster["accelerator"] == "cuda" and os.path.isfile(STUDY_SOURCE)
    else []
)
CALIBRATION_THREADS = (
    workflow.cores
    if PLAN.cluster["scheduler"] == "local"
    else CALIBRATION_NODE.get("cpus_per_task", 1)
)


rule calibrate:
    """The cluster's own rates (matmul, host<->GPU copies, CPU Adam, disk), measured in seconds
    on a node of it and kept for every study planned there. `snakemake calibrate` asks for it
    (add --profile slurm on a SLURM cluster); it refuses on a machine without the cluster's
    accelerator."""
    output:
        CALIBRATION_MEASURED,
    log:
        f"{layout.cluster_results(PLAN.cluster['name'])}/logs/calibrate.log",
    conda:
        "../../envs/train.yaml"
    threads: CALIBRATION_THREADS
    resources:
        **{**CALIBRATION_NODE, "runtime": 10},
    params:
        cluster=PLAN.cluster["name"],
        # the working directory's clusters, where the user wrote theirs (not the install's)
        cluster_dir=str(layout.CLUSTER_DIR),
        study=CALIBRATION_STUDY,
    shell:
        "python -m offload_study.prediction.calibrate --cluster {params.cluster:q}"
        " --cluster-dir {params.cluster_dir:q} --cores {threads} {params.study:q}"
        " --out {output:q} > {log:q} 2>&1"
        " || {{ status=$?; echo 'failed; the end of' {log:q} >&2;"
        " tail -n 30 {log:q} | cut -c 1-2000 >&2; exit $status; }}"


rule catalog_calibration:
    """A CUDA cluster not calibrated yet: the GPU catalog's values (CPU Adam measured here when
    this machine is the cluster's node), labelled uncalibrated; no GPU needed."""
    output:
        CALIBRATION_CATALOG,
    log:
        f"{layout.cluster_results(PLAN.cluster['name'])}/logs/catalog_calibration.log",
    conda:
        "../../envs/train.yaml"
    params:
        cluster=PLAN.cluster["name"],
        cluster_dir=str(layout.CLUSTER_DIR),
    shell:
        "python -m offload_study.prediction.catalog --cluster {params.cluster:q}"
        " --cluster-dir {params.cluster_dir:q} --out {output:q} > {log:q} 2>&1"
        " || {{ status=$?; echo 'failed; the end of' {log:q} >&2;"
        " tail -n 30 {log:q} | cut -c 1-2000 >&2; exit $status; }}"


rule plan:
    """Every DeepSpeed config parsed by DeepSpeed's own parser, and every scenario's memory and
    step time predicted (plan.csv; infeasible ones are not launched), before anything trains.
    """
    input:
        summary=PLAN_SUMMARY,
        specs=expand(layout.run_spec_path(RESULTS, "{scenario}"), scenario=SCENARIOS),
        calibration=CALIBRATION,
    output:
        json=f"{RESULTS}/plan.json",
        csv=f"{RESULTS}/plan.csv",
    log:
        f"{RESULTS}/logs/plan.log",
    conda:
        "../../envs/train.yaml"
    shell:
        # A refusal (DeepSpeed's parser, the op preflight) ends the log: on failure its last
        # lines go to the terminal too, so the reason is not only in the log file.
        "python -m offload_study.admission.admit --plan-json {input.summary:q} --out {output.json:q}"
        " --plan-csv {output.csv:q} --calibration {input.calibration:q} {input.specs:q}"
        " > {log:q} 2>&1 || {{ status=$?; echo 'plan refused; the end of' {log:q} >&2;"
        " tail -n 30 {log:q} | cut -c 1-2000 >&2; exit $status; }};"
        # uncalibrated predictions say so in the terminal, not only in the log
        " grep -h '^plan: UNCALIBRATED' {log:q} >&2 || true"
