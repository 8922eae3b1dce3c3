"""What every page of the workflow shares (report, recommend, compare, site index): the one jinja2
environment and the one way a page links to a file.

Pages show what other clusters measured and named (bundles are untrusted): scenario names and
labels, hosts, error excerpts. So every template, file or string, is autoescaped, and no
template or module marks such text safe (``|safe``, ``Markup``). A link is made here only
(:func:`href`): a file name that comes from elsewhere can become no scheme (``javascript:``),
query or fragment. And every page carries a Content-Security-Policy that lets it run no script
and fetch nothing (templates/*.html.j2), a second wall behind the escaping.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape

from offload_study.analysis.report import views
from offload_study.core import verdict


def environment() -> Environment:
    """The templates of the package, autoescaped (string templates too), with the number
    filters and the two ways a page writes a number with its CI (``ratio``, ``ci``)."""
    env = Environment(
        loader=PackageLoader("offload_study", "templates"),
        autoescape=select_autoescape(["html", "j2", "html.j2"], default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        fmt=views.fmt,
        pct=views.fmt_pct,
        bytes=views.fmt_bytes,
        sig=views.fmt_sig,
        signed_pct=views.fmt_signed_pct,
        plain=views.plain,
    )
    env.globals.update(ratio=verdict.ratio_text, ci=views.fmt_ci)
    return env


def href(target: str | Path, page: str | Path) -> str:
    """The link from ``page`` to the file ``target`` (both paths of this machine): relative and
    percent-encoded, so that a name like ``javascript:x.tar.gz`` stays a file name."""
    rel = os.path.relpath(Path(target).resolve(), Path(page).resolve().parent)
    return urllib.parse.quote(Path(rel).as_posix())
