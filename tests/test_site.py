"""The published site built from the real bundles of conftest's cross_cluster, and the four
new rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import chromium, page_requests
from builders import XC_STUDY as STUDY
from conftest import REPO as REPO_ROOT
from conftest import with_clusters

from offload_study.across import bundle, headlines, site
from offload_study.core import contracts

pytestmark = pytest.mark.slow
RULES = ["common", "plan", "train", "collect", "report", "bundle", "compare", "check", "publish"]


@pytest.fixture(scope="module")
def published(cross_cluster, tmp_path_factory):  # noqa: F811 - the imported fixture
    """(index, site folder) of the site of both bundles, built by the CLI."""
    reports = tmp_path_factory.mktemp("published") / "reports"
    index, folder = reports / "index.html", reports / "site"
    args = ["--index", str(index), "--site-dir", str(folder)]
    assert site.main([*args, *map(str, cross_cluster.bundles.values())]) == 0
    return index, folder


def hrefs(page: Path, css_class: str | None = None) -> list[Path]:
    """The files a page's links point to (all relative: a static site; anchors and data: URIs
    stay on the page)."""
    pattern = (
        r'<a [^>]*href="([^"]+)"' if css_class is None else rf'class="{css_class}" href="([^"]+)"'
    )
    found = [h for h in re.findall(pattern, page.read_text()) if not h.startswith(("#", "data:"))]
    assert not [h for h in found if re.match(r"[a-z]+:", h)], "a link leaves the site"
    return [
        (page.parent / h.partition("#")[0]).resolve() for h in found
    ]  # the file, not its anchor


def test_site_holds_index_report_pages_compare_page_and_bundles(published, cross_cluster):  # noqa: F811
    index, folder = published
    pages = sorted(folder.glob("pages/*.html"))
    assert [p.name for p in pages] == [f"{STUDY}--cpu-a.html", f"{STUDY}--cpu-b.html"]
    assert (folder / "compare" / f"{STUDY}.html").is_file()
    for cluster, path in cross_cluster.bundles.items():
        copy = folder / "bundles" / path.name
        assert contracts.sha256_file(copy) == contracts.sha256_file(path), cluster
    every = [index, folder / "compare" / f"{STUDY}.html", *pages]
    for page in every:
        assert all(target.is_file() for target in hrefs(page)), page
    assert sorted(hrefs(index, "bundle")) == sorted(folder.glob("bundles/*.tar.gz"))
    assert sorted(hrefs(index, "page")) == pages
    assert hrefs(index, "compare") == [folder / "compare" / f"{STUDY}.html"]


def test_every_page_links_back_to_its_bundle(published):
    index, folder = published
    for page in folder.glob("pages/*.html"):
        assert hrefs(page, "bundle") == [folder / "bundles" / f"{page.stem}{bundle.SUFFIX}"]
        assert index in hrefs(page)
    compare_page = folder / "compare" / f"{STUDY}.html"
    assert sorted(hrefs(compare_page, "bundle")) == sorted(folder.glob("bundles/*.tar.gz"))
    assert index in hrefs(compare_page)


def test_report_page_gets_the_sites_csp_before_anything_else(published):
    _, folder = published
    text = (folder / "pages" / f"{STUDY}--cpu-a.html").read_text()
    assert text.startswith(f"<!DOCTYPE html>{site.CSP}")
    assert "offload study" in text and "cpu-a" in text


def test_rebuilding_replaces_the_site_whole(published, cross_cluster):  # noqa: F811
    index, folder = published
    stale = folder / "pages" / "stale.html"
    stale.write_text("old")
    args = ["--index", str(index), "--site-dir", str(folder), str(cross_cluster.bundles["cpu-a"])]
    assert site.main(args) == 0
    assert not stale.exists() and not (folder / "compare").exists()  # one cluster: no comparison
    assert not list(folder.parent.glob("*.tmp-*"))
    assert site.main([*args[:-1], *map(str, cross_cluster.bundles.values())]) == 0


@pytest.mark.browser
def test_site_opens_in_chromium_and_no_request_leaves_it(published, tmp_path):
    index, folder = published
    dom, reqs = chromium(tmp_path, index.as_uri(), "--dump-dom")
    assert page_requests(reqs) == []
    assert "Compare the clusters" in dom and f"{STUDY}--cpu-b.tar.gz" in dom
    dom, reqs = chromium(tmp_path, (folder / "compare" / f"{STUDY}.html").as_uri(), "--dump-dom")
    assert page_requests(reqs) == []
    assert 'id="scenario-table"' in dom and "cores granted" in dom
    for page in folder.glob("pages/*.html"):
        dom, reqs = chromium(tmp_path, page.as_uri(), "--dump-dom")
        assert page_requests(reqs) == [] and 'id="headline-table"' in dom


@pytest.mark.browser
def test_a_bundles_report_page_can_neither_fetch_nor_run_script(cross_cluster, tmp_path):  # noqa: F811
    """A bundle from elsewhere may carry any report.html: the site's copy is held by its CSP."""
    evil = tmp_path / "report.html"
    evil.write_text(
        '<!DOCTYPE html><html><head><script>document.title = "ran"</script></head><body>'
        '<img src="http://127.0.0.1:9/x.png"><p>evil</p></body></html>'
    )
    dom, reqs = chromium(tmp_path, evil.as_uri(), "--dump-dom")  # control: as it came
    assert "<title>ran</title>" in dom and page_requests(reqs)
    made = tmp_path / "bundles" / "evil.tar.gz"
    bundle.create(cross_cluster.root, "cpu-a", STUDY, made, report=evil)
    index = tmp_path / "reports" / "index.html"
    site.build([made], index, tmp_path / "reports" / "site")
    page = tmp_path / "reports" / "site" / "pages" / "evil.html"
    dom, reqs = chromium(tmp_path, page.as_uri(), "--dump-dom")
    assert page_requests(reqs) == [] and "<title>ran</title>" not in dom and "evil" in dom


