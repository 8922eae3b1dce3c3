"""Validation before anything runs (issue 17): a corpus of bad studies and cluster descriptions,
each refused with one StudyError that names the key path, what was given and what is allowed,
before anything is written; the shipped studies still plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import CLUSTER_DIR, SMALL_LLAMA, make_spec
from conftest import REPO as REPO_ROOT
from test_plan import SHIPPED_STUDIES, shipped, with_change

from offload_study.admission.admit import admitted_plan, first_problem
from offload_study.core.study import SHOWN_CHARS, StudyError
from offload_study.planning import dsconfig, presets
from offload_study.planning.plan import Plan, write_scenario_files

NAN, INF = float("nan"), float("inf")
NVME = "scenarios[3]"  # the default study's NVMe scenario (config/config.yaml)
#: Words that say what is allowed instead (every refusal has one).
ALLOWED_WORDS = ("allowed", "expected", "must", "use ", "did you mean", "known")
BIG_SWEEP = {"reduce_bucket_size": list(range(1, 101)), "sub_group_size": list(range(1, 101))}

# (key path to change, bad value, words the one error must contain: the key path first)
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

# (cluster key to change, bad value, words): the default study on a bad local-cpu description
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


@pytest.fixture
def study() -> dict:
    return shipped("config/config.yaml")


def refusal(config: dict, cwd, cluster_dir=CLUSTER_DIR) -> str:
    """The one StudyError of planning ``config``; nothing may be written (cwd stays empty)."""
    with pytest.raises(StudyError) as info:
        admitted_plan(config, cluster_dir=cluster_dir)
    assert list(cwd.iterdir()) == [], "a refused plan wrote files"
    return first_problem(info.value)


def assert_says(message: str, words: list[str]) -> None:
    for word in words:
        assert word in message, message
    assert any(w in message for w in ALLOWED_WORDS), f"does not say what is allowed: {message}"
    assert len(message) < 4 * SHOWN_CHARS + 400, f"error text too long: {len(message)}"


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize(
    ("path", "value", "words"),
    STUDY_CASES,
    ids=[f"{p}={v!r}"[:70] for p, v, _ in STUDY_CASES],
)
def test_bad_study_is_refused_naming_the_key(study, path, value, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_says(refusal(with_change(study, path, value), tmp_path), words)


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize(
    ("path", "value", "words"),
    CLUSTER_CASES,
    ids=[f"{p}={v!r}"[:70] for p, v, _ in CLUSTER_CASES],
)
def test_bad_cluster_is_refused_naming_the_key(study, path, value, words, tmp_path, monkeypatch):
    cluster = yaml.safe_load((REPO_ROOT / "config/clusters/local-cpu.yaml").read_text())
    clusters, cwd = tmp_path / "clusters", tmp_path / "cwd"
    clusters.mkdir(), cwd.mkdir()
    # YAML writes NaN and infinity as .nan/.inf: the loader reads them back as floats
    (clusters / "local-cpu.yaml").write_text(yaml.safe_dump(with_change(cluster, path, value)))
    monkeypatch.chdir(cwd)
    message = refusal(study, cwd, cluster_dir=clusters)
    assert "local-cpu.yaml" in message
    assert_says(message, words)


BAD_FILES = sorted((REPO_ROOT / "tests/fixtures/bad").glob("*.yaml"))


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_study_files_are_refused(path, tmp_path, monkeypatch):
    """Study files as a user writes them (YAML 1.1: 5e8 is text, .nan is a float); the first
    line says what the one error must contain: ``# expect: word | word``."""
    words = path.read_text().splitlines()[0].removeprefix("# expect:").split("|")
    monkeypatch.chdir(tmp_path)
    assert_says(refusal(path, tmp_path), [w.strip() for w in words])


def test_the_corpus_is_large():
    assert len(STUDY_CASES) + len(CLUSTER_CASES) + len(BAD_FILES) >= 60


@pytest.mark.refuses_bad_input
def test_a_folder_without_config_json_is_refused(study, tmp_path):
    (tmp_path / "model").mkdir()
    config = with_change(study, "model", {"name_or_path": str(tmp_path / "model")})
    with pytest.raises(StudyError, match=r"model\.name_or_path: .*no usable config\.json"):
        admitted_plan(config)


