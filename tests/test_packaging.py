"""The package as a non-editable install sees it, and the split of its dependencies."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "workflow" / "offload_study"
# What only the training runs may pull in: the analysis environment must install without them.
TRAIN_ONLY = {"torch", "deepspeed", "transformers", "nvidia-ml-py"}


def package_files() -> list[str]:
    """Every file of the package (modules, schemas, templates): a wheel without one breaks."""
    found = (p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return sorted(str(p.relative_to(PACKAGE.parent)) for p in found)


class Installed(NamedTuple):
    wheel: Path
    site: Path  # the `pip install --target` folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """A wheel built from a copy of the sources, installed with `pip --target` (no editable
    path back into the repo)."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    shutil.copytree(
        PACKAGE, src / "workflow" / "offload_study", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", src)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("offload_study-*.whl")
    site = tmp / "site"
    install = [*pip, "install", "--no-deps", "--no-index", "--target", site, wheel]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    return Installed(wheel, site)


def run_installed(installed: Installed, code: list[str]) -> subprocess.CompletedProcess:
    """Run python in a folder outside the repo with the installed copy first on the path."""
    outside = installed.site.parent / "elsewhere"
    outside.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(installed.site)}
    return subprocess.run(
        [sys.executable, *code], cwd=outside, env=env, capture_output=True, text=True, timeout=300
    )


def test_wheel_carries_every_file_of_the_package(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert [f for f in package_files() if f not in names] == []


def test_installed_package_loads_its_schemas_and_plans_from_outside_the_repo(installed):
    schemas = sorted(p.name.split(".schema.")[0] for p in (PACKAGE / "schemas").glob("*.schema.*"))
    study = yaml.safe_load((REPO / "config/config.yaml").read_text())
    code = (
        "import offload_study\n"
        "from offload_study.core.study import load_schema\n"
        "from offload_study.planning.plan import Plan\n"
        f"assert offload_study.__file__.startswith({str(installed.site)!r})\n"
        f"for name in {schemas!r}: assert load_schema(name)['type'] == 'object', name\n"
        f"plan = Plan({study!r}, cluster_dir={str(REPO / 'config/clusters')!r})\n"
        "print(len(plan.scenarios))\n"
    )
    result = run_installed(installed, ["-c", code])
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(study["scenarios"])


@pytest.mark.parametrize("cli", [["admission.admit", "--help"], ["schemadoc", "study"]])
def test_installed_command_line_tools_run_from_outside_the_repo(installed, cli):
    result = run_installed(installed, ["-m", f"offload_study.{cli[0]}", *cli[1:]])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def wheel_requirements(wheel: Path) -> dict[str, set[str]]:
    """extra ("" for the core) -> the distribution names the built wheel's metadata requires."""
    with zipfile.ZipFile(wheel) as whl:
        (metadata,) = (n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(metadata).decode().splitlines()
    requires: dict[str, set[str]] = {}
    for line in lines:
        if line.startswith("Requires-Dist: "):
            requirement = line.removeprefix("Requires-Dist: ")
            extra = re.search(r"extra == \"([^\"]+)\"", requirement)
            name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()
            requires.setdefault(extra[1] if extra else "", set()).add(name)
    return requires


def test_analysis_install_pulls_no_torch_or_deepspeed(installed):
    requires = wheel_requirements(installed.wheel)
    assert (requires[""] | requires["analysis"]) & TRAIN_ONLY == set()
    assert TRAIN_ONLY <= requires["train"]


@pytest.mark.parametrize(("env", "extra"), [("analysis", "analysis"), ("train", "train")])
def test_conda_env_installs_the_package_with_its_extra_only(env, extra):
    spec = yaml.safe_load((REPO / "envs" / f"{env}.yaml").read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    assert pip == [f"-e ..[{extra}]"]
