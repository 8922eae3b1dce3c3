"""The contracts between stages (offload_study.core.contracts): run spec, records, shared rules."""

from __future__ import annotations

import json
import sys
from importlib import resources

import jsonschema
import pytest
from conftest import REPO as REPO_ROOT
from conftest import make_spec

from offload_study.admission.admit import admitted_plan
from offload_study.core import contracts
from offload_study.core.contracts import RunSpec, StepRow, choose_baseline
from offload_study.core.study import StudyError
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.planning.plan import Plan, write_scenario_files

# run.json as the plan wrote it before contracts.py, plus what the cluster now adds
RUN_JSON_KEYS = set(
    "schema_version study cluster scenario base_scenario label sweep model model_params seq_len "
    "dtype micro_batch gradient_accumulation_steps global_batch gradient_checkpointing steps "
    "warmup_steps seed data optimizer nodes gpus_per_node world_size accelerator gpu_mem_gb "
    "cluster_gpu_mem_gb cpu_mem_gb offload_optimizer offload_param nvme_path pin_memory zero aio "
    "timeout_s step_timeout_s strict reference ds_config".split()
) | {"gpu_model", "peak_tflops", "nvme_capacity_gb", "measure", "force", "predict_only", "modes"}


def test_run_json_keys_and_round_trip(tmp_path):
    spec = make_spec("h200-8gpu", {"gpus_per_node": 4, "offload_optimizer": "nvme"})
    write_scenario_files(spec, str(tmp_path / "s.json"), str(tmp_path / "s.run.json"))
    written = json.loads((tmp_path / "s.run.json").read_text())
    assert set(written) == RUN_JSON_KEYS
    assert set(written["model"]) == {"source", "preset", "config", "name_or_path"}
    assert set(written["data"]) == {"kind", "token_file"}
    assert contracts.read_run_spec(tmp_path / "s.run.json") == spec.with_ds_config(
        tmp_path / "s.json"
    )
    # the cluster's facts travel with the run (MFU peak, card model, NVMe space)
    assert (written["gpu_model"], written["peak_tflops"]) == ("NVIDIA H200", None)
    assert written["nvme_path"] == "/tmp/offload-study-nvme"


def test_plan_run_spec_is_plain_data_for_snakemake_params():
    plan = Plan(REPO_ROOT / "config/config.yaml")
    params = plan.run_spec("nvme-1rank")
    assert type(params) is dict and json.loads(json.dumps(params)) == params
    assert params["ds_config"] == f"{plan.results_dir}/configs/nvme-1rank.json"
    assert RunSpec.from_dict(params) == plan.by_name["nvme-1rank"].with_ds_config(
        params["ds_config"]
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"bogus": 1}, ["unknown key 'bogus'"]),
        ({"world_size": None}, ["missing key 'world_size'"]),
        ({"model": {"source": "config"}}, ["model", "missing key 'preset'"]),
        ({"schema_version": 2}, ["schema_version 2", "re-plan"]),
    ],
)
def test_bad_run_spec_is_refused_naming_the_key(change, words):
    data = make_spec().to_dict()
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None or k != "world_size"}
    with pytest.raises(StudyError) as err:
        RunSpec.from_dict(data, source="x.run.json")
    for word in ["x.run.json", *words]:
        assert word in str(err.value)


def test_choose_baseline():
    offloads = {"a": ("cpu", "none"), "b": ("none", "none"), "c": ("none", "none")}
    assert choose_baseline(["a", "b", "c"], None, offloads) == "b"
    assert choose_baseline(["a", "c", "b"], "", offloads) == "c"  # order decides
    assert choose_baseline(["a", "b"], "a", offloads) == "a"  # requested wins
    assert choose_baseline(["a", "b"], "gone", offloads) == "gone"  # collect notes it
    assert choose_baseline(["a"], None, offloads) is None
    # the plan's default is the same rule
    plan = Plan(REPO_ROOT / "config/studies/seed.yaml")
    assert plan.baseline == "zero3-8gpu-40gb"


def test_steps_csv_round_trip(tmp_path):
    rows = [StepRow(1, "warmup", 0.25, 4096.0, 32.0, 6.5), [2, "measured", 0.2, 5120.0, 40.0, 6.4]]
    contracts.write_steps(tmp_path / "steps.csv", rows)
    text = (tmp_path / "steps.csv").read_text().splitlines()
    assert text[0] == ",".join(contracts.STEPS_COLUMNS)
    assert text[0] == (
        "step,phase,step_time_s,tokens_per_s,samples_per_s,loss,skipped,loss_scale,"
        "forward_s,backward_s,optimizer_s"
    )
    with open(tmp_path / "steps.csv", "a") as fh:
        fh.write("3,measured,0.2")  # a row cut short by a kill
    assert contracts.read_steps(tmp_path / "steps.csv") == [rows[0], StepRow(*rows[1])]
    assert contracts.read_steps(tmp_path / "absent.csv") == []


