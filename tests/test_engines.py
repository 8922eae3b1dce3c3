"""The engine registry: one folder per engine under offload_study/engines, found without a list;
stages ask it and never name an engine; the schemas' engine lists are the registry's."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

from offload_study import engines
from offload_study.core.study import load_schema
from offload_study.engines import schema_sync

PACKAGE = REPO / "workflow" / "offload_study"
#: what a stage would write to branch on an engine's name
NAMES_AN_ENGINE = re.compile(r'engine *(==|!=) *"|"fsdp2"|"deepspeed"')


def test_every_engine_folder_registers_and_is_found():
    folders = sorted(
        p.name for p in (PACKAGE / "engines").iterdir() if (p / "__init__.py").is_file()
    )
    found = {e.name for e in engines.engines()} | {
        p.engine for e in engines.engines() for p in e.paths
    }
    assert set(engines.names()) <= set(folders) and found <= set(engines.names())
    for engine in engines.engines():
        assert engine.label and engine.summary and engine.paths
        assert len({p.devices for p in engine.paths}) == len(engine.paths), engine.name


def test_an_unknown_engine_is_one_error_naming_the_engines():
    with pytest.raises(engines.UnknownEngine) as info:
        engines.get("megatron")
    assert "'megatron'" in str(info.value)
    assert all(name in str(info.value) for name in engines.names())


def test_the_schemas_engine_lists_are_the_registrys():
    """python -m offload_study.engines.schema_sync writes them (run from the checkout's root)."""
    study = load_schema("study")["properties"]["scenarios"]["items"]["properties"]["engine"]
    assert study["enum"] == list(engines.names())
    for name in schema_sync.RECORD_SCHEMAS:
        assert load_schema(name.split(".")[0])["properties"]["engine"]["enum"] == list(
            engines.names()
        )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from offload_study.engines import schema_sync; "
            "print([p.name for p, (a, b) in schema_sync.synced().items() if a != b])",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]", "run: python -m offload_study.engines.schema_sync"


def test_no_stage_branches_on_an_engines_name():
    """Only the engine folders name an engine; every stage asks the registry."""
    lines = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if "engines" not in path.relative_to(PACKAGE).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if NAMES_AN_ENGINE.search(line)
    ]
    assert lines == []
