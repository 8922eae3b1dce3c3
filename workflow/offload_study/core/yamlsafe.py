"""The one loader of user YAML (studies, cluster descriptions, references): data, never code.

Study files and cluster descriptions are exchanged between clusters, so reading one must not run
anything and must not exhaust the machine. :func:`load_mapping` reads with PyYAML's safe loader
(no Python tags) and refuses, naming the file (and the line where there is one):

- files over :data:`MAX_BYTES`, binary (NUL bytes) or not UTF-8 text, empty (or only comments);
- a duplicate key in one mapping (YAML lets the last value win silently);
- a key that is not text (``on:``/``yes:`` load as booleans in YAML 1.1; ``1:`` as a number);
- nesting deeper than :data:`MAX_DEPTH`, more than :data:`MAX_ALIASES` aliases, or a document
  whose aliases expand to more than :data:`MAX_NODES` values (an "alias bomb": a few lines that
  every later reader - validation, error messages - would walk as billions of values);
- a top level that is not a mapping (a list, a bare value).

Error text is capped (:func:`cap_text`), so no input can print megabytes.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

#: A study is a few kilobytes; a 1,000-scenario sweep well under a megabyte.
MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_ALIASES = 100
#: values (mappings, lists, scalars) of the document once its aliases are expanded
MAX_NODES = 200_000
#: the most characters of one error message that reach a terminal or a log
MAX_ERROR_CHARS = 2000

#: Snakemake's YAML template engine (YTE) runs a file's Python when this top-level key is true.
TEMPLATE_KEY = "__use_yte__"


class YamlRefused(ValueError):
    """A YAML file that is refused; the message names the file (study.read_yaml re-raises it
    as StudyError)."""


def cap_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} ... [{len(text) - limit} more characters not shown]"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, counting depth and aliases while it composes the document and
    refusing duplicate and non-text keys while it constructs it."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source, self.depth, self.aliases = source, 0, 0

    def refuse(self, mark, text: str):
        where = f"{self.source}: line {mark.line + 1}" if mark else self.source
        raise YamlRefused(f"{where}: {text}")

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                self.refuse(
                    self.peek_event().start_mark,
                    f"more than {MAX_ALIASES} aliases (*name); a study needs few or none",
                )
            return super().compose_node(parent, index)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                self.refuse(self.peek_event().start_mark, f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *defaults` merges keys: later ones override on purpose
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    self.refuse(
                        key_node.start_mark,
                        f"key {key!r} is a {type(key).__name__}, not text; quote it",
                    )
                if key in first_line:
                    self.refuse(
                        key_node.start_mark,
                        f"duplicate key {key!r} (first on line {first_line[key]}); "
                        "YAML would silently keep only the last value",
                    )
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(data, limit: int) -> int:
    """How many values ``data`` holds when every alias is expanded, counting stops past
    ``limit`` (so an alias bomb or a self-referencing alias costs at most ``limit`` steps)."""
    count, stack = 0, [data]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _text(path: Path) -> str:
    """The file's text: refused when missing, too large, binary or not UTF-8."""
    if not path.is_file():
        raise YamlRefused(f"{path}: file not found")
    with open(path, "rb") as fh:
        raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise YamlRefused(f"{path}: larger than {MAX_BYTES} bytes; not a study or cluster file")
    if b"\0" in raw:
        raise YamlRefused(f"{path}: a binary file (NUL bytes), not YAML text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlRefused(f"{path}: not UTF-8 text (byte {exc.start} is invalid)") from None
    if not text.strip():
        raise YamlRefused(f"{path}: the file is empty; expected a mapping of keys (key: value)")
    return text


def parse(text: str, source: str):
    """The one YAML document of ``text`` (any type), loaded safely within the limits."""
    loader = _Loader(text, source)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise YamlRefused(cap_text(f"{source}: not valid YAML: {exc}")) from None
    finally:
        loader.dispose()
    if _expanded_size(data, MAX_NODES) > MAX_NODES:
        raise YamlRefused(
            f"{source}: its aliases expand to more than {MAX_NODES} values (an alias bomb?)"
        )
    return data


def load_mapping(path: str | Path) -> dict:
    """The file's top-level mapping, loaded safely within the limits (YamlRefused otherwise)."""
    path = Path(path)
    data = parse(_text(path), str(path))
    if data is None:
        raise YamlRefused(f"{path}: the file holds only comments; expected a mapping of keys")
    if not isinstance(data, dict):
        raise YamlRefused(
            f"{path}: the top level is a {type(data).__name__}; expected a mapping of keys "
            "(key: value lines)"
        )
    return data


#: A number as YAML 1.1 leaves it a string (5e8, 1.5E+9).
NUMBER_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def normalize_number(value):
    """YAML 1.1 reads 5e8 as the string '5e8'; DeepSpeed wants integers for sizes."""
    if isinstance(value, str) and NUMBER_TEXT.match(value.strip()):
        value = float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
