localrules:
    publish,


# Every bundle in bundles/ (other clusters' copied there) plus this study's own (rule bundle).
PUBLISHED_BUNDLES = sorted(
    {*(str(p) for p in Path("bundles").glob("*.tar.gz")), BUNDLE}
)


# Every report and recommend page already under reports/<cluster>/<study>/ (committed ones
# included; across.headlines): the index links each. Inputs, so that a newer page makes publish
# run again; this study's own pages come through its bundle (never a reason to rerun its runs).
PUBLISHED_PAGES = sorted(
    str(p)
    for name in ("report.html", "recommend.html")
    for p in Path(layout.REPORTS_ROOT).glob(f"*/*/{name}")
    if p.parts[1] not in ("site", "compare") and str(p.parent) != REPORT_DIR
)


rule publish:
    """Static, self-contained site: reports/index.html (every report and recommend page under
    reports/<cluster>/<study>/ with its headline), a page per bundle and a comparison per study
    measured on several clusters; every bundle's page links to its bundle.
    """
    input:
        bundles=PUBLISHED_BUNDLES,
        pages=PUBLISHED_PAGES,
    output:
        index="reports/index.html",
        site=directory("reports/site"),
    log:
        "logs/publish.log",
    conda:
        "../../envs/analysis.yaml"
    params:
        reports=lambda wc, output: os.path.dirname(output.index),  # reports/, beside the index
    shell:
        "python -m offload_study.across.site --index {output.index:q} --site-dir {output.site:q}"
        " --reports-root {params.reports:q} {input.bundles:q} > {log:q} 2>&1"
