"""Study validation, plan expansion and DeepSpeed config generation (issue: Foundation)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import yaml
from bad_inputs import BAD_INPUT, SHIPPED_STUDIES, Swept, shipped, with_change
from conftest import REPO as REPO_ROOT

from offload_study.admission import admit
from offload_study.admission.admit import Case, admitted_plan, first_problem
from offload_study.core.contracts import read_json, read_run_spec
from offload_study.core.study import StudyError, load_cluster, load_study
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.planning.names import format_value
from offload_study.planning.plan import Plan, expand_plan


@pytest.fixture
def study() -> dict:
    return shipped("config/config.yaml")


def plan_error(config: dict, cluster_dir=None) -> str:
    """The first problem of a refused study (every test names the one it expects first)."""
    with pytest.raises(StudyError) as info:
        admitted_plan(config, cluster_dir=cluster_dir)
    return first_problem(info.value)


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize(
    ("path", "value", "words"), BAD_INPUT, ids=[f"{p}={v!r}"[:60] for p, v, _ in BAD_INPUT]
)
def test_bad_input_is_refused_naming_the_key(study, path, value, words):
    message = plan_error(with_change(study, path, value))
    for word in words:
        assert word in message, message


def test_every_bad_input_is_distinct_and_admission_lists_them_all(study):
    """One corpus, each case a different change; a study with several of them gets every one
    back from admission at once, each naming its key."""
    assert len({(p, repr(v)) for p, v, _ in BAD_INPUT}) == len(BAD_INPUT)
    broken = with_change(with_change(study, "seq_len", 100_000), "scenarios[0].cpu_mem_gb", 1e308)
    broken = with_change(broken, "baseline", "nope")
    plan = Plan(broken)  # expansion never raises
    found = [str(p) for p in admit.admit(Case(plan.planned, plan.study, plan.cluster))]
    assert [f.split(":")[0] for f in found] == ["seq_len", "scenarios[0].cpu_mem_gb", "baseline"]


def test_duplicate_scenario_names(study):
    study["scenarios"][2]["name"] = study["scenarios"][0]["name"]
    message = plan_error(study)
    assert "scenarios[2].name" in message and "used twice" in message and "scenarios[0]" in message


def test_non_divisible_batch_names_the_numbers(study):
    message = plan_error(with_change(study, "global_batch", 7))
    assert "scenarios[0]" in message and "global_batch 7" in message and "micro_batch 2" in message


def test_nvme_without_path(study, tmp_path):
    cluster = yaml.safe_load((REPO_ROOT / "config/clusters/local-cpu.yaml").read_text())
    del cluster["nvme_path"]
    (tmp_path / "local-cpu.yaml").write_text(yaml.safe_dump(cluster))
    message = plan_error(study, cluster_dir=tmp_path)
    assert "scenarios[3].offload_optimizer" in message and "nvme_path" in message


def test_more_gpus_than_the_cluster_has(study):
    message = plan_error(with_change(study, "scenarios[1].gpus_per_node", 3))
    assert "scenarios[1].gpus_per_node" in message and "local-cpu" in message and "(2)" in message


def test_more_nodes_than_the_cluster_has(study):
    message = plan_error(with_change(study, "scenarios[1].nodes", 2))
    assert "scenarios[1].nodes" in message


def test_bigger_card_than_the_cluster_has():
    seed = shipped("config/studies/seed.yaml")
    message = plan_error(with_change(seed, "scenarios[2].gpu_mem_gb", 200))
    assert "scenarios[2].gpu_mem_gb" in message and "141" in message


def test_unknown_cluster_names_the_file(study):
    message = plan_error(with_change(study, "cluster", "nowhere"))
    assert "config/clusters/nowhere.yaml" in message and "local-cpu" in message


def test_bad_cluster_file(tmp_path, study):
    (tmp_path / "local-cpu.yaml").write_text(
        "name: local-cpu\naccelerator: tpu\ngpus_per_node: 1\n"
    )
    message = plan_error(study, cluster_dir=tmp_path)
    assert "local-cpu.yaml" in message and "accelerator" in message and "'cuda'" in message


def test_invalid_yaml_file(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text("study: [unclosed\n")
    with pytest.raises(StudyError, match="study.yaml: not valid YAML"):
        load_study(path)


def test_defaults_are_filled(study):
    loaded = load_study(study)
    assert loaded["scenarios"][0]["nodes"] == 1
    assert loaded["scenarios"][0]["offload_param"] == "none"
    assert loaded["optimizer"] == {"type": "AdamW", "lr": 1e-4, "weight_decay": 0.0}


def test_the_plan_names_the_file_its_study_came_from_for_the_pages(study, tmp_path, monkeypatch):
    """plan.json's study_file (a study named unlike its file, outside config/studies/) is what
    a page's command to run the study again gives; a study given as data has none."""
    from offload_study.analysis.report import origin

    monkeypatch.chdir(tmp_path)  # the workflow's working directory: no config/studies/ here
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**study, "study": "which-engine"}))
    summary = Plan(str(path), cluster_dir=REPO_ROOT / "config/clusters").summary()
    assert summary["study_file"] == str(path)
    command = origin.rerun_command("which-engine", "local-cpu", "recommend", summary["study_file"])
    assert f"study_file={path}" in command and command.startswith("snakemake --cores all")
    assert Plan(study, cluster_dir=REPO_ROOT / "config/clusters").summary()["study_file"] is None
    assert "'study_file=<your study file>'" in origin.rerun_command("which-engine", "local-cpu")


