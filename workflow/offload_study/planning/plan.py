"""Expand a validated study into runs: scenarios x sweeps, in one place (like Ramble's matrices).

``expand_plan`` is pure: study + cluster dicts in, a list of
:class:`~offload_study.core.contracts.RunSpec` out (docs/design.md). Every semantic check that JSON schema cannot express happens here, before anything runs,
and each error names the key path.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from offload_study.admission import preflight
from offload_study.core.contracts import (
    DataSpec,
    MeasureSpec,
    ModelSpec,
    OptimizerSpec,
    RunSpec,
    choose_baseline,
    read_calibration,
    read_json,
    read_run_spec,
    sha256_file,
    write_json,
    write_predictions,
    write_run_spec,
)
from offload_study.core.study import StudyError, load_cluster, load_study, shown
from offload_study.planning import dsconfig, modes, presets, samealloc
from offload_study.planning.resources import check_fits
from offload_study.prediction import predict

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
    "offload_optimizer_ratio": "ratio",
    "bind_cores": "bind",
    "pin_memory": "pin",
    "super_offload": "super",
}
BATCH_KNOBS = ("micro_batch", "gradient_accumulation_steps")


def format_value(value) -> str:
    """5e8 -> '5e8', 1000000000 -> '1e9', 123456789 -> '1.23456789e8', 4 -> '4', True -> 'true'.

    Every digit is kept (distinct values, distinct names); a value that 6 digits wrote exactly
    keeps the name it had before.
    """
    value = dsconfig.normalize_number(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and abs(value) >= 10_000:
        digits = str(abs(value))  # exact: no float in between
        mantissa = f"{digits[0]}.{digits[1:]}".rstrip("0").rstrip(".")
        return f"{'-' if value < 0 else ''}{mantissa}e{len(digits) - 1}"
    return str(value)


def expanded_name(base: str, combo: dict) -> str:
    parts = [f"{KNOB_ABBREV.get(k, k)}-{format_value(v)}" for k, v in combo.items()]
    return "__".join([base, *parts])


def model_spec(study: dict) -> ModelSpec:
    model = study["model"]
    overrides = model.get("overrides", {})
    if "name_or_path" in model:
        return ModelSpec("pretrained", None, dict(overrides), model["name_or_path"])
    if "preset" in model:  # a known preset: presets.check_model ran first (expand_plan)
        config = {**presets.PRESETS[model["preset"]], **overrides}
        return ModelSpec("config", model["preset"], config, None)
    return ModelSpec("config", None, {**model["config"], **overrides}, None)


def _param_count(model: ModelSpec) -> int | None:
    cfg = model.config
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if (
        model.source == "config"
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


def _run_spec(
    study: dict, cluster: dict, scenario: dict, combo: dict, batch: tuple[int, int, int]
) -> RunSpec:
    """The RunSpec of one expansion (sweep combo) of a scenario."""
    micro, gas, global_batch = batch
    zero = {**study["zero"], **scenario.get("zero", {})}
    zero.update({k: v for k, v in combo.items() if k not in BATCH_KNOBS + modes.SWEEPABLE})
    pin_memory, run_modes = modes.resolve(scenario, combo)
    model = model_spec(study)
    nvme_path = scenario["nvme_path"] or cluster["nvme_path"]
    uses_nvme = "nvme" in (scenario["offload_optimizer"], scenario["offload_param"])
    return RunSpec(
        study=study["study"],
        cluster=cluster["name"],
        scenario=expanded_name(scenario["name"], combo),
        base_scenario=scenario["name"],
        label=scenario.get("label") or scenario["name"],
        sweep={k: dsconfig.normalize_number(v) for k, v in combo.items()},
        model=model,
        model_params=_param_count(model),
        seq_len=study["seq_len"],
        dtype=study["dtype"],
        micro_batch=micro,
        gradient_accumulation_steps=gas,
        global_batch=global_batch,
        gradient_checkpointing=study["gradient_checkpointing"],
        **measure_fields(study, scenario),
        seed=study["seed"],
        data=DataSpec(
            kind="token_file" if study["token_file"] else "synthetic",
            token_file=study["token_file"],
        ),
        optimizer=OptimizerSpec(**study["optimizer"]),
        nodes=scenario["nodes"],
        gpus_per_node=scenario["gpus_per_node"],
        world_size=scenario["gpus_per_node"] * scenario["nodes"],
        accelerator=cluster["accelerator"],
        gpu_mem_gb=scenario["gpu_mem_gb"],
        cluster_gpu_mem_gb=cluster["gpu_mem_gb"],
        gpu_model=cluster["gpu_model"],
        peak_tflops=cluster["peak_tflops"],
        cpu_mem_gb=scenario["cpu_mem_gb"],
        offload_optimizer=scenario["offload_optimizer"],
        offload_param=scenario["offload_param"],
        nvme_path=nvme_path if uses_nvme else None,
        nvme_capacity_gb=cluster["nvme_capacity_gb"],
        pin_memory=pin_memory,
        modes=run_modes,
        zero=zero,
        aio=study["aio"],
        timeout_s=study["timeout_min"] * 60,
        step_timeout_s=study["step_timeout_s"],
        strict=study["strict"],
        reference=scenario.get("reference"),
        force=scenario.get("force", study["force"]),
        predict_only=scenario["predict_only"],
    )


def measure_fields(study: dict, scenario: dict) -> dict:
    """RunSpec's measure, warmup_steps and steps: the scenario's measure keys over the study's,
    the mode resolved (unset: fixed when the study sets steps, else adaptive); the step counts
    are the fixed mode's (None in adaptive mode)."""
    merged = {**study["measure"], **scenario.get("measure", {})}
    merged.setdefault("mode", "fixed" if "steps" in study else "adaptive")
    fixed = merged["mode"] == "fixed"
    return {
        "measure": MeasureSpec(**merged),
        "warmup_steps": study["warmup_steps"] if fixed else None,
        "steps": study.get("steps") if fixed else None,
    }


