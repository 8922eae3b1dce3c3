"""Write the schemas' engine lists from the registry (`python -m offload_study.engines.schema_sync`).

The schemas stay the single source of keys and docs for every stage (jsonschema validates
against them, the configuration reference is generated from them); the engines named there are
the registry's, written here and kept in step by a test (tests/test_engines.py).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

from offload_study import engines

#: run from the checkout's root, as readme_sync is
SCHEMAS = Path("workflow/offload_study/schemas")
#: the study schema's ``engine`` key: its enum line and its description, up to the next key
STUDY_ENGINE = re.compile(
    r"(?P<head>\n(?P<indent> +)engine:\n)(?P=indent)  enum: \[[^\]]*\]\n"
    r"(?P<default>(?P=indent)  default: \S+\n)(?P=indent)  description: >-\n"
    r"(?:(?P=indent)    .*\n)+"
)
#: the recommend grid's ``engine`` key: the engines a search may try
GRID_ENGINE = re.compile(
    r'(\n +engine:\n +type: \[array, "null"\]\n +items: \{enum: \[)[^\]]*(\]\})'
)
#: the JSON records that name the engine that trained: (file, property)
RECORD_SCHEMAS = ("metrics.schema.json", "provenance.schema.json")


def engine_description() -> str:
    """The study schema's description of ``engine``: one line per engine, from its summary
    and offload paths."""
    lines = ["The training engine:"]
    for engine in engines.engines():
        paths = "; ".join(f"{p.devices[0]}/{p.devices[1]}: {p.label}" for p in engine.paths)
        lines.append(
            f"{engine.name} ({engine.label}): {engine.summary}. Offload paths "
            f"(offload_optimizer/offload_param): {paths}."
        )
    return " ".join(lines)


def synced_study(text: str) -> str:
    names = ", ".join(engines.names())

    def block(m: re.Match) -> str:
        indent = m["indent"]
        body = textwrap.fill(
            engine_description(),
            width=100 - len(indent) - 4,
            initial_indent=indent + "    ",
            subsequent_indent=indent + "    ",
            break_on_hyphens=False,
        )
        return (
            f"{m['head']}{indent}  enum: [{names}]\n{m['default']}{indent}  description: >-\n"
            f"{body}\n"
        )

    synced, found = STUDY_ENGINE.subn(block, text)
    synced, in_grid = GRID_ENGINE.subn(lambda m: f"{m[1]}{names}{m[2]}", synced)
    if (found, in_grid) != (1, 1):
        raise RuntimeError(
            "study.schema.yaml: the scenario key engine or the recommend grid's was not found once"
        )
    return synced


def synced_record(text: str) -> str:
    schema = json.loads(text)
    schema["properties"]["engine"]["enum"] = list(engines.names())
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def synced() -> dict[Path, tuple[str, str]]:
    """Each schema file -> (its text now, its text with the registry's engines)."""
    files = {SCHEMAS / "study.schema.yaml": synced_study}
    files.update({SCHEMAS / name: synced_record for name in RECORD_SCHEMAS})
    return {path: (path.read_text(), sync(path.read_text())) for path, sync in files.items()}


def main() -> int:
    for path, (now, wanted) in synced().items():
        if now != wanted:
            path.write_text(wanted)
            print(f"rewrote {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
