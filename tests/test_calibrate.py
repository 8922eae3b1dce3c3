"""Calibration: real measurements on this CPU machine (small sizes, bounded time), how a rate is
taken (warm-up, median of samples, spread), the sizes past the cache, and the calibration files
shipped for the H200 machines. The whole calibration with its 2-rank ZeRO-3 probe (DeepSpeed,
tens of seconds on a shared 2-core machine) is the slow test."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CLUSTER_DIR
from conftest import REPO as REPO_ROOT

from offload_study import engines
from offload_study.core import contracts
from offload_study.core.study import StudyError
from offload_study.prediction import calibrate

SHIPPED = sorted((REPO_ROOT / "config/calibration").glob("*.json"))
MIB = 2**20


def test_working_sets_are_four_times_the_last_level_cache():
    cache = calibrate.last_level_cache_bytes()
    assert cache >= 256 * 2**10  # every x86 or Arm server CPU has a last-level cache this large
    size = calibrate.sizes("cpu", 32 * MIB)
    assert 3 * size["matmul"] ** 2 * 2 >= 4 * 32 * MIB  # three bf16 operands
    assert 3 * (size["matmul"] - 256) ** 2 * 2 < 4 * 32 * MIB  # the smallest such side
    assert size["adam"] * 16 >= 4 * 32 * MIB and size["copy"] == 0  # no copies without a GPU
    gpu = calibrate.sizes("cuda", 32 * MIB)
    assert gpu["matmul"] == 8192 and gpu["copy"] == 512 * MIB  # what reaches a GPU's peak
    # an H200 host's 300 MiB cache would ask for a 14592 side: the GPU's rate stays at the
    # side the fitted efficiency is a share of
    assert calibrate.sizes("cuda", 300 * MIB)["matmul"] == calibrate.GPU_MATMUL_SIDE


def test_a_gpu_workload_takes_the_reference_matmul_rate_and_records_the_layers(monkeypatch):
    """calibrate --study on a GPU: the rate at GPU_MATMUL_SIDE (what the engines' fitted efficiency
    is a share of), the layer's shapes beside it; a CPU takes the layer's shapes."""
    asked = []

    def square(device, n):
        asked.append(("square", device, n))
        return {"median": 790.0, "spread_pct": 1.0}

    def layers(device, shapes):
        asked.append(("layers", device, shapes))
        return {"median": 668.0, "spread_pct": 2.0}

    monkeypatch.setattr(calibrate, "matmul_tflops", square)
    monkeypatch.setattr(calibrate, "matmul_tflops_at", layers)
    shapes = ((8192, 2304, 2304),)
    gpu = calibrate.workload_matmul("cuda", shapes)
    assert gpu["median"] == 790.0 and gpu["layer_shapes"]["median"] == 668.0
    assert ("square", "cuda", calibrate.GPU_MATMUL_SIDE) in asked
    assert calibrate.workload_matmul("cpu", shapes)["median"] == 668.0


def test_a_rate_is_the_median_after_a_warm_up_with_its_spread():
    # a slow first call (warm-up), one for sizing, then 5 samples of one call: one slow sample
    seconds = iter([0.5, 0.02, 0.02, 0.2, 0.02, 0.02, 0.02])
    timing = calibrate.measure(lambda: time.sleep(next(seconds)), calls=1)
    assert (timing.samples, timing.calls_per_sample) == (5, 1)
    assert 0.02 <= timing.median < 0.1 and timing.fastest < 0.1  # neither the warm-up nor 0.2
    assert 0.2 <= timing.slowest < 0.45
    rate = timing.rate(1.0)
    assert rate["low"] < rate["median"] < rate["high"] and rate["spread_pct"] > 100


def test_samples_last_at_least_the_minimum():
    timing = calibrate.measure(lambda: time.sleep(0.001), repeats=3, min_sample_s=0.02)
    assert timing.calls_per_sample >= 2 and timing.samples == 3


def test_cpu_matmul_and_adam_rates_are_measured_here():
    matmul = calibrate.matmul_tflops("cpu", 256)
    adam = calibrate.cpu_adam_params_per_s(200_000, len(os.sched_getaffinity(0)))
    torch_adam = calibrate.torch_adam_params_per_s(200_000, len(os.sched_getaffinity(0)))
    check = calibrate.fp16_check_elems_per_s(200_000, len(os.sched_getaffinity(0)))
    for rate in (matmul, adam, torch_adam, check):
        assert 0 < rate["low"] <= rate["median"] <= rate["high"]
        assert rate["samples"] == calibrate.REPEATS and rate["spread_pct"] >= 0
    assert 1e-4 < matmul["median"] < 100  # a few cores, not a GPU
    assert 1e6 < adam["median"] < 1e11 and 1e6 < torch_adam["median"] < 1e11
    assert 1e6 < check["median"] < 1e12


def test_the_partition_is_laid_out_in_sub_groups_as_the_run_holds_it():
    groups = calibrate.partition_layout(25_000, sub_group=10_000)
    assert [m.numel() for m in groups] == [10_000, 10_000, 5_000]
    assert all(m.grad is not None and m.grad.shape == m.shape for m in groups)
    assert [m.numel() for m in calibrate.partition_layout(25_000)] == [25_000]  # flat


def test_the_steps_host_passes_are_measured_over_the_sub_groups():
    """calibrate.step_passes_at on this CPU: the unscale and the host copy of the master, both
    over the same sub-groups CPU Adam steps one at a time; no upload without a GPU."""
    cores = len(os.sched_getaffinity(0))
    groups = calibrate.partition_layout(300_000, sub_group=100_000)
    adam = calibrate.adam_rate("DeepSpeedCPUAdam", 300_000, cores, until_stable=True, groups=groups)
    passes = calibrate.step_passes_at(300_000, cores, "cpu", groups=groups)
    assert set(passes) == {"grad_unscale_params_per_s", "master_copy_params_per_s"}
    for rate in (adam, *passes.values()):
        assert 1e6 < rate["low"] <= rate["median"] <= rate["high"] < 1e12
        assert rate["params"] == 300_000 and isinstance(rate["settled"], bool)


def test_superoffloads_step_is_measured_through_deepspeeds_own_worker():
    """calibrate.superoffload_step_at on this CPU: DeepSpeed's SuperOffload worker (a spawned
    process) steps the sub-groups one round trip at a time; the rate of the parameters and the
    cost of a round trip come back apart, and this process's cores are given back."""
    affinity = os.sched_getaffinity(0)
    groups = calibrate.partition_layout(400_000, sub_group=200_000)
    before = [m.detach().clone() for m in groups]
    got = calibrate.superoffload_step_at(400_000, "cpu", groups)
    assert os.sched_getaffinity(0) == affinity
    assert set(got) == {"superoffload_step_params_per_s", "superoffload_sub_group_s"}
    rate, round_trip = got["superoffload_step_params_per_s"], got["superoffload_sub_group_s"]
    assert 1e5 < rate["low"] <= rate["median"] <= rate["high"] < 1e12
    assert rate["sub_groups"] == 2 and rate["samples"] == calibrate.REPEATS
    assert 1e-5 < round_trip["low"] <= round_trip["median"] <= round_trip["high"] < 1.0
    # the worker's Adam steps came back into the masters
    assert all(not m.detach().equal(b) for m, b in zip(groups, before, strict=True))


