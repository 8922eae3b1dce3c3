"""Shared test helpers: run specs come from the real planner, never written by hand."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import pytest

from offload_study.contracts import RunSpec
from offload_study.plan import expand_plan
from offload_study.study import CLUSTER_DIR, load_cluster, load_study, validate

#: A Llama small enough for a 2-core CPU run in seconds (the runner tests train it).
SMALL_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
    "max_position_embeddings": 128,
}  # fmt: skip


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
        "study": "test", "cluster": cluster["name"], "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64, "dtype": "bf16", "micro_batch": 2, "gradient_checkpointing": False,
        "steps": 3, "warmup_steps": 1, "seed": 1234, "timeout_min": 5, "scenarios": [scenario],
        **study,
    }  # fmt: skip
    (run,) = expand_plan(load_study(config, source="test study"), cluster)
    return run


# --------------------------------------------------------------------------- test summary figure
def record_fingerprints(results: Path) -> dict[str, str]:
    """Complete record folder (a metrics.json in place, archived ones too) -> sha256 of its files.

    Temp records (``rep<k>.tmp-<pid>``) are not results yet and are left out."""
    prints = {}
    for metrics in sorted(results.rglob("metrics.json")):
        folder = metrics.parent
        if ".tmp-" in str(folder.relative_to(results)):
            continue
        digest = hashlib.sha256()
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(str(f.relative_to(folder)).encode() + b"\0" + f.read_bytes())
        prints[str(folder)] = digest.hexdigest()
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


LEDGER = pytest.StashKey[ResultsLedger]()


@pytest.fixture
def results_ledger(request) -> ResultsLedger:
    """The session's ledger of records checked and lost (see ResultsLedger)."""
    return request.config.stash.setdefault(LEDGER, ResultsLedger())


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
