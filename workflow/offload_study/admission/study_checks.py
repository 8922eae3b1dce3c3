"""What admission asks of a study's expansion before anything runs: input that passes the schema
but makes no sense, what each scenario's engine says of its keys, the cluster fit, and the host. Each check returns
every problem it finds as "key path: message" text (offload_study.admission.admit makes them
Problems), in the order a reader fixes them: the study's keys, then each scenario's.

The checks also judge a study the schema refused (its checkable copy, core.study.checkable):
each one runs through :func:`_every` (core.study.unless_refused), and one that reads a refused
value is skipped. The units skipped are small: a study-level check, each memory key, one
scenario's keys, each measure rule, one run's fit, one run's batch.
"""

from __future__ import annotations

import math
from pathlib import Path

from offload_study import engines
from offload_study.core import units
from offload_study.core.contracts import RunSpec
from offload_study.core.study import StudyError, nvme_dir_problem, shown, unless_refused
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


def _every(*calls) -> list[str]:
    """The problems of each ``(check, *args)`` in turn; one that reads a value the schema refused
    is skipped (core.study.unless_refused)."""
    return [found for check, *args in calls for found in unless_refused(check, *args)]


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
    return _every(*((_overflow, key, value) for key, value in _memory_keys(study, cluster)))


def _overflow(key: str, value) -> list[str]:
    if value is None:
        return []
    try:
        fits = math.isfinite(float(value)) and float(value) <= MAX_MEMORY_GIB
    except OverflowError:  # an int too big for a float
        fits = False
    if fits:
        return []
    return [
        f"{key}: {shown(value)} GiB overflows when converted to bytes; allowed: a size "
        f"below {MAX_MEMORY_GIB:.3g} GiB"
    ]


def engine_study_problems(study: dict) -> list[str]:
    """The study-wide keys each engine owns (DeepSpeed's zero and aio blocks)."""
    return _every(*((engine.study_problems, study) for engine in engines.engines()))


def _count_errors(values: list, where: str) -> list[str]:
    """Sweep values of micro_batch or gradient_accumulation_steps that are not counts."""
    return [
        f"{where}[{i}]: {shown(v)} is not allowed; allowed: a positive whole number (>= 1)"
        for i, v in enumerate(values)
        if not positive_count(v)
    ]


def scenario_key_problems(study: dict, scenario: dict, cluster: dict, where: str) -> list[str]:
    """Sweep values of the batch knobs that are not counts, then what the scenario's engine
    says of its keys (offload_study.engines: its knobs, modes, offload path, folders)."""
    errors = [
        problem
        for knob, values in scenario.get("sweep", {}).items()
        if knob in BATCH_KNOBS
        for problem in _count_errors(values, f"{where}.sweep.{knob}")
    ]
    engine = engines.get(scenario["engine"])
    return errors + engine.scenario_problems(study, scenario, cluster, where)


def measure_problems(study: dict, scenario: dict, where: str) -> list[str]:
    """Measure keys that contradict each other (each error names the key that set the value;
    each rule judged alone, so one that reads a refused value leaves the others standing)."""
    if study["measure"].get("mode") == "adaptive" and "steps" in study:
        return [
            "steps: only the fixed mode uses it, but measure.mode is adaptive; remove steps "
            "or set measure.mode: fixed"
        ]
    m = measure_fields(study, scenario)["measure"]
    own = scenario.get("measure", {})

    def key(name: str) -> str:
        return f"{where}.measure.{name}" if name in own else f"measure.{name}"

    rules = [
        (
            "mode",
            lambda: m.mode == "fixed" and "steps" not in study,
            lambda: "the fixed mode needs the study's steps",
        ),
        (
            "min_warmup_steps",
            lambda: m.min_warmup_steps > m.max_warmup_steps,
            lambda: f"is above max_warmup_steps ({m.max_warmup_steps})",
        ),
        (
            "max_warmup_steps",
            lambda: 2 * m.settle_window > m.max_warmup_steps,
            lambda: (
                f"is below 2 × settle_window ({m.settle_window}), so step times could never settle"
            ),
        ),
        (
            "min_steps",
            lambda: m.min_steps > m.max_steps,
            lambda: f"is above max_steps ({m.max_steps})",
        ),
    ]

    def judged(name: str, broken, why) -> list[str]:
        if not (broken() and (name == "mode" or m.mode == "adaptive")):
            return []
        return [f"{key(name)}: {getattr(m, name)!r} {why()}"]

    return _every(*((judged, *rule) for rule in rules))


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
    arithmetic, which more GPUs can also break); then expanded names that clash."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for index, scenario in enumerate(study["scenarios"]):
        where = f"scenarios[{index}]"
        problems += _every(
            (_name_problems, scenario, seen, where),
            (scenario_key_problems, study, scenario, cluster, where),
            (measure_problems, study, scenario, where),
        )
        for run in unless_refused(_runs_of, scenario, runs):
            problems += _every(
                (_fit_problems, run, cluster, where), (batch_problems, study, scenario, run, where)
            )
    problems += _every((expanded_name_problems, study, runs))
    return list(dict.fromkeys(problems))  # one line per problem (two combos may share one)


