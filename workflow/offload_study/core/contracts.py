"""The contracts between the stages, defined once: shapes, file names, writers and readers.

=========================  ===============  =================  =====================================
file                       written by       read by            shape
=========================  ===============  =================  =====================================
configs/<s>.run.json       plan             runner, harness    :class:`RunSpec`
<record>/progress.json     harness rank 0   runner             :class:`Progress`
<record>/rank<r>.stats.json  harness        runner             :class:`RankStats`
<record>/steps.csv         harness rank 0   runner, collect    :class:`StepRow` (``STEPS_COLUMNS``)
<record>/metrics.json      runner           collect            ``schemas/metrics.schema.json``
<record>/provenance.json   runner           report             ``schemas/provenance.schema.json``
<record>/logs/rank<r>.log  harness (tee)    runner             raw text
<record>/pair/             runner           collect            a whole record (:attr:`RecordDir.pair`)
calibration.json           calibrate        plan               :class:`Calibration`
plan.csv                   plan             runner, report     :class:`Prediction`
=========================  ===============  =================  =====================================

Key lists that the schemas already define (``METRICS_FIELDS``, ``OUTCOMES``, ``BREAKDOWN_KEYS``,
``PROVENANCE_FIELDS``) are read from them, never retyped. JSON is always written atomically
(:func:`write_json`), so a reader never sees half a file.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import jsonschema

from offload_study.core import csvsafe, layout, units
from offload_study.core.study import StudyError, load_schema

# --------------------------------------------------------------------------- file names
METRICS_FILE = "metrics.json"
STEPS_FILE = "steps.csv"
PROVENANCE_FILE = "provenance.json"
PROGRESS_FILE = "progress.json"
LOGS_DIR = "logs"
LAUNCHER_LOG = "launcher.log"
RANK_STATS_GLOB = "rank*.stats.json"
NVME_DIR_PREFIX = "offload-study-"
#: How a rank's log announces its GPU memory cap, followed by "<GiB> GiB of <GiB> GiB" (read back
#: only for a rank that died before writing its stats).
GPU_CAP_LOG_PREFIX = "[harness] GPU memory capped to "
#: The record of the short no-offload run made in the same job as the run (study key
#: ``same_allocation_baseline``), inside the run's record: rep<k>/pair/{metrics.json,...}.
PAIR_DIR = "pair"
#: The run spec and DeepSpeed config the nested pair record ran with (inside that record).
PAIR_SPEC_FILE = "run.json"
PAIR_DS_CONFIG_FILE = "ds_config.json"


def rank_stats_name(rank: int) -> str:
    return f"rank{rank}.stats.json"


def rank_log_name(rank: int) -> str:
    return f"rank{rank}.log"


def nvme_run_dir(nvme_path: str, run_id: str) -> str:
    """The run-private NVMe swap folder: the harness makes and removes it, the runner removes
    what a killed run left there."""
    return os.path.join(nvme_path, f"{NVME_DIR_PREFIX}{run_id}")


@dataclass(frozen=True)
class RecordDir:
    """The files of one run record: the runner's temp folder while the run goes, then rep<k>/."""

    root: Path

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def steps(self) -> Path:
        return self.root / STEPS_FILE

    @property
    def provenance(self) -> Path:
        return self.root / PROVENANCE_FILE

    @property
    def progress(self) -> Path:
        return self.root / PROGRESS_FILE

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def launcher_log(self) -> Path:
        return self.logs / LAUNCHER_LOG

    def rank_log(self, rank: int) -> Path:
        return self.logs / rank_log_name(rank)

    def rank_stats(self, rank: int) -> Path:
        return self.root / rank_stats_name(rank)

    @property
    def pair(self) -> RecordDir:
        """The nested record of the same-allocation pair run (absent when none ran)."""
        return RecordDir(self.root / PAIR_DIR)


# --------------------------------------------------------------------------- schemas
@functools.cache
def metrics_schema() -> dict:
    return load_schema("metrics")


@functools.cache
def provenance_schema() -> dict:
    return load_schema("provenance")


