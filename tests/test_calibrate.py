"""Calibration: real measurements on this CPU machine (small sizes, bounded time) and the
calibration files shipped for the H200 machines."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
from conftest import make_cluster

from offload_study import calibrate, contracts
from offload_study.study import CLUSTER_DIR, REPO_ROOT, StudyError

SHIPPED = sorted((REPO_ROOT / "config/calibration").glob("*.json"))


def test_calibrate_measures_this_machine_in_seconds(tmp_path):
    cluster = make_cluster({"name": "here", "accelerator": "cpu", "gpus_per_node": 1,
                            "nvme_path": str(tmp_path / "nvme")})  # fmt: skip
    start = time.perf_counter()
    cal = calibrate.calibrate(cluster, cores=len(os.sched_getaffinity(0)))
    assert time.perf_counter() - start < 60  # seconds when the machine is idle; shared here
    assert cal.cluster == "here" and cal.accelerator == "cpu"
    for rate in (cal.matmul_tflops, cal.cpu_adam_params_per_s, cal.disk_read_gb_s,
                 cal.disk_write_gb_s):  # fmt: skip
        assert math.isfinite(rate) and rate > 0
    assert 1e-3 < cal.matmul_tflops < 100  # a few cores, not a GPU
    assert 1e6 < cal.cpu_adam_params_per_s < 1e11
    assert cal.h2d_gb_s is cal.d2h_gb_s is cal.pageable_h2d_gb_s is None  # no GPU here
    assert cal.source.startswith("measured by offload_study.calibrate")
    assert cal.provenance["deepspeed_version"] and cal.provenance["disk_path"]
    assert list((tmp_path / "nvme").iterdir()) == []  # its probe files are gone


def test_disk_probe_writes_reads_and_removes_its_files(tmp_path):
    disk = calibrate.disk_gb_s(str(tmp_path), 4 * 2**20)
    assert disk["disk_bytes"] == calibrate.DISK_FILES * 4 * 2**20
    assert disk["disk_read_gb_s"] > 0 and disk["disk_write_gb_s"] > 0
    assert isinstance(disk["direct_io"], bool)  # O_DIRECT where the file system takes it
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_the_file_atomically(tmp_path):
    out = tmp_path / "results/local-cpu/calibration.json"
    cmd = [sys.executable, "-m", "offload_study.calibrate", "--cluster", "local-cpu",
           "--cores", "1", "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    cal = contracts.read_calibration(out)
    assert cal.cluster == "local-cpu" and cal.cpu_adam_threads == 1
    assert [p.name for p in out.parent.iterdir()] == ["calibration.json"]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_calibrations_say_where_their_numbers_come_from(path):
    cal = contracts.read_calibration(path)
    assert cal.cluster == path.stem and (CLUSTER_DIR / f"{path.stem}.yaml").is_file()
    assert cal.accelerator == "cuda" and cal.source.startswith("shipped, not measured")
    measured = {k for k, v in cal.to_dict().items() if isinstance(v, float)}
    assert measured <= set(cal.provenance), "every number needs its origin"


def test_a_file_that_is_not_a_calibration_is_refused(tmp_path):
    path = tmp_path / "calibration.json"
    contracts.write_json(path, {"schema_version": 99})
    with pytest.raises(StudyError, match="not a calibration file"):
        contracts.read_calibration(path)
