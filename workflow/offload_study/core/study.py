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
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from offload_study.core import yamlsafe
from offload_study.core.layout import CLUSTER_DIR  # relative: from the workflow's working dir


class StudyError(ValueError):
    """A study or cluster description that cannot run; the message names the key and file."""

    def __str__(self) -> str:
        # however it is printed (terminal, log, WorkflowError), never megabytes of text
        return yamlsafe.cap_text(super().__str__())


def load_schema(name: str) -> dict:
    """The package's schema ``name`` (study, cluster, metrics, provenance): the one way to read one.

    Returns a fresh copy (callers may fill defaults into what they get).
    """
    return copy.deepcopy(_parsed_schema(name))


#: libyaml's safe loader where PyYAML has it: the same documents, ~6x faster than the pure-Python
#: one (the study schema is parsed while Snakemake parses the workflow, in every job too)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _yaml(text: str):
    return yaml.load(text, Loader=_SAFE_LOADER)


@functools.cache
def _parsed_schema(name: str) -> dict:
    folder = resources.files("offload_study") / "schemas"
    for suffix, parse in ((".schema.json", json.loads), (".schema.yaml", _yaml)):
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


#: How much of a given value an error message repeats (a 10 MB list must not become the message).
SHOWN_CHARS = 120


def shown(value: Any) -> str:
    """repr of a given value for an error message, cut to SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} chars)"


def _is_integer(_checker, value) -> bool:
    # jsonschema's "integer" accepts 2048.0 and its "number" accepts True: a count must be
    # written as a whole number, a boolean is not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(_checker, value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _full_pattern(validator, pattern, instance, schema):
    """The pattern keyword as a full match: re.search would let '^name$' match 'name' + newline."""
    if isinstance(instance, str) and not re.fullmatch(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


StrictValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    validators={"pattern": _full_pattern},
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _is_integer, "number": _is_number}
    ),
)


def non_finite_key(instance: Any, path: tuple = ()) -> tuple | None:
    """Key path of the first NaN or infinite number anywhere in ``instance`` (None if none)."""
    if isinstance(instance, float) and not math.isfinite(instance):
        return path
    if isinstance(instance, dict):
        children = instance.items()
    else:
        children = enumerate(instance) if isinstance(instance, list) else ()
    for key, value in children:
        found = non_finite_key(value, (*path, key))
        if found is not None:
            return found
    return None


_BOUND_WORDS = {
    "minimum": ("too small", ">="),
    "exclusiveMinimum": ("too small", ">"),
    "maximum": ("too large", "<="),
    "exclusiveMaximum": ("too large", "<"),
}


_SIZE_WORDS = {
    "minLength": ("too short", "at least"),
    "minItems": ("too short", "at least"),
    "minProperties": ("too short", "at least"),
    "maxLength": ("too long", "at most"),
    "maxItems": ("too long", "at most"),
}


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
        return f"{key_path(path)}: {shown(err.instance)} is not allowed; allowed values: {allowed}"
    if err.validator == "oneOf" and path == ["model"]:
        return "model: give exactly one of preset, config or name_or_path"
    if err.validator in _BOUND_WORDS:
        words, bound = _BOUND_WORDS[err.validator]
        return f"{key_path(path)}: {shown(err.instance)} is {words}; must be {bound} {err.validator_value}"
    if err.validator == "type":
        return f"{key_path(path)}: {shown(err.instance)} has the wrong type; {_expected(err)}"
    if "propertyNames" in err.schema_path:  # a key inside zero:, sweep:, ...
        return (
            f"{key_path(path)}: key {shown(err.instance)} is not a valid key name; allowed: "
            "lowercase letters, digits and '_'"
        )
    if err.validator in ("pattern", "not") or (
        err.validator == "propertyNames" or "pattern" in str(err.validator)
    ):
        return (
            f"{key_path(path)}: {shown(err.instance)} is not a valid name; use letters, digits, "
            "'.', '_' and '-' only (no path separators, spaces, newlines or shell characters, "
            "not '..')"
        )
    if err.validator in _SIZE_WORDS:
        words, bound = _SIZE_WORDS[err.validator]
        empty = " (should be non-empty)" if bound == "at least" and err.validator_value == 1 else ""
        return (
            f"{key_path(path)}: {shown(err.instance)} is {words}{empty}; "
            f"allowed: {bound} {err.validator_value}"
        )
    if err.validator == "uniqueItems":
        return f"{key_path(path)}: {shown(err.instance)} repeats a value; allowed: each value once"
    return f"{key_path(path)}: {err.message[: 2 * SHOWN_CHARS]}"


def _expected(err: jsonschema.ValidationError) -> str:
    expected = err.validator_value
    names = expected if isinstance(expected, list) else [expected]
    text = f"expected {' or '.join(names)}"
    if "integer" in names and isinstance(err.instance, float):
        text += " (a count is a whole number: write 2048, not 2048.0)"
    elif isinstance(err.instance, bool):
        text += " (true/false is a boolean, not a number)"
    return text


def validate(instance: dict, schema_name: str, source: str) -> dict:
    """Validate against a schema (exact types: integers are not floats, booleans are not
    numbers; no NaN or infinity anywhere); return a copy with schema defaults filled in."""
    bad = non_finite_key(instance)
    if bad is not None:
        value = _value_at(instance, bad)
        raise StudyError(
            f"{source}: {key_path(list(bad))}: {value!r} is not allowed; numbers must be finite"
        )
    schema = load_schema(schema_name)
    validator = StrictValidator(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: (len(e.absolute_path), e.path))
    if errors:
        err = jsonschema.exceptions.best_match(errors)
        # best_match prefers shallow errors; an unknown/missing key deeper down is more useful.
        deep = [e for e in errors if e.validator in ("additionalProperties", "required", "enum")]
        if err.validator in ("oneOf", "anyOf") and deep and list(err.absolute_path) != ["model"]:
            err = deep[0]
        raise StudyError(f"{source}: {_describe_error(err, schema)}")
    return fill_defaults(copy.deepcopy(instance), schema, schema)


def _value_at(instance: Any, path: tuple) -> Any:
    for part in path:
        instance = instance[part]
    return instance


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
    """A user YAML file's top-level mapping, through the one safe loader (yamlsafe: no code,
    no duplicate keys, limits on size, depth and aliases); StudyError names the file."""
    try:
        return yamlsafe.load_mapping(path)
    except yamlsafe.YamlRefused as exc:
        raise StudyError(str(exc)) from None


def load_cluster(name: str, cluster_dir: str | Path = CLUSTER_DIR) -> dict:
    path = Path(cluster_dir) / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in Path(cluster_dir).glob("*.yaml"))
        where = "" if path.is_absolute() else f" in the working directory {Path.cwd()}"
        raise StudyError(
            f"cluster: no cluster description {path}{where} for cluster {name!r}; "
            f"known: {', '.join(known) or 'none'}"
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
