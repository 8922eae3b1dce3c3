"""Per-job start overhead: the time a Snakemake job spends parsing the workflow before its work.

    PYTHONPATH=workflow .venv/bin/python benchmarks/job_overhead.py [--runs 4 1000] [--repeats 5]
    # another commit (here: 0a837e8, before a job stopped planning the study again), with this
    # script and its sibling:
    git worktree add /tmp/before 0a837e8 && cp benchmarks/{job,dryrun}_overhead.py /tmp/before/benchmarks/
    cd /tmp/before && PYTHONPATH=workflow /work/dev/.venv/bin/python benchmarks/job_overhead.py

A job that Snakemake runs outside its main process (every job submitted to SLURM; locally a
`run:` rule's job) starts a fresh `python -m snakemake --target-jobs RULE:... --allowed-rules
RULE ...` that parses the whole workflow, every top-level statement of the Snakefile and of its
rules files, before it builds the one job's graph and runs it. For each study size in --runs:

1. The job's real command. The default study (config/config.yaml) swept to that many runs
   (benchmarks/dryrun_overhead.py's study_with_runs) is run as `snakemake -c1 --verbose
   --forceall RULE` in a temp working directory; Snakemake's local executor spawns the `run:`
   rule's job as a subprocess and logs the command it formats for it ("spawned job: ..."). A
   SLURM job's command differs in the executor's arguments (--mode remote, ...), not in what it
   parses. The same for a raw Snakefile (temp folder) of one `run:` rule with as many jobs.
2. Both commands replayed --repeats times, interleaved so drifting load hits both alike: wall
   and CPU seconds of each, median and min-max; the study's job minus the raw job's is the
   workflow's own per-job overhead.
3. One more replay of the study's job under cProfile: where the workflow's top-level code spent
   its time (imports, library calls by package, Snakemake), and how many calls went into the
   library's planning and admission packages, DeepSpeed and transformers, and the library's
   `ast.parse` calls (it reads the installed DeepSpeed's config classes from their source): i.e.
   whether the study's planning and admission ran inside the job. (A model block is built with
   transformers once per content and user: ~/.cache/offload-study/model-checks; a job finds the
   main process's marker where home is shared.)

Exit status 0 (a benchmark prints numbers, it does not judge); 1 when a job fails.
"""

from __future__ import annotations

import argparse
import pstats
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from dryrun_overhead import REPO_ROOT, study_with_runs, warn_if_slurm_is_configured_but_down

RAW_SNAKEFILE = """\
rule all:
    input:
        expand("out/{i}.txt", i=range(JOBS)),


rule one:
    output:
        "out/{i}.txt",
    run:
        Path(output[0]).touch()
"""
#: packages whose function calls say that the study's planning and admission ran in the job
WATCHED = ("offload_study/planning/", "offload_study/admission/", "/deepspeed/", "/transformers/")
#: the part of a profile's file names that says "the workflow's own code"
WORKFLOW_FILES = re.compile(r"(/Snakefile|\.smk)$")
SNAKEMAKE = "Snakemake (rule declarations, includes; the rest)"


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def spawned_job_command(snakefile: Path, workdir: Path, target: str, *args: str) -> str:
    """The command Snakemake's local executor formats for the job that makes `target`."""
    cmd = [sys.executable, "-m", "snakemake", "-c1", "--verbose", "--nolock", "--forceall"]
    # the target before `args`: --configfile takes every word after it
    cmd += ["--snakefile", str(snakefile), "--directory", str(workdir), target, *args]
    result = subprocess.run(cmd, cwd=snakefile.parent, capture_output=True, text=True)
    found = re.search(r"^spawned job: (.*)$", result.stdout + result.stderr, re.M)
    if result.returncode or not found:
        sys.exit(f"no spawned job for {target} ({snakefile}):\n{result.stderr[-3000:]}")
    # the replay prints what a job prints without --verbose (the benchmark's own flag)
    return found[1].replace(" --verbose ", " ")


