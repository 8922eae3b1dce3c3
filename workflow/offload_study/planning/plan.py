"""Expand a validated study into runs: scenarios x sweeps, in one place (like Ramble's matrices).

``expand_plan`` is pure and never raises: study + cluster dicts in, a list of
:class:`~offload_study.core.contracts.RunSpec` out (docs/design.md). It only computes; whether
the runs may go ahead is admission's one judgement (offload_study.admission.admit), made on
what this module returns: expand, then admit, then write (:func:`write_scenario_files`).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from pathlib import Path

from offload_study import engines
from offload_study.core import architecture, layout
from offload_study.core.contracts import (
    DEFAULT_ENGINE,
    DataSpec,
    MeasureSpec,
    ModelSpec,
    OptimizerSpec,
    RunSpec,
    choose_baseline,
    write_json,
    write_run_spec,
)
from offload_study.core.study import StudyError, load_cluster, load_study
from offload_study.core.yamlsafe import normalize_number
from offload_study.planning import modes, presets, samealloc
from offload_study.planning.candidates import with_candidates
from offload_study.planning.names import expanded_name

BATCH_KNOBS = ("micro_batch", "gradient_accumulation_steps")


def model_spec(study: dict) -> ModelSpec:
    model = study["model"]
    overrides = model.get("overrides", {})
    if "name_or_path" in model:
        return ModelSpec("pretrained", None, dict(overrides), model["name_or_path"])
    if "preset" in model:  # an unknown preset is admission's to refuse (model.preset)
        config = architecture.overridden(presets.PRESETS.get(model["preset"], {}), overrides)
        return ModelSpec("config", model["preset"], config, None)
    return ModelSpec("config", None, architecture.overridden(model["config"], overrides), None)


def _sweep_combos(sweep: dict) -> list[dict]:
    if not sweep:
        return [{}]
    keys = list(sweep)
    return [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(sweep[k] for k in keys))
    ]


def positive_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def batch(study: dict, scenario: dict, combo: dict, world: int) -> tuple[int, int, int]:
    """(micro_batch, gas, global_batch): the global batch stays the study's unless gas is fixed.
    Where it does not divide (or a count is no count) the spec still gets numbers, gas rounded
    down to at least 1, so that admission can name the key (offload_study.admission.admit)."""
    micro = normalize_number(
        combo.get("micro_batch", scenario.get("micro_batch", study["micro_batch"]))
    )
    gas = combo.get("gradient_accumulation_steps", scenario.get("gradient_accumulation_steps"))
    micro = micro if positive_count(micro) else 1
    if gas is not None:
        gas = gas if positive_count(gas) else 1
        return micro, gas, micro * gas * world
    global_batch = study["global_batch"]
    return micro, max(1, global_batch // (micro * world)), global_batch


def _run_spec(
    study: dict, cluster: dict, scenario: dict, combo: dict, batch: tuple[int, int, int]
) -> RunSpec:
    """The RunSpec of one expansion (sweep combo) of a scenario."""
    micro, gas, global_batch = batch
    zero = {**study["zero"], **scenario.get("zero", {})}
    zero.update({k: v for k, v in combo.items() if k not in BATCH_KNOBS + modes.SWEEPABLE})
    pin_memory, run_modes = modes.resolve(scenario, combo)
    model = model_spec(study)
    nvme_path = scenario["nvme_path"] or cluster.get("nvme_path")
    uses_nvme = "nvme" in (scenario["offload_optimizer"], scenario["offload_param"])
    return RunSpec(
        study=study["study"],
        cluster=cluster["name"],
        scenario=expanded_name(scenario["name"], combo),
        base_scenario=scenario["name"],
        label=label(study, scenario),
        engine=scenario["engine"],
        sweep={k: normalize_number(v) for k, v in combo.items()},
        model=model,
        # counted where it costs nothing: a plan is made at every Snakemake start (the NVMe
        # check counts any other model when it needs to)
        model_params=architecture.param_count(model, build=False),
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


def label(study: dict, scenario: dict) -> str:
    """The scenario's label (default its name); where the study uses more than one engine, the
    engine is added unless the label names it, so two scenarios that differ only by engine
    are told apart in every table and figure."""
    text = scenario.get("label") or scenario["name"]
    used = {s.get("engine", DEFAULT_ENGINE) for s in study["scenarios"]}
    name = engines.label(scenario["engine"])
    if len(used) < 2 or name.lower() in text.lower() or scenario["engine"] in text.lower():
        return text
    return f"{text} ({name})"


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


def nvme_path_key(scenario: dict, cluster: dict, where: str) -> tuple[str | None, str]:
    """A scenario's NVMe folder (its own, else the cluster's) and the key that sets it."""
    if scenario["nvme_path"] is not None:
        return scenario["nvme_path"], f"{where}.nvme_path"
    return cluster["nvme_path"], f"nvme_path (config/clusters/{cluster['name']}.yaml)"


def sweep_sizes(study: dict) -> list[int]:
    """Expanded scenarios per scenario of the study, counted without expanding a sweep."""
    return [math.prod(map(len, sc.get("sweep", {}).values())) for sc in study["scenarios"]]


def _expand_scenario(study: dict, cluster: dict, scenario: dict) -> list[RunSpec]:
    """One RunSpec per sweep combo of the scenario."""
    world = scenario["gpus_per_node"] * scenario["nodes"]
    return [
        _run_spec(study, cluster, scenario, combo, batch(study, scenario, combo, world))
        for combo in _sweep_combos(scenario.get("sweep", {}))
    ]


def expand_plan(study: dict, cluster: dict) -> list[RunSpec]:
    """All runs of a validated study (one spec per expanded scenario; repeats are not expanded).

    Pure and never raises: admission judges what it returns. A study past max_runs is expanded
    only up to max_runs expanded scenarios (a typo in a sweep must not plan millions); admission
    counts the whole study and refuses it (max_runs)."""
    runs: list[RunSpec] = []
    for scenario in study["scenarios"]:
        if len(runs) >= study["max_runs"]:
            break
        runs += _expand_scenario(study, cluster, scenario)
    return samealloc.attach_pairs(study, runs[: study["max_runs"]])


def nvme_folders(study: dict, cluster: dict, runs: list[RunSpec]) -> dict[str, str]:
    """NVMe folder -> the key that sets it, of every folder the trained runs write swap files to."""
    folders: dict[str, str] = {}
    for index, scenario in enumerate(study["scenarios"]):
        path, key = nvme_path_key(scenario, cluster, f"scenarios[{index}]")
        used = any(
            r.nvme_path == path and r.base_scenario == scenario["name"] and not r.predict_only
            for r in runs
        )
        if path is not None and used:  # None: the scenario's runs write no NVMe files
            folders.setdefault(path, key)
    return folders


def node_checks(study: dict, cluster: dict, runs: list[RunSpec]) -> list[str]:
    """The checks left to the node that trains (plan.json node_checks): under a scheduler the
    NVMe folders are on the compute node, so each run checks first (else config_error); on a
    local cluster admission checks them where the plan is made (none left)."""
    if cluster["scheduler"] == "local":
        return []
    return [
        f"{key}: {path} is on the compute node: each run checks that it can write there "
        "before it starts (else outcome config_error)"
        for path, key in nvme_folders(study, cluster, runs).items()
    ]


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
        study = load_study(config, source=source)
        #: the study's file, where it was read from one (the pages' command to run it again)
        self.study_file = next(
            (str(f) for f in (source, config) if isinstance(f, (str, Path)) and os.path.isfile(f)),
            None,
        )
        kwargs = {"cluster_dir": cluster_dir} if cluster_dir else {}
        self.cluster = load_cluster(study["cluster"], **kwargs)
        # a study with a recommend block: its candidate grid (what can run on the cluster)
        # joins the scenarios
        self.study = with_candidates(study, self.cluster, source)
        #: every expanded run, trained or predicted only (what admission judges)
        self.planned = expand_plan(self.study, self.cluster)
        planned = self.planned
        #: checks only the node that trains can make (plan.json; the runner makes them)
        self.node_checks = node_checks(self.study, self.cluster, planned)
        #: the runs to train, and those only predicted (plan.csv, report), never trained
        self.runs = [run for run in planned if not run.predict_only]
        self.predicted_only = [run for run in planned if run.predict_only]
        self.by_name = {run.scenario: run for run in self.runs}
        self.baseline = choose_baseline(
            self.scenarios,
            self.study["baseline"],
            {r.scenario: (r.offload_optimizer, r.offload_param) for r in self.runs},
        )
        self.results_dir = layout.study_dir(self.cluster["name"], self.study["study"])
        self.report_dir = layout.report_dir(self.cluster["name"], self.study["study"])

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
        return layout.ds_config_path(self.results_dir, scenario)

    def run_spec(self, scenario: str) -> dict:
        """The run spec with its ds_config path, as the plain dict of run.json: Snakemake compares
        a rule's params between runs only when they are plain data (not a dataclass). The dict of
        ``with_ds_config(path).to_dict()``, made without copying the spec (once per job of a dry
        run)."""
        return {**self.by_name[scenario].to_dict(), "ds_config": self.ds_config_path(scenario)}

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
            "study_file": self.study_file,
            "description": self.study.get("description", ""),
            "purpose": self.study.get("purpose", "result"),
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
                {**_keys_of(run, keys), "name": run["scenario"], "spec": run}
                for run in (r.to_dict() for r in self.predicted_only)
            ],
        }

    def _scenario_summary(self, run: dict, keys: list[str]) -> dict:
        return {
            **_keys_of(run, keys),
            "name": run["scenario"],
            "ds_config": self.ds_config_path(run["scenario"]),
            "run_spec": layout.run_spec_path(self.results_dir, run["scenario"]),
        }


def _keys_of(run: dict, keys: list[str]) -> dict:
    """A run spec dict's ``keys``, and its engine where it is not the default (a DeepSpeed
    study's plan.json stays as it was)."""
    return {**{k: run[k] for k in keys}, **({"engine": run["engine"]} if "engine" in run else {})}


def write_scenario_files(run_spec: RunSpec | dict, ds_config_path: str, spec_path: str) -> None:
    """configs/<scenario>.json (the engine's config: DeepSpeed's JSON, FSDP2's settings) and
    configs/<scenario>.run.json (run spec).

    ``run_spec`` may be the plain dict of :meth:`Plan.run_spec` (what a rule's params carry).
    """
    if not isinstance(run_spec, RunSpec):
        run_spec = RunSpec.from_dict(run_spec)
    run_spec = run_spec.with_ds_config(ds_config_path)
    write_json(ds_config_path, engines.of(run_spec).build_config(run_spec))
    write_run_spec(spec_path, run_spec)
