"""The published site: a static, self-contained folder built from bundles.

CLI::

    python -m offload_study.across.site --index reports/index.html --site-dir reports/site \
        --reports-root reports [bundles/*.tar.gz]

What it writes (links are relative, so the folder can be served by any web server or opened
from disk; no page loads anything from elsewhere)::

    reports/index.html                  every report and recommend page under
                                        reports/<cluster>/<study>/ (committed ones included),
                                        each with a one-line headline; then studies x
                                        clusters: report pages, bundles, compare pages
    reports/site/bundles/<b>.tar.gz     each bundle as given (every page links to its bundle)
    reports/site/pages/<b>.html         each bundle's report.html (rendered on its cluster), with
                                        a line linking the index and the bundle
    reports/site/compare/<study>.html   each study bundled from two or more clusters

The site folder is built beside its place and moved into place whole; the index is written
last. A report page comes from another cluster, so its copy gets this site's
Content-Security-Policy first thing in the document: whatever the bundle's page holds, it can
run no script and fetch nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from markupsafe import Markup

from offload_study.across import bundle, compare, headlines
from offload_study.analysis.report.html import href
from offload_study.training import placement

CSP = (
    '<meta http-equiv="Content-Security-Policy" '
    "content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">"
)
_DOCTYPE_RE = re.compile(r"\A\s*<!DOCTYPE[^>]*>", re.I)
_BODY_RE = re.compile(r"<body[^>]*>", re.I)


def report_page(html: str, index_href: str, bundle_href: str, bundle_name: str) -> str:
    """A bundle's report.html as a site page: this site's CSP right after the doctype (before
    anything the page holds) and, at the top of the body, links to the index and the bundle."""
    nav = str(
        Markup(
            '<nav style="font:13px sans-serif;padding:6px 28px;background:#eef3fb">'
            '<a href="{}">← all studies and clusters</a> · bundle: <a class="bundle" href="{}">{}</a>'
            "</nav>"
        ).format(index_href, bundle_href, bundle_name)
    )  # escaped once, then plain text
    doctype = _DOCTYPE_RE.match(html)
    head_end = doctype.end() if doctype else 0
    html = html[:head_end] + CSP + html[head_end:]
    body = _BODY_RE.search(html, head_end + len(CSP))
    at = body.end() if body else head_end + len(CSP)
    return html[:at] + nav + html[at:]


@dataclass(frozen=True)
class Layout:
    """Where the site goes (``final``, links are computed there) and where it is built."""

    final: Path
    tmp: Path
    index: Path

    def building(self, path: Path) -> Path:
        """The file being written for the final ``path`` (made with its folder)."""
        out = self.tmp / path.relative_to(self.final)
        out.parent.mkdir(parents=True, exist_ok=True)
        return out


def _publish_bundle(b: bundle.Bundle, side: compare.Side, site: Layout) -> dict:
    """Copy the bundle and its report page into the site; the index's entry for it."""
    copy = site.final / "bundles" / b.path.name
    shutil.copyfile(b.path, site.building(copy))
    entry = {
        "side": side,
        "bundle": b,
        "bundle_file": copy,
        "page": None,
        "size": b.path.stat().st_size,
        "runs": len(side.runs),
        "ok": int((side.runs["outcome"] == "ok").sum()),
    }
    if b.report is not None:
        page = site.final / "pages" / f"{b.name}.html"
        text = b.report.read_text(encoding="utf-8", errors="replace")
        html = report_page(text, href(site.index, page), href(copy, page), b.path.name)
        site.building(page).write_text(html, encoding="utf-8")
        entry["page"] = page
    return entry


def _publish_compare(study: str, entries: list[dict], site: Layout) -> dict:
    page = site.final / "compare" / f"{study}.html"
    view = compare.comparison([e["side"] for e in entries])
    links = {e["bundle"].name: href(e["bundle_file"], page) for e in entries}
    html = compare.render(view, links, href(site.index, page))
    site.building(page).write_text(html, encoding="utf-8")
    return {"study": study, "page": page, "verdicts": view["verdicts"]}


def _sides(bundles: list[bundle.Bundle]) -> list[compare.Side]:
    """Each bundle's side; labels unique within each study (they share a compare page)."""
    labels = {}
    for study in {b.manifest.study for b in bundles}:
        group = [b for b in bundles if b.manifest.study == study]
        labels.update(zip(map(id, group), compare.side_labels(group), strict=True))
    return [compare.load_side(b, labels[id(b)], seed=1000 * i) for i, b in enumerate(bundles)]


def build(
    paths: Sequence[str | Path],
    index: str | Path,
    site_dir: str | Path,
    reports_root: str | Path | None = None,
) -> dict:
    """Build the site from the bundles and the pages under reports_root; returns what the
    index shows."""
    names = [Path(p).name for p in paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bundle.BundleError(f"two bundles are named {twice[0]}: a site needs unique names")
    final, index = Path(site_dir).resolve(), Path(index).resolve()
    site = Layout(final, final.with_name(f"{final.name}.tmp-{os.getpid()}"), index)
    shutil.rmtree(site.tmp, ignore_errors=True)
    site.tmp.mkdir(parents=True)
    with bundle.opened(paths) as bundles:
        sides = _sides(bundles)
        entries = [_publish_bundle(b, s, site) for b, s in zip(bundles, sides, strict=True)]
        groups: dict[str, list[dict]] = {}
        for e in entries:
            groups.setdefault(e["bundle"].manifest.study, []).append(e)
        compares = {s: _publish_compare(s, g, site) for s, g in groups.items() if len(g) >= 2}
        view = _index_view(groups, compares, index)
        view["pages"] = headlines.local_pages(reports_root, index) if reports_root else []
        html = compare.html_environment().get_template("site_index.html.j2").render(**view)
    placement.move_into_place(site.tmp, final)
    tmp_index = index.with_name(f"{index.name}.tmp-{os.getpid()}")
    tmp_index.write_text(html, encoding="utf-8")
    os.replace(tmp_index, index)
    return view


def _index_view(groups: dict[str, list[dict]], compares: dict, index: Path) -> dict:
    """Per study: its bundles with their links from the index, its compare page and verdicts."""
    studies = []
    for study, entries in groups.items():
        rows = [
            {
                **e,
                "page_href": e["page"] and href(e["page"], index),
                "bundle_href": href(e["bundle_file"], index),
            }
            for e in entries
        ]
        cmp = compares.get(study)
        studies.append(
            {
                "study": study,
                "rows": rows,
                "compare_href": cmp and href(cmp["page"], index),
                "verdicts": cmp["verdicts"] if cmp else [],
            }
        )
    return {"studies": studies, "generated": compare.generated()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.across.site",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--index", required=True, help="the index page (reports/index.html)")
    ap.add_argument("--site-dir", required=True, help="folder of the site's pages and bundles")
    ap.add_argument(
        "--reports-root",
        help="index every report and recommend page under it "
        "(reports/<cluster>/<study>/{report,recommend}.html)",
    )
    ap.add_argument("bundles", nargs="*", help="bundles (.tar.gz) to publish")
    a = ap.parse_args(argv)
    try:
        view = build(a.bundles, a.index, a.site_dir, a.reports_root)
    except bundle.BundleError as e:
        print(f"site: {e}")
        return 1
    n_pages = sum(1 for s in view["studies"] for r in s["rows"] if r["page"])
    n_compare = sum(1 for s in view["studies"] if s["compare_href"])
    print(
        f"site: wrote {a.index} and {a.site_dir}: {len(view['pages'])} pages indexed, "
        f"{len(a.bundles)} bundles, {n_pages} bundle report pages, {n_compare} compare pages"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