def test_json_is_written_atomically_and_hashed_once(tmp_path):
    path = tmp_path / "deep" / "x.json"
    contracts.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temp file left
    assert len(contracts.sha256_file(path)) == 64
    assert contracts.sha256_file(tmp_path / "none", missing_ok=True) is None
    with pytest.raises(FileNotFoundError):
        contracts.sha256_file(tmp_path / "none")


def test_key_lists_come_from_the_schemas():
    props = contracts.metrics_schema()["properties"]
    assert contracts.METRICS_FIELDS == list(props)
    # the measurement keys came after the first records: optional, so those stay valid
    required = contracts.metrics_schema()["required"]
    assert set(required) < set(props) and "stop_reason" not in required
    assert contracts.OUTCOMES == props["outcome"]["enum"]
    assert contracts.BREAKDOWN_KEYS == list(props["breakdown_ms"]["properties"])
    assert contracts.BREAKDOWN_TIMERS["forward"] == "fwd"
    assert "nvml_error" not in contracts.PROVENANCE_FIELDS


def test_schemas_are_package_data():
    folder = resources.files("offload_study") / "schemas"
    names = {p.name for p in folder.iterdir()}
    assert {
        "study.schema.yaml",
        "cluster.schema.yaml",
        "metrics.schema.json",
        "provenance.schema.json",
    } <= names
    section = (REPO_ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    line = next(ln for ln in section.splitlines() if ln.startswith("offload_study ="))
    assert '"schemas/*"' in line  # an installed (not editable) package carries the schemas


def test_committed_records_still_validate():
    found = 0
    for path in (REPO_ROOT / "docs" / "results").rglob("rep*/metrics.json"):
        metrics = json.loads(path.read_text())
        jsonschema.validate(metrics, contracts.metrics_schema())
        prov = json.loads((path.parent / contracts.PROVENANCE_FILE).read_text())
        jsonschema.validate(prov, contracts.provenance_schema())
        # every field there (the order is the writer's: test_provenance checks it on new records;
        # a few committed records have two fields swapped, so only the set is checked here)
        assert set(contracts.PROVENANCE_FIELDS) <= set(prov)
        steps = contracts.read_steps(path.parent / contracts.STEPS_FILE)
        assert len([r for r in steps if r.phase == "measured"]) == (metrics["steps_measured"] or 0)
        if metrics["outcome"] == "ok":
            stats = contracts.read_rank_stats(contracts.RecordDir(path.parent))
            assert stats[0].finished and stats[0].model_params == metrics["model_params"]
        found += 1
    assert found >= 10


def test_planning_without_deepspeed_fails_loudly(monkeypatch):
    """A study's ZeRO keys cannot be checked without DeepSpeed: one clear error, no silent pass."""
    dsconfig.installed_key_names.cache_clear()
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an absent package looks like
    try:
        with pytest.raises(StudyError, match="install deepspeed where snakemake runs"):
            admitted_plan(REPO_ROOT / "config/config.yaml")
    finally:
        dsconfig.installed_key_names.cache_clear()


def test_plan_csv_names_its_reserved_columns_and_reads_the_older_ones(tmp_path):
    """plan.csv holds torch's reserved peak (gpu_reserved_gib, what a cap limits) and the same
    with the CUDA context (gpu_reserved_with_context_gib); a plan.csv written before held one
    column, gpu_reserved_bytes (with the context, in bytes), and an older one GB for NVMe."""
    import dataclasses

    from offload_study.core.contracts import (
        PREDICTION_COLUMNS,
        Prediction,
        read_predictions,
        write_predictions,
    )

    assert {"gpu_reserved_gib", "gpu_reserved_with_context_gib"} <= set(PREDICTION_COLUMNS)
    assert "gpu_reserved_bytes" not in PREDICTION_COLUMNS
    blank = {f.name: None for f in dataclasses.fields(Prediction)}
    row = Prediction(
        **{
            **blank,
            "scenario": "a",
            "predict_only": False,
            "force": False,
            "world_size": 1,
            "feasible": True,
            "gpu_reserved_gib": 13.25,
            "gpu_reserved_with_context_gib": 13.75,
        }
    )
    write_predictions(tmp_path / "plan.csv", [row])
    assert read_predictions(tmp_path / "plan.csv")["a"] == row
    older = tmp_path / "older.csv"
    older.write_text(
        "scenario,predict_only,force,world_size,gpu_gib,nvme_gb,feasible,"
        f"gpu_reserved_bytes\na,False,False,1,12.0,2.0,True,{14 * 2**30}\n"
    )
    read = read_predictions(older)["a"]
    assert read.gpu_reserved_with_context_gib == 14.0 and read.gpu_reserved_gib is None
    assert read.nvme_gib == pytest.approx(2e9 / 2**30) and read.gpu_gib == 12.0
