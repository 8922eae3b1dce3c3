"""Predict before you spend, from any machine: a CUDA cluster never
calibrated is planned here (no GPU) from the GPU catalog, labelled uncalibrated with its band;
calibrate refuses where the cluster's accelerator is missing; the one error-bands reader; what
a recommend search spent and saved."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import copy_repo_for_run
from runs import snakemake

from offload_study.core import devices, layout
from offload_study.core.contracts import Prediction, read_calibration, read_predictions
from offload_study.core.study import StudyError
from offload_study.prediction import catalog, error_bands, recommend

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")

THEIR_CLUSTER = "their-l40s"  # shipped by nobody: no measured or shipped calibration
THEIR_STUDY = {
    "study": "their-study",
    "cluster": THEIR_CLUSTER,
    "model": {
        "config": {
            "model_type": "llama",
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 128,
        }
    },
    "seq_len": 64,
    "dtype": "bf16",
    "micro_batch": 2,
    "steps": 3,
    "warmup_steps": 1,
    "timeout_min": 5,
    "scenarios": [
        {"name": "zero3", "gpus_per_node": 1, "cpu_mem_gb": 8},
        {"name": "offload-opt", "gpus_per_node": 2, "cpu_mem_gb": 8, "offload_optimizer": "cpu"},
    ],
}


def their_checkout(tmp: Path, scheduler: str = "slurm") -> Path:
    """A working dir with a GPU cluster and a study the repository does not ship."""
    work = copy_repo_for_run(tmp)
    cluster = yaml.safe_load((work / layout.cluster_file("example-slurm")).read_text())
    cluster.update(
        name=THEIR_CLUSTER,
        scheduler=scheduler,
        gpu_model="NVIDIA L40S",
        gpu_mem_gb=48,
        gpus_per_node=2,
        nodes=1,
        cpu_cores_per_node=32,
    )
    (work / layout.cluster_file(THEIR_CLUSTER)).write_text(yaml.safe_dump(cluster))
    (work / "config/studies/their-study.yaml").write_text(yaml.safe_dump(THEIR_STUDY))
    return work


def test_plan_of_an_uncalibrated_gpu_cluster_runs_here_without_calibrate(tmp_path):
    work = their_checkout(tmp_path)
    res = snakemake(
        "-n", "plan", "--config", "study_file=config/studies/their-study.yaml", cwd=work
    )
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = res.stdout + res.stderr
    assert "catalog_calibration" in jobs and "rule calibrate" not in jobs
    assert "calibrate " not in jobs.split("job ")[-1].split("total")[0]


def test_the_catalog_calibration_is_labelled_uncalibrated(tmp_path):
    work = their_checkout(tmp_path)
    out = tmp_path / "uncal.json"
    cmd = [
        sys.executable,
        "-m",
        "offload_study.prediction.catalog",
        "--cluster",
        THEIR_CLUSTER,
        "--cluster-dir",
        str(work / "config/clusters"),
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    cal = read_calibration(out)
    assert cal.calibrated is False and cal.source.startswith("uncalibrated: GPU catalog")
    l40s = devices.catalog()["gpus"]["L40S"]
    assert (cal.matmul_tflops, cal.h2d_gb_s) == (l40s["peak_tflops"], l40s["host_link_gb_s"])
    cpu = devices.catalog()["cpu"]  # a SLURM node's CPU is not this one: the catalog's default
    assert cal.cpu_adam_params_per_s == cpu["cpu_adam_params_per_s_per_core"] * 32
    assert "not measured here" in cal.source


def test_an_unknown_gpu_model_is_refused_naming_the_key():
    cluster = {"name": "x", "accelerator": "cuda", "gpu_model": "Acme Z9", "scheduler": "slurm"}
    with pytest.raises(StudyError, match="gpu_model 'Acme Z9' is not in the GPU catalog"):
        catalog.gpu_entry(cluster)


def test_the_peak_table_is_the_catalog():
    for model, entry in devices.catalog()["gpus"].items():
        assert devices.peak_tflops(entry["aliases"][0]) == entry["peak_tflops"], model


def test_calibrate_refuses_a_gpu_cluster_on_a_machine_without_its_gpu(tmp_path):
    work = their_checkout(tmp_path)
    out = tmp_path / "calibration.json"
    cmd = [
        sys.executable,
        "-m",
        "offload_study.prediction.calibrate",
        "--cluster",
        THEIR_CLUSTER,
        "--cluster-dir",
        str(work / "config/clusters"),
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and not out.exists()
    assert f"cluster '{THEIR_CLUSTER}' has accelerator cuda (NVIDIA L40S)" in res.stderr
    assert "no CUDA GPU" in res.stderr and "nothing measured" in res.stderr


GOOD = {
    "calibrated": {k: 0.1 for k in error_bands.QUANTITIES},
    "uncalibrated": {k: 0.3 for k in error_bands.QUANTITIES},
    "measured_by": "python benchmarks/prediction_accuracy.py",
    "records": 12,
}


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize(
    "change, named",
    [
        (lambda d: d.pop("records"), "missing key 'records'"),
        (lambda d: d.update(extra=1), "unknown key 'extra'"),
        (lambda d: d["uncalibrated"].pop("host"), "uncalibrated.host: missing"),
        (lambda d: d["calibrated"].update(step_time="10%"), "calibrated.step_time: '10%'"),
        (lambda d: d["calibrated"].update(gpu_allocated=-0.1), "calibrated.gpu_allocated: -0.1"),
        (lambda d: d.update(records=0), "records: 0"),
        (lambda d: d.update(measured_by=""), "measured_by"),
    ],
)
def test_a_bad_error_bands_file_is_refused_naming_the_key(tmp_path, change, named):
    data = json.loads(json.dumps(GOOD))
    change(data)
    path = tmp_path / "error_bands.json"
    path.write_text(json.dumps(data))
    with pytest.raises(StudyError, match=str(path)) as err:
        error_bands.load(path)
    assert named in str(err.value)


def test_the_committed_error_bands_are_read_and_uncalibrated_is_wider():
    calibrated, uncalibrated = error_bands.bands(True), error_bands.bands(False)
    assert uncalibrated["step_time"] >= calibrated["step_time"] > 0
    path = tmp = Path("/nonexistent/error_bands.json")
    with pytest.raises(StudyError, match="no error bands"):
        error_bands.load(tmp)
    assert error_bands.text(0.25) == "±25 %" and error_bands.text(None) == "band not measured"
    assert not path.exists()


def _row(name: str, gpu_hours: float | None, feasible: bool = True) -> Prediction:
    fields = {f.name: None for f in dataclasses.fields(Prediction)}
    return Prediction(
        **{
            **fields,
            "scenario": name,
            "predict_only": False,
            "force": False,
            "world_size": 1,
            "feasible": feasible,
            "gpu_hours": gpu_hours,
        }
    )


def test_a_search_says_what_it_spent_and_what_the_whole_grid_would_cost():
    space = {"candidates": {"a": "opt", "b": "opt", "c": "opt", "d": "opt"}, "references": ["r"]}
    preds = {
        "a": _row("a", 0.1),
        "b": _row("b", 0.2),
        "c": _row("c", 0.3, feasible=False),
        "d": _row("d", 0.05),
        "r": _row("r", 0.15),
    }
    spend = recommend.spending(space, {"device_minutes": 12.0}, preds)
    assert spend["grid_runs"] == 4  # c is predicted not to fit: never measured
    assert spend["grid_predicted_device_minutes"] == pytest.approx(60 * 0.5)
    assert spend["saved_device_minutes"] == pytest.approx(30 - 12)
    line = recommend.spending_line(spend)
    assert line == (
        "recommend: spent 12.0 device-minutes measured (wall time x GPUs, or ranks on a CPU "
        "cluster); measuring the whole grid (4 feasible configs) would take 30.0 device-minutes "
        "predicted, saved 18.0"
    )


def test_recommend_measures_four_candidates_at_most_by_default():
    from offload_study.core.study import load_schema

    rec = load_schema("study")["properties"]["recommend"]
    props = rec.get("properties") or next(
        o["properties"] for o in rec.get("anyOf", rec.get("oneOf", [])) if "properties" in o
    )
    assert props["max_measured"]["default"] == 4 and props["top_n"]["default"] is None


@pytest.mark.slow
def test_a_real_plan_of_an_uncalibrated_gpu_cluster_here(tmp_path):
    """The plan target itself, on this CPU-only machine (~2 min: DeepSpeed's parser)."""
    work = their_checkout(tmp_path)
    res = snakemake(
        "-c1", "plan", "--config", "study_file=config/studies/their-study.yaml", cwd=work
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"plan: UNCALIBRATED predictions for cluster '{THEIR_CLUSTER}'" in res.stderr
    study = work / layout.study_dir(THEIR_CLUSTER, "their-study")
    rows = read_predictions(study / "plan.csv")
    band = error_bands.bands(False)["step_time"]
    assert {(r.calibration, r.step_time_band) for r in rows.values()} == {("uncalibrated", band)}
    assert all(r.step_time_s for r in rows.values())
    prediction = json.loads((study / "plan.json").read_text())["prediction"]
    assert prediction["calibrated"] is False and prediction["error_bands"]["step_time"] == band
    assert not (work / layout.measured_calibration(THEIR_CLUSTER)).exists()