def timed(command: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one job; exits when it fails."""
    cpu, start = child_cpu_seconds(), time.perf_counter()
    result = subprocess.run(command, shell=True, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, child_cpu_seconds() - cpu
    if result.returncode:
        sys.exit(f"job failed: {command}\n{result.stderr[-3000:]}")
    return wall, cpu


def job_commands(tmp: Path, runs: int, rule: str) -> dict[str, str]:
    """{case name: the job command} for the study of `runs` runs and the raw Snakefile."""
    study, workdir = tmp / "study.yaml", tmp / "study-wd"
    workdir.mkdir()
    # the study's cluster description is read from the working directory's config/clusters
    (workdir / "config").symlink_to(REPO_ROOT / "config")
    study.write_text(yaml.safe_dump(study_with_runs(runs), sort_keys=False))
    raw = tmp / "raw"
    raw.mkdir()
    (raw / "Snakefile").write_text(RAW_SNAKEFILE.replace("JOBS", str(runs)))
    return {
        f"{runs}-run study, job {rule}": spawned_job_command(
            REPO_ROOT / "Snakefile", workdir, rule, "--configfile", str(study)
        ),
        f"raw Snakefile, {runs} jobs": spawned_job_command(raw / "Snakefile", raw, "out/0.txt"),
    }


def time_jobs(commands: dict[str, str], repeats: int) -> dict[str, list[tuple[float, float]]]:
    times = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
            times[name].append(timed(command))
    return times


def spread(values: list[float]) -> str:
    return (
        f"median {statistics.median(values):5.2f} s (min {min(values):.2f}, max {max(values):.2f})"
    )


def print_times(times: dict[str, list[tuple[float, float]]]) -> None:
    for name, pairs in times.items():
        walls, cpus = [w for w, _ in pairs], [c for _, c in pairs]
        each = " ".join(f"{w:.2f}" for w in walls)
        print(f"{name:>34}: wall {each}\n{'':>36}wall {spread(walls)}, CPU {spread(cpus)}")
    (study, raw) = ([statistics.median(x[i] for x in p) for i in (0, 1)] for p in times.values())
    print(
        f"{'study job - raw job':>34}: {study[0] - raw[0]:+.2f} s wall, "
        f"{study[1] - raw[1]:+.2f} s CPU; study / raw {study[0] / raw[0]:.2f}x wall, "
        f"{study[1] / raw[1]:.2f}x CPU"
    )


def profile(command: str, out: Path) -> pstats.Stats:
    """Replays the job under cProfile (its main thread, where the workflow is parsed)."""
    python = f"{shlex.quote(sys.executable)} -m snakemake"
    if python not in command:
        sys.exit(f"cannot profile a job not started as {python!r}: {command}")
    timed(command.replace(python, f"{python[: -len('snakemake')]}cProfile -o {out} -m snakemake"))
    return pstats.Stats(str(out))


def kind_of(file: str, name: str) -> str:
    """What a function called from the workflow's top-level code is, for the breakdown."""
    if "importlib" in file or name == "<built-in method builtins.__import__>":
        return "imports (the library and what it imports)"
    if "offload_study/" in file:
        return "offload_study." + file.split("offload_study/")[1].split("/")[0].removesuffix(".py")
    return SNAKEMAKE


def workflow_time(stats: pstats.Stats) -> tuple[float, Counter]:
    """(seconds in the Snakefile's top-level code, {kind: seconds} of what it called)."""
    by_kind, top = Counter(), 0.0
    for (file, _, name), (*_, ct, callers) in stats.stats.items():
        if file.endswith("/Snakefile") and name == "<module>":
            top = max(top, ct)
        if WORKFLOW_FILES.search(file):
            # an included rules file runs inside Snakemake's `include`: counted once, by kind
            by_kind[SNAKEMAKE] -= ct if name == "<module>" and file.endswith(".smk") else 0
            continue  # the workflow's own functions: what they call is counted
        for (caller_file, *_), (*_, edge_ct) in callers.items():
            if WORKFLOW_FILES.search(caller_file):
                by_kind[kind_of(file, name)] += edge_ct
    return top, by_kind


def library_calls(stats: pstats.Stats, count: int = 6) -> list[tuple[float, int, str]]:
    """The library functions the workflow's code called that took longest: (s, calls, name)."""
    calls = []
    for (file, _, name), (_, ncalls, _, ct, callers) in stats.stats.items():
        if "offload_study/" in file and any(WORKFLOW_FILES.search(c[0]) for c in callers):
            where = file.split("offload_study/")[1].removesuffix(".py").replace("/", ".")
            calls.append((ct, ncalls, f"{where}.{name}"))
    return sorted(calls, reverse=True)[:count]


def watched_calls(stats: pstats.Stats) -> dict[str, int]:
    """{watched package: calls into its functions}; importing it (module and class bodies run
    once) is not a call."""
    calls = dict.fromkeys(WATCHED, 0)
    for (file, _, name), (_, ncalls, _, _, callers) in stats.stats.items():
        if name == "<module>" or all(c[2].endswith("__build_class__>") for c in callers):
            continue
        for package in WATCHED:
            calls[package] += ncalls if package in file else 0
    named = {package.strip("/").replace("/", "."): n for package, n in calls.items()}
    return {**named, "ast.parse by the library (DeepSpeed's source read)": parsed_by_library(stats)}


def parsed_by_library(stats: pstats.Stats) -> int:
    return sum(
        n
        for (file, _, name), (*_, callers) in stats.stats.items()
        if file.endswith("/ast.py") and name == "parse"
        for (caller, *_), (_, n, *_) in callers.items()
        if "offload_study/" in caller
    )


def print_profile(stats: pstats.Stats) -> None:
    top, by_kind = workflow_time(stats)
    print(
        f"{'profiled job':>34}: the Snakefile's top-level code {top:.2f} s (under cProfile), of it"
    )
    for kind, seconds in by_kind.most_common():
        print(f"{'':>36}{seconds:6.2f} s  {kind}")
    longest = (f"{name} {s:.2f} s ({n}x)" for s, n, name in library_calls(stats))
    print(f"{'longest library calls':>34}: {', '.join(longest)}")
    calls = (f"{package} {n}" for package, n in watched_calls(stats).items())
    print(f"{'calls inside the job':>34}: {', '.join(calls)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[4, 1000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rule", default="plan_summary", help="a `run:` rule without wildcards")
    args = parser.parse_args()
    warn_if_slurm_is_configured_but_down()
    for runs in args.runs:
        with tempfile.TemporaryDirectory(prefix="job-bench-") as tmp:
            commands = job_commands(Path(tmp), runs, args.rule)
            print(f"job command: {next(iter(commands.values()))}")
            print_times(time_jobs(commands, args.repeats))
            print_profile(profile(next(iter(commands.values())), Path(tmp, "job.prof")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
