"""Load and validate a study config and its cluster description.

The schemas in the package (offload_study/schemas/, read with importlib.resources through
:func:`load_schema`, so an installed package finds them too) are the one source of truth for
keys, types and defaults; this module turns jsonschema's errors into one message that names each
refused key path (``scenarios[2].offload_optimizer``) and the allowed values.

A study the schema refuses is still checked for sense (offload_study.admission.admit,
``admitted_plan``), so that one error lists every problem: :class:`SchemaRefused` carries a
*checkable* copy, in which each refused value is a :class:`RefusedValue` stand-in, and
:func:`unless_refused` skips each check that reads one.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import re
import tempfile
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


def listed(problems: list[str]) -> str:
    """One message of several problems: the first, then every other one on its line."""
    first, *rest = problems
    more = "".join(f"\n  - {p}" for p in rest)
    return f"{first}" + (f"\n{len(rest)} more problem(s):{more}" if rest else "")


class SchemaRefused(StudyError):
    """Input its schema refused. ``problems``: every refused key as "key path: what is wrong",
    the one a single error would name first, then the others in the file's order. ``checkable``:
    the input as far as the schema accepted it (:func:`checkable`)."""

    def __init__(self, source: str, schema_name: str, problems: list[str], checkable: Any):
        super().__init__(f"{source}: {listed(problems)}")
        self.source, self.schema_name = source, schema_name
        self.problems, self.checkable = problems, checkable


class UsesRefusedValue(Exception):
    """A check used a value the schema refused (:class:`RefusedValue`)."""


def _refuse(*_args, **_kwargs):
    raise UsesRefusedValue


class RefusedValue:
    """What a checkable study holds in place of a value its schema refused: every use of it
    (comparing, hashing, arithmetic, truth, length, iteration, items, attributes, text, a path,
    ``isinstance`` against any other class) raises :class:`UsesRefusedValue`, so a check that
    reads one stops instead of judging a value nobody wrote. ``isinstance`` raises too (through
    ``__class__``, which Python asks when the type itself does not match): code that tests a
    value's type before it uses the value (``positive_count``) must not take it for a count.
    Each refused value has its own instance (two are never the same scenario name)."""

    __class__ = property(_refuse)  # type: ignore[assignment]

    def __deepcopy__(self, _memo):
        return self


_OPERATIONS = (
    "eq ne lt le gt ge hash bool len iter reversed contains getitem setitem delitem getattr "
    "call str repr format bytes fspath int float complex index round trunc floor ceil abs neg "
    "pos invert add sub mul matmul truediv floordiv mod divmod pow lshift rshift and xor or"
).split()
_REFLECTED = "add sub mul matmul truediv floordiv mod divmod pow lshift rshift and xor or".split()
for _name in _OPERATIONS + [f"r{n}" for n in _REFLECTED]:
    setattr(RefusedValue, f"__{_name}__", _refuse)


def holds_refused(value: Any) -> bool:
    """Whether ``value`` (a study, a list of run specs, ...) holds a :class:`RefusedValue`."""
    if isinstance(value, RefusedValue):  # first: isinstance against another class raises
        return True
    if isinstance(value, dict):
        return any(holds_refused(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_refused(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds_refused(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def unless_refused(check, *args) -> list:
    """``check(*args)``, or ``[]`` when it reads a value the schema refused: the unit that a
    half-valid study skips. A check that fails otherwise on input holding a refused value (a
    C function refusing the stand-in's type) is skipped too; on valid input it raises."""
    try:
        return check(*args)
    except UsesRefusedValue:
        return []
    except Exception:
        if holds_refused(args):
            return []
        raise


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


def non_finite_keys(instance: Any, path: tuple = ()):
    """Key path of each NaN or infinite number in ``instance``, in the file's order."""
    if isinstance(instance, float) and not math.isfinite(instance):
        yield path
    if isinstance(instance, dict):
        children = instance.items()
    else:
        children = enumerate(instance) if isinstance(instance, list) else ()
    for key, value in children:
        yield from non_finite_keys(value, (*path, key))


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


def _unknown_keys(err: jsonschema.ValidationError, root: dict) -> list:
    """The keys an additionalProperties error is about, in the file's order."""
    allowed = _resolve(err.schema, root).get("properties", {})
    return [key for key in err.instance if key not in allowed]


def _describe_error(err: jsonschema.ValidationError, root: dict, unknown=None) -> str:
    """One refused key's message; ``unknown``: the unknown key it names (additionalProperties)."""
    path = list(err.absolute_path)
    schema = _resolve(err.schema, root) if isinstance(err.schema, dict) else {}
    if err.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = [unknown] if unknown is not None else _unknown_keys(err, root)
        where = key_path(path + extra[:1])
        return f"{where}: unknown key; allowed keys here: {', '.join(allowed)}"
    if err.validator == "required":
        return f"{key_path(path + [_missing_key(err)])}: required key is missing"
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


def _missing_key(err: jsonschema.ValidationError) -> str:
    """The key a ``required`` error says is missing."""
    return err.message.split("'")[1] if "'" in err.message else err.message


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
    numbers; no NaN or infinity anywhere); return a copy with schema defaults filled in.
    :class:`SchemaRefused` lists every refused key otherwise."""
    schema = load_schema(schema_name)
    refusals = _refusals(instance, schema)
    if refusals:
        problems = [text for _path, text, _unknown in refusals]
        raise SchemaRefused(source, schema_name, problems, checkable(instance, refusals, schema))
    return fill_defaults(copy.deepcopy(instance), schema, schema)


def _first_error(errors: list) -> jsonschema.ValidationError:
    """The error a single message would name: jsonschema's best match, but an unknown, missing
    or misspelt key deeper down over a shallow oneOf/anyOf (best_match prefers shallow ones)."""
    errors = sorted(errors, key=lambda e: (len(e.absolute_path), [str(p) for p in e.path]))
    err = jsonschema.exceptions.best_match(errors)
    deep = [e for e in errors if e.validator in ("additionalProperties", "required", "enum")]
    if err.validator in ("oneOf", "anyOf") and deep and list(err.absolute_path) != ["model"]:
        err = deep[0]
    return err


def _refused_keys(err: jsonschema.ValidationError, root: dict) -> list[tuple]:
    """(key path, message, unknown key?) of each key one error refuses: a missing key's own
    path, each unknown key's, else where the error is (a key name that is no valid name: the
    mapping that holds it)."""
    path = tuple(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        return [
            ((*path, key), _describe_error(err, root, key), True)
            for key in _unknown_keys(err, root)
        ]
    text = _describe_error(err, root)
    if err.validator == "required":
        return [((*path, _missing_key(err)), text, False)]
    return [(path, text, False)]


def _refusals(instance: Any, schema: dict) -> list[tuple]:
    """(key path, message, unknown key?) of every refused key, one each: a number that is not
    finite (as before any schema error), then the key :func:`_first_error` names, then the
    others in the file's order. Several errors of one key (wrong type and too small) speak
    through the first."""
    found = [
        (
            path,
            f"{key_path(list(path))}: {_value_at(instance, path)!r} is not allowed; "
            "numbers must be finite",
            False,
        )
        for path in non_finite_keys(instance)
    ]
    errors = list(StrictValidator(schema).iter_errors(instance))
    if errors:
        first = _first_error(errors)
        for err in [first] + [e for e in errors if e is not first]:
            found += _refused_keys(err, schema)
    by_key: dict[tuple, tuple] = {}
    for refusal in found:
        by_key.setdefault(refusal[0], refusal)
    refusals = list(by_key.values())
    return refusals[:1] + sorted(refusals[1:], key=lambda r: _position(instance, r[0]))


def _position(instance: Any, path: tuple) -> tuple:
    """Where ``path`` is in the file: the index of each key in its mapping (a missing key after
    the present ones) or item in its list."""
    place = []
    for part in path:
        if isinstance(instance, dict):
            keys = list(instance)
            place.append(keys.index(part) if part in instance else len(keys))
            instance = instance.get(part)
        elif isinstance(instance, list) and isinstance(part, int) and part < len(instance):
            place.append(part)
            instance = instance[part]
        else:
            place.append(0)
    return tuple(place)


def checkable(instance: Any, refusals: list[tuple], schema: dict) -> Any:
    """The input as the sense checks may see it where the schema refused some of it: each
    unknown key left out (nothing reads it), each other refused value (a missing key included)
    replaced by its own :class:`RefusedValue`, and the schema's defaults filled in around them
    (a refused value gets none: a default is not what its author wrote)."""
    out = copy.deepcopy(instance)
    for path, _text, unknown in sorted(refusals, key=lambda r: len(r[0])):
        if not path:
            return RefusedValue()
        parent = out
        for part in path[:-1]:
            parent = _child(parent, part)
        if isinstance(parent, dict) and unknown:
            parent.pop(path[-1], None)
        elif isinstance(parent, dict) or (
            isinstance(parent, list) and isinstance(path[-1], int) and path[-1] < len(parent)
        ):
            parent[path[-1]] = RefusedValue()
    return fill_defaults(out, schema, schema)


def _child(node: Any, part) -> Any:
    """``node[part]``; None below a value already replaced or left out."""
    if isinstance(node, RefusedValue) or node is None:
        return None
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and part < len(node):
        return node[part]
    return None


def _value_at(instance: Any, path: tuple) -> Any:
    for part in path:
        instance = instance[part]
    return instance


def fill_defaults(instance: Any, schema: dict, root: dict) -> Any:
    if isinstance(instance, RefusedValue):
        return instance
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


def study_source(config: dict | str | Path, source: str | None = None) -> str:
    """What an error calls the study: ``source``, else its file, else "study config"."""
    return source or (str(config) if not isinstance(config, dict) else "study config")


def load_study(config: dict | str | Path, source: str | None = None) -> dict:
    """A validated study with defaults filled in (``config`` is a dict or a YAML path)."""
    source = study_source(config, source)
    if not isinstance(config, dict):
        config = read_yaml(config)
    return validate(config, "study", source)


def nvme_path_problem(path) -> str | None:
    """Why ``path`` cannot be an NVMe offload folder, from its text alone (None if it can):
    empty, relative (it would depend on each job's working folder) or with '..' in it."""
    if not isinstance(path, str) or not path.strip():
        return f"{shown(path)} is empty; allowed: an absolute folder (or null for the default)"
    if not os.path.isabs(path):
        return f"{shown(path)} is relative; allowed: an absolute folder such as /local/nvme/x"
    if ".." in Path(path).parts:
        return f"{shown(path)} contains '..'; allowed: an absolute folder without '..'"
    return None


_WRITABLE = "allowed: a folder this machine can write (or one it can make)"


def nvme_dir_problem(path: str) -> str | None:
    """Why NVMe swap files cannot be written under ``path`` on this machine (None if they can):
    the folder, or the nearest existing folder above it (the harness makes the rest), must be
    a writable folder. The runner asks this first on the node that trains."""
    problem = nvme_path_problem(path)
    if problem:
        return problem
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{shown(path)}: {existing} is not a folder on {os.uname().nodename}; {_WRITABLE}"
    try:  # os.access says yes to root everywhere, even in /proc: make a folder and remove it
        os.rmdir(tempfile.mkdtemp(prefix=".offload-study-check-", dir=existing))
    except OSError as exc:
        return (
            f"{shown(path)}: cannot write in {existing} on {os.uname().nodename} "
            f"({exc.strerror}); {_WRITABLE}"
        )
    return None
