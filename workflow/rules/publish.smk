localrules:
    publish,


# Every bundle in bundles/ (other clusters' copied there) plus this study's own (rule bundle).
PUBLISHED_BUNDLES = sorted(
    {*(str(p) for p in Path("bundles").glob("*.tar.gz")), BUNDLE}
)


rule publish:
    """Static, self-contained site: reports/index.html, a page per study x cluster and a
    comparison per study measured on several clusters; every page links to its bundle.
    """
    input:
        PUBLISHED_BUNDLES,
    output:
        index="reports/index.html",
        site=directory("reports/site"),
    log:
        "logs/publish.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "python -m offload_study.across.site --index {output.index:q} --site-dir {output.site:q} {input:q}"
        " > {log:q} 2>&1"