def test_global_batch_constant_across_scenarios():
    plan = Plan(shipped("config/studies/seed.yaml"))
    by = plan.by_name
    assert {r.global_batch for r in plan.runs} == {128}
    assert by["zero3-8gpu-40gb"].gradient_accumulation_steps == 4
    assert by["offload-4gpu-40gb"].gradient_accumulation_steps == 8
    assert by["offload-2gpu-80gb"].gradient_accumulation_steps == 16
    assert plan.baseline == "zero3-8gpu-40gb"
    assert 6.7e9 < by["zero3-8gpu-40gb"].model_params < 6.8e9


def test_sweep_expands_cartesian_with_readable_names(study):
    study["scenarios"][1]["sweep"] = {
        "reduce_bucket_size": [5.0e8, 1_000_000_000],
        "gradient_accumulation_steps": [1, 4],
    }
    plan = Plan(study)
    names = [r.scenario for r in plan.runs if r.base_scenario == "offload-opt-2rank"]
    assert names == [
        "offload-opt-2rank__rbs-5e8__gas-1",
        "offload-opt-2rank__rbs-5e8__gas-4",
        "offload-opt-2rank__rbs-1e9__gas-1",
        "offload-opt-2rank__rbs-1e9__gas-4",
    ]
    run = plan.by_name["offload-opt-2rank__rbs-1e9__gas-4"]
    # gas fixed by the sweep: global batch follows micro × gas × world.
    assert run.global_batch == 2 * 4 * 2
    config = dsconfig.build_ds_config(run)
    assert config["zero_optimization"]["reduce_bucket_size"] == 1_000_000_000
    assert config["gradient_accumulation_steps"] == 4
    assert len(plan.runs) == 3 + 4


def test_format_value():
    assert format_value(5.0e8) == "5e8"
    assert format_value(1_000_000_000) == "1e9"
    assert format_value(2.5e8) == "2.5e8"
    assert format_value(4) == "4"
    assert format_value(True) == "true"
    # every digit kept: values that 6 digits told apart keep their old names, others differ
    assert format_value(123456789) == "1.23456789e8" != format_value(123456790)
    assert format_value(2**63 - 1) == "9.223372036854775807e18"


