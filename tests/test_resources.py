"""Unit tests for offload_study.resources (run spec + cluster -> slurm plugin resources)."""

import pytest

from offload_study.resources import (
    MEM_HEADROOM_MB,
    check_fits,
    resource_callables,
    resource_keys,
    train_resources,
)

GPU_CLUSTER = {
    "name": "gpu-h200",
    "accelerator": "cuda",
    "gpus_per_node": 8,
    "nodes": 4,
    "cpu_cores_per_node": 96,
    "mem_gb_per_node": 1500,
    "slurm": {
        "partition": "gpu",
        "gres_type": "h200",
        "cpus_per_gpu": 12,
        "max_runtime_min": 120,
        "account": None,
        "qos": "normal",
        "constraint": None,
        "slurm_extra": "--exclusive",
    },
}
CPU_CLUSTER = {"name": "local-cpu", "accelerator": "cpu", "gpus_per_node": 2, "nodes": 1}


def spec(**kw):
    base = {
        "scenario": "cpu-offload-opt",
        "nodes": 1,
        "gpus_per_node": 2,
        "world_size": 2,
        "accelerator": "cuda",
        "cpu_mem_gb": 64,
        "timeout_s": 1800,
    }
    base.update(kw)
    return base


def test_gpu_single_node():
    r = train_resources(spec(), GPU_CLUSTER)
    assert r == {
        "nodes": 1,
        "mem_mb": 64 * 1024 + MEM_HEADROOM_MB,
        "runtime": 30 + 10,
        "cpus_per_task": 24,
        "gres": "gpu:h200:2",
        "slurm_partition": "gpu",
        "qos": "normal",
        "slurm_extra": "--exclusive",
    }
    assert set(r) == set(resource_keys(GPU_CLUSTER))


def test_gpu_multi_node_gres_is_per_node():
    r = train_resources(spec(nodes=2, gpus_per_node=8, world_size=16), GPU_CLUSTER)
    assert r["gres"] == "gpu:h200:8"
    assert r["nodes"] == 2
    assert r["cpus_per_task"] == 96
    assert "tasks" not in r  # would become --ntasks-per-gpu on a GPU job


def test_untyped_gres_and_core_share():
    cl = dict(GPU_CLUSTER, slurm={"partition": None})
    r = train_resources(spec(gpus_per_node=4, world_size=4), cl)
    assert r["gres"] == "gpu:4"
    assert r["cpus_per_task"] == 48  # half the GPUs -> half the 96 cores
    assert "slurm_partition" not in r and "qos" not in r and "constraint" not in r


def test_cpu_cluster_ranks_get_cpus_and_no_gpu():
    r = train_resources(spec(accelerator="cpu", cpu_mem_gb=4, timeout_s=600), CPU_CLUSTER)
    assert r == {
        "nodes": 1,
        "tasks": 1,
        "cpus_per_task": 2,
        "mem_mb": 4 * 1024 + MEM_HEADROOM_MB,
        "runtime": 20,
    }
    assert "gres" not in r and "gpu" not in r


def test_runtime_capped_and_margin():
    r = train_resources(spec(timeout_s=3 * 3600), GPU_CLUSTER)
    assert r["runtime"] == 120
    r = train_resources(spec(timeout_s=200 * 60), dict(GPU_CLUSTER, slurm={}))
    assert r["runtime"] == 220  # 10 % margin above 100 min
    r = train_resources(spec(timeout_s=None), dict(GPU_CLUSTER, slurm={}))
    assert r["runtime"] == 24 * 60


def test_mem_headroom_capped_at_node():
    cl = dict(GPU_CLUSTER, mem_gb_per_node=64)
    assert train_resources(spec(cpu_mem_gb=64), cl)["mem_mb"] == 64 * 1024


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"gpus_per_node": 9, "world_size": 9}, "gpus_per_node=9"),
        ({"nodes": 5, "world_size": 10}, "nodes=5"),
        ({"cpu_mem_gb": 2000}, "cpu_mem_gb=2000"),
        ({"accelerator": "cpu"}, "accelerator='cpu'"),
        ({"world_size": 3}, "world_size=3"),
    ],
)
def test_check_fits_names_scenario_and_key(kw, key):
    with pytest.raises(ValueError) as e:
        check_fits(spec(scenario="big-one", **kw), GPU_CLUSTER)
    assert "big-one" in str(e.value) and key in str(e.value)
    with pytest.raises(ValueError):
        train_resources(spec(scenario="big-one", **kw), GPU_CLUSTER)


def test_cpu_ranks_more_than_cores():
    cl = dict(CPU_CLUSTER, gpus_per_node=8, cpu_cores_per_node=2)
    with pytest.raises(ValueError, match="cpu_cores_per_node=2"):
        check_fits(spec(accelerator="cpu", gpus_per_node=4, world_size=4), cl)


def test_bad_gres_type():
    cl = dict(GPU_CLUSTER, slurm={"gres_type": "h200;rm"})
    with pytest.raises(ValueError, match="gres_type"):
        train_resources(spec(), cl)


def test_resource_callables():
    specs = {"a": spec(scenario="a"), "b": spec(scenario="b", gpus_per_node=8, world_size=8)}

    class WC:
        def __init__(self, s):
            self.scenario = s

    fns = resource_callables(lambda wc: specs[wc.scenario], GPU_CLUSTER)
    assert set(fns) == set(resource_keys(GPU_CLUSTER))
    assert fns["gres"](WC("a")) == "gpu:h200:2"
    assert fns["gres"](WC("b")) == "gpu:h200:8"


def test_mem_without_budget():
    assert train_resources(spec(cpu_mem_gb=None), GPU_CLUSTER)["mem_mb"] == 1500 * 1024
    r = train_resources(spec(accelerator="cpu", cpu_mem_gb=None), CPU_CLUSTER)
    assert r["mem_mb"] == 2 * 3072
