"""Where a page's numbers come from, in the reader's words: what the runs ran on and with what
(one table of what differs between runs, one line of what they share), whether they ran from
committed code, and the commands that re-run the study and re-render the page.

Read from each run's provenance.json (contracts.PROVENANCE_FIELDS) and its row of the runs
table; an engine's name and version come from the records (``engine``, ``engine_version``),
never from a list of engines here.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from pathlib import Path

import pandas as pd

from offload_study.analysis import collect
from offload_study.analysis.report import views, words
from offload_study.core import contracts, devices, units

#: Where a study's YAML lies by convention (config/studies/<study>.yaml): the re-run command
#: names it when it is there.
STUDY_FILES = Path("config/studies")


def _gib(n) -> str | None:
    return words.gib(units.bytes_to_gib(n), 1) if views.isnum(n) else None


def _card_gib(prov: Mapping) -> float | None:
    """The GPU memory a run's first card reports (NVML's total), GiB: the card as usable."""
    gpus = prov.get("gpus") or []
    total = gpus[0].get("memory_total_bytes") if gpus and isinstance(gpus[0], dict) else None
    return round(units.bytes_to_gib(total), 1) if views.isnum(total) else None


def _commit(prov: Mapping) -> str | None:
    commit = prov.get("git_commit")
    if not commit:
        return None
    return commit[:12] + (" with uncommitted changes" if prov.get("git_dirty") else "")


#: The version column of records from before ``engine_version``: they ran the default engine
#: (contracts.DEFAULT_ENGINE) and name its version there.
LEGACY_VERSION = "deepspeed_version"


def engine_version(run: Mapping) -> str | None:
    """The engine and its version as the record names them (``engine``, ``engine_version``;
    older records: :data:`LEGACY_VERSION`)."""
    version = run.get("engine_version") or run.get(LEGACY_VERSION)
    return f"{contracts.engine_of(run)} {version}" if version else None


#: The facts of a run a page names, in words: (name, how it is read from (run row, provenance)).
FACTS: tuple[tuple[str, Callable[[Mapping, Mapping], object]], ...] = (
    ("host", lambda r, p: p.get("host")),
    ("GPU", lambda r, p: devices.card_name(r.get("device_name") or p.get("gpu_model"))),
    ("GPU memory", lambda r, p: words.gib(g, 1) if (g := _card_gib(p)) else None),
    ("GPU driver", lambda r, p: p.get("gpu_driver")),
    ("CUDA runtime", lambda r, p: p.get("cuda_version")),
    ("torch", lambda r, p: r.get("torch_version") or p.get("torch_version")),
    ("engine version", lambda r, p: engine_version(r)),
    ("transformers", lambda r, p: p.get("transformers_version")),
    ("Python", lambda r, p: p.get("python_version")),
    ("OS", lambda r, p: p.get("platform")),
    ("CPU", lambda r, p: p.get("cpu_model")),
    ("CPU cores granted", lambda r, p: p.get("cores_granted")),
    ("host RAM", lambda r, p: _gib(p.get("ram_total_bytes"))),
    ("SLURM job", lambda r, p: r.get("slurm_job_id") or p.get("slurm_job_id")),
    (
        "launch environment",
        lambda r, p: " ".join(f"{k}={v}" for k, v in sorted((p.get("launch_env") or {}).items())),
    ),
    ("commit", lambda r, p: _commit(p)),
    ("config sha256", lambda r, p: (r.get("ds_config_sha256") or "")[:12] or None),
    ("started", lambda r, p: r.get("started_at")),
)


def _runs(runs: pd.DataFrame) -> list[tuple[dict, dict]]:
    """(run row, provenance) of every run record; {} where provenance.json is unreadable."""
    rows = [views.Row({k: views._clean(x) for k, x in r.items()}) for r in runs.to_dict("records")]
    return [(r, collect.read_provenance(r["record_dir"]) or {}) for r in rows]


def provenance(runs: pd.DataFrame, labels: Mapping[str, str]) -> dict:
    """{"shared": [(fact, value)] every run has alike, "columns": the facts that differ,
    "rows": per run its label, repeat and those facts}: one table of what differs, one line
    of what they share (a fact no run recorded is left out)."""
    facts = [(r, {name: read(r, p) for name, read in FACTS}) for r, p in _runs(runs)]
    values = {name: {f[name] for _, f in facts} - {None, ""} for name, _ in FACTS}
    shared = [
        (n, next(iter(v)))
        for n, v in values.items()
        if len(v) == 1 and all(f[n] not in (None, "") for _, f in facts)
    ]
    columns = [n for n, v in values.items() if v and (n, next(iter(v))) not in shared]
    rows = [
        {
            "label": labels.get(r["scenario"], r["label"] or r["scenario"] or "?"),
            "repeat": views._repeat(r),
            "facts": [f[c] or "—" for c in columns],
        }
        for r, f in facts
    ]
    return {"shared": shared, "columns": columns, "rows": rows}


def usable_gib(runs: pd.DataFrame) -> float | None:
    """The GPU memory of the cluster's card as its runs saw it (the first run that says)."""
    return next((g for _, p in _runs(runs) if (g := _card_gib(p))), None)


def hardware(runs: pd.DataFrame) -> str | None:
    """'2 × H200 (140.4 GiB each), 32 CPU cores, 251.8 GiB host RAM' from the first run with a
    provenance.json; None without one."""
    for _, prov in _runs(runs):
        if not prov:
            continue
        gpus, card = prov.get("gpu_count"), _card_gib(prov)
        model = devices.card_name(prov.get("gpu_model"))
        each = f" ({words.gib(card, 1)} each)" if card else ""
        ram = prov.get("ram_total_bytes")
        parts = [
            f"{gpus} × {model}{each}" if gpus and model else None,
            f"{prov['cores_granted']} CPU cores" if prov.get("cores_granted") else None,
            f"{_gib(ram)} host RAM" if ram else None,
        ]
        return ", ".join(p for p in parts if p) or None
    return None


def dirty(runs: pd.DataFrame) -> str | None:
    """A sentence when runs ran from a working tree with uncommitted changes; None when none
    did (or no run says)."""
    provs = [p for _, p in _runs(runs) if p]
    unclean = [p for p in provs if p.get("git_dirty")]
    if not unclean:
        return None
    commits = sorted({(p.get("git_commit") or "?")[:12] for p in unclean})
    return (
        f"{len(unclean)} of {len(provs)} runs ran from a working tree with uncommitted "
        f"changes (at commit {', '.join(commits)}): no commit holds exactly the code "
        "they ran."
    )


def rerun_command(
    study: str, cluster: str, target: str | None = None, study_file: str | None = None
) -> str:
    """The command that runs the study again on its cluster (Snakemake): with the file the plan
    read the study from (plan.json ``study_file``), else the one named after the study under
    config/studies/ by convention."""
    named = STUDY_FILES / f"{study}.yaml"
    if not (study_file and Path(study_file).is_file()):
        study_file = str(named) if named.is_file() else "<your study file>"
    return shlex.join(
        [
            "snakemake",
            "--cores",
            "all",
            *([target] if target else []),
            "--config",
            f"study_file={study_file}",
            f"cluster={cluster}",
        ]
    )


def rerender_command(records: str | Path, out: str | Path) -> str:
    """The command that renders the page again from its records, without a run (a recommend
    page's adds ``recommend``)."""
    return shlex.join(["bash", "benchmarks/rerender.sh", str(records), str(Path(out).parent)])