def test_seed_config_is_the_base():
    plan = Plan(shipped("config/studies/seed.yaml"))
    config = dsconfig.build_ds_config(plan.by_name["offload-4gpu-40gb"])
    zero = config["zero_optimization"]
    for key, value in dsconfig.SEED_ZERO3.items():
        assert zero[key] == value
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    assert (
        "offload_optimizer"
        not in dsconfig.build_ds_config(plan.by_name["zero3-8gpu-40gb"])["zero_optimization"]
    )


def test_aio_is_top_level_with_installed_names(study):
    study["aio"] = {"intra_op_parallelism": 2, "queue_depth": 16}
    plan = Plan(study)
    config = dsconfig.build_ds_config(plan.by_name["nvme-1rank"])
    assert config["aio"] == {"intra_op_parallelism": 2, "queue_depth": 16}
    assert "aio" not in config["zero_optimization"]
    assert "aio" not in dsconfig.build_ds_config(plan.by_name["zero3-2rank"])


def test_installed_key_names_come_from_deepspeed():
    names = dsconfig.installed_key_names()
    assert {"reduce_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size"} <= names[
        "zero"
    ]
    assert "intra_op_parallelism" in names["aio"] and "thread_count" not in names["aio"]
    assert "nvme_path" in names["offload_param"]


def test_configfile_study_replaces_default(tmp_path):
    """Snakemake merges --configfile into the default; we replace (no leaked scenarios)."""
    seed = Plan(shipped("config/studies/seed.yaml"))
    assert [r.base_scenario for r in seed.runs][0] == "zero3-8gpu-40gb"
    assert load_cluster("h200-8gpu")["gpus_per_node"] == 8


# Real DeepSpeed's own parser accepts every config both shipped studies produce (batch arithmetic too).
@pytest.fixture(scope="module")
def deepspeed_comm():
    def check(spec_paths: list[str]) -> list[str]:
        """Admission's DeepSpeed parser check of written configs (rule plan's first check)."""
        specs = [read_run_spec(p) for p in spec_paths]
        case = Case(specs, configs={s.scenario: read_json(s.ds_config) for s in specs})
        return [str(p) for p in admit.admit(case, (admit.engine_parser,))]

    return check


@pytest.mark.parametrize("study_path", SHIPPED_STUDIES)
def test_shipped_configs_pass_deepspeeds_parser(study_path, tmp_path, deepspeed_comm):
    from offload_study.planning.plan import write_scenario_files

    plan = Plan(shipped(study_path))
    assert plan.runs, f"{study_path} plans no run"
    specs = []
    for run in plan.runs:
        ds_path, spec_path = (
            tmp_path / f"{run.scenario}.json",
            tmp_path / f"{run.scenario}.run.json",
        )
        write_scenario_files(run, str(ds_path), str(spec_path))
        specs.append(str(spec_path))
        config = json.loads(ds_path.read_text())
        if run.engine == "fsdp2":  # its settings: the same batch arithmetic, no DeepSpeed keys
            per_step = config["micro_batch"] * config["gradient_accumulation_steps"]
            assert (
                per_step * run.world_size == run.global_batch and "zero_optimization" not in config
            )
            continue
        assert (
            config["train_batch_size"]
            == config["train_micro_batch_size_per_gpu"]
            * config["gradient_accumulation_steps"]
            * run.world_size
        )
        parsed = dsconfig.parse_with_deepspeed(config, run.world_size)
        assert parsed.zero_optimization_stage == 3
        assert parsed.train_batch_size == run.global_batch
        assert parsed.world_size == run.world_size
    assert deepspeed_comm(specs) == []


def test_deepspeed_parser_refusal_is_reported(tmp_path, deepspeed_comm):
    from offload_study.planning.plan import write_scenario_files

    run = Plan(shipped("config/config.yaml")).runs[0]
    spec_path = tmp_path / "x.run.json"
    write_scenario_files(run, str(tmp_path / "x.json"), str(spec_path))
    bad = json.loads((tmp_path / "x.json").read_text())
    bad["train_batch_size"] = 7
    (tmp_path / "x.json").write_text(json.dumps(bad))
    errors = deepspeed_comm([str(spec_path)])
    assert len(errors) == 1 and "zero3-2rank" in errors[0] and "batch" in errors[0].lower()


