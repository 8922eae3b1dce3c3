"""The one rule for the CSV tables a person opens (runs.csv, summary.csv, plan.csv, steps.csv):
a text cell that a spreadsheet would run as a formula is written as text.

Records come from other clusters (bundles), and a scenario label, a host name or an error
excerpt may begin with ``=``, ``+``, ``-`` or ``@``, or with a tab, carriage return or line feed
(which some spreadsheets drop before they look): opened in Excel or LibreOffice such a cell is
a formula (``=HYPERLINK(...)``, ``=cmd|' /c calc'!A1``). OWASP's rule for CSV injection: such a
cell begins with a single quote. Numbers stay numbers: a number written as a number, or a text
cell that is exactly a number ("-1.5", "-inf"), is no formula. A text cell that begins with a
quote gets one more, so that :func:`read_cell` gives back exactly what was written (a scenario
name may begin with '-' and must read back as itself).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported where frames are written: the harness writes rows only
    import pandas as pd

#: First characters that make a spreadsheet read a cell as a formula (OWASP, CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n")
QUOTE = "'"
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|infinity|nan)", re.I)


def cell(value: Any) -> Any:
    """``value`` as it is written into a CSV: a text cell that could be a formula quoted."""
    if not isinstance(value, str):
        return value
    if value.startswith(QUOTE) or (
        value.startswith(FORMULA_STARTS) and not _NUMBER.fullmatch(value)
    ):
        return QUOTE + value
    return value


def read_cell(value: Any) -> Any:
    """A cell as it was before :func:`cell` (the inverse: one leading quote removed)."""
    return value[1:] if isinstance(value, str) and value.startswith(QUOTE) else value


def row(values: Iterable[Any]) -> list:
    """A row for ``csv.writer.writerow``, each cell through :func:`cell`."""
    return [cell(v) for v in values]


def _text_columns(frame: pd.DataFrame) -> list:
    import pandas as pd

    return [c for c in frame.columns if not pd.api.types.is_numeric_dtype(frame[c].dtype)]


def write_frame(frame: pd.DataFrame, path: str | Path) -> None:
    """``frame`` as a CSV (no index), its text cells through :func:`cell`."""
    safe = frame.copy()
    for column in _text_columns(safe):
        safe[column] = safe[column].map(cell, na_action="ignore")
    safe.columns = [cell(str(c)) for c in safe.columns]
    safe.to_csv(path, index=False, quoting=csv.QUOTE_MINIMAL)


def read_frame(path: str | Path) -> pd.DataFrame:
    """A CSV written by :func:`write_frame`, its text cells as they were."""
    import pandas as pd

    frame = pd.read_csv(path)
    for column in _text_columns(frame):
        frame[column] = frame[column].map(read_cell, na_action="ignore")
    frame.columns = [read_cell(c) for c in frame.columns]
    return frame