_METRICS_PROPERTIES = metrics_schema()["properties"]
#: metrics.json keys, in the schema's order.
METRICS_FIELDS: list[str] = list(_METRICS_PROPERTIES)
#: Every outcome a run can have (the schema's enum).
OUTCOMES: list[str] = list(_METRICS_PROPERTIES["outcome"]["enum"])
#: Why a run stopped measuring (the schema's ``stop_reason`` enum, null left out; :mod:`offload_study.training.steady`).
STOP_REASONS: list[str] = [r for r in _METRICS_PROPERTIES["stop_reason"]["enum"] if r is not None]
#: breakdown_ms key -> DeepSpeed timer name (the schema's x-deepspeed-timer annotation).
BREAKDOWN_TIMERS: dict[str, str] = {
    key: prop["x-deepspeed-timer"]
    for key, prop in _METRICS_PROPERTIES["breakdown_ms"]["properties"].items()
}
BREAKDOWN_KEYS: list[str] = list(BREAKDOWN_TIMERS)
#: provenance.json keys every record has (nvml_error only appears when NVML failed).
PROVENANCE_FIELDS: list[str] = list(provenance_schema()["required"])


def schema_problems(record: Mapping, schema: dict) -> list[str]:
    """One line per way ``record`` breaks ``schema`` (empty when it is valid)."""
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(record)]


# --------------------------------------------------------------------------- plain files
def write_atomic(path: str | Path, write: Callable[[IO[str]], Any]) -> None:
    """The one atomic write of a text file: ``write(fh)`` into a temp file beside ``path``, then
    os.replace. When it fails (a full disk: ENOSPC at write or close), the file already at
    ``path`` stays as it was, the temp file is removed, and the OSError names ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", newline="") as fh:
            write(fh)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}", str(path)) from e


def write_json(path: str | Path, obj: Any) -> None:
    """JSON written atomically (:func:`write_atomic`)."""
    text = json.dumps(obj, indent=2, default=str) + "\n"
    write_atomic(path, lambda fh: fh.write(text))


#: The deepest nesting of a JSON file this workflow reads (its own nest a few levels). Python's
#: json parser is recursive: a file of 100,000 '[' would end in a RecursionError, not in an
#: error naming the file, so the depth is counted on the bytes first (:class:`JsonDepth`).
JSON_MAX_DEPTH = 64
_JSON_TOKENS = re.compile(rb'[\[\]{}"\\]')
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = b"[{", b"]}", ord('"'), ord("\\")


class JsonDepth:
    """The nesting depth of JSON text, counted on its bytes (fed in pieces, as they are read)
    before anything parses it; brackets inside strings do not count."""

    def __init__(self) -> None:
        self.depth = self.deepest = 0
        self._in_string = self._escaped = False

    def feed(self, data: bytes) -> int:
        """Count one more piece; returns the deepest nesting so far."""
        skip = 0 if self._escaped else -1  # the piece before ended in a string's backslash
        self._escaped = False
        for match in _JSON_TOKENS.finditer(data):
            i = match.start()
            if i == skip:
                continue
            c = data[i]
            if self._in_string:
                if c == _BACKSLASH:
                    skip, self._escaped = i + 1, i + 1 == len(data)
                elif c == _QUOTE:
                    self._in_string = False
            elif c == _QUOTE:
                self._in_string = True
            elif c in _OPEN:
                self.depth += 1
                self.deepest = max(self.deepest, self.depth)
            else:  # a closing bracket (a backslash outside a string is for json to refuse)
                self.depth -= c in _CLOSE
        return self.deepest


def read_json(path: str | Path) -> Any:
    """A JSON file; ValueError naming the file when it nests deeper than JSON_MAX_DEPTH."""
    data = Path(path).read_bytes()
    if JsonDepth().feed(data) > JSON_MAX_DEPTH:
        raise ValueError(f"{path}: JSON nested deeper than {JSON_MAX_DEPTH} levels")
    return json.loads(data.decode())


def sha256_file(path: str | Path, missing_ok: bool = False) -> str | None:
    """sha256 of a file's bytes; None for a missing/unreadable file only when ``missing_ok``."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        if missing_ok:
            return None
        raise


def sha256_tree(folder: str | Path) -> str:
    """sha256 over every file of a folder (relative path, then bytes, in path order): one
    digest for a whole run record, so that "the same record" means every byte of it."""
    folder, digest = Path(folder), hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(folder)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


