"""Provenance's commit: a checkout names its HEAD; a tree exported by `git archive` (a copy sent
to a cluster or a device, often into another repository's folder) names the commit it came
from, not the HEAD of whatever repository holds it. Provenance's boot id: which machine boot a
run ran on (collect pairs repeats only within one). Provenance's ranks: the cores and threads
each saw."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import make_spec

from offload_study.core import contracts
from offload_study.core.contracts import RankStats
from offload_study.training import provenance
from offload_study.training.supervise import Supervision

REPO_ROOT = Path(__file__).resolve().parents[1]


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def new_repo(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    (path / "f").write_text("x\n")
    git(path, "add", "f")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return git(path, "rev-parse", "HEAD")


def test_a_checkout_names_its_head_and_whether_it_is_dirty(tmp_path):
    head = new_repo(tmp_path / "repo")
    assert provenance.git_commit(tmp_path / "repo") == (head, False)
    for folder in provenance.NOT_CODE:  # a user's own study, cluster, pages: not code
        (tmp_path / "repo" / folder).mkdir()
        (tmp_path / "repo" / folder / "mine.yaml").write_text("study: mine\n")
    assert provenance.git_commit(tmp_path / "repo") == (head, False)
    (tmp_path / "repo" / "f").write_text("y\n")
    assert provenance.git_commit(tmp_path / "repo") == (head, True)
    (tmp_path / "repo" / "f").write_text("x\n")
    (tmp_path / "repo" / "plugin.py").write_text("print()\n")  # new code counts
    assert provenance.git_commit(tmp_path / "repo") == (head, True)


def test_an_exported_tree_inside_another_repository_names_its_own_commit(tmp_path):
    outer = new_repo(tmp_path / "outer")
    tree = tmp_path / "outer" / "export" / "src"
    tree.mkdir(parents=True)
    stamp = tree / "SOURCE_COMMIT"
    stamp.write_text("0123456789abcdef0123456789abcdef01234567\n")
    commit, dirty = provenance.git_commit(tree, stamp)
    assert (commit, dirty) == ("0123456789abcdef0123456789abcdef01234567", None)
    assert commit != outer
    stamp.write_text("$Format:%H$\n")  # a checkout's file: no commit to name
    assert provenance.git_commit(tree, stamp) == (None, None)
    assert provenance.git_commit(tmp_path / "nowhere", stamp) == (None, None)


def test_git_archive_writes_the_commit_into_the_source_commit_file(tmp_path):
    """.gitattributes (export-subst) makes `git archive` fill in the placeholder."""
    path = provenance.SOURCE_COMMIT.relative_to(REPO_ROOT).as_posix()
    data = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", "HEAD", path], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        text = tar.extractfile(path).read().decode()
    (tmp_path / "SOURCE_COMMIT").write_text(text)
    exported = provenance.exported_commit(tmp_path / "SOURCE_COMMIT")
    assert exported == git(REPO_ROOT, "rev-parse", "HEAD")
    assert provenance.exported_commit() is None  # this checkout's own file: the placeholder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="boot_id is Linux's")
def test_the_record_names_the_boot_of_the_host_it_ran_on(tmp_path):
    spec = make_spec("local-cpu").with_ds_config(str(tmp_path / "ds.json"))
    record = provenance.provenance(spec, None, {}, 1, Supervision(rc=None), "run-1")
    assert record["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f-]{36}", record["boot_id"])
    assert provenance.provenance_problems(record) == []
    # optional: the records written before it (docs/results) still validate without it
    assert "boot_id" not in contracts.PROVENANCE_FIELDS
    del record["boot_id"]
    assert provenance.provenance_problems(record) == []


def test_an_unreadable_boot_id_is_null(tmp_path):
    assert provenance.boot_id(tmp_path / "none") is None
    (tmp_path / "empty").write_text("\n")
    assert provenance.boot_id(tmp_path / "empty") is None


def test_the_record_names_every_ranks_cores_and_threads(tmp_path):
    spec = make_spec("local-cpu", {"gpus_per_node": 2}).with_ds_config(str(tmp_path / "ds.json"))
    seen = {
        "cpu_affinity": "0-2",
        "torch_threads": 3,
        "torch_interop_threads": 16,
        "omp_num_threads": "3",
        "mkl_num_threads": None,
    }
    stats = {
        1: RankStats(rank=1, local_rank=1, world_size=2, host="h", pid=2),  # died early
        0: RankStats(rank=0, local_rank=0, world_size=2, host="h", pid=1, **seen),
    }
    record = provenance.provenance(spec, None, stats, 1, Supervision(rc=0), "run-1")
    assert record["rank_threads"] == [
        {"rank": 0, "host": "h", **seen},
        {"rank": 1, "host": "h", **dict.fromkeys(seen)},
    ]
    assert provenance.provenance_problems(record) == []
    # optional: the records written before it (docs/results) still validate without it
    assert "rank_threads" not in contracts.PROVENANCE_FIELDS
    del record["rank_threads"]
    assert provenance.provenance_problems(record) == []
