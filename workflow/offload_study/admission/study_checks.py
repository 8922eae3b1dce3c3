"""What admission asks of a study's expansion before anything runs: input that passes the schema
but makes no sense, what each scenario's engine says of its keys, the cluster fit, and the host. Each check returns
every problem it finds as "key path: message" text (offload_study.admission.admit makes them
Problems), in the order a reader fixes them: the study's keys, then each scenario's.
"""

from __future__ import annotations

import math
from pathlib import Path

from offload_study import engines
from offload_study.core import units
from offload_study.core.contracts import RunSpec
from offload_study.core.study import StudyError, nvme_dir_problem, shown
from offload_study.planning import presets
from offload_study.planning.plan import (
    BATCH_KNOBS,
    measure_fields,
    nvme_folders,
    positive_count,
    sweep_sizes,
)
from offload_study.planning.resources import fit_problems

#: Memory sizes (GiB) are converted to bytes (caps, SLURM, NVML): above this they overflow 64 bits.
MAX_MEMORY_GIB = units.bytes_to_gib(units.MAX_INT64)


def _raised(check, *args) -> list[str]:
    """The StudyError of a check that raises (model and file checks) as a problem list."""
    try:
        check(*args)
    except StudyError as err:
        return [str(err)]
    return []


def cluster_problems(study: dict, cluster: dict) -> list[str]:
    if study["cluster"] == cluster["name"]:
        return []
    return [f"cluster: study names {study['cluster']!r} but got cluster {cluster['name']!r}"]


def run_count_problems(study: dict) -> list[str]:
    """More runs than max_runs, counted without expanding a sweep."""
    sizes = sweep_sizes(study)
    total = sum(sizes) * study["repeats"]
    if total <= study["max_runs"]:
        return []
    big = max(range(len(sizes)), key=sizes.__getitem__)
    biggest = f"; scenarios[{big}].sweep alone expands to {sizes[big]}" if sizes[big] > 1 else ""
    return [
        f"max_runs: the study has {total} runs ({sum(sizes)} expanded scenarios × "
        f"{study['repeats']} repeats{biggest}); allowed: at most max_runs = "
        f"{study['max_runs']}: shrink the sweeps or repeats, or raise max_runs"
    ]


def model_problems(study: dict) -> list[str]:
    """The model builds (without weights), and the sequence fits its positions."""
    model = study["model"]
    if "name_or_path" in model:  # read on this machine: a host check (host_problems)
        return []
    try:
        positions = presets.check_model(model)
    except StudyError as err:
        return [str(err)]
    return seq_len_problems(study, positions)


def seq_len_problems(study: dict, positions: int | None) -> list[str]:
    if positions is None or study["seq_len"] <= positions:
        return []
    return [
        f"seq_len: {study['seq_len']} tokens is past the model's max_position_embeddings "
        f"({positions}); allowed: at most {positions}, or a model with more positions "
        "(model.overrides.max_position_embeddings)"
    ]


def _memory_keys(study: dict, cluster: dict):
    for i, scenario in enumerate(study["scenarios"]):
        for key in ("gpu_mem_gb", "cpu_mem_gb"):
            yield f"scenarios[{i}].{key}", scenario.get(key)
    for key in ("gpu_mem_gb", "cpu_mem_gb"):
        yield f"recommend.{key}", (study.get("recommend") or {}).get(key)
    for key in ("gpu_mem_gb", "mem_gb_per_node", "nvme_capacity_gb"):
        yield f"{key} (config/clusters/{cluster['name']}.yaml)", cluster.get(key)


def memory_problems(study: dict, cluster: dict) -> list[str]:
    """Memory sizes whose bytes would not fit 64 bits (or are no finite number)."""
    problems = []
    for key, value in _memory_keys(study, cluster):
        if value is None:
            continue
        try:
            fits = math.isfinite(float(value)) and float(value) <= MAX_MEMORY_GIB
        except OverflowError:  # an int too big for a float
            fits = False
        if not fits:
            problems.append(
                f"{key}: {shown(value)} GiB overflows when converted to bytes; allowed: a size "
                f"below {MAX_MEMORY_GIB:.3g} GiB"
            )
    return problems


def engine_study_problems(study: dict) -> list[str]:
    """The study-wide keys each engine owns (DeepSpeed's zero and aio blocks)."""
    return [problem for engine in engines.engines() for problem in engine.study_problems(study)]


def _count_errors(values: list, where: str) -> list[str]:
    """Sweep values of micro_batch or gradient_accumulation_steps that are not counts."""
    return [
        f"{where}[{i}]: {shown(v)} is not allowed; allowed: a positive whole number (>= 1)"
        for i, v in enumerate(values)
        if not positive_count(v)
    ]


def scenario_key_problems(scenario: dict, cluster: dict, where: str) -> list[str]:
    """Sweep values of the batch knobs that are not counts, then what the scenario's engine
    says of its keys (offload_study.engines: its knobs, modes, offload path, folders)."""
    errors = [
        problem
        for knob, values in scenario.get("sweep", {}).items()
        if knob in BATCH_KNOBS
        for problem in _count_errors(values, f"{where}.sweep.{knob}")
    ]
    return errors + engines.get(scenario["engine"]).scenario_problems(scenario, cluster, where)