#: JSON leaves, returned as they are (most of a run spec's values: checked first, by exact type)
_LEAF_TYPES = frozenset({str, int, float, bool, type(None)})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    """A dataclass's field names (None for any other class), looked up once per class."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


def plain_data(value: Any) -> Any:
    """``dataclasses.asdict`` for the plain data of contracts (dataclasses, dicts, lists, tuples
    of JSON values), without its deep copy of every leaf: a 1,000-run dry run converts each run
    spec twice while Snakemake builds its jobs (benchmarks/dryrun_overhead.py)."""
    if type(value) in _LEAF_TYPES:
        return value
    names = _field_names(type(value))
    if names is not None:
        return {name: plain_data(getattr(value, name)) for name in names}
    if isinstance(value, dict):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain_data(v) for v in value)
    return value


def _from_mapping(cls, data: Mapping, source: str):
    """A dataclass from a dict with exactly its keys (those with defaults may be left out)."""
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    missing = [
        f.name
        for f in fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if unknown or missing:
        raise StudyError(
            f"{source}: not a {cls.__name__}: "
            + "; ".join(
                [f"unknown key {k!r}" for k in unknown] + [f"missing key {k!r}" for k in missing]
            )
        )
    return cls(**data)


# --------------------------------------------------------------------------- run spec
RUN_SPEC_VERSION = 1
_ENGINE_KEY = load_schema("study")["properties"]["scenarios"]["items"]["properties"]["engine"]
#: The default training engine (scenario key ``engine``), from the study schema (whose list
#: of engines offload_study.engines.schema_sync writes from the engine registry).
DEFAULT_ENGINE: str = _ENGINE_KEY["default"]


def engine_of(row: Mapping) -> str:
    """The engine of a run spec dict, plan row, metrics record or summary row (records and
    specs from before the key ran DeepSpeed)."""
    engine = row.get("engine")
    return engine if isinstance(engine, str) and engine else DEFAULT_ENGINE


@dataclass(frozen=True)
class ModelSpec:
    source: str  # "config" (random init from a transformers config) | "pretrained"
    preset: str | None
    config: dict  # full transformers config dict (source=config), overrides (pretrained)
    name_or_path: str | None  # HF id or local path (source=pretrained)


@dataclass(frozen=True)
class DataSpec:
    kind: str  # "synthetic" | "token_file"
    token_file: str | None


@dataclass(frozen=True)
class OptimizerSpec:
    type: str
    lr: float
    weight_decay: float


@dataclass(frozen=True)
class MeasureSpec:
    """How long a run warms up and measures (study key ``measure``; :mod:`offload_study.training.steady`)."""

    mode: str  # adaptive | fixed (fixed: exactly RunSpec.warmup_steps + RunSpec.steps)
    target_ci_pct: float  # stop once the median step time's 95 % CI half-width is within this
    min_warmup_steps: int
    max_warmup_steps: int
    settle_window: int  # k: the median of the last k steps is compared with the k before
    settle_tol_pct: float
    min_steps: int
    max_steps: int
    max_measure_s: float  # the measured steps' times summed


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One planned run: ``configs/<scenario>.run.json`` (docs/design.md explains each key)."""

    schema_version: int = RUN_SPEC_VERSION
    study: str
    cluster: str
    scenario: str  # expanded name (sweep values appended)
    base_scenario: str  # name as written in the study
    label: str
    sweep: dict  # knob -> value of this expansion ({} when not swept)
    model: ModelSpec
    model_params: int | None
    seq_len: int
    dtype: str
    micro_batch: int
    gradient_accumulation_steps: int
    global_batch: int
    gradient_checkpointing: bool
    steps: int | None  # fixed mode: measured steps (None in adaptive mode)
    warmup_steps: int | None  # fixed mode: warm-up steps (None in adaptive mode)
    measure: MeasureSpec
    seed: int
    data: DataSpec
    optimizer: OptimizerSpec
    nodes: int
    gpus_per_node: int
    world_size: int
    accelerator: str  # the cluster's: cpu | cuda
    # Memory sizes keep their config keys' names (run.json, plan.json, metrics.json) and unit,
    # GiB (offload_study.core.units); code reads them in bytes through the *_bytes properties.
    gpu_mem_gb: float | None  # GiB: the card the scenario stands for
    cluster_gpu_mem_gb: float | None  # GiB: the cluster's real card
    gpu_model: str | None  # the cluster's GPU model (peak-TFLOPS lookup when torch names none)
    peak_tflops: float | None  # the cluster's override of the peak-TFLOPS table (MFU)
    cpu_mem_gb: float | None  # GiB: host memory per node the run may use
    offload_optimizer: str  # none | cpu | nvme
    offload_param: str
    nvme_path: str | None  # set only when the run offloads to NVMe
    nvme_capacity_gb: float | None  # GiB: space at the cluster's nvme_path
    pin_memory: bool | None  # None: DeepSpeed's default (left out of the offload blocks)
    zero: dict  # zero_optimization overrides (study, scenario, sweep)
    aio: dict
    timeout_s: float
    step_timeout_s: float | None
    strict: bool
    reference: dict | None
    force: bool = False  # launched even when predicted not to fit (predict.refusal)
    predict_only: bool = False  # planned and predicted, never trained (e.g. more GPUs than exist)
    ds_config: str | None = None  # path of its DeepSpeed config (set when the files are written)
    # newer offload modes and host knobs away from their defaults (offload_study.planning.modes.MODE_KEYS)
    modes: dict = dataclasses.field(default_factory=dict)
    # study key same_allocation_baseline: the run spec (dict) of the short no-offload run made
    # right after this one in the same job, into <record>/pair/ (None: no such run)
    same_allocation_pair: dict | None = None
    # the training engine (scenario key engine; offload_study.engines has one folder each)
    engine: str = DEFAULT_ENGINE

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    @property
    def gpu_mem_bytes(self) -> int | None:
        return units.gib_to_bytes_or_none(self.gpu_mem_gb)

    @property
    def cluster_gpu_mem_bytes(self) -> int | None:
        return units.gib_to_bytes_or_none(self.cluster_gpu_mem_gb)

    @property
    def cpu_mem_bytes(self) -> int | None:
        return units.gib_to_bytes_or_none(self.cpu_mem_gb)

    @property
    def nvme_capacity_bytes(self) -> int | None:
        return units.gib_to_bytes_or_none(self.nvme_capacity_gb)

    def pair_spec(self) -> RunSpec | None:
        """The run spec of :attr:`same_allocation_pair` (None when there is none)."""
        if self.same_allocation_pair is None:
            return None
        return RunSpec.from_dict(
            self.same_allocation_pair, f"{self.scenario}: same_allocation_pair"
        )

    @property
    def job_timeout_s(self) -> float:
        """Wall-clock limit of everything the run's job does: the run, then its pair run."""
        pair = self.same_allocation_pair
        return float(self.timeout_s) + (float(pair["timeout_s"]) if pair else 0.0)

    def with_ds_config(self, path: str | Path) -> RunSpec:
        return dataclasses.replace(self, ds_config=str(path))

    def to_dict(self) -> dict:
        """The spec as JSON-ready dict; without a pair run the ``same_allocation_pair`` key is
        left out, and ``engine`` when it is the default, so a study that leaves them off writes
        the run specs it wrote before (Snakemake sees no changed params and re-runs nothing)."""
        out = plain_data(self)
        if out["same_allocation_pair"] is None:
            del out["same_allocation_pair"]
        if out["engine"] == DEFAULT_ENGINE:  # the same: DeepSpeed studies re-run nothing
            del out["engine"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "run spec") -> RunSpec:
        if data.get("schema_version") != RUN_SPEC_VERSION:
            raise StudyError(
                f"{source}: schema_version {data.get('schema_version')!r} is not "
                f"{RUN_SPEC_VERSION}; re-plan the study"
            )
        nested = {
            "model": ModelSpec,
            "data": DataSpec,
            "optimizer": OptimizerSpec,
            "measure": MeasureSpec,
        }
        values = {
            key: _from_mapping(nested[key], value, f"{source}: {key}") if key in nested else value
            for key, value in data.items()
        }
        return _from_mapping(cls, values, source)


