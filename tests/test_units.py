"""Memory in one unit: a `_gb` key is GiB for the GPU cap, the plan's budget, the SLURM request,
the runner's limit and the run record alike; one table of bytes per parameter (core.units)."""

import math
from pathlib import Path

import pytest
from conftest import make_spec

from offload_study.core import units
from offload_study.core.contracts import RankStats, StepRow, read_predictions
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.engines.deepspeed import model as ds_model
from offload_study.planning.resources import MEM_HEADROOM_MIB, fit_problems, train_resources
from offload_study.prediction import predict, shared
from offload_study.training import metrics, probes, supervise
from offload_study.training.supervise import Supervision

GIB = 2**30
REPO = Path(__file__).resolve().parents[1]
H200 = {
    "name": "h200",
    "accelerator": "cuda",
    "gpus_per_node": 8,
    "nodes": 2,
    "gpu_mem_gb": 141,
    "mem_gb_per_node": 1500,
    "gpu_model": "NVIDIA H200",
}
#: what torch reports as an H200's total memory (140.4 GiB; docs/results rank stats)
H200_CARD_BYTES = 150_754_820_096


def record_of(spec, stats):
    """metrics.json of a run that made one measured step, by the real metrics code."""
    step = StepRow(
        step=1, phase="measured", step_time_s=1.0, tokens_per_s=1.0, samples_per_s=1.0, loss=1.0
    )
    inp = metrics.MetricsInput(
        spec.with_ds_config("no-such-config.json"),
        0,
        Supervision(rc=0, elapsed=1.0),
        "ok",
        None,
        [step],
        stats,
        {},
        "2026-01-01T00:00:00Z",
        "2026-01-01T00:00:01Z",
    )
    return metrics.compute_metrics(inp)


def test_one_key_value_is_the_same_bytes_everywhere():
    spec = make_spec(H200, {"gpus_per_node": 1, "gpu_mem_gb": 24, "cpu_mem_gb": 100})
    gpu_bytes, host_bytes = 24 * GIB, 100 * GIB
    assert (spec.gpu_mem_bytes, spec.cpu_mem_bytes) == (gpu_bytes, host_bytes)
    # the GPU cap: torch's fraction of the card is exactly 24 GiB of it
    fraction, recorded = probes.gpu_cap(spec, H200_CARD_BYTES)
    assert fraction * H200_CARD_BYTES == pytest.approx(gpu_bytes, abs=1)
    # the plan's budgets (bytes, and GiB in plan.csv)
    assert predict.budget_bytes(spec) == {"gpu": gpu_bytes, "host": host_bytes, "nvme": None}
    row = predict.predict(spec, dsconfig.build_ds_config(spec), None)
    assert (row.gpu_budget_gib, row.host_budget_gib) == (24.0, 100.0)  # was 93.132 (10^9 B)
    # the SLURM request: --mem in MiB, 100 GiB and the headroom
    assert train_resources(spec, H200)["mem_mb"] * 2**20 == host_bytes + MEM_HEADROOM_MIB * 2**20

    # the runner's host limit: 100 GiB of RSS is within it, one byte more is not (was 10^11 B)
    def passed(rss):
        return supervise.limit_passed(spec, supervise.Watch(started=0.0, rss=rss), 1.0, None)

    assert passed(host_bytes) is None
    assert passed(host_bytes + 1)[0] == "host_oom"
    # the run record: the cap the rank applied, and the keys as given (GiB)
    stats = {0: RankStats(rank=0, local_rank=0, world_size=1, host="h", pid=1, **recorded)}
    record = record_of(spec, stats)
    assert record["gpu_mem_cap_gib"] * GIB == gpu_bytes
    assert units.gib_to_bytes(record["gpu_mem_gb"]) == gpu_bytes
    assert units.gib_to_bytes(record["cpu_mem_gb"]) == host_bytes


def test_the_whole_node_and_an_uncapped_card_are_gib_too():
    spec = make_spec(H200, {"gpus_per_node": 8, "gpu_mem_gb": 141, "cpu_mem_gb": None})
    assert train_resources(spec, H200)["mem_mb"] == 1500 * 1024  # mem_gb_per_node, MiB
    assert probes.gpu_cap(spec, H200_CARD_BYTES)[0] is None  # the card itself: no cap
    assert predict.budget_bytes(spec)["gpu"] == 141 * GIB


def test_nvme_need_is_one_number_for_the_fit_check_and_the_prediction():
    spec = make_spec(
        H200,
        {
            "gpus_per_node": 1,
            "offload_optimizer": "nvme",
            "offload_param": "nvme",
            "nvme_path": "/scratch",
        },
        model={"preset": "llama2-7b"},
        timeout_min=30,
    )
    per_param = units.bytes_per_param("nvme", "bf16", "nvme", "nvme")
    assert per_param == 4 + 8 + 4 + 2  # fp32 master, Adam moments, fp32 gradients; bf16 params
    need = sum(ds_model.nvme_parts(spec, shared.model_shape(spec)).values())
    assert need == spec.model_params * per_param  # one GPU: its partition is the model

    def nvme_refused(capacity_gib):
        problems = fit_problems(spec, dict(H200, nvme_capacity_gb=capacity_gib))
        return [key for key, text in problems if "NVMe" in text]

    need_gib = units.bytes_to_gib(need)
    assert nvme_refused(need_gib - 0.01) == ["offload_optimizer"]
    assert nvme_refused(need_gib + 0.01) == []


def test_sizes_convert_exactly_and_refuse_what_is_no_size():
    assert units.gib_to_bytes(0.5) == 2**29
    assert units.gib_to_bytes(1e300) > 10**308  # exact, where 1e300 * 2**30 as a float overflows
    assert units.bytes_to_mib_ceil(GIB + 1) == 1025 and units.bytes_to_mib_floor(GIB + 1) == 1024
    assert units.gib_to_bytes_or_none(None) is None
    with pytest.raises(ValueError, match="inf GiB"):
        units.gib_to_bytes(math.inf)


def test_an_older_plan_csv_in_gb_is_read_in_gib():
    rows = read_predictions(REPO / "docs/results/h200-1gpu/model-b-nvme/plan.csv")
    assert rows["nvme-opt"].nvme_gib == pytest.approx(5.982e9 / GIB)  # written as 5.982 GB
    assert rows["nvme-opt"].nvme_budget_gib == pytest.approx(40e9 / GIB)
    assert rows["zero3"].nvme_gib is None
