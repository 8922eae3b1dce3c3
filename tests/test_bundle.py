"""Bundles of real CPU runs on two "clusters": made, checked, refused when tampered or unsafe.

The session fixture ``cross_cluster`` (conftest; builders.cross_cluster_runs) runs one tiny study
on two CPU "clusters" that differ in the cores granted to each run (2 against 1) through the real
pipeline pieces: the planner (run specs, DeepSpeed configs, plan.json), the runner (a real ZeRO-3
run each), collect, the report and the bundle CLI. test_compare, test_check and test_site use it
too.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from builders import XC_STUDY as STUDY

from offload_study.across import bundle, compare
from offload_study.analysis import collect
from offload_study.core import contracts


# --------------------------------------------------------------------------- helpers
def members(path: Path) -> dict[str, bytes]:
    """name -> bytes of every file member of a bundle (test side: read without the checks)."""
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of bundle ``src`` whose members go through ``change(tar_out, info, data)``."""
    with tarfile.open(src, "r:gz") as tin, tarfile.open(dst, "w:gz") as tout:
        for info in tin.getmembers():
            data = tin.extractfile(info).read() if info.isfile() else None
            change(tout, info, data)
    return dst


def keep(tout, info, data) -> None:
    tout.addfile(info, io.BytesIO(data) if data is not None else None)


def refused(path: Path, tmp_path: Path, **limits) -> str:
    into = tmp_path / "into"
    with pytest.raises(bundle.BundleError) as err:
        bundle.extract(path, into, bundle.Limits(**limits) if limits else bundle.LIMITS)
    assert not into.exists(), "a refused bundle left files behind"
    return str(err.value)


# --------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_bundle_carries_records_logs_configs_report_and_manifest(cross_cluster, tmp_path):
    path = cross_cluster.bundles["cpu-a"]
    names = members(path)
    top = bundle.bundle_name(STUDY, "cpu-a")
    assert {n.split("/")[0] for n in names} == {top}
    rel = {n.removeprefix(top + "/") for n in names}
    study = bundle.study_dir("cpu-a", STUDY)
    for scenario in ("zero3", "offload-opt"):
        for f in (
            "metrics.json",
            "steps.csv",
            "provenance.json",
            "logs/launcher.log",
            "logs/rank0.log",
        ):
            assert f"{study}/{scenario}/rep0/{f}" in rel
        assert f"{study}/configs/{scenario}.json" in rel
    assert {
        f"{study}/plan.json",
        f"{study}/summary.csv",
        f"{study}/runs.csv",
        bundle.report_path(STUDY),
        bundle.MANIFEST,
    } <= rel
    assert not any("/archive/" in n for n in rel), "superseded-record archive is not bundled"
    manifest = json.loads(names[f"{top}/{bundle.MANIFEST}"])
    assert set(manifest["members"]) == rel - {bundle.MANIFEST}
    m = manifest["members"][f"{study}/zero3/rep0/metrics.json"]
    assert m["sha256"] == contracts.sha256_file(
        cross_cluster.root / study / "zero3/rep0/metrics.json"
    )


@pytest.mark.slow
def test_extracted_bundle_reads_like_the_working_tree(cross_cluster, tmp_path):
    b = bundle.extract(cross_cluster.bundles["cpu-b"], tmp_path / "x")
    assert (b.manifest.study, b.manifest.cluster) == (STUDY, "cpu-b")
    assert b.sha256 == contracts.sha256_file(cross_cluster.bundles["cpu-b"])
    rec = b.study_dir / "offload-opt" / "rep0"
    assert collect.read_record(rec / "metrics.json")["outcome"] == "ok"
    assert collect.read_provenance(rec)["cores_granted"] == 1
    assert b.report.read_text().startswith("<!DOCTYPE html>")
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "offload_study.across.bundle",
            "verify",
            *map(str, cross_cluster.bundles.values()),
        ],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and cli.stdout.count("bundle: ok") == 2, cli.stdout


@pytest.mark.slow
def test_tampered_member_is_refused_naming_it(cross_cluster, tmp_path):
    def edit(tout, info, data):
        if info.name.endswith("zero3/rep0/metrics.json"):
            m = json.loads(data)
            m["tokens_per_s"] *= 10  # a better number than was measured
            data = json.dumps(m).encode()
            info.size = len(data)
        keep(tout, info, data)

    bad = rewrite(cross_cluster.bundles["cpu-a"], tmp_path / "bad.tar.gz", edit)
    msg = refused(bad, tmp_path)
    assert "zero3/rep0/metrics.json" in msg and "sha256" in msg