def measure_problems(study: dict, scenario: dict, where: str) -> list[str]:
    """Measure keys that contradict each other (each error names the key that set the value)."""
    if study["measure"].get("mode") == "adaptive" and "steps" in study:
        return [
            "steps: only the fixed mode uses it, but measure.mode is adaptive; remove steps "
            "or set measure.mode: fixed"
        ]
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
    return [
        f"{key(name)}: {getattr(m, name)!r} {why}"
        for broken, name, why in problems
        if broken and (name == "mode" or m.mode == "adaptive")
    ]


def batch_problems(study: dict, scenario: dict, run: RunSpec, where: str) -> list[str]:
    """A global batch the run's GPUs cannot split, or one past DeepSpeed's 64-bit integers."""
    combo, world = run.sweep, run.world_size
    micro, gas = run.micro_batch, run.gradient_accumulation_steps
    fixed_gas = "gradient_accumulation_steps" in combo or scenario.get(
        "gradient_accumulation_steps"
    )
    global_batch = run.global_batch
    if not fixed_gas and global_batch % (micro * world):
        return [
            f"{where}: global_batch {global_batch} is not divisible by micro_batch {micro} × "
            f"world_size {world} (= {micro * world}); gradient_accumulation_steps would not "
            "be an integer. Change global_batch, micro_batch or the GPU count"
        ]
    if max(global_batch, gas) > units.MAX_INT64:
        key = "global_batch" if not fixed_gas else f"{where}.gradient_accumulation_steps"
        return [
            f"{key}: a global batch of {global_batch} samples ({gas} micro-steps of {micro} on "
            f"{world} GPUs) is past 64-bit integers: no cluster can run it"
        ]
    return []


def scenario_problems(study: dict, cluster: dict, runs: list[RunSpec]) -> list[str]:
    """Per scenario, in study order: its name, keys, measure, fit, then each sweep combo's batch
    (a scenario that does not fit the cluster is the root cause: its fit comes before the batch
    arithmetic, which more GPUs can also break)."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for index, scenario in enumerate(study["scenarios"]):
        where = f"scenarios[{index}]"
        if scenario["name"] in seen:
            problems.append(
                f"{where}.name: {scenario['name']!r} is used twice (also {seen[scenario['name']]})"
            )
        seen.setdefault(scenario["name"], where)
        problems += scenario_key_problems(scenario, cluster, where)
        problems += measure_problems(study, scenario, where)
        for run in (r for r in runs if r.base_scenario == scenario["name"]):
            if not run.predict_only:  # a prediction may stand for a bigger cluster than this
                problems += [f"{where}.{key}: {text}" for key, text in fit_problems(run, cluster)]
            problems += batch_problems(study, scenario, run, where)
    names = [r.scenario for r in runs]
    clashes = sorted({n for n in names if names.count(n) > 1 and "__" in n})
    problems += [f"scenarios: the sweeps expand to {n!r} more than once" for n in clashes]
    return list(dict.fromkeys(problems))  # one line per problem (two combos may share one)


def baseline_problems(study: dict, runs: list[RunSpec]) -> list[str]:
    """The baseline must name an expanded scenario: a swept scenario's own name is gone."""
    baseline = study["baseline"]
    names = [r.scenario for r in runs]
    if baseline is None or baseline in names:
        return []
    renamed = [n for n in names if n.startswith(f"{baseline}__")]
    why = (
        f"its sweep renamed it to {', '.join(renamed)}; name one of them"
        if renamed
        else "not a scenario of this study"
    )
    return [f"baseline: {baseline!r}: {why}; expanded scenarios: {', '.join(names)}"]


def host_problems(study: dict, cluster: dict, runs: list[RunSpec]) -> list[str]:
    """Paths the plan can check where it is made: the token file and a pretrained model (read
    here, by the plan, and by the runs on a shared file system), NVMe folders when the cluster
    runs on this machine (scheduler local; else plan.json node_checks leave them to the runs)."""
    problems = []
    token_file = study["token_file"]
    if token_file is not None and not Path(token_file).is_file():
        problems.append(
            f"token_file: {shown(token_file)}: no such file on this machine; allowed: an "
            "existing .npy file of token ids (read by the runs too), or null for synthetic tokens"
        )
    model = study["model"]
    if "name_or_path" in model:
        try:
            positions = presets.check_pretrained(model["name_or_path"], model["overrides"])
            problems += seq_len_problems(study, positions)
        except StudyError as err:
            problems.append(str(err))
    if cluster["scheduler"] == "local":
        for path, key in nvme_folders(study, cluster, runs).items():
            problem = nvme_dir_problem(path)
            problems += [f"{key}: {problem}"] if problem else []
    return problems


def study_problems(study: dict, cluster: dict, runs: list[RunSpec]) -> list[str]:
    """Every problem of a study's expansion, the study's own keys first."""
    problems = cluster_problems(study, cluster) + run_count_problems(study)
    if problems:  # another cluster's study, or a sweep past max_runs: nothing more to judge
        return problems
    return (
        engine_study_problems(study)
        + model_problems(study)
        + memory_problems(study, cluster)
        + scenario_problems(study, cluster, runs)
        + baseline_problems(study, runs)
    )
