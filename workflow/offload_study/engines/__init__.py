"""The training engines, one plug-in folder each: ``engines/<name>/`` registers one
:class:`Engine` (as torchtitan registers a train spec), and a folder may add an
:class:`OffloadPath` to an engine it extends.

Every stage asks this registry what the run's engine does (admission, its config, its ops, its
training step in the harness, its records, its memory and step-time model) and never branches on
an engine's name. Adding an engine is adding a folder: the registry imports every sub-package
of this one the first time it is asked (``pkgutil``), and the schemas' engine lists are written
from it (``python -m offload_study.engines.schema_sync``, checked by a test).

An engine's parts import torch, DeepSpeed or another library only inside their functions, so
asking the registry at parse time costs nothing of the kind.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class Trainer(Protocol):
    """What the harness's step loop asks of one rank's engine (engines/<name>/train.py)."""

    device: object
    vocab_size: int
    model_params: int
    skipped_steps: int  # optimizer steps skipped so far (fp16 overflow)

    def synchronize(self) -> None: ...
    def train(self) -> None: ...
    def forward(self, ids): ...
    def backward(self, loss) -> None: ...
    def step(self, boundary: bool) -> None: ...
    def loss_scale(self) -> float | None: ...
    def effective_modes(self) -> dict: ...
    def versions(self) -> dict: ...
    def close(self, stats): ...


class Model(Protocol):
    """An engine's memory and step-time model (engines/<name>/model.py), over a run spec, the
    engine's config (:attr:`Engine.build_config`) and the cluster's calibration."""

    def predict_memory(self, spec, config: dict, cal): ...
    def reserved_features(self, spec, config: dict) -> tuple[float, ...]: ...
    def known_reserved_bytes(self, spec, config: dict) -> float: ...
    def step_time(self, spec, config: dict, cal): ...
    def note(self, spec, config: dict, cal=None) -> str | None: ...
    def own_estimate(self, spec) -> tuple[float, float] | None: ...


@dataclass(frozen=True)
class OffloadPath:
    """One way an engine offloads, selected by the scenario's offload keys.

    ``devices`` is (offload_optimizer, offload_param) as a study writes them; ``keys`` the
    further scenario keys the path takes (``offload_optimizer_ratio``); ``problems`` says why a
    scenario of a study cannot use it on a cluster (study, scenario, cluster, key path ->
    "key: why" lines);
    ``parts`` is what the engine's own code asks of the path (its trainer's and model's hooks).
    """

    engine: str
    name: str
    label: str
    devices: tuple[str, str]
    keys: frozenset[str] = frozenset()
    problems: Callable[[dict, dict, dict, str], list[str]] = (
        lambda study, scenario, cluster, where: []
    )
    parts: object = None
    grid: tuple[dict, ...] = ()  # scenario keys a recommendation may try on this path


@dataclass(frozen=True)
class Engine:
    """What a stage may ask of a training engine. Each callable's arguments are named in its
    field's comment; ``spec`` is a :class:`~offload_study.core.contracts.RunSpec`."""

    name: str  # the scenario key's value
    label: str  # what pages call it ("ZeRO-3")
    summary: str  # one sentence, for the study schema's description of ``engine``
    # admission (study keys): (study) and (study, scenario, cluster, key path) -> "key: why"
    study_problems: Callable[[dict], list[str]]
    scenario_problems: Callable[[dict, dict, dict, str], list[str]]
    # rule plan: (spec, config) -> why the engine's own parser refuses the config, or None
    config_problem: Callable[[object, dict], str | None]
    ops_needed: Callable[[object], list[str]]  # (spec) -> compiled ops it loads, in order
    build_config: Callable[[object], dict]  # (spec) -> configs/<scenario>.json
    # harness: (spec, config path, run id) -> (config, private NVMe folder or None)
    start_rank: Callable[[object, str | None, str], tuple[dict | None, str | None]]
    trainer: Callable[..., Trainer]  # (spec, config, rank stats, is_cuda) -> Trainer
    # records: (spec, rank 0's log, steps.csv rows, harness parts) -> breakdown_ms
    breakdown: Callable[[object, str, list, dict | None], dict]
    # records: (first_stat: rank stat name -> value) -> deepspeed_version, engine_version
    versions: Callable[[Callable[[str], object]], dict]
    model: Model
    # calibrate's probe of the host time per decoder layer (a CPU cluster's ranks run it between
    # their FLOPs): (a tiny transformers model on the CPU, the device type, in an initialized
    # process group) -> one micro-step, forward, backward and step (tokens -> the seconds of its
    # forward); None: the engine's model takes its fitted time per layer
    host_probe: Callable[[object, str], Callable[[object], float]] | None = None
    # records: (the run's effective modes, as its trainer recorded them) -> whether the run keeps
    # memory in processes of its own beside the ranks, which a rank's own peak does not count
    host_workers: Callable[[dict], bool] = lambda effective_modes: False
    # scenario keys of the offload paths a recommendation may try (more come from OffloadPaths)
    grid: tuple[dict, ...] = ()
    paths: tuple[OffloadPath, ...] = field(default=())

    def path(self, offload_optimizer: str, offload_param: str) -> OffloadPath | None:
        """The offload path that serves these offload keys (None: the engine has none)."""
        wanted = (offload_optimizer, offload_param)
        return next((p for p in self.paths if p.devices == wanted), None)


_ENGINES: dict[str, Engine] = {}
_PATHS: list[OffloadPath] = []


def register(engine: Engine) -> Engine:
    """Called by an engine's folder when it is imported."""
    if engine.name in _ENGINES:
        raise RuntimeError(f"engine {engine.name!r} is registered twice")
    _ENGINES[engine.name] = engine
    return engine


def register_path(path: OffloadPath) -> OffloadPath:
    """Called by a folder that adds an offload path to an engine (its own or another's)."""
    _PATHS.append(path)
    return path


@functools.cache
def _discovered() -> dict[str, Engine]:
    for module in pkgutil.iter_modules(__path__):
        if module.ispkg:
            importlib.import_module(f"{__name__}.{module.name}")
    engines = {}
    for name, engine in sorted(_ENGINES.items()):
        own = tuple(p for p in _PATHS if p.engine == name)
        engines[name] = dataclasses.replace(engine, paths=engine.paths + own)
    orphans = sorted({p.engine for p in _PATHS} - set(engines))
    if orphans:
        raise RuntimeError(f"offload paths registered for engines that do not exist: {orphans}")
    return engines


def names() -> tuple[str, ...]:
    """Every engine there is, by name."""
    return tuple(_discovered())


def engines() -> tuple[Engine, ...]:
    return tuple(_discovered().values())


class UnknownEngine(ValueError):
    pass


def get(name: str) -> Engine:
    """The engine called ``name``; one clear error naming the engines there are."""
    try:
        return _discovered()[name]
    except KeyError:
        raise UnknownEngine(
            f"engine {name!r} is not one of this workflow's engines: {', '.join(names())}"
        ) from None


def of(spec) -> Engine:
    """The engine of a run spec."""
    return get(spec.engine)


def label(name: str) -> str:
    """What a page calls an engine (its name when no such engine is installed here)."""
    engine = _discovered().get(name)
    return engine.label if engine else name
