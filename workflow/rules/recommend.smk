# `snakemake recommend` for a study with a recommend block (offload_study.prediction.recommend): predict every
# candidate of every engine (rule plan), measure for real those predicted within the model's
# step-time error of the best (the checkpoint decides which runs to make, round by round while
# none ran ok, up to recommend.max_measured; rule train makes them), write the fastest config
# within the GPU-memory budget.
# (its input functions and recommend_search: rules/common.smk)


localrules:
    recommend_space,


rule recommend_space:
    output:
        f"{RECOMMEND_DIR}/space.json",
    log:
        f"{RESULTS}/logs/recommend_space.log",
    params:
        # a study without a recommend block fails here, naming the key
        space=lambda wc: recommend_search.space(PLAN),
    run:
        from offload_study.core.contracts import write_json

        write_json(output[0], params.space)


checkpoint recommend_select:
    """Round 0: rank the candidates by their prediction; those within the step-time error band
    of the best and the references get measured. Round r > 0: the band of the best left, while
    no candidate measured so far ran ok."""
    input:
        unpack(recommend_round_inputs),
        space=rules.recommend_space.output[0],
        plan_csv=rules.plan.output.csv,
    output:
        f"{RECOMMEND_DIR}/{layout.RECOMMEND_ROUND}",
    log:
        f"{RESULTS}/logs/recommend_select.round{{round}}.log",
    wildcard_constraints:
        round=r"\d+",
    conda:
        "../../envs/analysis.yaml"
    params:
        # round r > 0: --previous SELECTED and the records so far
        previous_round=lambda wc, input: (
            ["--previous", input.previous, *input.metrics]
            if "previous" in input.keys()
            else []
        ),
    shell:
        "python -m offload_study.prediction.recommend select --space {input.space:q}"
        " --plan-csv {input.plan_csv:q} --out {output:q} {params.previous_round:q}"
        " > {log:q} 2>&1"


rule recommend:
    """The fastest measured config within the budget: its engine's config, margin, reasons."""
    input:
        space=rules.recommend_space.output[0],
        # every round's selection (the last measured nothing) and its runs' records; named
        # functions, so that a dry run shows them as still to be decided
        rounds=lambda wc: recommend_search.search_rounds(recommend_round),
        metrics=lambda wc: rounds_records(
            recommend_search.search_rounds(recommend_round)
        ),
        plan_csv=rules.plan.output.csv,
    output:
        json=f"{RECOMMEND_DIR}/{layout.RECOMMENDATION_JSON}",
        ds_config=f"{RECOMMEND_DIR}/recommended.ds_config.json",
        html=f"{REPORT_DIR}/recommend.html",
    log:
        f"{RESULTS}/logs/recommend.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        configs=f"{RESULTS}/configs",
    shell:
        "python -m offload_study.prediction.recommend decide --space {input.space:q}"
        " --rounds {input.rounds:q} --configs {params.configs:q}"
        " --ds-config-out {output.ds_config:q} --html {output.html:q} --out {output.json:q}"
        " --plan-csv {input.plan_csv:q} {input.metrics:q} > {log:q} 2>&1"
        # what the search spent and saved, in the terminal too
        " && grep -h '^recommend: ' {log:q} >&2"
