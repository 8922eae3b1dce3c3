"""Expand a validated study into runs: scenarios x sweeps, in one place (like Ramble's matrices).

``expand_plan`` is pure: study + cluster dicts in, a list of run specs out (docs/design.md).
Every semantic check that JSON schema cannot express happens here, before anything runs,
and each error names the key path.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import os
import sys
from pathlib import Path

from offload_study import dsconfig, presets
from offload_study.study import StudyError, load_cluster, load_study

RUN_SPEC_VERSION = 1
# Short names for common sweep knobs, so generated scenario names stay readable.
KNOB_ABBREV = {
    "micro_batch": "mb",
    "gradient_accumulation_steps": "gas",
    "reduce_bucket_size": "rbs",
    "stage3_prefetch_bucket_size": "pbs",
    "prefetch_bucket_size": "pbs",
    "stage3_max_live_parameters": "live",
    "stage3_param_persistence_threshold": "persist",
    "sub_group_size": "sgs",
}
BATCH_KNOBS = ("micro_batch", "gradient_accumulation_steps")


def format_value(value) -> str:
    """5e8 -> '5e8', 1000000000 -> '1e9', 4 -> '4', True -> 'true'."""
    value = dsconfig.normalize_number(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and abs(value) >= 10_000:
        mantissa, exp = f"{value:e}".split("e")
        return f"{float(mantissa):g}e{int(exp)}"
    return str(value)


def expanded_name(base: str, combo: dict) -> str:
    parts = [f"{KNOB_ABBREV.get(k, k)}-{format_value(v)}" for k, v in combo.items()]
    return "__".join([base, *parts])


def model_spec(study: dict) -> dict:
    model = study["model"]
    overrides = model.get("overrides", {})
    if "name_or_path" in model:
        return {
            "source": "pretrained",
            "preset": None,
            "config": dict(overrides),
            "name_or_path": model["name_or_path"],
        }
    if "preset" in model:
        if model["preset"] not in presets.PRESETS:
            known = ", ".join(sorted(presets.PRESETS))
            raise StudyError(
                f"model.preset: {model['preset']!r} is unknown; known presets: {known}"
            )
        config = {**presets.PRESETS[model["preset"]], **overrides}
        return {
            "source": "config",
            "preset": model["preset"],
            "config": config,
            "name_or_path": None,
        }
    return {
        "source": "config",
        "preset": None,
        "config": {**model["config"], **overrides},
        "name_or_path": None,
    }


def _param_count(model: dict) -> int | None:
    cfg = model["config"]
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if (
        model["source"] == "config"
        and cfg.get("model_type") == "llama"
        and all(k in cfg for k in needed)
    ):
        return presets.llama_param_count({"vocab_size": 32000, **cfg})
    return None


def _sweep_combos(sweep: dict) -> list[dict]:
    if not sweep:
        return [{}]
    keys = list(sweep)
    return [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(sweep[k] for k in keys))
    ]


def _batch(
    study: dict, scenario: dict, combo: dict, world: int, where: str
) -> tuple[int, int, int]:
    """(micro_batch, gas, global_batch): the global batch stays the study's unless gas is fixed."""
    micro = dsconfig.normalize_number(
        combo.get("micro_batch", scenario.get("micro_batch", study["micro_batch"]))
    )
    gas = combo.get("gradient_accumulation_steps", scenario.get("gradient_accumulation_steps"))
    for key, value in (("micro_batch", micro), ("gradient_accumulation_steps", gas)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise StudyError(f"{where}.sweep.{key}: {value!r} must be a positive integer")
    if gas is not None:
        return micro, gas, micro * gas * world
    global_batch = study["global_batch"]
    if global_batch % (micro * world):
        raise StudyError(
            f"{where}: global_batch {global_batch} is not divisible by micro_batch {micro} × "
            f"world_size {world} (= {micro * world}); gradient_accumulation_steps would not be "
            "an integer. Change global_batch, micro_batch or the GPU count"
        )
    return micro, global_batch // (micro * world), global_batch


def _check_cluster_fit(scenario: dict, cluster: dict, where: str) -> None:
    if scenario["gpus_per_node"] > cluster["gpus_per_node"]:
        raise StudyError(
            f"{where}.gpus_per_node: {scenario['gpus_per_node']} is more than cluster "
            f"{cluster['name']!r} has per node ({cluster['gpus_per_node']})"
        )
    if scenario["nodes"] > cluster["nodes"]:
        raise StudyError(
            f"{where}.nodes: {scenario['nodes']} is more than cluster {cluster['name']!r} "
            f"allows ({cluster['nodes']})"
        )
    card = cluster.get("gpu_mem_gb")
    if card and scenario["gpu_mem_gb"] and scenario["gpu_mem_gb"] > card:
        raise StudyError(
            f"{where}.gpu_mem_gb: {scenario['gpu_mem_gb']} GB is more than the cards of cluster "
            f"{cluster['name']!r} have ({card} GB); memory can only be capped, not added"
        )
    host = cluster.get("mem_gb_per_node")
    if host and scenario["cpu_mem_gb"] and scenario["cpu_mem_gb"] > host:
        raise StudyError(
            f"{where}.cpu_mem_gb: {scenario['cpu_mem_gb']} GB is more than a node of cluster "
            f"{cluster['name']!r} has ({host} GB)"
        )


def expand_plan(study: dict, cluster: dict) -> list[dict]:
    """All runs of a validated study (one spec per expanded scenario; repeats are not expanded)."""
    if study["cluster"] != cluster["name"]:
        raise StudyError(
            f"cluster: study names {study['cluster']!r} but got cluster {cluster['name']!r}"
        )
    errors = dsconfig.check_zero_keys(study["zero"], "zero") + dsconfig.check_aio_keys(study["aio"])
    if errors:
        raise StudyError(errors[0])
    model = model_spec(study)
    runs: list[dict] = []
    seen: dict[str, str] = {}
    for index, scenario in enumerate(study["scenarios"]):
        where = f"scenarios[{index}]"
        if scenario["name"] in seen:
            raise StudyError(
                f"{where}.name: {scenario['name']!r} is used twice (also {seen[scenario['name']]})"
            )
        seen[scenario["name"]] = where
        errors = dsconfig.check_zero_keys(scenario.get("zero", {}), f"{where}.zero")
        for knob in scenario.get("sweep", {}):
            if knob not in BATCH_KNOBS:
                errors += dsconfig.check_zero_keys({knob: None}, f"{where}.sweep")
        if errors:
            raise StudyError(errors[0])
        _check_cluster_fit(scenario, cluster, where)
        nvme = "nvme" in (scenario["offload_optimizer"], scenario["offload_param"])
        nvme_path = scenario["nvme_path"] or cluster.get("nvme_path")
        if nvme and not nvme_path:
            key = (
                "offload_optimizer" if scenario["offload_optimizer"] == "nvme" else "offload_param"
            )
            raise StudyError(
                f"{where}.{key}: nvme offload needs a directory: set {where}.nvme_path or "
                f"nvme_path in config/clusters/{cluster['name']}.yaml"
            )
        world = scenario["gpus_per_node"] * scenario["nodes"]
        for combo in _sweep_combos(scenario.get("sweep", {})):
            name = expanded_name(scenario["name"], combo)
            micro, gas, global_batch = _batch(study, scenario, combo, world, where)
            zero = {**study["zero"], **scenario.get("zero", {})}
            zero.update({k: v for k, v in combo.items() if k not in BATCH_KNOBS})
            runs.append(
                {
                    "schema_version": RUN_SPEC_VERSION,
                    "study": study["study"],
                    "cluster": cluster["name"],
                    "scenario": name,
                    "base_scenario": scenario["name"],
                    "label": scenario.get("label") or scenario["name"],
                    "sweep": {k: dsconfig.normalize_number(v) for k, v in combo.items()},
                    "model": model,
                    "model_params": _param_count(model),
                    "seq_len": study["seq_len"],
                    "dtype": study["dtype"],
                    "micro_batch": micro,
                    "gradient_accumulation_steps": gas,
                    "global_batch": global_batch,
                    "gradient_checkpointing": study["gradient_checkpointing"],
                    "steps": study["steps"],
                    "warmup_steps": study["warmup_steps"],
                    "seed": study["seed"],
                    "data": {
                        "kind": "token_file" if study["token_file"] else "synthetic",
                        "token_file": study["token_file"],
                    },
                    "optimizer": study["optimizer"],
                    "nodes": scenario["nodes"],
                    "gpus_per_node": scenario["gpus_per_node"],
                    "world_size": world,
                    "accelerator": cluster["accelerator"],
                    "gpu_mem_gb": scenario["gpu_mem_gb"],
                    "cluster_gpu_mem_gb": cluster.get("gpu_mem_gb"),
                    "cpu_mem_gb": scenario["cpu_mem_gb"],
                    "offload_optimizer": scenario["offload_optimizer"],
                    "offload_param": scenario["offload_param"],
                    "nvme_path": nvme_path if nvme else None,
                    "pin_memory": scenario["pin_memory"],
                    "zero": zero,
                    "aio": study["aio"],
                    "timeout_s": study["timeout_min"] * 60,
                    "step_timeout_s": study["step_timeout_s"],
                    "strict": study["strict"],
                    "reference": scenario.get("reference"),
                }
            )
        if len({r["scenario"] for r in runs}) != len(runs):
            raise StudyError(f"{where}.sweep: expands to a scenario name that already exists")
    baseline = study["baseline"]
    if baseline is not None and baseline not in {r["scenario"] for r in runs} | set(seen):
        raise StudyError(
            f"baseline: {baseline!r} is not a scenario of this study; scenarios: {', '.join(seen)}"
        )
    return runs


def default_baseline(study: dict, runs: list[dict]) -> str | None:
    if study["baseline"]:
        return study["baseline"]
    for run in runs:
        if run["offload_optimizer"] == run["offload_param"] == "none":
            return run["scenario"]
    return None


class Plan:
    """A loaded study, its cluster and its runs; what the Snakefile works from."""

    def __init__(
        self, config: dict | str | Path, cluster_dir: str | Path | None = None, source=None
    ):
        self.study = load_study(config, source=source)
        kwargs = {"cluster_dir": cluster_dir} if cluster_dir else {}
        self.cluster = load_cluster(self.study["cluster"], **kwargs)
        self.runs = expand_plan(self.study, self.cluster)
        self.by_name = {run["scenario"]: run for run in self.runs}
        self.baseline = default_baseline(self.study, self.runs)
        self.results_dir = f"results/{self.cluster['name']}/{self.study['study']}"

    @property
    def scenarios(self) -> list[str]:
        return list(self.by_name)

    @property
    def repeats(self) -> list[int]:
        return list(range(self.study["repeats"]))

    def run_spec(self, scenario: str) -> dict:
        run = copy.deepcopy(self.by_name[scenario])
        run["ds_config"] = f"{self.results_dir}/configs/{scenario}.json"
        return run

    def summary(self) -> dict:
        """plan.json: what the report needs to know of each scenario."""
        keys = (
            "scenario base_scenario label nodes gpus_per_node world_size gpu_mem_gb cpu_mem_gb "
            "offload_optimizer offload_param sweep micro_batch gradient_accumulation_steps "
            "global_batch reference"
        ).split()
        return {
            "study": self.study["study"],
            "cluster": self.cluster["name"],
            "cluster_description": self.cluster.get("description", ""),
            "description": self.study.get("description", ""),
            "baseline": self.baseline,
            "model": self.runs[0]["model"],
            "model_params": self.runs[0]["model_params"],
            "seq_len": self.study["seq_len"],
            "dtype": self.study["dtype"],
            "repeats": self.study["repeats"],
            "scenarios": [
                {
                    **{k: run[k] for k in keys},
                    "name": run["scenario"],
                    "ds_config": f"{self.results_dir}/configs/{run['scenario']}.json",
                    "run_spec": f"{self.results_dir}/configs/{run['scenario']}.run.json",
                }
                for run in self.runs
            ],
        }


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_scenario_files(run_spec: dict, ds_config_path: str, spec_path: str) -> None:
    write_json(ds_config_path, dsconfig.build_ds_config(run_spec))
    write_json(spec_path, {**run_spec, "ds_config": str(ds_config_path)})


def check_with_deepspeed(spec_paths: list[str]) -> list[str]:
    """Parse every DeepSpeed config with DeepSpeed's own parser; return one error per refusal."""
    dsconfig.ensure_single_process_comm()
    errors = []
    for spec_path in spec_paths:
        spec = json.loads(Path(spec_path).read_text())
        config = json.loads(Path(spec["ds_config"]).read_text())
        try:
            dsconfig.parse_with_deepspeed(config, spec["world_size"])
        except Exception as exc:  # DeepSpeed raises AssertionError, ValueError, ValidationError
            errors.append(
                f"{spec['ds_config']} (scenario {spec['scenario']!r}): DeepSpeed refused it: {exc}"
            )
    return errors


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Check planned DeepSpeed configs and write plan.json"
    )
    parser.add_argument("--plan-json", required=True, help="plan summary written by the workflow")
    parser.add_argument("--out", required=True, help="validated plan to write")
    parser.add_argument("specs", nargs="+", help="run specs (configs/<scenario>.run.json)")
    args = parser.parse_args(argv)
    errors = check_with_deepspeed(args.specs)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    plan = json.loads(Path(args.plan_json).read_text())
    plan["deepspeed_checked"] = True
    plan["ds_config_sha256"] = {
        json.loads(Path(p).read_text())["scenario"]: sha256_file(
            json.loads(Path(p).read_text())["ds_config"]
        )
        for p in args.specs
    }
    write_json(args.out, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
