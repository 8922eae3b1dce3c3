"""Load and validate a study config and its cluster description.

The schemas in the package (offload_study/schemas/, read with importlib.resources through
:func:`load_schema`, so an installed package finds them too) are the one source of truth for
keys, types and defaults; this module turns jsonschema's errors into one message that names the key path
(``scenarios[2].offload_optimizer``) and the allowed values.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_DIR = REPO_ROOT / "config" / "clusters"


class StudyError(ValueError):
    """A study or cluster description that cannot run; the message names the key and file."""


def load_schema(name: str) -> dict:
    """The package's schema ``name`` (study, cluster, metrics, provenance): the one way to read one.

    Returns a fresh copy (callers may fill defaults into what they get).
    """
    return copy.deepcopy(_parsed_schema(name))


@functools.cache
def _parsed_schema(name: str) -> dict:
    folder = resources.files("offload_study") / "schemas"
    for suffix, parse in ((".schema.json", json.loads), (".schema.yaml", yaml.safe_load)):
        path = folder / f"{name}{suffix}"
        if path.is_file():
            return parse(path.read_text())
    raise FileNotFoundError(f"offload_study/schemas/{name}.schema.json|yaml: no such schema")


def key_path(parts) -> str:
    """['scenarios', 2, 'offload_optimizer'] -> 'scenarios[2].offload_optimizer'."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<top level>"


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        ref = schema["$ref"]
        node = root
        for part in ref.lstrip("#/").split("/"):
            node = node[part]
        schema = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _describe_error(err: jsonschema.ValidationError, root: dict) -> str:
    path = list(err.absolute_path)
    schema = _resolve(err.schema, root) if isinstance(err.schema, dict) else {}
    if err.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed)) if isinstance(err.instance, dict) else []
        where = key_path(path + extra[:1])
        return f"{where}: unknown key; allowed keys here: {', '.join(allowed)}"
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else err.message
        return f"{key_path(path + [missing])}: required key is missing"
    if err.validator == "enum":
        allowed = ", ".join(repr(v) for v in err.validator_value)
        return f"{key_path(path)}: {err.instance!r} is not allowed; allowed values: {allowed}"
    if err.validator == "oneOf" and path == ["model"]:
        return "model: give exactly one of preset, config or name_or_path"
    if err.validator in ("minimum", "exclusiveMinimum"):
        bound = ">=" if err.validator == "minimum" else ">"
        return f"{key_path(path)}: {err.instance!r} is too small; must be {bound} {err.validator_value}"
    if err.validator == "type":
        expected = err.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        return f"{key_path(path)}: {err.instance!r} has the wrong type; expected {expected}"
    if err.validator in ("pattern", "not") or (
        err.validator == "propertyNames" or "pattern" in str(err.validator)
    ):
        return (
            f"{key_path(path)}: {err.instance!r} is not a valid name; use letters, digits, "
            "'.', '_' and '-' only (no path separators, spaces or shell characters, not '..')"
        )
    return f"{key_path(path)}: {err.message}"


def validate(instance: dict, schema_name: str, source: str) -> dict:
    """Validate against a schema; return a copy with schema defaults filled in."""
    schema = load_schema(schema_name)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: (len(e.absolute_path), e.path))
    if errors:
        err = jsonschema.exceptions.best_match(errors)
        # best_match prefers shallow errors; an unknown/missing key deeper down is more useful.
        deep = [e for e in errors if e.validator in ("additionalProperties", "required", "enum")]
        if err.validator in ("oneOf", "anyOf") and deep and list(err.absolute_path) != ["model"]:
            err = deep[0]
        raise StudyError(f"{source}: {_describe_error(err, schema)}")
    return fill_defaults(copy.deepcopy(instance), schema, schema)


def fill_defaults(instance: Any, schema: dict, root: dict) -> Any:
    schema = _resolve(schema, root)
    if isinstance(instance, dict):
        for key, sub in schema.get("properties", {}).items():
            sub = _resolve(sub, root)
            if key not in instance and "default" in sub:
                instance[key] = copy.deepcopy(sub["default"])
            if key in instance:
                instance[key] = fill_defaults(instance[key], sub, root)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        instance = [fill_defaults(item, schema["items"], root) for item in instance]
    return instance


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"{path}: file not found")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise StudyError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise StudyError(f"{path}: expected a mapping of keys at the top level")
    return data


def load_cluster(name: str, cluster_dir: str | Path = CLUSTER_DIR) -> dict:
    path = Path(cluster_dir) / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in Path(cluster_dir).glob("*.yaml"))
        raise StudyError(
            f"cluster: no cluster description {path} for cluster {name!r}; known: {', '.join(known)}"
        )
    cluster = validate(read_yaml(path), "cluster", str(path))
    if cluster["name"] != name:
        raise StudyError(f"{path}: name: {cluster['name']!r} must equal the file name {name!r}")
    return cluster


def load_study(config: dict | str | Path, source: str | None = None) -> dict:
    """A validated study with defaults filled in (``config`` is a dict or a YAML path)."""
    if not isinstance(config, dict):
        source = source or str(config)
        config = read_yaml(config)
    return validate(config, "study", source or "study config")
