"""Validation before anything runs: a corpus of bad studies and cluster descriptions,
each refused with one StudyError that names the key path, what was given and what is allowed,
before anything is written; the shipped studies still plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from bad_inputs import (
    BAD_FILES,
    BAD_INPUT,
    CLUSTER_CASES,
    SHIPPED_STUDIES,
    STUDY_CASES,
    shipped,
    with_change,
)
from conftest import CLUSTER_DIR, SMALL_LLAMA, make_spec
from conftest import REPO as REPO_ROOT
from runs import runner_argv

from offload_study.admission.admit import Refused, admitted_plan, first_problem
from offload_study.core.study import SHOWN_CHARS, SchemaRefused, StudyError, load_study
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.planning import presets
from offload_study.planning.plan import Plan, write_scenario_files

#: Words that say what is allowed instead (every refusal has one).
ALLOWED_WORDS = ("allowed", "expected", "must", "use ", "did you mean", "known")

# (key path to change, bad value, words the one error must contain: the key path first)

# (cluster key to change, bad value, words): the default study on a bad local-cpu description


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


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_study_files_are_refused(path, tmp_path, monkeypatch):
    """Study files as a user writes them (YAML 1.1: 5e8 is text, .nan is a float); the first
    line says what the one error must contain: ``# expect: word | word``."""
    words = path.read_text().splitlines()[0].removeprefix("# expect:").split("|")
    monkeypatch.chdir(tmp_path)
    assert_says(refusal(path, tmp_path), [w.strip() for w in words])


def schema_refuses(config: dict) -> bool:
    try:
        load_study(config)
    except SchemaRefused:
        return True
    return False


#: Corpus changes the schema refuses. Not the cluster key: every check judges against the
#: cluster, so a study whose cluster is refused is judged no further.
SCHEMA_CASES = [
    case
    for case in BAD_INPUT + STUDY_CASES
    if case[0] != "cluster"
    and schema_refuses(with_change(shipped("config/config.yaml"), *case[:2]))
]
#: A problem only admission finds, on a key the change does not touch: (key, value, words).
SENSE_PROBLEMS = {
    "zero": ("zero", {"reduce_bucket_sise": 1}, "zero.reduce_bucket_sise: not a key"),
    "seq_len": ("seq_len", 100_000, "seq_len: 100000 tokens is past"),
}


def test_schema_and_sense_problems_come_in_one_error(study):
    """The schema's problem and admission's, in one error through the Snakefile's entry point,
    the schema's first; each names its key."""
    config = with_change(with_change(study, "measure.min_steps", 5), "measure.max_warmup_steps", 5)
    with pytest.raises(Refused) as info:
        admitted_plan(config, source="my-study.yaml")
    assert [str(p) for p in info.value.problems] == [
        "measure.min_steps: 5 is too small; must be >= 6",
        "measure.max_warmup_steps: 5 is below 2 × settle_window (3), so step times could never "
        "settle",
    ]
    assert str(info.value).startswith("my-study.yaml: measure.min_steps: 5 is too small")


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize(
    ("path", "value", "words"), SCHEMA_CASES, ids=[f"{p}={v!r}"[:70] for p, v, _ in SCHEMA_CASES]
)
def test_a_study_the_schema_refuses_is_judged_on_the_rest(study, path, value, words):
    """Every schema refusal of the corpus beside one problem only admission finds: the one error
    lists both, the schema's first, and nothing the refused value would have caused (a check
    that reads it is skipped, never run on a stand-in); what admission says of the changed key
    itself may stand (steps given in an adaptive study)."""
    key, bad, said = SENSE_PROBLEMS["seq_len" if path.startswith("zero") else "zero"]
    with pytest.raises(Refused) as info:
        admitted_plan(with_change(with_change(study, key, bad), path, value))
    first, *rest = [str(p) for p in info.value.problems]
    for word in words:
        assert word in first, first
    others = [p for p in rest if not p.startswith(f"{path}: ")]
    assert len(others) == 1 and said in others[0], info.value


def test_a_scenario_the_schema_refuses_leaves_the_others_judged(study):
    """Each scenario is expanded alone: one with a refused count loses its own run checks, the
    others' runs are still judged against the cluster."""
    config = with_change(study, "scenarios[0].gpus_per_node", 0)
    with pytest.raises(Refused) as info:
        admitted_plan(with_change(config, "scenarios[1].gpus_per_node", 3))
    first, fit, batch = info.value.problems
    assert first.key == "scenarios[0].gpus_per_node" and "too small" in first.message
    assert fit.key == "scenarios[1].gpus_per_node" and "local-cpu" in fit.message
    assert batch.key == "scenarios[1]" and "world_size 3" in batch.message


def test_every_refused_key_is_listed_once_in_the_files_order(study):
    """Several schema problems: the one a single error names first, then the file's order; a
    value that breaks two rules of its key (type and range) is one problem."""
    config = with_change(study, "scenarios[2].gpus_per_node", 0.5)
    config = with_change(with_change(config, "stepz", 1), "dtype", "fp8")
    config = with_change(config, "timeout_min", float("nan"))
    with pytest.raises(Refused) as info:
        admitted_plan(config)
    keys = [p.key for p in info.value.problems]
    assert keys == ["timeout_min", "dtype", "scenarios[2].gpus_per_node", "stepz"], keys


@pytest.mark.refuses_bad_input
def test_a_dry_run_lists_schema_and_sense_problems_in_one_error(study, tmp_path):
    """Through `snakemake -n`: one "invalid study" error naming both keys, no traceback."""
    config = with_change(with_change(study, "measure.min_steps", 5), "measure.max_warmup_steps", 5)
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO_ROOT / "Snakefile"),
        "-d",
        str(REPO_ROOT),
        "-n",
        "--config",
        f"study_file={study_file}",
    ]
    result = subprocess.run(snakemake, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output, output
    assert f"invalid study: {study_file}: measure.min_steps: 5 is too small" in output, output
    assert "1 more problem(s):\n  - measure.max_warmup_steps: 5 is below" in output, output


def test_the_corpus_is_large():
    assert len(STUDY_CASES) + len(CLUSTER_CASES) + len(BAD_FILES) >= 60
    assert len(SCHEMA_CASES) >= 40  # each also judged beside a problem only admission finds


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
    cmd = runner_argv(spec_path, outdir)
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


def test_a_checkpoint_that_built_is_not_built_again_until_its_config_changes(tmp_path, monkeypatch):
    """check_pretrained reads the folder's config.json every time, and builds its model once
    per content: a changed config.json is built (and judged) again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    assert presets.check_pretrained(str(folder), {}) == SMALL_LLAMA["max_position_embeddings"]
    with monkeypatch.context() as patched:
        patched.setattr(presets, "build_config", lambda *a: pytest.fail("built again"))
        presets.check_pretrained(str(folder), {})
    (folder / "config.json").write_text(json.dumps({**SMALL_LLAMA, "pad_token_id": 9999}))
    with pytest.raises(StudyError, match="model.name_or_path.pad_token_id: 9999 is past"):
        presets.check_pretrained(str(folder), {})