def test_disk_probe_writes_reads_and_removes_its_files(tmp_path):
    disk = calibrate.disk_gb_s(str(tmp_path), 4 * 2**20)
    assert disk["disk_bytes"] == calibrate.DISK_FILES * 4 * 2**20
    assert disk["disk_read_gb_s"] > 0 and disk["disk_write_gb_s"] > 0
    assert isinstance(disk["direct_io"], bool)  # O_DIRECT where the file system takes it
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_calibrates_this_machine_with_each_engines_host_probe(cpu_calibration):
    """The session's calibration (conftest.measure_calibration: this CLI, as the calibrate rule
    runs it, into a folder of its own; measuring it a second time here cost ~2 min of CI)."""
    out = Path(cpu_calibration)
    assert [p.name for p in out.parent.iterdir()] == ["calibration.json"]  # written atomically
    cal = contracts.read_calibration(out)
    assert cal.cluster == "local-cpu" and cal.accelerator == "cpu"
    assert cal.cpu_adam_threads == os.cpu_count()  # measure_calibration's --cores
    # every engine with a probe, for 1 and 2 ranks
    probing = [e.name for e in engines.engines() if e.host_probe is not None]
    assert sorted(cal.layer_host_s) == sorted(probing) and {"deepspeed", "fsdp2"} <= set(probing)
    probed = [cal.layer_host_s[e][ranks] for e in probing for ranks in ("1", "2")]
    layer_costs = [costs[k] for costs in probed for k in ("forward", "backward", "rest")]
    growth = ("forward_per_element", "backward_per_element", "rest_per_token")
    assert all(costs[k] >= 0 for costs in probed for k in growth)
    assert all((costs["tokens"], costs["layer_elements"]) == (64, 64 * 64) for costs in probed)
    for rate in (
        cal.matmul_tflops,
        cal.cpu_adam_params_per_s,
        cal.torch_adam_params_per_s,
        cal.fp16_check_elems_per_s,
        cal.grad_unscale_params_per_s,
        cal.master_copy_params_per_s,
        cal.disk_read_gb_s,
        cal.disk_write_gb_s,
        cal.collective_latency_s,
        cal.interconnect_gb_s,
        cal.page_fault_gb_s,
    ):
        assert math.isfinite(rate) and rate > 0
    assert 1e-6 < cal.collective_latency_s < 0.1
    # a rank's host runtime, measured in a fresh process (on an H200: 1.43 / 2.02-2.06 GiB)
    assert 0.1 < cal.runtime_at_init_gib < 8 and 0.1 < cal.runtime_gib < 8
    assert cal.runtime_gib >= 0.9 * cal.runtime_at_init_gib  # the first step adds, not frees
    assert "runtime" not in cal.provenance["probe_errors"]
    # seconds per layer forward and backward, and of the rest, per engine for 1 and 2 ranks
    assert len(layer_costs) == 6 * len(probing) and all(0 <= cost < 1 for cost in layer_costs)
    assert cal.h2d_gb_s is cal.d2h_gb_s is cal.pageable_h2d_gb_s is None  # no GPU here
    assert cal.master_upload_params_per_s is None
    assert cal.source.startswith("measured by offload_study.prediction.calibrate")
    spread = cal.provenance["spread"]
    for key in (
        "matmul_tflops",
        "cpu_adam_params_per_s",
        "torch_adam_params_per_s",
        "fp16_check_elems_per_s",
        "all-gather 2 KiB",
        "ZeRO-3, 1 rank(s), seq 32, 3 layer(s): forward",
        "FSDP2, 2 rank(s), seq 128, 1 layer(s): micro-step",
    ):
        assert spread[key]["low"] <= spread[key]["median"] <= spread[key]["high"]
    assert cal.provenance["sizes"]["adam"] * 16 >= 4 * cal.provenance["last_level_cache_bytes"]


