localrules:
    deepspeed_config,
    plan_summary,
    plan,


rule deepspeed_config:
    """One DeepSpeed config and run spec per (expanded) scenario."""
    output:
        ds_config=f"{RESULTS}/configs/{{scenario}}.json",
        spec=f"{RESULTS}/configs/{{scenario}}.run.json",
    log:
        f"{RESULTS}/logs/deepspeed_config/{{scenario}}.log",
    params:
        # A changed scenario re-plans (and re-runs) that scenario alone.
        spec=lambda wc: PLAN.run_spec(wc.scenario),
    run:
        from offload_study.plan import write_scenario_files

        write_scenario_files(params.spec, output.ds_config, output.spec)


rule plan_summary:
    output:
        f"{RESULTS}/plan.unchecked.json",
    log:
        f"{RESULTS}/logs/plan_summary.log",
    params:
        summary=PLAN.summary(),
    run:
        from offload_study.plan import write_json

        write_json(output[0], params.summary)


rule plan:
    """Every DeepSpeed config parsed by DeepSpeed's own parser before anything trains."""
    input:
        summary=rules.plan_summary.output[0],
        specs=expand(f"{RESULTS}/configs/{{scenario}}.run.json", scenario=SCENARIOS),
    output:
        f"{RESULTS}/plan.json",
    log:
        f"{RESULTS}/logs/plan.log",
    conda:
        "../../envs/train.yaml"
    shell:
        "python -m offload_study.plan --plan-json {input.summary} --out {output} {input.specs} > {log} 2>&1"