def _check_measure(study: dict, scenario: dict, where: str) -> None:
    """Measure keys that contradict each other (each error names the key that set the value)."""
    if study["measure"].get("mode") == "adaptive" and "steps" in study:
        raise StudyError(
            "steps: only the fixed mode uses it, but measure.mode is adaptive; remove steps "
            "or set measure.mode: fixed"
        )
    m = measure_fields(study, scenario)["measure"]
    own = scenario.get("measure", {})

    def key(name: str) -> str:
        return f"{where}.measure.{name}" if name in own else f"measure.{name}"

    problems = [
        (m.mode == "fixed" and "steps" not in study, "mode", "the fixed mode needs the study's steps"),
        (m.min_warmup_steps > m.max_warmup_steps, "min_warmup_steps",
         f"is above max_warmup_steps ({m.max_warmup_steps})"),
        (2 * m.settle_window > m.max_warmup_steps, "max_warmup_steps",
         f"is below 2 × settle_window ({m.settle_window}), so step times could never settle"),
        (m.min_steps > m.max_steps, "min_steps", f"is above max_steps ({m.max_steps})"),
    ]  # fmt: skip
    for broken, name, why in problems:
        if broken and (name == "mode" or m.mode == "adaptive"):
            raise StudyError(f"{key(name)}: {getattr(m, name)!r} {why}")


def _check_scenario_keys(scenario: dict, cluster: dict, where: str) -> None:
    """ZeRO knobs the installed DeepSpeed knows, and a folder for NVMe offload."""
    errors = dsconfig.check_zero_keys(scenario.get("zero", {}), f"{where}.zero")
    for knob, values in scenario.get("sweep", {}).items():
        if knob in BATCH_KNOBS:
            errors += _count_errors(values, f"{where}.sweep.{knob}")
        elif knob not in modes.SWEEPABLE:
            errors += dsconfig.check_sweep_values(knob, values, f"{where}.sweep")
    errors += modes.check_scenario(scenario, where)
    if errors:
        raise StudyError(errors[0])
    devices = (scenario["offload_optimizer"], scenario["offload_param"])
    path, key = nvme_path_key(scenario, cluster, where)
    problem = dsconfig.nvme_path_problem(path) if path is not None else None
    if problem and (key.startswith(where) or "nvme" in devices):
        raise StudyError(f"{key}: {problem}")
    if "nvme" in devices and not path:
        key = "offload_optimizer" if devices[0] == "nvme" else "offload_param"
        raise StudyError(
            f"{where}.{key}: nvme offload needs a directory: set {where}.nvme_path or "
            f"nvme_path in config/clusters/{cluster['name']}.yaml"
        )


def _count_errors(values: list, where: str) -> list[str]:
    """Sweep values of micro_batch or gradient_accumulation_steps that are not counts."""
    return [
        f"{where}[{i}]: {shown(v)} is not allowed; allowed: a positive whole number (>= 1)"
        for i, v in enumerate(values)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1
    ]


def nvme_path_key(scenario: dict, cluster: dict, where: str) -> tuple[str | None, str]:
    """A scenario's NVMe folder (its own, else the cluster's) and the key that sets it."""
    if scenario["nvme_path"] is not None:
        return scenario["nvme_path"], f"{where}.nvme_path"
    return cluster["nvme_path"], f"nvme_path (config/clusters/{cluster['name']}.yaml)"