def test_layer_costs_are_the_slope_and_intercept_of_two_engines():
    def timing(seconds):
        return calibrate.Timing(seconds, seconds, seconds, 1, 1)

    # 1 layer: forward 0.03 s, micro-step 0.1 s; 3 layers: forward 0.07 s, micro-step 0.2 s
    costs = calibrate._slope_costs(
        (1, (timing(0.03), timing(0.1))), (3, (timing(0.07), timing(0.2)))
    )
    assert costs == pytest.approx({"forward": 0.02, "backward": 0.03, "rest": 0.05})
    # a noisy sample never gives a negative cost
    noisy = calibrate._slope_costs(
        (1, (timing(0.05), timing(0.1))), (3, (timing(0.07), timing(0.1)))
    )
    assert noisy["backward"] == 0


def test_growth_with_size_is_per_element_of_a_layer_and_per_token_of_the_rest():
    small = {"forward": 0.002, "backward": 0.003, "rest": 0.006}
    large = {"forward": 0.004, "backward": 0.0024, "rest": 0.0084}  # backward: noise, shrank
    got = calibrate._size_costs(small, large)
    # 2 x 32 and 2 x 128 tokens of hidden 64: 4,096 and 16,384 elements
    assert got == pytest.approx(
        {
            **small,
            "layer_elements": 4096,
            "tokens": 64,
            "forward_per_element": 0.002 / 12288,
            "backward_per_element": 0.0,
            "rest_per_token": 0.0024 / 192,
        }
    )