def write_run_spec(path: str | Path, spec: RunSpec) -> None:
    write_json(path, spec.to_dict())


def read_run_spec(path: str | Path) -> RunSpec:
    return RunSpec.from_dict(read_json(path), source=str(path))


# --------------------------------------------------------------------------- harness -> runner
#: host_tree_measure's suffix on a tree's peak that is at least the rank's own high-water mark
#: (VmHWM): a peak between two samples counts. A tree without it may miss one.
TREE_FLOORED = "+hwm"


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """rank<r>.stats.json: written once the device is set up (GPU cap known), again at the end."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    finished: bool = False
    device_name: str | None = None
    gpu_total_bytes: int | None = None
    gpu_mem_cap_gib: float | None = None  # per-process cap applied (None: uncapped)
    cuda_version: str | None = None
    torch_version: str | None = None
    deepspeed_version: str | None = None
    nvme_dir: str | None = None
    model_params: int | None = None
    peak_gpu_allocated_bytes: int | None = None
    peak_gpu_reserved_bytes: int | None = None
    nvml_used_bytes: int | None = None
    host_peak_rss_bytes: int | None = None  # this process's own peak (getrusage)
    # the peak of this process and its children summed (SuperOffload's optimizer worker),
    # sampled (probes.HostMemorySampler); host_tree_measure: "rss+uss" or "rss", what was summed,
    # with TREE_FLOORED when the peak is at least the rank's own high-water mark
    host_peak_tree_bytes: int | None = None
    host_tree_measure: str | None = None
    steps_done: int | None = None
    train_time_s: float | None = None
    stop_reason: str | None = None  # one of STOP_REASONS (rank 0's decision, shared by all)
    warmup_settled: bool | None = None  # rank 0: step times settled (False: cut at the budget)
    nvme_bytes_used: int | None = None
    nvme_cleaned: bool | None = None
    wall_time_s: float | None = None
    modes: dict | None = None  # what the engine used (offload_study.planning.modes.effective)
    bound_cores: list | None = None  # cores this rank was bound to (bind_cores), None: not bound
    cpu_affinity: str | None = None  # cores it could run on once its engine was built: "0-15"
    torch_threads: int | None = None  # torch.get_num_threads()
    torch_interop_threads: int | None = None  # torch.get_num_interop_threads()
    omp_num_threads: str | None = None  # its environment's OMP_NUM_THREADS (None: unset)
    mkl_num_threads: str | None = None  # and MKL_NUM_THREADS
    engine: str | None = None  # the engine that trained (RunSpec.engine)
    engine_version: str | None = None  # its version, as the engine reports it


def write_rank_stats(record: RecordDir, stats: RankStats) -> None:
    write_json(record.rank_stats(stats.rank), dataclasses.asdict(stats))


def read_rank_stats(record: RecordDir) -> dict[int, RankStats]:
    """rank -> stats of every rank that wrote them (unreadable files are left out)."""
    out = {}
    for path in record.root.glob(RANK_STATS_GLOB):
        try:
            stats = _from_mapping(RankStats, read_json(path), str(path))
        except (OSError, ValueError, TypeError):
            continue
        out[stats.rank] = stats
    return out


@dataclass(frozen=True)
class Progress:
    """progress.json: rank 0's heartbeat, rewritten after every optimizer step."""

    step: int
    total: int
    time: float
    phase: str  # start | warmup | measured
    step_time_s: float | None = None