def check_run_count(study: dict) -> None:
    """Refuse a study with more runs than max_runs, counted before any sweep is expanded."""
    sizes = [math.prod(map(len, sc.get("sweep", {}).values())) for sc in study["scenarios"]]
    total = sum(sizes) * study["repeats"]
    if total > study["max_runs"]:
        big = max(range(len(sizes)), key=sizes.__getitem__)
        biggest = (
            f"; scenarios[{big}].sweep alone expands to {sizes[big]}" if sizes[big] > 1 else ""
        )
        raise StudyError(
            f"max_runs: the study has {total} runs ({sum(sizes)} expanded scenarios × "
            f"{study['repeats']} repeats{biggest}); allowed: at most max_runs = "
            f"{study['max_runs']}: shrink the sweeps or repeats, or raise max_runs"
        )


def _expand_scenario(study: dict, cluster: dict, scenario: dict, where: str) -> list[RunSpec]:
    """One RunSpec per sweep combo. A scenario that does not fit the cluster is the root cause,
    so that is reported before its batch arithmetic (which more GPUs can also break)."""
    _check_scenario_keys(scenario, cluster, where)
    _check_measure(study, scenario, where)
    world = scenario["gpus_per_node"] * scenario["nodes"]
    runs = []
    for combo in _sweep_combos(scenario.get("sweep", {})):
        try:
            batch, batch_error = _batch(study, scenario, combo, world, where), None
        except StudyError as err:
            batch, batch_error = (1, 1, world), err  # stand-in so that the fit is checked first
        run = _run_spec(study, cluster, scenario, combo, batch)
        if not run.predict_only:  # a prediction may stand for a bigger cluster than this one
            check_fits(run, cluster, where)
        if batch_error:
            raise batch_error
        runs.append(run)
    return runs


def expand_plan(study: dict, cluster: dict) -> list[RunSpec]:
    """All runs of a validated study (one spec per expanded scenario; repeats are not expanded)."""
    if study["cluster"] != cluster["name"]:
        raise StudyError(
            f"cluster: study names {study['cluster']!r} but got cluster {cluster['name']!r}"
        )
    check_run_count(study)
    errors = dsconfig.check_zero_keys(study["zero"], "zero") + dsconfig.check_aio_keys(study["aio"])
    if errors:
        raise StudyError(errors[0])
    presets.check_model(study["model"])
    runs: list[RunSpec] = []
    seen: dict[str, str] = {}
    for index, scenario in enumerate(study["scenarios"]):
        where = f"scenarios[{index}]"
        if scenario["name"] in seen:
            raise StudyError(
                f"{where}.name: {scenario['name']!r} is used twice (also {seen[scenario['name']]})"
            )
        seen[scenario["name"]] = where
        runs += _expand_scenario(study, cluster, scenario, where)
        if len({r.scenario for r in runs}) != len(runs):
            raise StudyError(f"{where}.sweep: expands to a scenario name that already exists")
    baseline = study["baseline"]
    if baseline is not None and baseline not in {r.scenario for r in runs} | set(seen):
        raise StudyError(
            f"baseline: {baseline!r} is not a scenario of this study; scenarios: {', '.join(seen)}"
        )
    return samealloc.attach_pairs(study, runs)


def check_on_host(study: dict, cluster: dict, runs: list[RunSpec]) -> list[str]:
    """Paths the plan can check where it is made: the token file and a pretrained model (read
    here, by the plan, and by the runs on a shared file system), NVMe folders when the cluster
    runs on this machine (scheduler local). Returns the checks left to the node that trains
    (plan.json node_checks): the runner makes them first and records config_error."""
    token_file = study["token_file"]
    if token_file is not None and not Path(token_file).is_file():
        raise StudyError(
            f"token_file: {shown(token_file)}: no such file on this machine; allowed: an "
            "existing .npy file of token ids (read by the runs too), or null for synthetic tokens"
        )
    if "name_or_path" in study["model"]:
        presets.check_pretrained(study["model"]["name_or_path"], study["model"]["overrides"])
    folders: dict[str, str] = {}  # NVMe folder -> the key that sets it
    for index, scenario in enumerate(study["scenarios"]):
        path, key = nvme_path_key(scenario, cluster, f"scenarios[{index}]")
        used = any(r.nvme_path == path and r.base_scenario == scenario["name"] for r in runs)
        if path is not None and used:  # None: the scenario's runs write no NVMe files
            folders.setdefault(path, key)
    if cluster["scheduler"] != "local":
        return [
            f"{key}: {path} is on the compute node: each run checks that it can write there "
            "before it starts (else outcome config_error)"
            for path, key in folders.items()
        ]
    for path, key in folders.items():
        problem = dsconfig.nvme_dir_problem(path)
        if problem:
            raise StudyError(f"{key}: {problem}")
    return []


