localrules:
    deepspeed_config,
    plan_summary,
    plan,


rule deepspeed_config:
    """One DeepSpeed config and run spec per (expanded) scenario."""
    output:
        ds_config=layout.ds_config_path(RESULTS, "{scenario}"),
        spec=layout.run_spec_path(RESULTS, "{scenario}"),
    log:
        f"{RESULTS}/logs/deepspeed_config/{{scenario}}.log",
    params:
        # A changed scenario re-plans (and re-runs) that scenario alone.
        spec=lambda wc: PLAN.run_spec(scenario_of(wc)),
    run:
        from offload_study.planning.plan import write_scenario_files

        write_scenario_files(params.spec, output.ds_config, output.spec)


rule plan_summary:
    output:
        f"{RESULTS}/plan.unchecked.json",
    log:
        f"{RESULTS}/logs/plan_summary.log",
    params:
        # a function: evaluated for this job only, not each time a job parses the workflow
        summary=lambda wc: PLAN.summary(),
    run:
        from offload_study.core.contracts import write_json

        write_json(output[0], params.summary)


CALIBRATION_MEASURED = layout.measured_calibration(PLAN.cluster["name"])
CALIBRATION_SHIPPED = layout.shipped_calibration(PLAN.cluster["name"])


# The cluster's calibration: what was measured on it, else the file config/calibration ships
# for it (clusters we cannot measure now), else measure it (rule calibrate).
CALIBRATION = (
    CALIBRATION_SHIPPED
    if os.path.exists(CALIBRATION_SHIPPED) and not os.path.exists(CALIBRATION_MEASURED)
    else CALIBRATION_MEASURED
)
# Calibration runs once per cluster, on a node like the first run's (not per scenario).
CALIBRATION_NODE = RESOURCES_BY_SCENARIO[SCENARIOS[0]] if SCENARIOS else {}
CALIBRATION_THREADS = (
    workflow.cores
    if PLAN.cluster["scheduler"] == "local"
    else CALIBRATION_NODE.get("cpus_per_task", 1)
)


rule calibrate:
    """The cluster's own rates (matmul, host<->GPU copies, CPU Adam, disk), measured in seconds
    on a node of it and kept for every study planned there."""
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
    shell:
        "python -m offload_study.prediction.calibrate --cluster {params.cluster:q}"
        " --cluster-dir {params.cluster_dir:q} --cores {threads}"
        " --out {output:q} > {log:q} 2>&1"


rule plan:
    """Every DeepSpeed config parsed by DeepSpeed's own parser, and every scenario's memory and
    step time predicted (plan.csv; infeasible ones are not launched), before anything trains.
    """
    input:
        summary=rules.plan_summary.output[0],
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
        " tail -n 30 {log:q} | cut -c 1-2000 >&2; exit $status; }}"