def _name_problems(scenario: dict, seen: dict[str, str], where: str) -> list[str]:
    name = scenario["name"]
    seen.setdefault(name, where)
    if seen[name] == where:
        return []
    return [f"{where}.name: {name!r} is used twice (also {seen[name]})"]


def _runs_of(scenario: dict, runs: list[RunSpec]) -> list[RunSpec]:
    return [r for r in runs if r.base_scenario == scenario["name"]]


def _fit_problems(run: RunSpec, cluster: dict, where: str) -> list[str]:
    if run.predict_only:  # a prediction may stand for a bigger cluster than this
        return []
    return [f"{where}.{key}: {text}" for key, text in fit_problems(run, cluster)]


def expanded_name_problems(study: dict, runs: list[RunSpec]) -> list[str]:
    """Expanded names that more runs than one have, each naming the scenarios whose sweeps make
    it (a plain name used twice is _name_problems')."""
    owners: dict[str, list[int]] = {}
    for index, scenario in enumerate(study["scenarios"]):
        owners.setdefault(scenario["name"], []).append(index)
    made: dict[str, list[RunSpec]] = {}
    for run in runs:
        made.setdefault(run.scenario, []).append(run)
    problems = []
    for name, same in made.items():
        if len(same) > 1 and "__" in name:
            makers = sorted({i for r in same for i in owners.get(r.base_scenario, [])})
            problems.append(_clash_text(study, name, makers))
    return problems


def _clash_text(study: dict, name: str, makers: list[int]) -> str:
    if len(makers) < 2:
        where = f"scenarios[{makers[0]}].sweep" if makers else "scenarios"
        return (
            f"{where}: expands to {name!r} more than once (two sweep values with one name); "
            "allowed: sweep values with distinct names"
        )
    named = [f"scenarios[{i}].name {study['scenarios'][i]['name']!r}" for i in makers]
    return (
        f"scenarios[{makers[-1]}].name: {', '.join(named[:-1])} and {named[-1]} expand to the "
        f"same name {name!r} (a sweep adds its values to its scenario's name); allowed: "
        "distinct expanded names: rename one of them"
    )


def baseline_problems(study: dict, runs: list[RunSpec]) -> list[str]:
    """The baseline must name an expanded scenario: a swept scenario's own name is gone. Judged
    only when every scenario expanded (one holding a refused value does not)."""
    baseline = study["baseline"]
    names = [r.scenario for r in runs]
    if baseline is None or baseline in names:
        return []
    if {r.base_scenario for r in runs} != {s["name"] for s in study["scenarios"]}:
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
    problems = _every((cluster_problems, study, cluster), (run_count_problems, study))
    if problems:  # another cluster's study, or a sweep past max_runs: nothing more to judge
        return problems
    return _every(
        (engine_study_problems, study),
        (model_problems, study),
        (memory_problems, study, cluster),
        (scenario_problems, study, cluster, runs),
        (baseline_problems, study, runs),
    )