def write_progress(record: RecordDir, progress: Progress) -> None:
    write_json(record.progress, dataclasses.asdict(progress))


def read_progress(record: RecordDir) -> Progress | None:
    try:
        return _from_mapping(Progress, read_json(record.progress), str(record.progress))
    except (OSError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class StepRow:
    """One optimizer step of steps.csv (phase: warmup | measured).

    ``skipped``: 1 when the engine skipped the optimizer step (fp16 overflow: non-finite
    gradients, the loss scale is lowered); ``loss_scale``: the optimizer's loss scale after the
    step (None when it has none); ``forward_s``, ``backward_s``, ``optimizer_s``: where the
    step's time went (the harness times both engines alike). Files written before these columns
    existed read back with 0 and None.
    """

    step: int
    phase: str
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    loss: float
    skipped: int = 0
    loss_scale: float | None = None
    # the step's parts, summed over its micro-steps, each ended by a device synchronization
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None

    @property
    def timed(self) -> bool:
        """Counts towards the speed: measured, and its optimizer step was applied."""
        return self.phase == "measured" and not self.skipped

    def cells(self) -> list[str]:
        return [
            str(self.step),
            self.phase,
            f"{self.step_time_s:.6f}",
            f"{self.tokens_per_s:.3f}",
            f"{self.samples_per_s:.4f}",
            f"{self.loss:.6f}",
            str(int(self.skipped)),
            "" if self.loss_scale is None else f"{self.loss_scale:g}",
            *(
                "" if v is None else f"{v:.6f}"
                for v in (self.forward_s, self.backward_s, self.optimizer_s)
            ),
        ]


STEPS_COLUMNS: list[str] = [f.name for f in dataclasses.fields(StepRow)]


def _optional_float(cell: str) -> float | None:
    return None if cell == "" else float(cell)  # None (a row cut short) raises TypeError


_STEP_TYPES = (int, str, float, float, float, float, int, *[_optional_float] * 4)
#: Columns a steps.csv may lack (written before they existed): their defaults stand in.
_STEP_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(StepRow) if f.default is not dataclasses.MISSING
}