# --------------------------------------------------------------------------- the rules
def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(workdir / "Snakefile"),
        "--directory",
        str(workdir),
        "-n",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_rules_plan_bundle_check_publish_and_compare(cross_cluster, tmp_path):  # noqa: F811
    """A Snakefile of the workflow's rules plus the four new ones, dry-run in a scratch tree."""
    includes = "\n".join(f'include: "{REPO_ROOT}/workflow/rules/{r}.smk"' for r in RULES)
    (tmp_path / "Snakefile").write_text(
        f'configfile: "{REPO_ROOT}/config/config.yaml"\n'
        'STUDY_SOURCE = "the default study"\n\n' + includes + "\n"
    )
    with_clusters(tmp_path)
    (tmp_path / "bundles").mkdir()
    for path in cross_cluster.bundles.values():
        shutil.copy(path, tmp_path / "bundles")
    a, b = (f"bundles/{p.name}" for p in cross_cluster.bundles.values())
    res = snakemake(
        tmp_path, "bundle", "check", "publish", "compare", "--config", f"compare=[{a}, {b}]"
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    for job in ("bundle", "check", "publish", "compare", "report", "collect"):
        assert re.search(rf"^{job}\s+1$", out, re.M), job
    assert "bundles/default-cpu--local-cpu.tar.gz" in out
    assert f"reports/compare/{STUDY}--cpu-a__vs__{STUDY}--cpu-b.html" in out
    assert "results/local-cpu/default-cpu/check.json" in out
    res = snakemake(tmp_path, "compare")
    assert res.returncode != 0
    assert "compare: give two or more bundles" in res.stdout + res.stderr


# --------------------------------------------------------------------------- the landing page
REC_STUDY, REC_CLUSTER = "rec-study", "other-cluster"


def landing_tree(root: Path) -> Path:
    """A working directory like the repository's: a study measured here (results/, seed-like
    records, its report page), a committed recommend page whose records lie under docs/results/
    beside a superseded copy, and a page whose records are gone. Returns reports/."""
    from builders import CLUSTER, STUDY, make_plan, run_collect_cli, seed_like_records

    study_dir = root / "results" / CLUSTER / STUDY
    paths = seed_like_records(root)
    assert run_collect_cli(paths, study_dir) == 0
    plan = json.loads(make_plan(root, paths).read_text())
    plan.update(model={"preset": "llama2-7b"}, model_params=6_738_415_616, purpose="method")
    (study_dir / "plan.json").write_text(json.dumps(plan))
    for folder, winner in (("rec", "rec-opt__mb-8"), ("rec-superseded", "rec-old")):
        records = root / "docs" / "results" / REC_CLUSTER / folder
        (records / "recommend").mkdir(parents=True)
        (records / "plan.json").write_text(
            json.dumps(
                {
                    "study": REC_STUDY,
                    "cluster": REC_CLUSTER,
                    "model": {"config": {"model_type": "llama"}},
                    "model_params": 1_345_423_360,
                }
            )
        )
        (records / "recommend" / "recommendation.json").write_text(
            json.dumps({"winner": winner, "tokens_per_s": 19864.2, "gpu_mem_gb": 16})
        )
    reports = root / "reports"
    for page in (
        f"{CLUSTER}/{STUDY}/report.html",
        f"{REC_CLUSTER}/{REC_STUDY}/recommend.html",
        "lost/gone/report.html",
        "site/pages/report.html",
    ):
        (reports / page).parent.mkdir(parents=True, exist_ok=True)
        (reports / page).write_text("<!DOCTYPE html><html><body><p>a page</p></body></html>")
    (reports / CLUSTER / STUDY / "report.html").write_text(
        '<!DOCTYPE html><html><head><meta name="rendered" content="2026-01-02 03:04 UTC">'
        "</head><body><p>a page</p></body></html>"
    )
    return reports


def headline_rows(index: Path) -> dict[str, str]:
    """{page link: its headline's text} of the index's pages table."""
    text = index.read_text()
    rows = re.findall(
        r'<a class="(?:report|recommend)" href="([^"]+)">.*?<td class="headline">'
        r"(.*?)</td>",
        text,
        re.S,
    )
    return {href: " ".join(re.sub(r"<[^>]+>", "", h).split()) for href, h in rows}


def test_the_index_links_every_page_under_reports_with_its_headline(tmp_path, monkeypatch):
    from builders import CLUSTER, STUDY

    reports = landing_tree(tmp_path)
    monkeypatch.chdir(tmp_path)  # records are found relative to the working directory
    index = reports / "index.html"
    args = ["--index", str(index), "--site-dir", str(reports / "site"), "--reports-root", "reports"]
    assert site.main(args) == 0  # no bundle: the committed pages alone
    pages = sorted(p for p in reports.glob("*/*/*.html") if p.parts[-3] != "site")
    assert sorted(hrefs(index, "report") + hrefs(index, "recommend")) == pages
    rows = headline_rows(index)
    mine = rows[f"{CLUSTER}/{STUDY}/report.html"]
    assert mine.startswith(f"{CLUSTER} · llama2-7b (6.74B params) · seed 100%: "), mine
    assert mine.count("%: ") == 3  # one verdict per seed row (100 %, ~35 %, ~20 %)
    rec = rows[f"{REC_CLUSTER}/{REC_STUDY}/recommend.html"]
    assert rec == (
        f"{REC_CLUSTER} · Llama 1.35B · winner CPU optimizer offload; micro-batch 8: "
        "19,900 tokens/s within 16 GiB per GPU"
    ), rec  # not the superseded
    assert rows["lost/gone/report.html"].startswith("lost · no records found")
    # a method study sits in its own section, below; each line says when its page was rendered
    text = index.read_text()
    method = text[text.index('id="method-table"') :]
    assert f"{CLUSTER}/{STUDY}/report.html" in method and "2026-01-02 03:04 UTC" in method
    assert f"{REC_CLUSTER}/{REC_STUDY}/recommend.html" not in method
    assert (
        text.index('id="pages-table"') < text.index('id="method-table"') < text.index('id="legend"')
    )


def test_without_a_seed_table_the_headline_is_the_fastest_against_the_baseline(tmp_path):
    from builders import CLUSTER, STUDY, make_plan, make_record, run_collect_cli

    from offload_study.analysis import collect
    from offload_study.analysis.report import views

    paths = [
        make_record(tmp_path, "base", tokens_per_s=1000, seed=1),
        make_record(tmp_path, "offload", tokens_per_s=500, offload_optimizer="cpu", seed=2),
    ]
    study_dir = tmp_path / "results" / CLUSTER / STUDY
    assert run_collect_cli(paths, study_dir, baseline="base") == 0
    plan = json.loads(make_plan(tmp_path, paths).read_text())
    summary = collect.read_table(study_dir / "summary.csv")
    scenarios = views.scenario_views(summary, plan, "base")
    line = headlines.fastest_line(scenarios)
    # every other scenario slower than the baseline: the baseline leads, the runner-up follows
    assert re.match(
        r"fastest: the baseline, \S.* \(1,000 .*tokens/s\); next: ZeRO-3 offload, 50", line
    )
    assert line.endswith("of its speed (slower)")
    doubled = {"relative_speed": 2.0, "relative_speed_ci_low": 1.8, "relative_speed_ci_high": 2.2}
    faster = [v if v["is_baseline"] else {**v, **doubled} for v in scenarios]
    assert headlines.fastest_line(faster).endswith("200% [180%–220%] of baseline speed (faster)")
    alone = headlines.fastest_line([v for v in scenarios if v["is_baseline"]])
    assert alone.endswith("tokens/s; nothing else measured beside it")


@pytest.mark.browser
def test_the_landing_page_opens_in_chromium_and_no_request_leaves_it(tmp_path, monkeypatch):
    reports = landing_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    index = reports / "index.html"
    site.build([], index, reports / "site", "reports")
    dom, reqs = chromium(tmp_path, index.as_uri(), "--dump-dom")
    assert page_requests(reqs) == []
    assert 'id="pages-table"' in dom and "winner CPU optimizer offload; micro-batch 8" in dom


def test_a_studys_second_run_committed_under_its_own_name_is_found_by_that_name():
    """A search run twice is committed twice (docs/results/<cluster>/<name>, the same study in
    both plans): the page named as the second folder is read from it, the study's own name
    from the first."""
    cluster = "h100-1gpu"
    again = headlines.records_of(cluster, "recommend-h100-model-h-12g-again", REPO_ROOT, True)
    first = headlines.records_of(cluster, "recommend-h100-model-h-12g", REPO_ROOT, True)
    assert again == REPO_ROOT / "docs/results" / cluster / "recommend-h100-model-h-12g-again"
    assert first == REPO_ROOT / "docs/results" / cluster / "recommend-h100-model-h-12g"
    assert headlines.records_of(cluster, "no-such-study", REPO_ROOT, True) is None