#: The study's run_order -> the runs (scenario, repeat) in the order they start on one machine.
RUN_ORDERS = {
    "interleaved": lambda scenarios, repeats: [(s, r) for r in repeats for s in scenarios],
    "grouped": lambda scenarios, repeats: [(s, r) for s in scenarios for r in repeats],
}


def run_order(scenarios: list[str], repeats: list[int], order: str) -> list[tuple[str, int]]:
    """Every run (scenario, repeat) in the order they should start when one runs at a time:
    interleaved (A B C A B C) so that drift over time hits every scenario alike, or grouped."""
    if order not in RUN_ORDERS:
        raise StudyError(f"run_order: {order!r} is not one of {', '.join(RUN_ORDERS)}")
    return RUN_ORDERS[order](scenarios, repeats)


class Plan:
    """A loaded study, its cluster and its runs; what the Snakefile works from."""

    def __init__(
        self, config: dict | str | Path, cluster_dir: str | Path | None = None, source=None
    ):
        # a study with a recommend block: its candidate grid joins the scenarios (imported
        # here: recommend imports this module, and pandas for its decision)
        from offload_study.prediction import recommend

        self.study = recommend.with_candidates(load_study(config, source=source), source)
        kwargs = {"cluster_dir": cluster_dir} if cluster_dir else {}
        self.cluster = load_cluster(self.study["cluster"], **kwargs)
        planned = expand_plan(self.study, self.cluster)
        #: checks only the node that trains can make (plan.json; the runner makes them)
        self.node_checks = check_on_host(
            self.study, self.cluster, [r for r in planned if not r.predict_only]
        )
        #: the runs to train, and those only predicted (plan.csv, report), never trained
        self.runs = [run for run in planned if not run.predict_only]
        self.predicted_only = [run for run in planned if run.predict_only]
        self.by_name = {run.scenario: run for run in self.runs}
        self.baseline = choose_baseline(
            self.scenarios,
            self.study["baseline"],
            {r.scenario: (r.offload_optimizer, r.offload_param) for r in self.runs},
        )
        self.results_dir = f"results/{self.cluster['name']}/{self.study['study']}"

    @property
    def scenarios(self) -> list[str]:
        return list(self.by_name)

    @property
    def repeats(self) -> list[int]:
        return list(range(self.study["repeats"]))

    def run_order(self) -> list[tuple[str, int]]:
        """The runs (scenario, repeat) in the study's run_order."""
        return run_order(self.scenarios, self.repeats, self.study["run_order"])

    @functools.cached_property
    def _priorities(self) -> dict[tuple[str, int], int]:
        order = self.run_order()
        return {run: len(order) - i for i, run in enumerate(order)}

    def run_priority(self, scenario: str, repeat: int) -> int:
        """A Snakemake job priority that starts the runs in :meth:`run_order` (the first run has
        the highest); 0 for a run the plan does not have."""
        return self._priorities.get((scenario, int(repeat)), 0)

    def ds_config_path(self, scenario: str) -> str:
        return f"{self.results_dir}/configs/{scenario}.json"

    def run_spec(self, scenario: str) -> dict:
        """The run spec with its ds_config path, as the plain dict of run.json: Snakemake compares
        a rule's params between runs only when they are plain data (not a dataclass)."""
        return self.by_name[scenario].with_ds_config(self.ds_config_path(scenario)).to_dict()

    def summary(self) -> dict:
        """plan.json: what the report needs to know of each scenario."""
        keys = (
            "scenario base_scenario label nodes gpus_per_node world_size gpu_mem_gb cpu_mem_gb "
            "offload_optimizer offload_param sweep micro_batch gradient_accumulation_steps "
            "global_batch reference"
        ).split()
        first = (self.runs or self.predicted_only)[0].to_dict()
        return {
            "study": self.study["study"],
            "cluster": self.cluster["name"],
            "cluster_description": self.cluster.get("description", ""),
            "description": self.study.get("description", ""),
            "baseline": self.baseline,
            "model": first["model"],
            "model_params": first["model_params"],
            "seq_len": self.study["seq_len"],
            "dtype": self.study["dtype"],
            "repeats": self.study["repeats"],
            "preflight": self.study["preflight"],  # refuse | warn (plan main: the op preflight)
            "node_checks": self.node_checks,
            "scenarios": [self._scenario_summary(run.to_dict(), keys) for run in self.runs],
            # the whole spec: the plan job predicts them without a configs/ file
            "predict_only": [
                {**{k: run[k] for k in keys}, "name": run["scenario"], "spec": run}
                for run in (r.to_dict() for r in self.predicted_only)
            ],
        }

    def _scenario_summary(self, run: dict, keys: list[str]) -> dict:
        return {
            **{k: run[k] for k in keys},
            "name": run["scenario"],
            "ds_config": self.ds_config_path(run["scenario"]),
            "run_spec": f"{self.results_dir}/configs/{run['scenario']}.run.json",
        }