class StepsWriter:
    """steps.csv, one row per step, flushed at once (the runner reads it while the run goes)."""

    def __init__(self, path: str | Path):
        self._file = open(path, "w", newline="")  # noqa: SIM115 - closed by close()/__exit__
        self._csv = csv.writer(self._file)
        self._csv.writerow(STEPS_COLUMNS)
        self._file.flush()

    def write(self, row: StepRow) -> None:
        self._csv.writerow(csvsafe.row(row.cells()))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> StepsWriter:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def write_steps(path: str | Path, rows: Iterable[StepRow | Sequence]) -> None:
    """A whole steps.csv (rows as StepRow or as sequences in STEPS_COLUMNS order)."""
    with StepsWriter(path) as writer:
        for row in rows:
            writer.write(row if isinstance(row, StepRow) else StepRow(*row))


def read_steps(path: str | Path) -> list[StepRow]:
    """The rows of a steps.csv; rows cut short (a killed run) are left out."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error):  # absent, or not a CSV text at all
        return []
    out = []
    for row in rows:
        try:
            cells = zip(_STEP_TYPES, STEPS_COLUMNS, strict=True)
            out.append(StepRow(*(_cell(row, kind, column) for kind, column in cells)))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _cell(row: Mapping[str, str | None], kind, column: str):
    """One typed cell; a column the file lacks gives its default (a row cut short raises)."""
    if column not in row and column in _STEP_DEFAULTS:
        return _STEP_DEFAULTS[column]
    return kind(csvsafe.read_cell(row[column]))


# --------------------------------------------------------------------------- predictions
CALIBRATION_FILE = "calibration.json"
PLAN_CSV = "plan.csv"
CALIBRATION_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """calibration.json of a cluster: rates measured there (offload_study.prediction.calibrate) or shipped in
    config/calibration/ (``source`` says which); read by the plan's predictions."""

    schema_version: int = CALIBRATION_VERSION
    cluster: str
    accelerator: str  # cpu | cuda
    source: str  # how the numbers were obtained
    matmul_tflops: float  # dense matmul in the training dtype, one device
    matmul_dtype: str
    cpu_adam_params_per_s: float  # DeepSpeedCPUAdam with all the node's cores
    cpu_adam_threads: int
    # torch AdamW (foreach) with the same cores: fsdp2's CPU step (None: a file from before it;
    # the prediction then takes cpu_adam_params_per_s and says so)
    torch_adam_params_per_s: float | None = None
    # DeepSpeed's fp16 overflow check (isinf, isnan) over a host gradient buffer with the same
    # cores, elements/s (None: a file from before it; the prediction then scales CPU Adam's
    # rate by offload_study.engines.deepspeed.model.FP16_CHECK_PER_ADAM)
    fp16_check_elems_per_s: float | None = None
    # the passes of DeepSpeed's ZeRO-3 step over an offloaded sub-group beside CPU Adam, with the
    # same cores, parameters/s (calibrate.step_passes_at): the fp32 gradients' unscale, the fp32
    # master's copy into the bf16 partition on the host, and into one on the GPU (None: a file
    # from before them; the prediction then scales CPU Adam's rate, offload_study.prediction.shared.STEP_PASS_PER_ADAM)
    grad_unscale_params_per_s: float | None = None
    master_copy_params_per_s: float | None = None
    master_upload_params_per_s: float | None = None
    # SuperOffload's synchronous step through DeepSpeed's own CPU Adam worker, the cores split
    # as at its default share (calibrate.superoffload_step_at): parameters/s beyond the cost of
    # each sub-group's round trip, and that cost, seconds (None: a file from before the probe;
    # the prediction then scales CPU Adam's rate by the worker's share and says so)
    superoffload_step_params_per_s: float | None = None
    superoffload_sub_group_s: float | None = None
    # a training rank's host memory beside its model, GiB: when deepspeed.initialize returns
    # and after its first step (calibrate.runtime_probe; None: a file from before it, or the
    # probe failed: the prediction then takes predict.FITS's, measured on an H200)
    runtime_at_init_gib: float | None = None
    runtime_gib: float | None = None
    h2d_gb_s: float | None = None  # pinned host -> device copies (cuda only)
    d2h_gb_s: float | None = None  # pinned device -> host
    pageable_h2d_gb_s: float | None = None  # from ordinary (unpinned) host memory
    # fresh host pages mapped on their first write, one thread, GB/s (calibrate.page_fault_gb_s;
    # None: a file from before the probe, the prediction then takes the catalog's CPU default)
    page_fault_gb_s: float | None = None
    disk_read_gb_s: float | None = None  # at the cluster's nvme_path
    disk_write_gb_s: float | None = None
    interconnect_gb_s: float | None = None  # collective bus bandwidth between GPUs of a node
    # CPU clusters (calibrate's gloo probe): one small all-gather between two ranks, and per
    # engine with a probe and ranks on the node ("1", "2") the host seconds of a tiny Llama
    # decoder layer per forward and backward, and of the rest of a micro-step: {engine: {"2":
    # {"forward": s, "backward": s, "rest": s}}} and how they grow with the size
    # (calibrate._size_costs); an engine without one takes its fitted time per layer
    collective_latency_s: float | None = None
    layer_host_s: dict | None = None
    # False: no measurement of the cluster's accelerator, the GPU catalog's datasheet values
    # (offload_study.prediction.catalog); predictions made from it are labelled uncalibrated
    calibrated: bool = True
    provenance: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def write_calibration(path: str | Path, calibration: Calibration) -> None:
    write_json(path, calibration.to_dict())


