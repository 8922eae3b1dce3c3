"""Self-contained comparative HTML report of one study on one cluster.

Three parts, one responsibility each: :mod:`.views` (summary + plan -> what the report shows),
:mod:`.figures` (one function per plot) and :mod:`.render` (jinja2 template and the CLI,
``python -m offload_study.analysis.report``).
"""

from offload_study.analysis.report.render import main, render

__all__ = ["main", "render"]
