"""Render the configuration reference (config/README.md) from the JSON schemas: one source of
truth."""

from __future__ import annotations

import json
import sys

from offload_study.core.study import _resolve, load_schema


def _type_of(schema: dict) -> str:
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "object" if "properties" in schema else "any")
    return " \\| ".join(kind) if isinstance(kind, list) else kind


def _rows(schema: dict, root: dict, prefix: str, required: set[str]):
    for key, sub in schema.get("properties", {}).items():
        sub = _resolve(sub, root)
        path = f"{prefix}{key}"
        if key in required:
            default = "**required**"
        elif "default" in sub:
            default = f"`{json.dumps(sub['default'])}`"
        else:
            default = "—"
        text = " ".join(str(sub.get("description", "")).split())
        yield f"| `{path}` | {_type_of(sub)} | {default} | {text} |"
        nested = sub.get("items", sub) if sub.get("type") == "array" else sub
        nested = _resolve(nested, root)
        if "properties" in nested and key not in ("reference",):
            suffix = "[]." if sub.get("type") == "array" else "."
            yield from _rows(nested, root, path + suffix, set(nested.get("required", [])))


def render(name: str) -> str:
    schema = load_schema(name)
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += _rows(schema, schema, "", set(schema.get("required", [])))
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(sys.argv[1] if len(sys.argv) > 1 else "study"))