#: A calibration file from before every engine had its own probe holds the default engine's
#: alone (ZeRO-3's, the only probe then), under this key.
OLD_LAYER_PROBE_KEY = "zero3_layer_s"


def read_calibration(path: str | Path) -> Calibration:
    data = read_json(path)
    if not isinstance(data, dict) or data.get("schema_version") != CALIBRATION_VERSION:
        raise StudyError(f"{path}: not a calibration file of schema_version {CALIBRATION_VERSION}")
    if OLD_LAYER_PROBE_KEY in data and "layer_host_s" not in data:
        data = dict(data)
        old = data.pop(OLD_LAYER_PROBE_KEY)
        data["layer_host_s"] = {DEFAULT_ENGINE: old} if old else None
    return _from_mapping(Calibration, data, str(path))


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One row of plan.csv: what the plan predicts for one scenario before anything runs.

    Memory in GiB (2**30 B) per GPU and per node, NVMe in GiB per node, times in seconds per
    optimizer step; ``ds_*`` are DeepSpeed's own estimator (model states only). Plans written
    before NVMe was counted in GiB have ``nvme_gb``/``nvme_budget_gb`` columns in GB (1e9 B):
    :func:`read_predictions` reads them into the GiB fields.
    """

    scenario: str
    predict_only: bool
    force: bool
    world_size: int
    gpu_gib: float | None  # peak allocated per GPU (None: model shape unknown)
    gpu_budget_gib: float | None
    host_gib: float | None  # peak RSS per node
    host_budget_gib: float | None
    nvme_gib: float | None  # swap files per node
    nvme_budget_gib: float | None
    ds_gpu_gib: float | None
    ds_host_gib: float | None
    step_time_s: float | None
    tokens_per_s: float | None
    compute_s: float | None  # the parts of step_time_s
    pcie_s: float | None
    optimizer_s: float | None  # CPU Adam when offloaded
    nvme_s: float | None
    comm_s: float | None
    bound: str | None  # the part that takes longest
    gpu_hours: float | None  # GPU-hours of all its repeats: start-up, and pair runs, included
    feasible: bool
    reason: str | None  # why it does not fit (None when it does)
    note: str | None = None  # what the model assumes or leaves out for this run's offload mode
    # "calibrated" (the cluster's calibration) or "uncalibrated" (GPU catalog values, no
    # calibration yet: offload_study.prediction.catalog), and the step time's relative error
    # band for that case (workflow/offload_study/data/error_bands.json)
    calibration: str | None = None
    step_time_band: float | None = None
    # peak of torch's caching allocator per GPU (what a per-process cap limits: torch's
    # max_memory_reserved, as metrics.json's peak_gpu_reserved_gib), and the same with the CUDA
    # context (what the whole card must hold), GiB (predict.gpu_reserved_bytes; None: not a GPU
    # run, or an older plan.csv: its gpu_reserved_bytes column held the one with the context)
    gpu_reserved_gib: float | None = None
    gpu_reserved_with_context_gib: float | None = None


PREDICTION_COLUMNS: list[str] = [f.name for f in dataclasses.fields(Prediction)]


def _prediction_cell(text: str, kind: str):
    """A plan.csv cell back to its field's type (``kind`` is the annotation text)."""
    if text == "":
        return None
    text = csvsafe.read_cell(text)
    if kind.startswith("bool"):
        return text == "True"
    if kind.startswith("int"):
        return int(text)
    return float(text) if kind.startswith("float") else text


def plan_csv_of(record_outdir: Path) -> Path:
    """results/<cluster>/<study>/<scenario>/rep<k> -> results/<cluster>/<study>/plan.csv"""
    return layout.study_of_record(record_outdir) / PLAN_CSV


