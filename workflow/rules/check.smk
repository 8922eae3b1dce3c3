localrules:
    check,


REFERENCES_DIR = "config/references"


rule check:
    """This study's numbers against config/references/*.yaml: one verdict per scenario on the
    console; fails (non-zero exit) when a value falls outside its reference."""
    input:
        summary=rules.collect.output.summary,
        plan=rules.plan.output[0],
        references=sorted(str(p) for p in Path(REFERENCES_DIR).glob("*.yaml")),
    output:
        f"{RESULTS}/check.json",
    log:
        f"{RESULTS}/logs/check.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        references=lambda wildcards, input: (
            os.path.dirname(input.references[0])
            if input.references
            else REFERENCES_DIR
        ),
    shell:
        # tee: the verdicts on the console and in the log; pipefail keeps check's exit status
        "python -m offload_study.across.check --summary {input.summary:q} --plan {input.plan:q}"
        " --references {params.references:q} --out {output:q} 2>&1 | tee {log:q}"
