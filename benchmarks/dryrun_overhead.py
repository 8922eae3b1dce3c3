"""What the workflow adds to Snakemake's own dry-run time, and how planning scales with sweeps.

    python benchmarks/dryrun_overhead.py [--runs 1000] [--repeats 3] [--sizes 4 100 1000]
                                         [--compare CHECKOUT ...]

1. `snakemake -n --forceall` of the default study (config/config.yaml) with its scenarios swept
   to `--runs` runs in total, against the same dry run of a trivial workflow of `--runs` jobs
   (one rule: one output, no params, no resources) made in a temp folder; also, for reference,
   a trivial workflow with as many jobs as the study's dry run plans (each run is two jobs:
   engine_config and train). Each is run `--repeats` times, interleaved so drifting machine
   load hits all alike; prints every wall time, the medians (and the CPU time the dry runs
   used, which moves less with other work on a shared machine) and the ratio study / trivial
   of the wall-time medians against the target (at most 1.3x), and
   beside it the ratios to the trivial workflow of the study's job count (what the study's dry
   run would take if each of its jobs cost Snakemake no more than a trivial one), and to the
   study's DAG without the library's code (the same rules, outputs, logs, params, priority,
   conda env and resources per run, each job a `touch`): what Snakemake itself spends on a
   run's declarations, and over it what the workflow's own code adds; and to that DAG without
   the engine_config jobs (one job per run: the floor of a design where train writes its own
   configs, which Snakemake would not re-run when its scenario changes while the plan job
   re-runs too: benchmarks/snakemake_masking.py).
   The library's bytecode is compiled first: Snakemake's own modules come compiled with its
   install, and a user's checkout caches the library's after its first run, but where
   PYTHONDONTWRITEBYTECODE is set nothing would be cached and every dry run of the study would
   compile its ~40 modules from source (~0.1 s CPU) that the trivial workflow never imports.
2. With `--sizes`: in-process `Plan()` time per study size (the planner's share of a dry run).

Exit status 0 whether or not the target is met (a benchmark prints numbers, it does not judge);
1 when a dry run fails.
"""

from __future__ import annotations

import argparse
import compileall
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from offload_study.planning.plan import Plan

REPO_ROOT = Path(__file__).resolve().parents[1]

TARGET_RATIO = 1.3
SAME_SHAPE = "same DAG, no library"
ONE_JOB = "one job per run, no library"
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-n", "--forceall"]

TRIVIAL_SNAKEFILE = """\
rule all:
    input:
        expand("out/{i}.txt", i=range(JOBS)),


rule one:
    output:
        "out/{i}.txt",
    shell:
        "touch {output}"
"""


# The study's DAG with none of the library's code: per run, an engine_config job (2 outputs, a
# log, a params function) and a train job (3 outputs, a log, the config files and plan.json as
# inputs, a params function, threads, a conda env, a priority function, plain resources), then
# plan, collect and report as the study has them. What Snakemake itself spends on a run's
# declarations, the floor under the study's dry run.
SAME_SHAPE_SNAKEFILE = """\
rule all:
    input:
        "report.html",
        expand("runs/{s}/rep0/metrics.json", s=range(JOBS)),


rule engine_config:
    output:
        ds_config="configs/{s}.json",
        spec="configs/{s}.run.json",
    log:
        "logs/engine_config/{s}.log",
    params:
        spec=lambda wc: {"scenario": wc.s, "micro_batch": 4},
    shell:
        "touch {output}"


rule plan:
    input:
        "plan.unchecked.json",
    output:
        json="plan.json",
        csv="plan.csv",
    log:
        "logs/plan.log",
    shell:
        "touch {output}"


rule train:
    input:
        spec="configs/{s}.run.json",
        ds_config="configs/{s}.json",
        plan=ancient("plan.json"),
    output:
        metrics="runs/{s}/rep{r}/metrics.json",
        steps="runs/{s}/rep{r}/steps.csv",
        provenance="runs/{s}/rep{r}/provenance.json",
    log:
        "logs/train/{s}.rep{r}.log",
    priority: lambda wc: int(wc.s)
    conda:
        "ENV"
    threads: 2
    resources:
        nodes=1,
        mem_mb=4096,
        runtime=30,
        cpus_per_task=2,
        tasks=1,
    params:
        outdir=subpath(output.metrics, parent=True),
    shell:
        "touch {output}"


rule collect:
    input:
        expand("runs/{s}/rep0/metrics.json", s=range(JOBS)),
    output:
        "runs.csv",
    log:
        "logs/collect.log",
    shell:
        "touch {output}"


rule report:
    input:
        "runs.csv",
        "plan.json",
    output:
        "report.html",
    log:
        "logs/report.log",
    shell:
        "touch {output}"
"""


