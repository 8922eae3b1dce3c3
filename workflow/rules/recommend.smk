# `snakemake recommend` for a study with a recommend block (offload_study.recommend): predict every
# candidate (rule plan), measure the best few for real (the checkpoint decides which runs to make,
# rule train makes them), write the fastest config within the GPU-memory budget.
from offload_study import recommend as recommend_search

RECOMMEND_DIR = f"{RESULTS}/recommend"


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
        from offload_study.contracts import write_json

        write_json(output[0], params.space)


checkpoint recommend_select:
    """Rank the candidates by their prediction; the top ones and the references get measured."""
    input:
        space=rules.recommend_space.output[0],
        plan_csv=rules.plan.output.csv,
    output:
        f"{RECOMMEND_DIR}/selected.json",
    log:
        f"{RESULTS}/logs/recommend_select.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "python -m offload_study.recommend select --space {input.space:q}"
        " --plan-csv {input.plan_csv:q} --out {output:q} > {log:q} 2>&1"


rule recommend:
    """The fastest measured config within the budget: its DeepSpeed JSON, margin, reasons."""
    input:
        space=rules.recommend_space.output[0],
        selected=f"{RECOMMEND_DIR}/selected.json",
        # the records of the runs the checkpoint chose (made by rule train)
        metrics=lambda wc: recommend_search.selected_records(
            checkpoints.recommend_select.get().output[0], RESULTS, REPEATS
        ),
    output:
        json=f"{RECOMMEND_DIR}/recommendation.json",
        ds_config=f"{RECOMMEND_DIR}/recommended.ds_config.json",
        html=f"{REPORT_DIR}/recommend.html",
    log:
        f"{RESULTS}/logs/recommend.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        configs=f"{RESULTS}/configs",
    shell:
        "python -m offload_study.recommend decide --space {input.space:q}"
        " --selected {input.selected:q} --configs {params.configs:q}"
        " --ds-config-out {output.ds_config:q} --html {output.html:q} --out {output.json:q}"
        " {input.metrics:q} > {log:q} 2>&1"
