"""The Snakemake workflow as users drive it: dry runs, lint, README and CI wiring."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest
import yaml
from conftest import REPO as REPO_ROOT
from runs import snakemake

from offload_study import readme_sync
from offload_study.planning import presets


def job_counts(output: str) -> dict[str, int]:
    table = output.split("Job stats:")[1].split("total")[0]
    return {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)}


@pytest.mark.parametrize(
    ("args", "expected_train"),
    [((), 4), (("--config", "study_file=config/studies/seed.yaml"), 4)],
    ids=["default", "seed"],
)
def test_dry_run_plans_one_train_job_per_scenario_and_repeat(args, expected_train):
    result = snakemake("-n", "--forceall", *args)
    assert result.returncode == 0, result.stderr
    counts = job_counts(result.stdout)
    assert counts["train"] == expected_train
    assert counts["engine_config"] == expected_train
    assert counts["report"] == 1 and counts["collect"] == 1


def test_dry_run_counts_repeats_and_sweeps():
    result = snakemake("-n", "--forceall", "--config", "repeats=3")
    assert result.returncode == 0, result.stderr
    assert job_counts(result.stdout)["train"] == 12


def train_runtimes(output: str) -> set[str]:
    return set(re.findall(r"rule train:.*?resources: .*?runtime=(\d+)", output, re.S))


def test_a_study_file_replaces_the_default_study(tmp_path):
    """A key the study file leaves out takes the schema's default, not the default study's;
    the same with study_file (the documented way) and with a trusted --configfile."""
    study = yaml.safe_load((REPO_ROOT / "config/config.yaml").read_text())
    del study["timeout_min"]  # 15 in the default study, 60 in the schema: changes `runtime`
    study["study"] = "replaced"
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    default = snakemake("-n", "--forceall")
    replaced = snakemake("-n", "--forceall", "--config", f"study_file={path}")
    trusted = snakemake("-n", "--forceall", "--configfile", str(path))
    flagged = snakemake("-n", "--forceall", "--configfile", str(path), "--replace-workflow-config")
    for result in (default, replaced, trusted, flagged):
        assert result.returncode == 0, result.stderr
    assert "reports/local-cpu/replaced/report.html" in replaced.stdout
    assert train_runtimes(replaced.stdout) != train_runtimes(default.stdout)
    assert train_runtimes(trusted.stdout) == train_runtimes(replaced.stdout)
    assert train_runtimes(flagged.stdout) == train_runtimes(replaced.stdout)


def test_config_keys_go_over_a_study_file():
    result = snakemake(
        "-n", "--forceall", "--config", "study_file=config/studies/seed.yaml", "repeats=3"
    )
    assert result.returncode == 0, result.stderr
    assert job_counts(result.stdout)["train"] == 12
    assert "reports/h200-8gpu/seed/report.html" in result.stdout


def test_a_config_file_without_a_study_overrides_the_default_study(tmp_path):
    path = tmp_path / "more-repeats.yaml"
    path.write_text("repeats: 3\n")
    result = snakemake("-n", "--forceall", "--configfile", str(path))
    assert result.returncode == 0, result.stderr
    assert job_counts(result.stdout)["train"] == 12


def test_a_target_of_an_unknown_scenario_is_refused():
    result = snakemake("-n", "results/local-cpu/default-cpu/no-such-scenario/rep0/metrics.json")
    assert result.returncode != 0
    assert "no scenario 'no-such-scenario' in study 'default-cpu'" in result.stdout + result.stderr


def test_invalid_study_is_refused_before_anything_runs():
    result = snakemake("-n", "--config", "global_batch=7")
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "invalid study" in text and "global_batch 7" in text


def lints(output: str) -> list[str]:
    """`snakemake --lint` text -> ["<what was linted>: <problem>", ...] (`--lint json` is ignored
    by the 9.x command line, which always prints text)."""
    found, subject = [], None
    for line in output.splitlines():
        if line.startswith("Lints for "):
            subject = line.removeprefix("Lints for ").rstrip(":")
        elif subject and line.startswith("    * "):
            found.append(f"{subject}: {line.removeprefix('    * ').rstrip(':')}")
    return found


def test_lint_finds_nothing_in_the_workflow():
    result = snakemake("--lint")
    assert lints(result.stdout + result.stderr) == []
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_check_catches_known_problems(tmp_path):
    """The check above can fail: the same parsing finds the problems of a bad workflow."""
    (tmp_path / "Snakefile").write_text(
        'rule bad:\n    output:\n        "/tmp/absolute.txt",\n    shell:\n        "touch {output}"\n'
    )
    result = snakemake("--lint", cwd=tmp_path)
    found = lints(result.stdout + result.stderr)
    assert result.returncode != 0
    assert any('Absolute path "/tmp/absolute.txt"' in lint for lint in found), found
    assert any(lint.startswith("rule bad") and "No log directive" in lint for lint in found)


def test_readme_reference_is_in_sync_with_the_schemas():
    reference = (REPO_ROOT / readme_sync.REFERENCE).read_text()
    for name in readme_sync.SECTIONS:
        assert f"<!-- BEGIN {name} reference" in reference, f"{name} reference missing"
    assert readme_sync.synced(reference) == reference, "run: python -m offload_study.readme_sync"


def test_the_key_reference_speaks_the_readers_words():
    """The generated reference names no module of the package (a command to run aside), and the
    presets it lists are the ones there are."""
    reference = (REPO_ROOT / readme_sync.REFERENCE).read_text()
    modules = re.findall(r"(?<!python -m )\boffload_study\.[a-z_.]+", reference)
    assert modules == [], modules
    (preset_row,) = [line for line in reference.splitlines() if line.startswith("| `model.preset`")]
    names = preset_row.split("|")[4].split("preset: ")[1].split(" (")[0]
    assert sorted(re.split(r", | or ", names)) == sorted(presets.PRESETS), preset_row


def test_readme_stays_short():
    """README.md is what a newcomer reads first: the reference and the results live elsewhere."""
    assert len((REPO_ROOT / "README.md").read_text().split()) <= 1500


def test_the_readmes_studies_are_valid_and_the_search_has_candidates():
    """Every study the README asks a reader to save loads as written (schema, defaults, its
    cluster); the one with a recommend block searches both engines."""
    from offload_study.core.study import load_cluster, load_study
    from offload_study.planning import candidates

    readme = (REPO_ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "study:" in b]
    assert len(blocks) >= 2
    searched = set()
    for block in blocks:
        study = load_study(yaml.safe_load(block), source="README.md")
        cluster = load_cluster(study["cluster"], REPO_ROOT / "config" / "clusters")
        searched |= {c["engine"] for c in candidates.candidates(study, cluster)}
    assert searched == {"deepspeed", "fsdp2"}


def test_readme_has_two_setup_commands_and_ci_calls_the_test_one():
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("## The two commands")[1].split("```bash")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make study", "make test"]
    assert "make test" in (REPO_ROOT / ".ci/run").read_text()


def in_order(output: str, steps: list[str]) -> bool:
    """Each step appears on a line of output, in this order."""
    lines = output.splitlines()
    first = [next((i for i, line in enumerate(lines) if step in line), -1) for step in steps]
    return -1 not in first and first == sorted(first)


@pytest.mark.parametrize(
    ("target", "steps"),
    [
        ("test", ["scripts/setup.sh test", "-m venv", "offload_study.admission.ops", "-m pytest"]),
        (
            "study",
            [
                "scripts/setup.sh study",
                "-m venv",
                "offload_study.admission.ops",
                "snakemake --cores",
            ],
        ),
    ],
)
def test_make_sets_up_everything_before_it_runs(target, steps):
    result = subprocess.run(
        ["make", "-n", "-B", target], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert in_order(result.stdout, steps), result.stdout


def test_setup_only_checks_when_everything_is_there():
    """What `make test` runs first on every call: seconds at most once the machine is set up.
    Run as a user who cannot install, so the test itself never calls apt-get."""
    as_nobody = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    start = time.perf_counter()
    result = subprocess.run(
        [*as_nobody, "bash", "scripts/setup.sh", "test"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert time.perf_counter() - start < 5


def test_setup_outside_debian_says_what_to_install_in_one_message(tmp_path):
    only_bash = tmp_path / "bin"
    only_bash.mkdir()
    (only_bash / "bash").symlink_to(shutil.which("bash"))
    result = subprocess.run(
        [only_bash / "bash", "scripts/setup.sh", "test"],
        cwd=REPO_ROOT,
        env={"PATH": str(only_bash)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "libaio-dev" in result.stderr and "SKIP_DEBIAN_PACKAGES=1" in result.stderr


def test_setup_warns_when_slurm_is_configured_but_no_controller_answers(tmp_path):
    """Such a machine makes every snakemake command wait ~9 s: the set-up says so."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=down\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
        "NodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n"
    )
    result = subprocess.run(
        ["bash", "scripts/warn-slurm-without-controller.sh"],
        cwd=REPO_ROOT,
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert f"WARNING: {conf} exists but no SLURM controller answers" in result.stderr
