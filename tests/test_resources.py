"""Unit tests for offload_study.planning.resources (run spec + cluster -> slurm plugin resources)."""

from dataclasses import replace

import pytest
from conftest import make_spec

from offload_study.core import architecture
from offload_study.core.study import StudyError
from offload_study.planning.resources import (
    MEM_HEADROOM_MIB,
    check_fits,
    resource_keys,
    rule_resources,
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
#: Room for every scenario below, so the planner accepts them; check_fits then meets GPU_CLUSTER.
BIG_CLUSTER = dict(
    GPU_CLUSTER, name="big", gpus_per_node=16, nodes=8, mem_gb_per_node=4000, cpu_cores_per_node=192
)


def spec(cluster=GPU_CLUSTER, timeout_min=30, **scenario):
    """A planned run: 2 GPUs, 64 GiB host memory, 30 min, unless told otherwise."""
    scenario = {"name": "cpu-offload-opt", "gpus_per_node": 2, "cpu_mem_gb": 64, **scenario}
    return make_spec(cluster, scenario, timeout_min=timeout_min)


def test_gpu_single_node():
    r = train_resources(spec(), GPU_CLUSTER)
    assert r == {
        "nodes": 1,
        "mem_mb": 64 * 1024 + MEM_HEADROOM_MIB,
        "runtime": 30 + 10,
        "cpus_per_task": 24,
        "gres": "gpu:h200:2",
        "slurm_partition": "gpu",
        "qos": "normal",
        "slurm_extra": "--exclusive",
    }
    assert set(r) == set(resource_keys(GPU_CLUSTER))


def test_gpu_multi_node_gres_is_per_node():
    r = train_resources(spec(nodes=2, gpus_per_node=8), GPU_CLUSTER)
    assert r["gres"] == "gpu:h200:8"
    assert r["nodes"] == 2
    assert r["cpus_per_task"] == 96
    assert "tasks" not in r  # would become --ntasks-per-gpu on a GPU job


def test_untyped_gres_and_core_share():
    cl = dict(GPU_CLUSTER, slurm={"partition": None})
    r = train_resources(spec(cl, gpus_per_node=4), cl)
    assert r["gres"] == "gpu:4"
    assert r["cpus_per_task"] == 48  # half the GPUs -> half the 96 cores
    assert "slurm_partition" not in r and "qos" not in r and "constraint" not in r


def test_cpu_cluster_ranks_get_cpus_and_no_gpu():
    r = train_resources(spec(CPU_CLUSTER, timeout_min=10, cpu_mem_gb=4), CPU_CLUSTER)
    assert r == {
        "nodes": 1,
        "tasks": 1,
        "cpus_per_task": 2,
        "mem_mb": 4 * 1024 + MEM_HEADROOM_MIB,
        "runtime": 20,
    }
    assert "gres" not in r and "gpu" not in r


def test_runtime_capped_and_margin():
    r = train_resources(spec(timeout_min=180), GPU_CLUSTER)
    assert r["runtime"] == 120
    cl = dict(GPU_CLUSTER, slurm={})
    r = train_resources(spec(cl, timeout_min=200), cl)
    assert r["runtime"] == 220  # 10 % margin above 100 min


def test_mem_headroom_capped_at_node():
    cl = dict(GPU_CLUSTER, mem_gb_per_node=64)
    assert train_resources(spec(cl, cpu_mem_gb=64), cl)["mem_mb"] == 64 * 1024


@pytest.mark.parametrize(
    "planned, key",
    [
        (lambda: spec(BIG_CLUSTER, name="big-one", gpus_per_node=9), "gpus_per_node=9"),
        (lambda: spec(BIG_CLUSTER, name="big-one", nodes=5), "nodes=5"),
        (lambda: spec(BIG_CLUSTER, name="big-one", cpu_mem_gb=2000), "cpu_mem_gb=2000"),
        (lambda: spec(CPU_CLUSTER, name="big-one"), "accelerator='cpu'"),
        (lambda: replace(spec(name="big-one"), world_size=3), "world_size=3"),
    ],
    ids=["gpus", "nodes", "cpu_mem", "accelerator", "world_size"],
)
def test_check_fits_names_scenario_and_key(planned, key):
    run = planned()
    with pytest.raises(StudyError) as e:
        check_fits(run, GPU_CLUSTER)
    assert "big-one" in str(e.value) and key in str(e.value)
    with pytest.raises(StudyError):
        train_resources(run, GPU_CLUSTER)


def test_cpu_ranks_more_than_cores():
    run = spec(dict(CPU_CLUSTER, gpus_per_node=8), gpus_per_node=4)
    cl = dict(CPU_CLUSTER, gpus_per_node=8, cpu_cores_per_node=2)
    with pytest.raises(StudyError, match="cpu_cores_per_node=2"):
        check_fits(run, cl)


def test_plan_refuses_what_resources_refuse():
    """One fit rule: the planner refuses a scenario that train_resources would refuse."""
    cl = dict(CPU_CLUSTER, gpus_per_node=8, cpu_cores_per_node=2)
    with pytest.raises(StudyError, match=r"scenarios\[0\]\.gpus_per_node: .*cpu_cores_per_node=2"):
        spec(cl, gpus_per_node=4)


def test_nvme_capacity_refuses_only_the_clearly_impossible():
    nvme = {"offload_optimizer": "nvme", "nvme_path": "/scratch"}
    # SMALL_LLAMA (~0.1 M parameters) needs ~2 MiB of optimizer swap files: fits 1 GiB
    assert spec(dict(GPU_CLUSTER, nvme_capacity_gb=1), **nvme).nvme_capacity_gb == 1
    seven_b = {"model": {"preset": "llama2-7b"}, "timeout_min": 30}
    with pytest.raises(StudyError) as e:  # 6.74e9 params x 16 B = 100.4 GiB > 60 GiB
        make_spec(dict(GPU_CLUSTER, nvme_capacity_gb=60), {"name": "n", **nvme}, **seven_b)
    assert "scenarios[0].offload_optimizer" in str(e.value) and "nvme_capacity_gb=60" in str(
        e.value
    )
    # the same on two nodes: 50.2 GiB each
    run = make_spec(
        dict(GPU_CLUSTER, nvme_capacity_gb=60), {"name": "n", "nodes": 2, **nvme}, **seven_b
    )
    assert run.nvme_capacity_gb == 60


def test_nvme_capacity_counts_a_model_of_any_architecture():
    """A mixture of experts (no layout for the predictor) and another dense architecture are
    counted as transformers builds them when their NVMe need is judged (the plan counts a
    Llama's alone)."""
    nvme = {"offload_optimizer": "nvme", "nvme_path": "/scratch"}
    wide = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8}
    heads = {"num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
    moe = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    for model in ({**moe, **wide, **heads}, {"model_type": "qwen2", **wide, **heads}):
        study = {"model": {"config": model}, "timeout_min": 30}
        run = make_spec(dict(GPU_CLUSTER, nvme_capacity_gb=100), {"name": "n", **nvme}, **study)
        need_gib = architecture.param_count(run.model) * 16 / 2**30
        assert need_gib > 1  # mixtral: 3.4 B parameters, 51 GiB; qwen2: 0.62 B, 9.2 GiB
        with pytest.raises(StudyError, match=r"scenarios\[0\]\.offload_optimizer: .*=1\b"):
            make_spec(dict(GPU_CLUSTER, nvme_capacity_gb=1), {"name": "n", **nvme}, **study)


def test_bad_gres_type():
    cl = dict(GPU_CLUSTER, slurm={"gres_type": "h200;rm"})
    with pytest.raises(StudyError, match="gres_type"):
        train_resources(spec(), cl)


def test_rule_resources_plain_values_where_all_runs_agree():
    specs = {"a": spec(name="a"), "b": spec(name="b", gpus_per_node=8)}
    by_scenario = {name: train_resources(s, GPU_CLUSTER) for name, s in specs.items()}

    class WC:
        def __init__(self, s):
            self.scenario = s

    res = rule_resources(by_scenario, GPU_CLUSTER)
    assert set(res) == set(resource_keys(GPU_CLUSTER))
    assert res["gres"](WC("a")) == "gpu:h200:2"
    assert res["gres"](WC("b")) == "gpu:h200:8"
    assert res["nodes"] == 1  # the same for both runs: a plain value, no per-job call
    refused = rule_resources(by_scenario, GPU_CLUSTER, scenario_of=lambda wc: "nope")
    with pytest.raises(KeyError):
        refused["gres"](WC("a"))


def test_mem_without_budget():
    assert train_resources(spec(cpu_mem_gb=None), GPU_CLUSTER)["mem_mb"] == 1500 * 1024
    r = train_resources(spec(CPU_CLUSTER, cpu_mem_gb=None), CPU_CLUSTER)
    assert r["mem_mb"] == 2 * 3072
