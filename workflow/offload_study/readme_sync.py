"""Rewrite the generated parts of config/README.md from the schemas
(`python -m offload_study.readme_sync`, from the checkout's root)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from offload_study import schemadoc

SECTIONS = ("study", "cluster", "metrics")
#: The configuration reference, beside the files it documents (as the Snakemake workflow
#: catalog keeps it); relative to the checkout's root.
REFERENCE = Path("config/README.md")


def synced(text: str) -> str:
    for name in SECTIONS:
        pattern = re.compile(
            rf"(<!-- BEGIN {name} reference[^>]*-->\n).*?(<!-- END {name} reference -->)", re.S
        )
        text = pattern.sub(
            lambda m, n=name: m.group(1) + schemadoc.render(n) + "\n" + m.group(2), text
        )
    return text


def main() -> int:
    REFERENCE.write_text(synced(REFERENCE.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
