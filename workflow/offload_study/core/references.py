"""Reference values with tolerances (config/references/*.yaml, schema ``references``): what a
study's results are judged against, by check and by the report's seed block (one loader)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offload_study.core.layout import REFERENCES_DIR
from offload_study.core.study import StudyError, load_schema, read_yaml, validate

_ENTRY = load_schema("references")["properties"]["references"]["items"]
#: Summary columns a reference may name (the schema's enum).
METRICS: list[str] = list(_ENTRY["properties"]["metric"]["enum"])


@dataclass(frozen=True)
class Reference:
    """One expected value: ``value`` with tolerances ``lower`` <= 0 <= ``upper`` (fractions)."""

    file: str
    study: str
    scenario: str
    metric: str
    value: float
    lower: float | None
    upper: float | None
    cluster: str | None
    gpu_model: str | None
    note: str
    source: str

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        lo = None if self.lower is None else self.value * (1 + self.lower)
        hi = None if self.upper is None else self.value * (1 + self.upper)
        return lo, hi

    @property
    def specificity(self) -> int:
        return 2 if self.cluster else 1 if self.gpu_model else 0

    def applies(self, study: str, cluster: str, devices: set[str]) -> bool:
        return (
            self.study == study
            and self.cluster in (None, cluster)
            and (self.gpu_model is None or self.gpu_model in devices)
        )

    def band(self) -> str:
        lo, hi = self.bounds
        tol = f"{_tol(self.lower)}/{_tol(self.upper)}"
        return f"{self.value:g} ({tol}: {format_number(lo)} to {format_number(hi)})"


def _tol(t: float | None) -> str:
    return "unbounded" if t is None else f"{100 * t:+g}%"


def format_number(v) -> str:
    return "—" if v is None else f"{v:.4g}"


def load_references(folder: str | Path = REFERENCES_DIR) -> list[Reference]:
    """Every reference of every *.yaml in ``folder``, validated (StudyError names file and key)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StudyError(f"{folder}: no references folder")
    out = []
    for path in sorted(folder.glob("*.yaml")):
        doc = validate(read_yaml(path), "references", str(path))
        for entry in doc["references"]:
            out.append(Reference(file=str(path), study=doc["study"], source=doc["source"], **entry))
    _refuse_duplicates(out)
    return out


def _refuse_duplicates(refs: list[Reference]) -> None:
    seen: dict[tuple, Reference] = {}
    for r in refs:
        key = (r.study, r.scenario, r.metric, r.cluster, r.gpu_model)
        if key in seen:
            raise StudyError(
                f"{r.file}: references: scenario {r.scenario!r} metric {r.metric!r} is also "
                f"given in {seen[key].file} for the same cluster/gpu_model: keep one"
            )
        seen[key] = r


def published_or_none(folder: str | Path = REFERENCES_DIR) -> list[Reference]:
    """The references of the working directory's config/references; none where the folder is
    absent (a report rendered elsewhere shows bands from the study's own reference keys)."""
    try:
        return load_references(folder)
    except StudyError:
        return []
