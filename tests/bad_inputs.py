"""The one corpus of bad inputs the tests feed the workflow, and how a test makes one.

Each entry names the key (or file) that is wrong and the words the one refusal must say;
test_plan.py drives BAD_INPUT through admission, test_validation.py STUDY_CASES, CLUSTER_CASES
and BAD_FILES (study files as a user writes them: ``# expect: word | word`` on their first line)
through the schema and admission; the counts add up in the test summary (marker
``refuses_bad_input``)."""

from __future__ import annotations

import copy
import re

import yaml
from conftest import REPO as REPO_ROOT
from conftest import SMALL_LLAMA

from offload_study.across.bundle import LIMITS

NAN, INF = float("nan"), float("inf")
BIG_SWEEP = {"reduce_bucket_size": list(range(1, 101)), "sub_group_size": list(range(1, 101))}
NVME = "scenarios[3]"  # the default study's NVMe scenario (config/config.yaml)

SHIPPED_STUDIES = ["config/config.yaml"] + sorted(
    str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "config" / "studies").glob("*.yaml")
)


def shipped(path: str) -> dict:
    return yaml.safe_load((REPO_ROOT / path).read_text())


def with_change(config: dict, path: str, value) -> dict:
    """Copy of config with one key set; path like 'scenarios[1].offload_optimizer'."""
    config = copy.deepcopy(config)
    for other, other_value in getattr(value, "also", {}).items():
        config = with_change(config, other, other_value)
    value = str(value) if isinstance(value, Together) else value
    node = config
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    for part in parts[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    last = parts[-1]
    if value is DELETE:
        del node[last]
    elif last.startswith("["):
        node[int(last[1:-1])] = value
    else:
        node[last] = value
    return config


class Deleted:
    """The value that removes its key. Its repr names it: test ids are made of reprs, and every
    pytest-xdist worker must collect the same ids (an object()'s repr holds its address)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = Deleted()


class Together(str):
    """A value set together with other changes (path -> value) that it depends on."""

    def __new__(cls, value: str, also: dict):
        self = super().__new__(cls, value)
        self.also = also
        return self

    def __repr__(self) -> str:  # distinct cases: the same value with other changes
        return f"{str.__repr__(self)}+{self.also!r}"


class Swept(Together):
    """A value that a sweep set together with it renames (the dry-run test holds them out)."""


# (change, value, words the one error message must contain)
BAD_INPUT = [
    ("steps", "ten", ["steps", "wrong type", "integer"]),
    ("seq_len", 0, ["seq_len", "too small", ">= 1"]),
    ("micro_batch", -2, ["micro_batch", "too small"]),
    ("global_batch", 0, ["global_batch", "too small"]),
    ("repeats", 0, ["repeats", "too small"]),
    ("dtype", "fp8", ["dtype", "'fp8'", "'fp16'", "'bf16'"]),
    ("stepz", 3, ["stepz", "unknown key"]),
    (
        "scenarios[1].offload_optimizer",
        "gpu",
        ["scenarios[1].offload_optimizer", "'none'", "'cpu'", "'nvme'"],
    ),
    ("scenarios[2].offload_param", "disk", ["scenarios[2].offload_param", "allowed values"]),
    ("scenarios[0].gpus", 2, ["scenarios[0].gpus", "unknown key", "gpus_per_node"]),
    ("scenarios[0].gpus_per_node", DELETE, ["scenarios[0].gpus_per_node", "required"]),
    ("scenarios[0].gpus_per_node", 0, ["scenarios[0].gpus_per_node", "too small"]),
    ("scenarios[0].gpu_mem_gb", -40, ["scenarios[0].gpu_mem_gb", "too small"]),
    ("scenarios[0].cpu_mem_gb", 0, ["scenarios[0].cpu_mem_gb", "too small"]),
    ("scenarios[1].name", "../evil", ["scenarios[1].name", "not a valid name"]),
    ("scenarios[1].name", "has space", ["scenarios[1].name", "not a valid name"]),
    ("scenarios[1].name", "a;rm -rf", ["scenarios[1].name", "not a valid name"]),
    ("scenarios[1].name", "..", ["scenarios[1].name", "not a valid name"]),
    ("scenarios[1].name", "a/b", ["scenarios[1].name", "not a valid name"]),
    ("study", "my study", ["study", "not a valid name"]),
    ("cluster", "../clusters/x", ["cluster", "not a valid name"]),
    ("model", {}, ["model", "exactly one of preset, config or name_or_path"]),
    ("model", {"preset": "llama2-7b", "name_or_path": "x"}, ["model", "exactly one"]),
    ("model", {"preset": "llama9-1t"}, ["model.preset", "llama2-7b"]),
    ("model", {"config": {"hidden_size": 8}}, ["model.config.model_type", "required"]),
    ("scenarios", [], ["scenarios", "should be non-empty"]),
    ("model", DELETE, ["model", "required"]),
    ("timeout_min", 0, ["timeout_min", "too small"]),
    ("zero", {"reduce_bucket_sise": 5e8}, ["zero.reduce_bucket_sise", "reduce_bucket_size"]),
    ("zero", {"stage": 2}, ["zero.stage", "set by the scenario"]),
    ("scenarios[1].zero", {"offload_optimizer": {}}, ["scenarios[1].zero.offload_optimizer"]),
    ("aio", {"thread_count": 8}, ["aio.thread_count", "intra_op_parallelism"]),
    ("aio", {"queue_dept": 8}, ["aio.queue_dept", "queue_depth"]),
    (
        "scenarios[0].sweep",
        {"reduce_bucket_sise": [1, 2]},
        ["scenarios[0].sweep.reduce_bucket_sise"],
    ),
    # engine fsdp2: keys of DeepSpeed's, offloads its one CPUOffloadPolicy cannot map
    ("scenarios[0].engine", "megatron", ["scenarios[0].engine", "'deepspeed'", "'fsdp2'"]),
    (
        "scenarios[0].engine",
        Together("fsdp2", {"scenarios[0].zero": {"reduce_bucket_size": 5e7}}),
        ["scenarios[0].zero", "DeepSpeed key", "engine fsdp2"],
    ),
    (
        "scenarios[0].engine",
        Together("fsdp2", {"scenarios[0].sweep": {"reduce_bucket_size": [5e7, 5e8]}}),
        ["scenarios[0].sweep.reduce_bucket_size", "engine fsdp2"],
    ),
    ("scenarios[3].engine", "fsdp2", ["scenarios[3].offload_optimizer", "nvme", "fsdp2"]),
    # optimizer-only CPU offload on fsdp2 (torchao) needs a CUDA GPU: the CPU cluster refuses it
    (
        "scenarios[1].engine",
        "fsdp2",
        ["scenarios[1].offload_optimizer", "CUDA GPU", "CPUOffloadPolicy"],
    ),
    (
        "scenarios[1].engine",
        Together(
            "fsdp2", {"scenarios[1].offload_optimizer": "none", "scenarios[1].offload_param": "cpu"}
        ),
        ["scenarios[1].offload_optimizer", "no offload path", "allowed"],
    ),
    (
        "scenarios[1].engine",
        Together(
            "fsdp2", {"scenarios[1].offload_param": "cpu", "scenarios[1].super_offload": True}
        ),
        ["scenarios[1].super_offload", "DeepSpeed key", "engine fsdp2"],
    ),
    (
        "scenarios[2].engine",
        Together("fsdp2", {"scenarios[2].offload_optimizer_ratio": 0.5}),
        ["scenarios[2].offload_optimizer_ratio", "engine fsdp2"],
    ),
    ("scenarios[0].sweep", {"micro_batch": []}, ["scenarios[0].sweep.micro_batch"]),
    ("scenarios[0].sweep", {"micro_batch": [0]}, ["scenarios[0].sweep.micro_batch", "positive"]),
    ("baseline", "nope", ["baseline", "'nope'", "zero3-2rank"]),
    (
        "scenarios[1].name",
        Together("zero3-2rank__mb-1", {"scenarios[0].sweep": {"micro_batch": [1, 2]}}),
        ["scenarios[1].name", "scenarios[0].name 'zero3-2rank'", "expand to the same name"],
    ),
    ("scenarios[0].reference", {"speed_pct": "fast"}, ["scenarios[0].reference.speed_pct"]),
    # input that passes the schema but makes no sense (admission, not the schema, refuses it)
    ("seq_len", 100_000, ["seq_len", "max_position_embeddings (512)"]),
    ("global_batch", 10**30, ["global_batch", "64-bit", "no cluster can run it"]),
    ("scenarios[1].gpus_per_node", 3, ["scenarios[1].gpus_per_node", "local-cpu", "(2)"]),
    ("scenarios[0].gpu_mem_gb", 1e308, ["scenarios[0].gpu_mem_gb", "overflows"]),
    ("scenarios[0].cpu_mem_gb", 10**400, ["scenarios[0].cpu_mem_gb", "overflows"]),
    (
        "baseline",
        Swept("zero3-2rank", {"scenarios[0].sweep": {"micro_batch": [1, 2]}}),
        ["baseline: 'zero3-2rank'", "zero3-2rank__mb-1, zero3-2rank__mb-2"],
    ),
]


STUDY_CASES = [
    # exact types: a count is an integer, a boolean is a boolean
    ("seq_len", 2048.0, ["seq_len", "2048.0", "integer"]),
    ("micro_batch", 2.0, ["micro_batch", "integer"]),
    ("global_batch", 8.0, ["global_batch", "integer"]),
    ("repeats", True, ["repeats", "True", "boolean"]),
    ("seed", 1.0, ["seed", "integer"]),
    ("warmup_steps", 1.5, ["warmup_steps", "integer"]),
    ("max_runs", 1.0e3, ["max_runs", "integer"]),
    ("gradient_checkpointing", "yes", ["gradient_checkpointing", "'yes'", "boolean"]),
    ("gradient_checkpointing", 1, ["gradient_checkpointing", "boolean"]),
    ("strict", "false", ["strict", "boolean"]),
    ("timeout_min", True, ["timeout_min", "boolean"]),
    ("measure.min_steps", 10.0, ["measure.min_steps", "integer"]),
    ("measure.settle_window", True, ["measure.settle_window", "integer"]),
    ("scenarios[0].gpus_per_node", 2.0, ["scenarios[0].gpus_per_node", "integer"]),
    ("scenarios[0].nodes", True, ["scenarios[0].nodes", "boolean"]),
    ("scenarios[0].micro_batch", 1.0, ["scenarios[0].micro_batch", "integer"]),
    ("scenarios[0].cpu_mem_gb", "8GB", ["scenarios[0].cpu_mem_gb", "'8GB'", "number"]),
    ("scenarios[1].pin_memory", "true", ["scenarios[1].pin_memory", "boolean"]),
    ("optimizer", {"lr": "1e-4"}, ["optimizer.lr", "'1e-4'", "number"]),
    ("optimizer", {"lr": True}, ["optimizer.lr", "boolean"]),
    # NaN and infinity, anywhere
    ("timeout_min", NAN, ["timeout_min", "nan", "finite"]),
    ("timeout_min", INF, ["timeout_min", "inf", "finite"]),
    ("step_timeout_s", INF, ["step_timeout_s", "inf"]),
    ("scenarios[0].cpu_mem_gb", NAN, ["scenarios[0].cpu_mem_gb", "nan"]),
    ("scenarios[0].gpu_mem_gb", INF, ["scenarios[0].gpu_mem_gb", "inf"]),
    ("optimizer", {"lr": NAN}, ["optimizer.lr", "nan"]),
    ("optimizer", {"weight_decay": -INF}, ["optimizer.weight_decay", "-inf"]),
    ("measure.target_ci_pct", NAN, ["measure.target_ci_pct", "nan"]),
    ("zero", {"reduce_bucket_size": NAN}, ["zero.reduce_bucket_size", "nan"]),
    ("aio", {"block_size": INF}, ["aio.block_size", "inf"]),
    (
        "scenarios[1].sweep",
        {"reduce_bucket_size": [5.0e8, NAN]},
        ["scenarios[1].sweep.reduce_bucket_size[1]", "nan"],
    ),
    # negative sizes and timeouts
    ("optimizer", {"lr": -1e-4}, ["optimizer.lr", "too small", "> 0"]),
    ("optimizer", {"weight_decay": -0.1}, ["optimizer.weight_decay", "too small"]),
    ("step_timeout_s", -5, ["step_timeout_s", "too small"]),
    ("timeout_min", -1, ["timeout_min", "too small"]),
    ("optimizer", {"type": "SGD"}, ["optimizer.type", "'SGD'", "'AdamW'"]),
    ("optimizer", {"betas": [0.9, 0.99]}, ["optimizer.betas", "unknown key"]),
    # ZeRO knobs: type and range, stricter than DeepSpeed
    ("zero", {"reduce_bucket_size": True}, ["zero.reduce_bucket_size", "True", "not a number"]),
    ("zero", {"reduce_bucket_size": 0.5}, ["zero.reduce_bucket_size", "0.5", "whole number"]),
    ("zero", {"reduce_bucket_size": "5e8"}, ["zero.reduce_bucket_size", "'5e8'", "as text"]),
    ("zero", {"reduce_bucket_size": "500MB"}, ["zero.reduce_bucket_size", "'500MB'", "number"]),
    ("zero", {"reduce_bucket_size": 0}, ["zero.reduce_bucket_size", ">= 1"]),
    ("zero", {"stage3_prefetch_bucket_size": -1}, ["zero.stage3_prefetch_bucket_size", ">= 1"]),
    ("zero", {"sub_group_size": 0}, ["zero.sub_group_size", "out of range"]),
    ("zero", {"stage3_max_live_parameters": 1.5}, ["zero.stage3_max_live_parameters", "1.5"]),
    (
        "zero",
        {"stage3_param_persistence_threshold": -100},
        ["zero.stage3_param_persistence_threshold", ">= 0"],
    ),
    ("zero", {"stage3_max_reuse_distance": 1e30}, ["zero.stage3_max_reuse_distance", "64-bit"]),
    ("zero", {"overlap_comm": "yes"}, ["zero.overlap_comm", "'yes'", "boolean"]),
    ("zero", {"contiguous_gradients": 1}, ["zero.contiguous_gradients", "boolean"]),
    ("zero", {"cpu_offload": True}, ["zero.cpu_offload", "deprecated", "offload_optimizer"]),
    (
        "zero",
        {"cpu_offload_param": True},
        ["zero.cpu_offload_param", "deprecated", "offload_param"],
    ),
    (
        "zero",
        {"cpu_offload_use_pin_memory": True},
        ["zero.cpu_offload_use_pin_memory", "deprecated", "pin_memory"],
    ),
    (
        "zero",
        {"stage3_gather_fp16_weights_on_model_save": True},
        ["zero.stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"],
    ),
    (
        "scenarios[1].zero",
        {"reduce_bucket_size": True},
        ["scenarios[1].zero.reduce_bucket_size", "not a number"],
    ),
    ("scenarios[1].zero", {"cpu_offload": True}, ["scenarios[1].zero.cpu_offload", "deprecated"]),
    (
        "scenarios[1].sweep",
        {"reduce_bucket_size": [5.0e8, True]},
        ["scenarios[1].sweep.reduce_bucket_size[1]", "True"],
    ),
    (
        "scenarios[1].sweep",
        {"stage3_prefetch_bucket_size": ["5e8"]},
        ["scenarios[1].sweep.stage3_prefetch_bucket_size[0]", "'5e8'"],
    ),
    (
        "scenarios[1].sweep",
        {"cpu_offload": [True]},
        ["scenarios[1].sweep.cpu_offload", "deprecated"],
    ),
    (
        "scenarios[1].sweep",
        {"micro_batch": [1, 2.0]},
        ["scenarios[1].sweep.micro_batch[1]", "2.0", "whole number"],
    ),
    (
        "scenarios[1].sweep",
        {"gradient_accumulation_steps": [True]},
        ["scenarios[1].sweep.gradient_accumulation_steps[0]", "True"],
    ),
    # aio: type and range
    ("aio", {"block_size": -1}, ["aio.block_size", "-1", ">= 1"]),
    ("aio", {"block_size": 0}, ["aio.block_size", ">= 1"]),
    ("aio", {"queue_depth": 8.5}, ["aio.queue_depth", "8.5", "whole number"]),
    ("aio", {"queue_depth": "8"}, ["aio.queue_depth", "'8'", "not a number"]),
    ("aio", {"intra_op_parallelism": 0}, ["aio.intra_op_parallelism", ">= 1"]),
    ("aio", {"single_submit": "no"}, ["aio.single_submit", "'no'", "boolean"]),
    ("aio", {"use_gds": 1}, ["aio.use_gds", "boolean"]),
    ("aio", {"overlap_events": None}, ["aio.overlap_events", "None", "boolean"]),
    # NVMe folders: text, then (cluster local: this machine) existence and writability
    (f"{NVME}.nvme_path", "", [f"{NVME}.nvme_path", "''", "empty"]),
    ("scenarios[0].nvme_path", "  ", ["scenarios[0].nvme_path", "empty"]),
    (f"{NVME}.nvme_path", "nvme/swap", [f"{NVME}.nvme_path", "'nvme/swap'", "relative"]),
    (f"{NVME}.nvme_path", "/tmp/../etc/x", [f"{NVME}.nvme_path", "'..'"]),
    (f"{NVME}.nvme_path", "/proc/offload-study", [f"{NVME}.nvme_path", "cannot write in /proc"]),
    (f"{NVME}.nvme_path", "/etc/hostname/x", [f"{NVME}.nvme_path", "is not a folder"]),
    (f"{NVME}.nvme_path", 5, [f"{NVME}.nvme_path", "wrong type"]),
    # models: built as transformers configs (no weights, no network) when the plan is made
    ("model", {"preset": "tiny-lama"}, ["model.preset", "'tiny-lama'", "tiny-llama"]),
    (
        "model",
        {"config": {**SMALL_LLAMA, "model_type": "lama"}},
        ["model.config.model_type", "'lama'", "did you mean", "'llama'"],
    ),
    (
        "model",
        {"preset": "tiny-llama", "overrides": {"num_hiden_layers": 2}},
        ["model.overrides.num_hiden_layers", "LlamaConfig", "'num_hidden_layers'"],
    ),
    (
        "model",
        {"config": {**SMALL_LLAMA, "hiden_size": 64}},
        ["model.config.hiden_size", "'hidden_size'"],
    ),
    (
        "model",
        {"preset": "tiny-llama", "overrides": {"num_attention_heads": 5}},
        ["model.overrides.num_attention_heads", "5 heads", "hidden_size 128"],
    ),
    (
        "model",
        {"config": {**SMALL_LLAMA, "num_key_value_heads": 3}},
        ["model.config.num_key_value_heads", "num_attention_heads 4"],
    ),
    (
        "model",
        {"preset": "tiny-llama", "overrides": {"hidden_size": 128.0}},
        ["model.overrides.hidden_size", "int"],
    ),
    (
        "model",
        {"config": {"model_type": "gpt2", "n_embd": 100, "n_head": 3}},
        ["model.config.n_head", "hidden_size 100"],
    ),
    (
        # the config builds, the model does not: phi3's padding token is its own vocabulary's
        "model",
        {"config": {**SMALL_LLAMA, "model_type": "phi3"}},
        ["model.config.pad_token_id", "32000 (Phi3Config's default)", "vocab_size"],
    ),
    ("model", {"name_or_path": "/no/such/model"}, ["model.name_or_path", "no such folder"]),
    (
        "model",
        {"name_or_path": "someone/not-downloaded-model"},
        ["model.name_or_path", "not in the local Hugging Face cache", "download"],
    ),
    ("model", {"name_or_path": ""}, ["model.name_or_path", "too short"]),
    ("token_file", "/no/such/tokens.npy", ["token_file", "'/no/such/tokens.npy'", "no such file"]),
    ("token_file", 7, ["token_file", "wrong type"]),
    # limits: the number of runs, counted before expanding
    ("scenarios[1].sweep", BIG_SWEEP, ["max_runs", "10003 runs", "scenarios[1].sweep", "10000"]),
    ("repeats", 400, ["max_runs", "1600 runs", "at most max_runs = 1000"]),
    ("max_runs", 0, ["max_runs", "too small"]),
    # names: a full match (a trailing newline is not a valid name)
    ("study", "default-cpu\n", ["study", "not a valid name"]),
    ("scenarios[0].name", "zero3-2rank\n", ["scenarios[0].name", "not a valid name"]),
    ("cluster", "local-cpu\n", ["cluster", "not a valid name"]),
    (
        "scenarios[0].sweep",
        {"reduce_bucket_size\n": [1]},
        ["scenarios[0].sweep", "not a valid key name", "lowercase"],
    ),
    ("zero", {"reduce_bucket_size\n": 1}, ["zero", "not a valid key name"]),
]


CLUSTER_CASES = [
    ("mem_gb_per_node", NAN, ["mem_gb_per_node", "nan"]),
    ("mem_gb_per_node", INF, ["mem_gb_per_node", "inf"]),
    ("mem_gb_per_node", -1, ["mem_gb_per_node", "too small"]),
    ("gpu_mem_gb", INF, ["gpu_mem_gb", "inf"]),
    ("nvme_capacity_gb", NAN, ["nvme_capacity_gb", "nan"]),
    ("nvme_capacity_gb", 0, ["nvme_capacity_gb", "too small"]),
    ("peak_tflops", -5, ["peak_tflops", "too small"]),
    ("gpus_per_node", 2.0, ["gpus_per_node", "integer"]),
    ("nodes", True, ["nodes", "boolean"]),
    ("cpu_cores_per_node", 16.0, ["cpu_cores_per_node", "integer"]),
    ("slurm", {"max_runtime_min": INF}, ["slurm.max_runtime_min", "inf"]),
    ("slurm", {"max_runtime_min": 60.0}, ["slurm.max_runtime_min", "integer"]),
    ("slurm", {"cpus_per_gpu": 1.5}, ["slurm.cpus_per_gpu", "integer"]),
    ("slurm", {"cpus_per_gpu": 0}, ["slurm.cpus_per_gpu", "too small"]),
    ("name", "local-cpu\n", ["name", "not a valid name"]),
    ("accelerator", "tpu", ["accelerator", "'tpu'", "'cuda'"]),
    ("nvme_path", "", ["nvme_path (config/clusters/local-cpu.yaml)", "empty"]),
    ("nvme_path", "scratch", ["nvme_path (config/clusters/local-cpu.yaml)", "relative"]),
    ("nvme_path", "/scratch/../x", ["nvme_path (config/clusters/local-cpu.yaml)", "'..'"]),
    ("nvme_path", "/proc/nvme", ["nvme_path (config/clusters/local-cpu.yaml)", "cannot write"]),
]


BAD_FILES = sorted((REPO_ROOT / "tests/fixtures/bad").glob("*.yaml"))


#: Members a bundle from elsewhere may hold that extraction refuses, each with the words of its
#: one error (which also names the bundle file and the member): member below the bundle's top
#: folder (one the bundle has is replaced), a function making its bytes (made when used: one is
#: 64 MiB), words. The JSON is refused on its bytes, before a parser recurses.
BAD_BUNDLE_MEMBERS = {
    "deep-json": (
        "results/unit-cluster/unit-study/base/rep0/metrics.json",
        lambda: b"[" * 100_000 + b"]" * 100_000,
        [f"JSON nested deeper than {LIMITS.json_depth} levels"],
    ),
    "path-traversal": ("../../escaped.txt", lambda: b"x", ["'..'"]),
    "oversized-json": (
        "results/unit-cluster/unit-study/plan.json",
        lambda: b" " * (LIMITS.json_bytes + 1),
        [f"larger than {LIMITS.json_bytes} bytes"],
    ),
}