def test_a_local_pretrained_folder_is_built_with_its_overrides(study, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    config = with_change(study, "model", {"name_or_path": str(folder)})
    assert Plan(config).runs[0].model.name_or_path == str(folder)
    config["model"]["overrides"] = {"num_layers": 2}
    with pytest.raises(StudyError, match=r"model\.overrides\.num_layers: not a key"):
        admitted_plan(config)


def test_an_existing_token_file_is_accepted(study, tmp_path):
    tokens = tmp_path / "tokens.npy"
    tokens.write_bytes(b"\x93NUMPY")
    assert Plan(with_change(study, "token_file", str(tokens))).runs[0].data.kind == "token_file"


def test_integral_floats_are_sizes_but_not_counts(study):
    """5.0e+8 is how YAML writes 5e8 as a number: a ZeRO size takes it (as the integer)."""
    plan = Plan(with_change(study, "zero", {"reduce_bucket_size": 5.0e8}))
    zero = dsconfig.build_ds_config(plan.runs[0])["zero_optimization"]
    assert zero["reduce_bucket_size"] == 500_000_000 and isinstance(zero["reduce_bucket_size"], int)


def test_distinct_sweep_values_keep_distinct_names(study):
    """Values that 6 digits would round to one name (1.23457e8) get names with every digit."""
    values = [123_456_789, 123_456_790]
    plan = Plan(with_change(study, "scenarios[1].sweep", {"reduce_bucket_size": values}))
    names = [r.scenario for r in plan.runs if r.base_scenario == "offload-opt-2rank"]
    assert names == ["offload-opt-2rank__rbs-1.23456789e8", "offload-opt-2rank__rbs-1.2345679e8"]


def test_max_runs_can_be_raised(study):
    sweep = {"reduce_bucket_size": list(range(1, 41)), "sub_group_size": list(range(1, 31))}
    config = with_change(study, "scenarios[1].sweep", sweep)
    with pytest.raises(StudyError, match="max_runs"):
        admitted_plan(config)
    config["max_runs"] = 2000
    assert len(Plan(config).runs) == 3 + 40 * 30


@pytest.mark.parametrize("study_path", SHIPPED_STUDIES)
def test_shipped_studies_still_plan(study_path):
    assert Plan(shipped(study_path)).runs


def test_compute_node_paths_are_left_to_the_run(study, tmp_path):
    """On a SLURM cluster the NVMe folder is on the compute node: the plan says so (plan.json
    node_checks) instead of checking this machine."""
    cluster = yaml.safe_load((REPO_ROOT / "config/clusters/test-slurm.yaml").read_text())
    cluster["nvme_path"] = "/proc/only-on-the-node"
    (tmp_path / "test-slurm.yaml").write_text(yaml.safe_dump(cluster))
    plan = Plan(with_change(study, "cluster", "test-slurm"), cluster_dir=tmp_path)
    (check,) = plan.summary()["node_checks"]
    assert "/proc/only-on-the-node" in check and "config_error" in check


@pytest.mark.refuses_bad_input
def test_the_run_checks_its_nvme_folder_first(tmp_path):
    """The runner's first act: an NVMe folder it cannot write -> config_error, nothing launched."""
    spec = make_spec(
        "local-cpu",
        {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": "/proc/nvme-x"},
        model={"config": dict(SMALL_LLAMA)},
    )
    spec_path, ds_path = tmp_path / "s.run.json", tmp_path / "s.json"
    write_scenario_files(spec, str(ds_path), str(spec_path))
    outdir = tmp_path / "results" / "local-cpu" / "test" / spec.scenario / "rep0"
    cmd = [sys.executable, "-m", "offload_study.training.runner", "--spec", str(spec_path),
           "--repeat", "0", "--outdir", str(outdir)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    metrics = json.loads((outdir / "metrics.json").read_text())
    assert metrics["outcome"] == "config_error", metrics["error_excerpt"]
    assert "/proc/nvme-x" in metrics["error_excerpt"] and metrics["steps_measured"] is None
    assert not (outdir / "logs" / "rank0.log").exists()


def test_presets_build_without_weights():
    for name in presets.PRESETS:
        presets._build_model({"preset": name})  # the builder itself, past the cache


def test_a_model_block_that_built_is_not_built_again(tmp_path, monkeypatch):
    """check_model remembers successes per content (the dry-run cost of importing transformers);
    a failure, or another block, is built (and judged) again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    good = {"preset": "tiny-llama"}
    presets.check_model(good)
    assert presets.checked_marker(good).is_file()
    monkeypatch.setattr(presets, "_build_model", lambda model: pytest.fail("built again"))
    presets.check_model(good)
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bad = {"preset": "tiny-llama", "overrides": {"num_attention_heads": 7}}
    for _ in range(2):  # never remembered: refused every time
        with pytest.raises(StudyError, match="model.overrides"):
            presets.check_model(bad)
    assert not presets.checked_marker(bad).exists()