def write_scenario_files(run_spec: RunSpec | dict, ds_config_path: str, spec_path: str) -> None:
    """configs/<scenario>.json (DeepSpeed config) and configs/<scenario>.run.json (run spec).

    ``run_spec`` may be the plain dict of :meth:`Plan.run_spec` (what a rule's params carry).
    """
    if not isinstance(run_spec, RunSpec):
        run_spec = RunSpec.from_dict(run_spec)
    run_spec = run_spec.with_ds_config(ds_config_path)
    write_json(ds_config_path, dsconfig.build_ds_config(run_spec))
    write_run_spec(spec_path, run_spec)


def check_with_deepspeed(
    spec_paths: list[str], more: Sequence[tuple[RunSpec, dict]] = ()
) -> list[str]:
    """Parse every DeepSpeed config with DeepSpeed's own parser; return one error per refusal.

    ``more``: (run spec, DeepSpeed config) pairs that have no files (predict-only scenarios).
    """
    dsconfig.ensure_single_process_comm()
    pairs = [(spec, read_json(spec.ds_config)) for spec in map(read_run_spec, spec_paths)]
    errors = []
    for spec, config in [*pairs, *more]:
        try:
            dsconfig.parse_with_deepspeed(config, spec.world_size)
        except Exception as exc:  # DeepSpeed raises AssertionError, ValueError, ValidationError
            where = spec.ds_config or "predict-only config"
            errors.append(f"{where} (scenario {spec.scenario!r}): DeepSpeed refused it: {exc}")
    return errors


def predict_plan(plan: dict, specs: list[RunSpec], calibration: str | None, plan_csv: str) -> dict:
    """plan.csv (one prediction per scenario, predict-only ones too) and what plan.json says of
    it (predicted GPU-hours, the calibration used)."""
    cal = read_calibration(calibration) if calibration else None
    pairs = [(spec, read_json(spec.ds_config)) for spec in specs] + predict_only_configs(plan)
    rows = [predict.predict(s, c, cal, plan["repeats"], with_deepspeed=True) for s, c in pairs]
    write_predictions(plan_csv, rows)
    return {"plan_csv": plan_csv, **predict.summarize(rows, calibration, cal)}


def predict_only_configs(plan: dict) -> list[tuple[RunSpec, dict]]:
    """(run spec, DeepSpeed config) of each predict-only scenario of a plan summary."""
    specs = [
        RunSpec.from_dict(s["spec"], "plan: predict_only") for s in plan.get("predict_only", [])
    ]
    return [(spec, dsconfig.build_ds_config(spec)) for spec in specs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Check planned DeepSpeed configs and write plan.json"
    )
    parser.add_argument("--plan-json", required=True, help="plan summary written by the workflow")
    parser.add_argument("--out", required=True, help="validated plan to write")
    parser.add_argument("--plan-csv", help="plan.csv to write: predictions per scenario")
    parser.add_argument("--calibration", help="the cluster's calibration.json (step times)")
    parser.add_argument("specs", nargs="+", help="run specs (configs/<scenario>.run.json)")
    args = parser.parse_args(argv)
    plan = read_json(args.plan_json)
    errors = check_with_deepspeed(args.specs, predict_only_configs(plan))
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    specs = [read_run_spec(path) for path in args.specs]
    plan["preflight"], lines, stops = preflight.plan_gate(specs, plan["preflight"])
    if lines:
        print("\n".join(lines), file=sys.stderr)
    if stops:  # an op DeepSpeed cannot build here: nothing trains (study key preflight)
        return 1
    plan["deepspeed_checked"] = True
    plan["ds_config_sha256"] = {spec.scenario: sha256_file(spec.ds_config) for spec in specs}
    if args.plan_csv:
        plan["prediction"] = predict_plan(plan, specs, args.calibration, args.plan_csv)
        print(plan["prediction"]["summary"])
    write_json(args.out, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