def test_top_level_keys_are_known_to_deepspeed():
    """We emit no top-level key DeepSpeed would silently ignore."""
    import ast

    source = (dsconfig._deepspeed_dir() / "runtime/constants.py").read_text()
    known = {
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign)
        and isinstance(getattr(node, "value", None), ast.Constant)
        and isinstance(node.value.value, str)
    } | {"zero_optimization", "aio", "optimizer", "bf16", "fp16"}
    for path in SHIPPED_STUDIES:
        for run in Plan(shipped(path)).runs:
            unknown = set(dsconfig.build_ds_config(run)) - known
            assert not unknown, unknown


def test_admission_refuses_mismatched_cluster(study):
    loaded, cluster = load_study(study), load_cluster("h200-8gpu")
    runs = expand_plan(loaded, cluster)  # pure: it computes, admission judges
    (found,) = admit.admit(Case(runs, loaded, cluster))
    assert found.key == "cluster" and "'h200-8gpu'" in found.message


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [case for case in BAD_INPUT if case[1] == 100_000 or isinstance(case[1], Swept)],
    ids=["seq_len-past-positions", "baseline-renamed-by-its-sweep"],
)
def test_a_dry_run_refuses_held_out_input_naming_the_key(study, path, value, words, tmp_path):
    """Through the real Snakefile: `snakemake -n` stops with one "invalid study" error."""
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(with_change(study, path, value)))
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
    assert result.returncode != 0 and "invalid study: " in output, output
    for word in words:
        assert word in output, output


def test_the_layers_import_downward_without_circles():
    """core <- planning <- admission/prediction <- training <- analysis <- across: each module's
    imports of this library (module level and inside functions) go to its own layer or below,
    and no import circle joins two modules. The engine folders (offload_study.engines) stand
    beside the layers: every stage asks the registry, an engine builds on the stages' parts."""
    rank = {
        "core": 0,
        "planning": 1,
        "admission": 2,
        "prediction": 2,
        "training": 3,
        "analysis": 4,
        "across": 5,
    }
    package = REPO_ROOT / "workflow" / "offload_study"
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "offload_study."
            ):
                parts = node.module.split(".")
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets |= {
                    t for t in subs if (package.parent / f"{t.replace('.', '/')}.py").exists()
                }
                targets |= {node.module} if len(parts) > 2 else set()
        graph[name.removesuffix(".__init__")] = targets

    def layer(module: str) -> int | None:
        parts = module.split(".")
        return rank.get(parts[1]) if len(parts) > 2 else None

    upward = {
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if layer(m) is not None
        and layer(t) is not None
        and layer(t) > layer(m)
        and {m.split(".")[1], t.split(".")[1]} != {"admission", "prediction"}
    }
    # a package's __init__ and its own submodules are one unit, not a circle
    circles = [
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if m in graph.get(t, set()) and m < t and not t.startswith(f"{m}.")
    ]
    assert circles == [], circles
    assert upward == KNOWN_UPWARD, upward - KNOWN_UPWARD or f"now downward: {KNOWN_UPWARD - upward}"


#: Upward imports this test names so that no new one appears; each is its module owner's to
#: remove: calibrate launches a measurement, recommend decides on records.
KNOWN_UPWARD = {
    ("offload_study.prediction.calibrate", "offload_study.training.launch"),
    ("offload_study.prediction.recommend", "offload_study.analysis.sanity"),
    ("offload_study.prediction.recommend", "offload_study.analysis.collect"),
    ("offload_study.prediction.recommend", "offload_study.analysis.report.recommend"),
}
