"""The newer offload modes (offload_study.planning.modes): planned, checked against the installed
DeepSpeed's config classes, written into the DeepSpeed config, recorded; real runs on CPU (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from conftest import make_spec
from runs import runner_argv

from offload_study import engines
from offload_study.analysis import sanity
from offload_study.core import contracts
from offload_study.core.contracts import read_json
from offload_study.core.study import StudyError, load_schema
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.planning import modes
from offload_study.planning.plan import write_scenario_files

CPU_OPT = {"offload_optimizer": "cpu"}
ZENFLOW = {"topk_ratio": 0.1, "update_interval": 2}


def ds_config_of(scenario: dict) -> dict:
    return dsconfig.build_ds_config(make_spec("local-cpu", {"gpus_per_node": 1, **scenario}))


def test_mode_keys_come_from_the_schema():
    scenario = load_schema("study")["properties"]["scenarios"]["items"]["properties"]
    assert set(modes.SWEEPABLE) == {k for k, v in scenario.items() if v.get("x-sweepable")}
    expected = {"offload_optimizer_ratio", "super_offload", "cpuadam_cores_perc", "zenflow"}
    assert expected == set(modes.DEEPSPEED_KEYS)
    assert modes.NEEDS == {"cpuadam_cores_perc": "super_offload"}
    # every mode the schema maps is a field of the installed DeepSpeed's config classes
    for key, path in modes.DEEPSPEED_KEYS.items():
        section, _, field = path.rpartition(".")
        assert field in dsconfig.installed_fields()[section], key


def test_modes_go_where_deepspeed_reads_them_and_its_parser_accepts_them():
    cases = {
        "ratio": ({**CPU_OPT, "offload_optimizer_ratio": 0.3}, ("offload_optimizer", "ratio"), 0.3),
        "super": ({**CPU_OPT, "super_offload": True}, ("offload_optimizer", "super_offload"), True),
        "super-cores": (
            {**CPU_OPT, "super_offload": True, "cpuadam_cores_perc": 0.9},
            ("offload_optimizer", "cpuadam_cores_perc"),
            0.9,
        ),
        "zenflow": ({**CPU_OPT, "zenflow": ZENFLOW}, ("zenflow",), ZENFLOW),
    }
    for scenario, path, expected in cases.values():
        config = ds_config_of(scenario)
        value = config["zero_optimization"]
        for key in path:
            value = value[key]
        assert value == expected
        parsed = dsconfig.parse_with_deepspeed(config, 1).zero_config  # DeepSpeed's own classes
        assert parsed.offload_optimizer.device == "cpu"
    ratio_zero = dsconfig.parse_with_deepspeed(ds_config_of(cases["ratio"][0]), 1).zero_config
    assert ratio_zero.offload_optimizer.ratio == 0.3


def test_pin_memory_null_leaves_deepspeeds_default():
    config = ds_config_of({**CPU_OPT, "pin_memory": None})
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    parsed = dsconfig.parse_with_deepspeed(config, 1).zero_config.offload_optimizer
    assert parsed.pin_memory is True  # DeepSpeed >= 0.19.5's default
    assert ds_config_of(CPU_OPT)["zero_optimization"]["offload_optimizer"]["pin_memory"] is True


def test_a_study_without_modes_plans_as_before():
    spec = make_spec("local-cpu", {"gpus_per_node": 1, **CPU_OPT})
    assert spec.modes == {} and spec.pin_memory is True
    assert set(ds_config_of(CPU_OPT)["zero_optimization"]["offload_optimizer"]) == {
        "device",
        "pin_memory",
    }


def test_mode_knobs_sweep_with_readable_names():
    from conftest import make_cluster

    from offload_study.core.study import load_study
    from offload_study.planning.plan import expand_plan

    study = {
        "study": "t",
        "cluster": "local-cpu",
        "model": {"preset": "tiny-llama"},
        "global_batch": 4,
        "micro_batch": 2,
        "scenarios": [
            {
                "name": "opt",
                "gpus_per_node": 1,
                **CPU_OPT,
                "sweep": {"offload_optimizer_ratio": [0.3, 0.9], "bind_cores": [True, False]},
            }
        ],
    }
    runs = expand_plan(load_study(study), make_cluster())
    assert [r.scenario for r in runs] == [
        "opt__ratio-0.3__bind-true",
        "opt__ratio-0.3__bind-false",
        "opt__ratio-0.9__bind-true",
        "opt__ratio-0.9__bind-false",
    ]
    assert runs[0].modes == {"offload_optimizer_ratio": 0.3, "bind_cores": True}
    assert runs[1].zero.get("offload_optimizer_ratio") is None  # a mode, not a ZeRO override


@pytest.mark.refuses_bad_input
@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ({"offload_optimizer_ratio": 0.5}, "offload_optimizer_ratio: needs offload_optimizer: cpu"),
        (
            {"super_offload": True, "offload_optimizer": "nvme", "nvme_path": "/tmp"},
            "super_offload: needs offload_optimizer: cpu",
        ),
        (
            {**CPU_OPT, "zenflow": {"topk": 0.1}},
            "zenflow.topk: not a key of the installed DeepSpeed",
        ),
        (
            {**CPU_OPT, "sweep": {"offload_optimizer_ratio": [0.5, 1.5]}},
            "sweep.offload_optimizer_ratio: 1.5",
        ),
        ({**CPU_OPT, "sweep": {"bind_cores": ["yes"]}}, "sweep.bind_cores: 'yes'"),
        (
            {**CPU_OPT, "cpuadam_cores_perc": 0.9},
            "cpuadam_cores_perc: needs super_offload: true",
        ),
    ],
    ids=[
        "ratio-without-cpu-offload",
        "super-on-nvme",
        "zenflow-typo",
        "ratio-above-1",
        "bind-not-bool",
        "worker-cores-without-superoffload",
    ],
)
def test_bad_mode_input_is_refused_naming_the_key(scenario, message):
    with pytest.raises(StudyError, match="scenarios\\[0\\]." + message.replace("[", "\\[")):
        make_spec("local-cpu", {"gpus_per_node": 1, **scenario})


@pytest.mark.refuses_bad_input
def test_a_deepspeed_without_a_mode_refuses_it_naming_key_and_version(tmp_path, monkeypatch):
    """A DeepSpeed source tree like the installed one minus ratio/super_offload and ZenFlow (an
    older release): the plan refuses each mode, naming the key and the DeepSpeed version."""
    real = dsconfig._deepspeed_dir()
    for rel in (
        "runtime/zero/config.py",
        "runtime/zero/offload_config.py",
        "runtime/swap_tensor/constants.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(real / rel, tmp_path / rel)
    offload = tmp_path / "runtime/zero/offload_config.py"
    lines = offload.read_text().splitlines()
    offload.write_text(
        "\n".join(ln for ln in lines if not ln.lstrip().startswith(("ratio:", "super_offload:")))
    )
    monkeypatch.setattr(dsconfig, "_deepspeed_dir", lambda: tmp_path)
    dsconfig.installed_fields.cache_clear()
    dsconfig.installed_key_names.cache_clear()
    try:
        for key, value in (
            ("offload_optimizer_ratio", 0.5),
            ("super_offload", True),
            ("zenflow", ZENFLOW),
        ):
            with pytest.raises(StudyError) as err:
                make_spec("local-cpu", {"gpus_per_node": 1, **CPU_OPT, key: value})
            text = str(err.value)
            assert (
                f"scenarios[0].{key}: the installed DeepSpeed {dsconfig.deepspeed_version()}"
                in text
            )
            assert modes.DEEPSPEED_KEYS[key] in text
    finally:
        monkeypatch.undo()
        dsconfig.installed_fields.cache_clear()
        dsconfig.installed_key_names.cache_clear()


def test_bind_cores_gives_each_local_rank_its_own_slice():
    code = (
        "import os, json; from offload_study.planning import modes; "
        "allowed = sorted(os.sched_getaffinity(0)); "
        "got = [modes.bind_cores({'bind_cores': True}, r, 2) for r in (1,)]; "
        "print(json.dumps([allowed, got[0], sorted(os.sched_getaffinity(0)), "
        "modes.bind_cores({}, 0, 2)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    allowed, mine, now, unbound = json.loads(out.stdout.strip().splitlines()[-1])
    share = max(1, len(allowed) // 2)
    assert mine == (allowed[share : 2 * share] or [allowed[1 % len(allowed)]])
    assert now == mine and unbound is None


# --------------------------------------------------------------------------- loss parity
def _runs(scenario: str, losses: list[float], steps_measured=6) -> list[dict]:
    return [
        {
            "scenario": scenario,
            "repeat": k,
            "outcome": "ok",
            "steps_warmup": 2,
            "steps_measured": steps_measured,
            "loss_last": v,
        }
        for k, v in enumerate(losses)
    ]


def _parity(mine: list[float], pair: list[float], steps_measured=6, pair_engine=None):
    runs = pd.DataFrame(_runs("zenflow", mine, steps_measured) + _runs("zero3", pair))
    row = {"scenario": "zenflow", "pair": "zero3", "pair_kind": "same-settings"}
    peers = {"zero3": {"scenario": "zero3", "engine": pair_engine}}
    facts = sanity.Facts(row, peers, runs[runs["scenario"] == "zenflow"], [], runs)
    check = next(c for c in sanity.CHECKS if c.name == "loss-parity")
    return check.test(facts, check.tolerance)


def test_loss_parity_fires_only_beyond_its_tolerance_at_the_same_step():
    assert _parity([6.10, 6.12], [6.11, 6.11]) is None
    why = _parity([6.60, 6.70], [6.11, 6.11])
    assert why and "of 'zero3' at step 8" in why and "(rep 1, +9.7%)" in why
    assert _parity([6.60], [6.11], steps_measured=7) is None  # different steps: no comparison


def test_loss_parity_leaves_a_pair_of_another_engine_unjudged():
    """An offload run paired with another engine's run without offload (a study with no
    no-offload run of its own engine): their random weights differ from the first step."""
    other = next(name for name in engines.names() if name != contracts.DEFAULT_ENGINE)
    assert _parity([6.60, 6.70], [6.11, 6.11], pair_engine=contracts.DEFAULT_ENGINE)
    assert _parity([6.60, 6.70], [6.11, 6.11], pair_engine=other) is None


# --------------------------------------------------------------------------- real runs on CPU
def run_mode(tmp_path, name: str, scenario: dict) -> dict:
    """One real run of a one-rank scenario through the runner; its metrics.json."""
    spec = make_spec(
        "local-cpu",
        {"name": name, "gpus_per_node": 1, "cpu_mem_gb": 16, **scenario},
        timeout_min=15,
    )
    spec_path, ds_path = tmp_path / f"{name}.run.json", tmp_path / f"{name}.json"
    write_scenario_files(spec, str(ds_path), str(spec_path))
    outdir = tmp_path / "results" / "local-cpu" / "test" / name / "rep0"
    cmd = runner_argv(spec_path, outdir)
    subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    return read_json(outdir / "metrics.json")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "scenario"),
    [
        ("ratio", {**CPU_OPT, "offload_optimizer_ratio": 0.5}),
        ("zenflow", {**CPU_OPT, "zenflow": ZENFLOW}),
        ("super", {**CPU_OPT, "super_offload": True}),
        ("bind-nopin", {**CPU_OPT, "bind_cores": True, "pin_memory": None, "gpus_per_node": 2}),
    ],
)
def test_each_mode_runs_or_is_refused_with_deepspeeds_message(tmp_path, name, scenario):
    m = run_mode(tmp_path, name, scenario)
    assert m["modes"]["requested"] == {
        "pin_memory": scenario.get("pin_memory", True),
        **{k: v for k, v in scenario.items() if k in modes.MODE_KEYS},
    }
    if m["outcome"] != "ok":  # a refusal is a record with DeepSpeed's own words, not a crash
        assert m["outcome"] in ("config_error", "error") and m["error_excerpt"]
        assert m["tokens_per_s"] is None
        if name == "super":  # on a CPU accelerator DeepSpeed refuses it in so many words
            assert "SuperOffload only supports NVIDIA CUDA GPUs" in m["error_excerpt"]
        return
    effective = m["modes"]["effective"]
    assert m["tokens_per_s"] > 0 and effective["pin_memory_optimizer"] is True
    if name == "ratio":
        assert effective["offload_optimizer_ratio"] == 0.5
    if name == "zenflow":
        assert effective["zenflow"]["topk_ratio"] == 0.1
    if name == "super":
        assert effective["super_offload"] is True
    if name == "bind-nopin":  # two ranks, each on its own slice of the granted cores
        bound = m["modes"]["bound_cores"]
        assert set(bound) == {"0", "1"} and bound["0"] == effective["cores"]
        assert not set(bound["0"]) & set(bound["1"]) or len(os.sched_getaffinity(0)) == 1
