"""Shared test helpers: run specs come from the real planner, never written by hand."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock

from offload_study.admission.admit import admitted_runs
from offload_study.core.contracts import RunSpec, read_calibration, sha256_tree, write_calibration
from offload_study.core.study import load_cluster, load_study, validate

REPO = Path(__file__).resolve().parents[1]
#: the checkout's cluster descriptions (the library reads config/clusters from its working dir)
CLUSTER_DIR = REPO / "config" / "clusters"


def pytest_configure(config):
    """The test interpreter's bin folder first on PATH, as `make test` has it, so that every
    process the tests start finds the ninja that built the ops ahead. The venv's ninja (1.13)
    and Debian's (1.11) keep incompatible build logs: each switch between them rebuilds every
    op DeepSpeed loads (~1 min each, async_io ~3 min, on 2 cores). And the ops' build folder
    the Makefile gives them, the venv's, unless the caller set one: a pytest run outside `make
    test` would build them again in ~/.cache, and a run that builds one counts the compiler
    (3.8 GiB) in its rank's process tree."""
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
    config.stash[LEDGER] = ResultsLedger()
    config.pluginmanager.register(LedgerTotals(config.stash[LEDGER]), "results-ledger-totals")


#: OFFLOAD_STUDY_TEST_TIMELINE=<file>: every test appends one line to <file> (see
#: :func:`pytest_runtest_protocol`); benchmarks/test_timeline.py reads it.
TIMELINE = "OFFLOAD_STUDY_TEST_TIMELINE"


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (SLURM jobs are not
    ours: their CPU is missing)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With $OFFLOAD_STUDY_TEST_TIMELINE set, a line per test (set-up and teardown included):
    worker, start and end (epoch seconds), CPU seconds, test id, tab-separated; where the
    parallel run's wall time goes (the Makefile's TEST_WORKERS, the CI budget)."""
    path = os.environ.get(TIMELINE)
    if not path:
        yield
        return
    start, cpu = time.time(), _cpu_s()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = f"{worker}\t{start:.2f}\t{time.time():.2f}\t{_cpu_s() - cpu:.2f}\t{item.nodeid}\n"
    with open(path, "a") as out:  # one short append per test: whole lines under O_APPEND
        out.write(line)


#: A Llama small enough for a 2-core CPU run in seconds (the runner tests train it).
SMALL_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}


def make_cluster(cluster: dict | str = "local-cpu") -> dict:
    """A validated cluster (schema defaults filled in): a shipped one by name, or a dict."""
    if isinstance(cluster, str):
        return load_cluster(cluster, cluster_dir=CLUSTER_DIR)
    return validate(cluster, "cluster", f"test cluster {cluster.get('name')!r}")


def make_spec(cluster: dict | str = "local-cpu", scenario: dict | None = None, **study) -> RunSpec:
    """The one run of a one-scenario study, planned by the real planner on ``cluster``.

    ``scenario`` keys replace those of the default scenario (``gpus_per_node`` ranks of the
    cluster up to 2, gradient accumulation 2: the global batch is 2 x 2 x world_size);
    ``study`` keys replace those of the small default study (SMALL_LLAMA, seq_len 64, 1 warm-up +
    3 measured steps, 5 min timeout).
    """
    cluster = make_cluster(cluster)
    scenario = {
        "name": "test-scenario",
        "gpus_per_node": min(2, cluster["gpus_per_node"]),
        "gradient_accumulation_steps": 2,
        **(scenario or {}),
    }
    config = {
        "study": "test",
        "cluster": cluster["name"],
        "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64,
        "dtype": "bf16",
        "micro_batch": 2,
        "gradient_checkpointing": False,
        "steps": 3,
        "warmup_steps": 1,
        "seed": 1234,
        "timeout_min": 5,
        "scenarios": [scenario],
        **study,
    }
    (run,) = admitted_runs(load_study(config, source="test study"), cluster)
    return run


# --------------------------------------------------------------------------- the workflow in a copy
def copy_repo_for_run(tmp: Path, calibration: Path | None = None, cluster: str = "") -> Path:
    """A working dir with the repo's Snakefile, workflow/ and config/ (results land in tmp).

    With ``calibration`` (see :func:`cpu_calibration`), ``cluster``'s measured calibration is
    in place: the workflow plans with it instead of measuring the machine again."""
    work = tmp / "repo"
    work.mkdir()
    for item in ("Snakefile", "workflow", "config", "envs"):
        src = REPO / item
        if src.is_dir():
            shutil.copytree(
                src, work / item, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        elif src.exists():
            shutil.copy2(src, work / item)
    if calibration is not None:
        place_calibration(work, cluster, calibration)
    return work


def with_clusters(workdir: Path) -> Path:
    """The shipped cluster descriptions copied into the working dir ``workdir``: the workflow
    reads config/clusters/ from its working directory (as a user's own), not from this checkout."""
    shutil.copytree(CLUSTER_DIR, workdir / "config" / "clusters", dirs_exist_ok=True)
    return workdir


def place_calibration(workdir: Path, cluster: str, calibration: Path) -> None:
    """``cluster``'s measured calibration in the workflow's working dir ``workdir`` (from
    :func:`cpu_calibration`): the workflow plans with it instead of measuring again."""
    measured = dataclasses.replace(read_calibration(calibration), cluster=cluster)
    write_calibration(workdir / "results" / cluster / "calibration.json", measured)


#: A folder where :func:`made_once` keeps what it made for every pytest run that names it: the
#: Makefile's test target empties it, then its parallel run and its `alone` run share one
#: calibration of this machine (measuring it again alone cost ~1 min of the serial phase).
SHARED_DIR = "OFFLOAD_STUDY_TEST_SHARED"


def made_once(tmp_path_factory, name: str, make):
    """``make(folder)`` (-> a JSON-able value) run once per test run, in a fresh folder; the value.

    Under pytest-xdist each worker has its own session: the first worker to ask makes it in the
    run's shared temp dir (the parent of the workers' own) while the others wait on a file lock,
    then read what it made (the pattern of xdist's docs, "Making session-scoped fixtures execute
    only once"). A failed make leaves nothing behind: the next worker to ask tries again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's pytest-<n>: one per run, shared by its workers
    if os.environ.get(SHARED_DIR):  # `make test`'s two pytest runs share one
        base = Path(os.environ[SHARED_DIR])
        base.mkdir(parents=True, exist_ok=True)
    made = base / f"{name}.json"
    with FileLock(f"{made}.lock"):
        if not made.exists():
            value = make(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base)))
            made.write_text(json.dumps(value))
        return json.loads(made.read_text())


def measure_calibration(folder: Path) -> str:
    """This machine's calibration, measured into ``folder`` as the calibrate rule does."""
    out = folder / "calibration.json"
    cmd = [
        sys.executable,
        "-m",
        "offload_study.prediction.calibrate",
        "--cluster",
        "local-cpu",
        "--cores",
        str(os.cpu_count()),
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="session")
def cpu_calibration(tmp_path_factory) -> Path:
    """This machine's calibration.json, measured once per test run (offload_study.prediction.calibrate,
    as the workflow's calibrate rule runs it: ~1 min on 2 cores) for the workflow tests whose
    subject is not the calibration. Every test cluster is this machine (local or SLURM)."""
    return Path(made_once(tmp_path_factory, "calibration", measure_calibration))


# --------------------------------------------------------------------------- test summary figure
def record_fingerprints(results: Path) -> dict[str, str]:
    """Complete record folder (a metrics.json in place, archived ones too) -> sha256 of its files.

    Temp records (``rep<k>.tmp-<pid>``) are not results yet and are left out."""
    prints = {}
    for metrics in sorted(results.rglob("metrics.json")):
        folder = metrics.parent
        if ".tmp-" in str(folder.relative_to(results)):
            continue
        prints[str(folder)] = sha256_tree(folder)
    return prints


class ResultsLedger:
    """What the fault tests checked: complete records before a fault vs after it (and in the
    collected table). ``lost`` feeds the "results lost" count of the test summary."""

    def __init__(self):
        self.checked: int = 0
        self.lost: list[str] = []

    def note_lost(self, folders) -> None:
        self.lost.extend(str(f) for f in folders)

    @contextlib.contextmanager
    def guard(self, results: Path):
        """Every complete record under ``results`` before the block is there, byte for byte,
        after it (a fault may add records, never lose or rewrite one)."""
        before = record_fingerprints(results)
        yield
        after = record_fingerprints(results)
        lost = [folder for folder, digest in before.items() if after.get(folder) != digest]
        self.checked += len(before)
        self.note_lost(lost)
        assert not lost, f"records lost or rewritten by the fault: {lost}"


def make_cross_cluster(folder: Path) -> dict:
    from builders import cross_cluster_runs  # builders imports this module

    made = cross_cluster_runs(folder)
    return {"root": str(made.root), "bundles": {k: str(v) for k, v in made.bundles.items()}}


@pytest.fixture(scope="session")
def cross_cluster(tmp_path_factory):
    """Four real CPU runs (2 scenarios x 2 clusters), bundled, made once per test run for the
    bundle, compare, check and site tests (builders.cross_cluster_runs); they only read them."""
    from builders import CrossCluster

    made = made_once(tmp_path_factory, "cross-cluster", make_cross_cluster)
    return CrossCluster(Path(made["root"]), {k: Path(v) for k, v in made["bundles"].items()})


#: The user_properties key under which a test's report carries its ledger's numbers.
LEDGER_KEY = "results_ledger"


@pytest.fixture
def results_ledger(request):
    """This test's ledger of records checked and lost (see ResultsLedger). Its numbers travel in
    the test's teardown report (user_properties) to LedgerTotals: under pytest-xdist the tests
    run in worker processes, and only their reports reach the process that prints the summary."""
    ledger = ResultsLedger()
    yield ledger
    request.node.user_properties.append((LEDGER_KEY, (ledger.checked, ledger.lost)))


LEDGER = pytest.StashKey[ResultsLedger]()


class LedgerTotals:
    """The run's ledger: the sum of its tests' ledgers, from their teardown reports. A plugin
    of the process that prints the summary (the controller under pytest-xdist)."""

    def __init__(self, ledger: ResultsLedger):
        self.ledger = ledger

    def pytest_runtest_logreport(self, report) -> None:
        for key, (checked, lost) in report.user_properties:
            if key == LEDGER_KEY and report.when == "teardown":
                self.ledger.checked += checked
                self.ledger.note_lost(lost)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line: bad inputs refused, faults injected and recorded (passed tests with the markers
    refuses_bad_input / injects_fault) and the results the fault tests found lost."""
    passed = terminalreporter.stats.get("passed", [])
    refused = sum(1 for r in passed if "refuses_bad_input" in r.keywords)
    faults = sum(1 for r in passed if "injects_fault" in r.keywords)
    ledger = config.stash.get(LEDGER, ResultsLedger())
    terminalreporter.write_line(
        f"{refused} bad inputs refused, {faults} faults injected and recorded, "
        f"{len(ledger.lost)} results lost ({ledger.checked} records checked)"
    )
