"""A user's journey: a committed study run on *their* cluster, from *their* checkout.

The package is installed from this checkout (the venv's editable install, as a shared site
environment would be); the workflow runs from a copy of the tracked files elsewhere, with a
cluster description that only that copy has. Nothing of ours may shadow, be read for, or be
overwritten by their run.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from offload_study.across import bundle
from offload_study.core import layout

PUBLISHED = REPO / "docs/results/h200-2gpu/seed-2gpu"


def other_checkout(dest: Path) -> Path:
    """The tracked files copied to ``dest`` (what `git clone` gives), without the venv."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = REPO / name.decode()
        if source.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name.decode())
    return dest


def add_cluster(checkout: Path, like: str, name: str) -> None:
    """A cluster description the repository does not ship, written into the user's checkout."""
    cluster = yaml.safe_load((checkout / layout.cluster_file(like)).read_text())
    cluster["name"] = name
    (checkout / layout.cluster_file(name)).write_text(yaml.safe_dump(cluster))


def snakemake(checkout: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Snakemake of the installed environment, run in the user's checkout (no PYTHONPATH: the
    rules' `python -m offload_study...` is the package installed from the other checkout)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-m", "snakemake", *args]
    return subprocess.run(
        cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout
    )


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return other_checkout(tmp_path_factory.mktemp("their-clone"))


@pytest.mark.parametrize(
    "study", ["config/studies/seed-2gpu.yaml", "config/studies/h200-1gpu.yaml"]
)
def test_a_published_study_plans_its_runs_on_a_cluster_we_do_not_ship(checkout, study):
    add_cluster(checkout, "h200-2gpu", "their-cluster")
    published = digest(checkout / "reports")
    result = snakemake(checkout, "-n", "--config", f"study_file={study}", "cluster=their-cluster")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "Nothing to be done" not in result.stdout + result.stderr
    name = yaml.safe_load((checkout / study).read_text())["study"]
    trains = re.findall(r"^rule train:", result.stdout, re.M)
    assert len(trains) >= 2, result.stdout[-3000:]
    assert layout.report_html("their-cluster", name) in result.stdout
    assert f"{layout.study_dir('their-cluster', name)}/" in result.stdout
    assert digest(checkout / "reports") == published  # ours: neither target nor input


@pytest.mark.slow
def test_their_first_jobs_read_their_cluster_file_not_the_installs(checkout):
    """The workflow and package of this checkout (which has no mine-cpu.yaml) run in the user's
    working directory (`snakemake -s ... -d ...`): calibrate and plan, the first jobs, must read
    the cluster file there, not beside the package."""
    add_cluster(checkout, "local-cpu", "mine-cpu")
    assert not (REPO / layout.cluster_file("mine-cpu")).exists()
    snakefile = str(REPO / "Snakefile")
    result = snakemake(
        checkout,
        "-s",
        snakefile,
        "-d",
        str(checkout),
        "-c2",
        "plan",
        "--config",
        "cluster=mine-cpu",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    study = yaml.safe_load((checkout / "config/config.yaml").read_text())["study"]
    assert (checkout / layout.measured_calibration("mine-cpu")).is_file()
    assert (checkout / layout.study_dir("mine-cpu", study) / layout.PLAN_JSON).is_file()
    assert not (REPO / layout.cluster_results("mine-cpu")).exists()


def test_published_records_compare_and_check_without_a_bundle_file(tmp_path):
    from offload_study.across import check, compare

    out = tmp_path / "compare.html"
    view = compare.compare_bundles([PUBLISHED, PUBLISHED], out)
    assert out.is_file() and view
    assert check.main(["--bundle", str(PUBLISHED), "--out", str(tmp_path / "check.json")]) == 0
    assert "seed-2gpu" in (tmp_path / "check.json").read_text()


def test_published_records_are_checked_like_any_bundle(tmp_path):
    records = shutil.copytree(PUBLISHED, tmp_path / "records")
    (records / "zero3-2gpu" / "evil").symlink_to("/etc/passwd")
    with pytest.raises(bundle.BundleError, match="evil"):
        with bundle.opened([records]):
            pass
