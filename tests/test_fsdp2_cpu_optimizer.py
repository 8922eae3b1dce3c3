"""Optimizer-only CPU offload on FSDP2 (engines/fsdp2_cpu_optimizer: torchao's
CPUOffloadOptimizer). It cannot run without a CUDA GPU, so these tests cover everything up to
the launch: admission (refused on a CPU cluster, with fp16, with a ratio; accepted on a GPU
cluster behind SLURM), the settings the plan writes, and the memory and step-time model. Its
training runs are the device's (benchmarks/device/run_engines.sh)."""

from __future__ import annotations

import pytest
from builders import gpu_calibration
from conftest import make_spec

from offload_study import engines
from offload_study.core.study import StudyError
from offload_study.engines import fsdp2_cpu_optimizer
from offload_study.prediction import predict

OPTIMIZER_ONLY = {"engine": "fsdp2", "offload_optimizer": "cpu", "offload_param": "none"}
LLAMA_1B = {
    "config": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5504,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    }
}
CAL = gpu_calibration("example-slurm")


def gpu_spec(offload: dict, **study):
    """One run on the example SLURM cluster (CUDA; its nodes, not this machine, train)."""
    scenario = {"name": "s", "gpus_per_node": 1, "gradient_accumulation_steps": 1, **offload}
    return make_spec(
        "example-slurm",
        scenario,
        model=LLAMA_1B,
        seq_len=2048,
        micro_batch=4,
        gradient_checkpointing=True,
        **study,
    )


def refusal(cluster: str, scenario: dict, **study) -> str:
    with pytest.raises(StudyError) as info:
        make_spec(cluster, {"name": "s", **scenario}, **study)
    return str(info.value)


def test_the_path_is_fsdp2s_for_the_optimizer_alone():
    path = engines.get("fsdp2").path("cpu", "none")
    assert path.name == "cpu-optimizer" and "torchao" in path.label
    assert engines.get("deepspeed").path("cpu", "none").engine == "deepspeed"


@pytest.mark.refuses_bad_input
def test_a_cpu_cluster_refuses_it_naming_the_key():
    message = refusal("local-cpu", OPTIMIZER_ONLY)
    assert "scenarios[0].offload_optimizer" in message and "needs a CUDA GPU" in message
    assert "CPUOffloadPolicy" in message  # what runs there instead


@pytest.mark.refuses_bad_input
def test_fp16_and_a_ratio_are_refused_naming_their_keys():
    fp16 = refusal("example-slurm", OPTIMIZER_ONLY, dtype="fp16")
    assert "scenarios[0].offload_optimizer" in fp16 and "not fp16" in fp16
    ratio = refusal("example-slurm", {**OPTIMIZER_ONLY, "offload_optimizer_ratio": 0.5})
    assert "scenarios[0].offload_optimizer_ratio" in ratio and "engine fsdp2" in ratio


def test_the_plan_writes_its_settings():
    spec = gpu_spec(OPTIMIZER_ONLY)
    settings = engines.of(spec).build_config(spec)
    assert settings["offload"]["path"] == "cpu-optimizer"
    assert settings["fully_shard"]["param_dtype"] == "bfloat16"
    assert engines.of(spec).ops_needed(spec) == []


def test_the_model_keeps_weights_and_gradients_on_the_gpu_and_the_optimizer_on_the_host():
    """8 bytes a parameter on the GPU (fp32 weights and gradients), 16 on the host (pinned fp32
    copies of both, the Adam moments); between no offload (16 on the GPU) and CPUOffloadPolicy
    (the states on the host); the CPU step at the fused CPU Adam's rate, the optimizer off the GPU."""
    rows = {}
    for name, opt, param in [
        ("none", "none", "none"),
        ("opt", "cpu", "none"),
        ("all", "cpu", "cpu"),
    ]:
        spec = gpu_spec({"engine": "fsdp2", "offload_optimizer": opt, "offload_param": param})
        rows[name] = predict.predict(spec, engines.of(spec).build_config(spec), CAL)
    params, gib = spec.model_params, 2**30
    none, opt, everything = rows["none"], rows["opt"], rows["all"]
    assert none.gpu_gib - opt.gpu_gib == pytest.approx(8 * params / gib, rel=0.02)
    assert everything.gpu_gib + 4 * params / gib < opt.gpu_gib < none.gpu_gib
    assert opt.host_gib > 16 * params / gib > none.host_gib
    # fused CPU AdamW at the CPU Adam rate, and torchao's own work per offloaded tensor (the
    # 7 matrices of each of 24 layers, the embedding and the head; the norms stay on the GPU)
    own = 170 * fsdp2_cpu_optimizer.SECONDS_PER_TENSOR
    assert opt.optimizer_s == pytest.approx(params / 2e9 + own, rel=0.01)
    assert opt.step_time_s < everything.step_time_s  # no parameter copies per micro-step


def test_gradient_accumulation_costs_it_no_transfers():
    """The gradients accumulate on the GPU: more micro-steps add compute, no PCIe traffic."""
    one = gpu_spec(OPTIMIZER_ONLY)
    four = gpu_spec({**OPTIMIZER_ONLY, "gradient_accumulation_steps": 4}, global_batch=16)
    times = [predict.step_time(s, engines.of(s).build_config(s), CAL) for s in (one, four)]
    assert times[0].pcie_s == times[1].pcie_s > 0
    assert times[1].optimizer_s == times[0].optimizer_s
