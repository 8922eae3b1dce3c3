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
   run would take if each of its jobs cost Snakemake no more than a trivial one).
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
