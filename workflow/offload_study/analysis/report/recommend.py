"""The report's "recommended config" section (``templates/_recommend.html.j2``) and the page
``rule recommend`` writes (``reports/<study>/recommend.html``).

Both render recommend/recommendation.json (:func:`offload_study.prediction.recommend.decide`): the
winner with its measured tokens/s and CI, its margin over the runner-up, its ratio to each
reference ("beyond CI" or "within noise"), why every other candidate lost, the search's device
time. report.html shows the section when recommendation.json lies in the study's results.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape

from offload_study.analysis.report import views
from offload_study.core.contracts import read_json

#: Where recommendation.json lies, relative to the study's results folder (beside plan.json).
RECOMMENDATION = Path("recommend") / "recommendation.json"

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>{{ recommend.study }} on {{ recommend.cluster }}: recommended config</title>
<style>body{font:14px/1.45 sans-serif;max-width:1100px;margin:20px auto;padding:0 20px}
table{border-collapse:collapse;width:100%}th,td{border-bottom:1px solid #d9dee7;padding:5px 8px;
text-align:left;vertical-align:top}.num{text-align:right}.small{font-size:12px;color:#5b6475}
.note{color:#b26a00}.noise{color:#5b6475;font-style:italic}</style></head>
<body><h1>{{ recommend.study }} on {{ recommend.cluster }}</h1>
{% include "_recommend.html.j2" %}</body></html>
"""


def beside(plan_path: str | Path) -> dict | None:
    """recommendation.json of the study whose plan.json is ``plan_path`` (None: no search)."""
    path = Path(plan_path).parent / RECOMMENDATION
    return read_json(path) if path.is_file() else None


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("offload_study", "templates"),
        autoescape=select_autoescape(["html", "j2", "html.j2"], default=True),
    )
    env.filters.update(fmt=views.fmt, pct=views.fmt_pct)
    return env


def write_page(recommendation: dict, out: str | Path) -> None:
    """The standalone recommendation page."""
    html = _environment().from_string(_PAGE).render(recommend=recommendation)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(html, encoding="utf-8")