def write_predictions(path: str | Path, rows: Iterable[Prediction]) -> None:
    """plan.csv, atomically (:func:`write_atomic`)."""

    def write(fh: IO[str]) -> None:
        out = csv.writer(fh)
        out.writerow(PREDICTION_COLUMNS)
        for row in rows:
            out.writerow(csvsafe.row("" if v is None else v for v in dataclasses.astuple(row)))

    write_atomic(path, write)


#: plan.csv columns of older plans -> (the GiB field they fill, bytes in one of their units)
_OLD_COLUMNS = {
    "nvme_gb": ("nvme_gib", units.GB),  # GB (1e9 B)
    "nvme_budget_gb": ("nvme_budget_gib", units.GB),
    "gpu_reserved_bytes": ("gpu_reserved_with_context_gib", 1),  # bytes, with the context
}


def read_predictions(path: str | Path) -> dict[str, Prediction]:
    """scenario -> its row of plan.csv (an older plan's columns read into today's fields)."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(Prediction)}
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = {}
    for row in rows:
        for old, (gib, unit) in _OLD_COLUMNS.items():
            if gib not in row and row.get(old):
                row[gib] = str(units.bytes_to_gib(float(row[old]) * unit))
        values = {k: _prediction_cell(row.get(k, ""), kinds[k]) for k in PREDICTION_COLUMNS}
        out[values["scenario"]] = Prediction(**values)
    return out


# --------------------------------------------------------------------------- shared rules
def choose_baseline(
    scenarios: Sequence[str], requested: str | None, offloads: Mapping[str, tuple[str, str]]
) -> str | None:
    """The study's baseline scenario (its speed is 100 %): one rule for plan, collect and report.

    ``requested`` (the study's ``baseline``) wins when it is set (not None or ""), whether or not
    it is among ``scenarios`` (the plan refuses an unknown one; collect notes it has no run).
    Otherwise the first of ``scenarios`` in their order whose ``offloads[name]`` is
    ``("none", "none")`` (offload_optimizer, offload_param: nothing offloaded); None if none is.
    """
    if requested:
        return requested
    return next((s for s in scenarios if offloads_nothing(*offloads.get(s, (None, None)))), None)


def offloads_nothing(offload_optimizer: str | None, offload_param: str | None) -> bool:
    """Whether a scenario moves nothing off the GPU: the one notion of "no offload" behind the
    study baseline and each scenario's no-offload pair (collect) and the sanity checks."""
    return (offload_optimizer, offload_param) == ("none", "none")


#: Settings two scenarios share to be compared run for run (collect's same-settings pair, the
#: sanity checks): the same GPUs and the same tokens per optimizer step. Model, sequence length,
#: precision and checkpointing are the study's, shared by all its scenarios already.
SAME_SETTINGS_KEYS: tuple[str, ...] = (
    "nodes",
    "world_size",
    "micro_batch",
    "gradient_accumulation_steps",
)


def settings_of(row: Mapping, keys: Sequence[str] = SAME_SETTINGS_KEYS) -> tuple | None:
    """The values of ``keys`` in a run or summary row, as floats; None when one is unknown."""
    try:
        values = tuple(float(row[k]) for k in keys)
    except (KeyError, TypeError, ValueError):
        return None
    return values if all(v == v for v in values) else None  # v != v: NaN


def no_offload_pairs(
    row: Mapping, rows: Iterable[Mapping], keys: Sequence[str] = SAME_SETTINGS_KEYS
) -> list[Mapping]:
    """The no-offload partners of ``row`` among ``rows`` (run specs, plan scenarios or summary
    rows, in study order): the scenarios that offload nothing and share its values of ``keys``,
    those of its engine, then with its ``gpu_mem_gb``, first; none when one of its ``keys`` is unknown. ``row`` itself
    is among them when it offloads nothing. The one pairing rule: collect's pairs, the plan's
    same-allocation pair runs, the report's predicted overhead and the sanity checks (which
    leave the accumulation out of ``keys`` to compare it)."""
    settings = settings_of(row, keys)
    if settings is None:
        return []
    same = [
        r
        for r in rows
        if offloads_nothing(r.get("offload_optimizer"), r.get("offload_param"))
        and settings_of(r, keys) == settings
    ]
    # the same engine first (an FSDP2 offload run against FSDP2 without offload), then the card
    return sorted(
        same,
        key=lambda r: (
            engine_of(r) != engine_of(row),
            r.get("gpu_mem_gb") != row.get("gpu_mem_gb"),
        ),
    )