def study_with_runs(runs: int) -> dict:
    """The default study, each scenario swept over runs/scenarios values of one ZeRO knob."""
    study = yaml.safe_load((REPO_ROOT / "config/config.yaml").read_text())
    study["study"] = f"bench-dryrun-{runs}"
    study["max_runs"] = max(runs, 1000)  # the study key that allows more than 1000 runs
    per_scenario = max(1, runs // len(study["scenarios"]))
    values = [int(5e7) * (i + 1) for i in range(per_scenario)]
    for scenario in study["scenarios"]:
        scenario["sweep"] = {"reduce_bucket_size": values}
    return study


def warn_if_slurm_is_configured_but_down() -> None:
    """Every snakemake command waits ~9 s then (see the script): the numbers would mean nothing."""
    subprocess.run(["bash", REPO_ROOT / "scripts/warn-slurm-without-controller.sh"], check=False)


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def dry_run(cwd: Path, *args: str) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one dry run; exits when it fails. CPU time is
    shown beside wall time: on a shared machine it moves less with the other work."""
    cpu, start = child_cpu_seconds(), time.perf_counter()
    result = subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, child_cpu_seconds() - cpu
    if result.returncode:
        sys.exit(f"dry run failed in {cwd}:\n{result.stderr[-3000:]}")
    return wall, cpu, result.stdout


def trivial_workflow(folder: Path, jobs: int) -> Path:
    folder.mkdir()
    (folder / "Snakefile").write_text(TRIVIAL_SNAKEFILE.replace("JOBS", str(jobs)))
    return folder


def same_shape_workflow(folder: Path, runs: int, one_job_per_run: bool = False) -> Path:
    """The study's DAG without the library; with ``one_job_per_run``, without the engine_config
    jobs too (train would write its own configs, its run spec a param): the floor of that
    design, timed only (its re-runs are wrong: benchmarks/snakemake_masking.py)."""
    folder.mkdir()
    env = REPO_ROOT / "envs" / "train.yaml"
    text = SAME_SHAPE_SNAKEFILE.replace("JOBS", str(runs)).replace("ENV", str(env))
    if one_job_per_run:
        config_rule = text[text.index("rule engine_config:") : text.index("rule plan:")]
        config_inputs = (
            '        spec="configs/{s}.run.json",\n        ds_config="configs/{s}.json",\n'
        )
        text = text.replace(config_rule, "").replace(config_inputs, "")
        # its run spec then a train param, so that a changed scenario still re-runs alone
        train_params = "    params:\n        outdir=subpath"
        spec_param = '        spec=lambda wc: {"scenario": wc.s, "micro_batch": 4},\n'
        text = text.replace(
            train_params, train_params.replace("    params:\n", f"    params:\n{spec_param}")
        )
    (folder / "Snakefile").write_text(text)
    (folder / "plan.unchecked.json").write_text("{}")
    return folder


def compile_library(checkout: Path) -> None:
    """The library's bytecode, as a checkout has it after its first run (see the docstring)."""
    compileall.compile_dir(checkout / "workflow" / "offload_study", quiet=1)


def time_cases(cases: dict[str, tuple], repeats: int) -> tuple[dict, dict]:
    """Wall and CPU seconds of each case's dry run, `repeats` times, interleaved."""
    walls, cpus = {name: [] for name in cases}, {name: [] for name in cases}
    for _ in range(repeats):
        for name, args in cases.items():
            wall, cpu, _ = dry_run(*args)
            walls[name].append(wall)
            cpus[name].append(cpu)
    return walls, cpus


def compare_dry_runs(runs: int, repeats: int, others: list[str]) -> None:
    """The study's dry run (this checkout's, then each of `others`') against the trivial ones."""
    checkouts = {f"{runs}-run study": REPO_ROOT}
    checkouts |= {f"study at {Path(other).name}": Path(other).resolve() for other in others}
    with tempfile.TemporaryDirectory(prefix="dryrun-bench-") as tmp:
        study = Path(tmp, "study.yaml")
        study.write_text(yaml.safe_dump(study_with_runs(runs), sort_keys=False))
        cases = {
            name: (checkout, "--configfile", str(study)) for name, checkout in checkouts.items()
        }
        for name, checkout in checkouts.items():  # compiled, and each run once before timing
            compile_library(checkout)
            *_, planned = dry_run(*cases[name])
        jobs = int(re.search(r"^total\s+(\d+)", planned, re.M)[1])
        cases[f"trivial, {runs} jobs"] = (trivial_workflow(Path(tmp, "trivial"), runs),)
        cases[f"trivial, {jobs} jobs"] = (trivial_workflow(Path(tmp, "same-jobs"), jobs),)
        cases[SAME_SHAPE] = (same_shape_workflow(Path(tmp, "same-shape"), runs),)
        cases[ONE_JOB] = (same_shape_workflow(Path(tmp, "one-job"), runs, one_job_per_run=True),)
        walls, cpus = time_cases(cases, repeats)
    print_ratios(walls, cpus, list(checkouts), f"trivial, {runs} jobs", f"trivial, {jobs} jobs")


def print_ratios(walls: dict, cpus: dict, studies: list[str], trivial: str, same_jobs: str):
    """Every time, the medians, and the ratios of the medians (the first study's: the target's)."""
    wall, cpu = ({n: statistics.median(t) for n, t in d.items()} for d in (walls, cpus))
    for name, seconds in walls.items():
        each = "  ".join(f"{t:5.2f}" for t in seconds)
        print(f"{name:>24}: wall {each}  median {wall[name]:5.2f} s  (CPU {cpu[name]:5.2f} s)")
    ratio = wall[studies[0]] / wall[trivial]
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(
        f"{'study / trivial':>24}: {ratio:.2f}x wall (target <= {TARGET_RATIO:g}x: {verdict}),"
        f" {cpu[studies[0]] / cpu[trivial]:.2f}x CPU"
    )
    for other in studies[1:]:
        print(
            f"{other + ' / trivial':>24}: {wall[other] / wall[trivial]:.2f}x wall,"
            f" {cpu[other] / cpu[trivial]:.2f}x CPU"
        )
    shape = wall[SAME_SHAPE] / wall[trivial]
    print(
        f"{SAME_SHAPE + ' / trivial':>24}: {shape:.2f}x wall, {cpu[SAME_SHAPE] / cpu[trivial]:.2f}x"
        f" CPU (Snakemake alone, for the study's declarations); study / {SAME_SHAPE}:"
        f" {wall[studies[0]] / wall[SAME_SHAPE]:.2f}x wall,"
        f" {cpu[studies[0]] / cpu[SAME_SHAPE]:.2f}x CPU (the workflow's own code)"
    )
    print(
        f"{ONE_JOB + ' / trivial':>24}: {wall[ONE_JOB] / wall[trivial]:.2f}x wall,"
        f" {cpu[ONE_JOB] / cpu[trivial]:.2f}x CPU (without the engine_config jobs)"
    )
    print(
        f"{'study / ' + same_jobs:>24}: {wall[studies[0]] / wall[same_jobs]:.2f}x wall,"
        f" {cpu[studies[0]] / cpu[same_jobs]:.2f}x CPU; {same_jobs} / {trivial}:"
        f" {wall[same_jobs] / wall[trivial]:.2f}x wall, {cpu[same_jobs] / cpu[trivial]:.2f}x CPU"
    )


def plan_scaling(sizes: list[int]) -> None:
    print(f"{'runs':>6} {'Plan() s':>9}")
    for size in sizes:
        study = study_with_runs(size)
        start = time.perf_counter()
        plan = Plan(study)
        print(f"{len(plan.scenarios):>6} {time.perf_counter() - start:>9.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="*", default=[])
    parser.add_argument(
        "--compare",
        nargs="*",
        default=[],
        metavar="CHECKOUT",
        help="other checkouts of the workflow (e.g. a `git worktree add` of the commit before a"
        " change) whose study dry runs are timed in the same interleaved loop",
    )
    args = parser.parse_args()
    warn_if_slurm_is_configured_but_down()
    compare_dry_runs(args.runs, args.repeats, args.compare)
    if args.sizes:
        plan_scaling(args.sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