def test_cli_needs_a_cluster_and_an_output():
    res = subprocess.run(
        [sys.executable, "-m", "offload_study.prediction.calibrate", "--cluster", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "--cluster and --out are required" in res.stderr


def test_the_page_fault_probe_times_fresh_pages_against_touched_ones():
    """calibrate.page_fault_gb_s: GB/s of pages the OS maps on their first write, from copies
    into an allocation over glibc's mmap threshold (fresh every call; here from host memory,
    on a GPU from the device); finite, and its spread's range holds its median."""
    from offload_study.prediction import calibrate, shared

    spread = calibrate.page_fault_gb_s("cpu")["page_fault_gb_s"]
    assert spread["bytes"] >= 2 * shared.MMAP_THRESHOLD_BYTES
    assert 0 < spread["low"] <= spread["median"] <= spread["high"] < math.inf


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_calibrations_say_where_their_numbers_come_from(path):
    cal = contracts.read_calibration(path)
    assert cal.cluster == path.stem and (CLUSTER_DIR / f"{path.stem}.yaml").is_file()
    assert cal.accelerator == "cuda" and cal.source.startswith("shipped")
    measured = {k for k, v in cal.to_dict().items() if isinstance(v, float)}
    assert measured <= set(cal.provenance), "every number needs its origin"


def test_a_file_that_is_not_a_calibration_is_refused(tmp_path):
    path = tmp_path / "calibration.json"
    contracts.write_json(path, {"schema_version": 99})
    with pytest.raises(StudyError, match="not a calibration file"):
        contracts.read_calibration(path)


def test_measure_until_stable_stops_once_the_last_samples_agree_or_at_its_cap():
    timing, settled = calibrate.measure_until_stable(
        lambda: time.sleep(0.002), window=3, spread=0.5, min_sample_s=0.0
    )
    assert settled and timing.samples == 3
    noisy = iter([0.001, 0.02] * 50)
    timing, settled = calibrate.measure_until_stable(
        lambda: time.sleep(next(noisy)), window=3, spread=0.01, max_samples=6, min_sample_s=0.0
    )
    assert not settled and timing.samples == 3 and timing.summary()["spread_pct"] > 50


def test_workload_of_a_study_is_its_partition_layer_shapes_and_buckets():
    work = calibrate.workload_of(
        str(REPO_ROOT / "config/config.yaml"), str(REPO_ROOT / "config/clusters")
    )
    assert work.adam_params > 0 and work.copy_bytes
    assert work.sub_group_params == 100_000_000  # the generated config's sub_group_size
    m, k, n = max(work.matmul_shapes, key=lambda s: s[0] * s[1] * s[2])
    assert m % 2 == 0 and k > 0 and n > 0
    assert calibrate.layer_matmuls(8, 4, 16, 2) == [
        (8, 4, 4),
        (8, 4, 4),
        (8, 4, 2),
        (8, 4, 2),
        (8, 4, 16),
        (8, 4, 16),
        (8, 16, 4),
    ]


def test_the_runtime_probe_measures_a_fresh_rank_at_both_moments():
    """calibrate.runtime_probe (a CUDA cluster's: a process of its own) run on this CPU: a
    tiny Llama's rank under torchrun, its resident memory at initialization and after a step."""
    runtime, why = calibrate.runtime_probe("cpu")
    assert why is None
    assert 0.1 < runtime["runtime_at_init_gib"] <= 1.1 * runtime["runtime_gib"] < 8