@pytest.mark.slow
def test_member_added_or_removed_after_bundling_is_refused(cross_cluster, tmp_path):
    top = bundle.bundle_name(STUDY, "cpu-a")
    study = bundle.study_dir("cpu-a", STUDY)

    def add(tout, info, data):
        keep(tout, info, data)
        if info.name.endswith("plan.json"):
            extra = tarfile.TarInfo(f"{top}/{study}/zero3/rep0/extra.json")
            extra.size = 2
            tout.addfile(extra, io.BytesIO(b"{}"))

    msg = refused(rewrite(cross_cluster.bundles["cpu-a"], tmp_path / "add.tar.gz", add), tmp_path)
    assert "extra.json" in msg and "not in the manifest" in msg

    def drop(tout, info, data):
        if not info.name.endswith("offload-opt/rep0/steps.csv"):
            keep(tout, info, data)

    msg = refused(rewrite(cross_cluster.bundles["cpu-a"], tmp_path / "drop.tar.gz", drop), tmp_path)
    assert "offload-opt/rep0/steps.csv" in msg and "not the bundle" in msg


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["../evil.txt", "/etc/evil.txt", "{top}/../../evil.txt", "{top}/results/./x", "{top}//x"],
)
def test_path_traversal_member_is_refused(cross_cluster, tmp_path, name):
    top = bundle.bundle_name(STUDY, "cpu-a")
    name = name.format(top=top)

    def inject(tout, info, data):
        keep(tout, info, data)
        if info.name.endswith(bundle.MANIFEST):
            evil = tarfile.TarInfo(name)
            evil.size = 4
            tout.addfile(evil, io.BytesIO(b"evil"))

    bad = rewrite(cross_cluster.bundles["cpu-a"], tmp_path / "evil.tar.gz", inject)
    msg = refused(bad, tmp_path)
    assert repr(name) in msg or repr(name.rstrip("/")) in msg
    assert not list(tmp_path.rglob("evil.txt")) and not Path("/etc/evil.txt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE])
def test_links_and_special_members_are_refused(cross_cluster, tmp_path, kind):
    top = bundle.bundle_name(STUDY, "cpu-a")

    def inject(tout, info, data):
        if info.name.endswith("zero3/rep0/steps.csv"):  # replaced by a link to a host file
            info = tarfile.TarInfo(info.name)
            info.type, info.linkname = kind, "/etc/passwd"
            data = None
        keep(tout, info, data)

    msg = refused(rewrite(cross_cluster.bundles["cpu-a"], tmp_path / "l.tar.gz", inject), tmp_path)
    assert f"{top}/" in msg and "plain files only" in msg


@pytest.mark.slow
def test_size_limits_refuse_a_bundle_before_filling_the_disk(cross_cluster, tmp_path):
    path = cross_cluster.bundles["cpu-a"]
    assert "larger than 1000 bytes" in refused(path, tmp_path, member_bytes=1000)
    assert "more than 20000 bytes" in refused(path, tmp_path, total_bytes=20_000)
    assert "more than 3 members" in refused(path, tmp_path, members=3)


def test_not_a_bundle_is_refused_with_one_clear_error(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar at all")
    assert "not a readable bundle" in refused(junk, tmp_path)
    plain = tmp_path / "plain.tar.gz"
    with tarfile.open(plain, "w:gz") as tar:
        info = tarfile.TarInfo("x--y/readme.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    assert "no x--y/manifest.json" in refused(plain, tmp_path)
    assert "bundle not found" in refused(tmp_path / "absent.tar.gz", tmp_path)


def test_a_study_without_plan_is_not_bundled(tmp_path):
    (tmp_path / "results" / "c" / "s").mkdir(parents=True)
    with pytest.raises(bundle.BundleError, match="no plan.json"):
        bundle.create(tmp_path, "c", "s", tmp_path / "b.tar.gz")


def test_a_plan_whose_names_would_leave_the_bundle_is_refused(tmp_path):
    """Scenario names of a bundle's plan.json become paths when it is read: plain names only."""
    study = tmp_path / bundle.study_dir("c", "s")
    study.mkdir(parents=True)
    for bad, why in (
        ("../../../etc", "scenario name '../../../etc'"),
        ("..", "scenario name '..'"),
    ):
        contracts.write_json(study / "plan.json", {"scenarios": [{"name": bad}], "repeats": 1})
        bundle.create(tmp_path, "c", "s", tmp_path / "b.tar.gz")
        with bundle.opened([tmp_path / "b.tar.gz"]) as (b,):
            with pytest.raises(bundle.BundleError, match=re.escape(why)):
                compare.load_side(b, "c")
    with pytest.raises(bundle.BundleError, match="'..' is not a valid name"):
        bundle.Manifest.from_dict({**_manifest_fields(), "study": ".."}, "m")


def _manifest_fields() -> dict:
    return {
        "bundle_version": 1,
        "study": "s",
        "cluster": "c",
        "created_at": "now",
        "created_by": {},
        "report": None,
        "calibration": None,
        "members": {},
    }
