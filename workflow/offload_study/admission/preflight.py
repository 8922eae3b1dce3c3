"""Preflight: can DeepSpeed load the ops each planned run needs, on this machine?

Which ops a run needs follows what DeepSpeed 0.19 loads (``ops_needed``, pure):

- the optimizer: ``engine._configure_basic_optimizer`` builds DeepSpeedCPUAdam (cpu_adam) when the
  optimizer is offloaded (to cpu or nvme), FusedAdam (fused_adam) otherwise, on both accelerators;
- NVMe offload (optimizer or parameters): the swappers load async_io, which loads pin_memory first;
- the CPU accelerator's communication backend loads shm_comm (``comm.torch.build_shm_op``).

Each op is checked the way ``OpBuilder.load``/``jit_load`` go before they compile (``check_op``):
installed with DeepSpeed -> ready; else the builder's own ``is_compatible(verbose=False)`` (for
async_io: does a test program link with -laio), ninja, on CUDA ``TORCH_CUDA_ARCH_LIST`` and
CUDA_HOME, and a C++ compiler unless the op is already built in torch's extension folder.

The plan runs it where the plan runs (the train env); under SLURM the compute nodes may differ,
so the runner runs it again before each launch (admission.admit.at_launch) and records a
refused run as ``op_build_error`` (its fix first) without starting it. A machine without a CUDA device
cannot check a cuda cluster's ops: those runs are skipped with a note, never refused.

    python -m offload_study.admission.preflight configs/*.run.json     (exit 1 when a run is refused)
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from offload_study import engines
from offload_study.admission import ops
from offload_study.core.contracts import RunSpec, read_run_spec

#: Ops DeepSpeed does without when they are not compatible (build_shm_op falls back to gloo).
FALLS_BACK = {"shm_comm"}
#: One entry of TORCH_CUDA_ARCH_LIST as DeepSpeed parses it (int(major), int(minor) before +PTX).
ARCH_ENTRY = re.compile(r"\d+\.\d+(?:\+PTX)?")


def ops_needed(spec: RunSpec) -> list[str]:
    """The compiled ops ``spec`` loads, in the order it loads them (its engine says which)."""
    return engines.of(spec).ops_needed(spec)


@dataclass(frozen=True)
class OpVerdict:
    """One op on this machine: ``missing`` (a key of ops.FIXES) and ``detail`` in words."""

    op: str
    accelerator: str
    missing: str | None = None
    detail: str = ""
    built: bool = True  # False: it compiles in the first run that needs it

    @property
    def fix(self) -> str | None:
        """How to get the missing piece (ops.remedy); None when nothing is missing."""
        return ops.remedy(self.missing, self.op, self.accelerator) if self.missing else None


# ----------------------------------------------------------------------------- probes
# Each probe: builder -> (missing piece, detail) or None, in the order jit_load meets them.
Probe = Callable[[object, str], "tuple[str, str] | None"]


def compatible(builder, op: str) -> tuple[str, str] | None:
    try:
        ok = builder.is_compatible(verbose=False)
        reason = "DeepSpeed's compatibility check says no"
    except Exception as exc:  # noqa: BLE001 - a probe that fails is a "no" (DeepSpeed agrees)
        ok, reason = False, f"its compatibility check failed: {exc}"
    if ok:
        return None
    if op == "async_io":
        return "libaio", "libaio not found (a test program does not link with -laio)"
    return "incompatible", reason


def ninja(_builder, _op: str) -> tuple[str, str] | None:
    from torch.utils.cpp_extension import is_ninja_available

    return None if is_ninja_available() else ("ninja", "ninja not found")


def cuda_toolchain(builder, _op: str) -> tuple[str, str] | None:
    """CUDA builders compute nvcc flags (arch list, nvcc version) on every JIT load."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder
    from torch.utils import cpp_extension

    if not isinstance(builder, CUDAOpBuilder):
        return None
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    bad = [e for e in re.split(r"[;\s]+", arch_list) if e and not ARCH_ENTRY.fullmatch(e)]
    if bad:
        return "cuda_arch", f"TORCH_CUDA_ARCH_LIST={arch_list!r} has {bad[0]!r}, not X.Y[+PTX]"
    home = cpp_extension.CUDA_HOME
    if not home or not Path(home, "bin", "nvcc").exists():
        return "cuda_home", f"CUDA_HOME does not exist ({home or 'unset'}: no bin/nvcc)"
    return None


PROBES: list[Probe] = [compatible, ninja, cuda_toolchain]


def _prebuilt(builder, accelerator: str) -> bool:
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(builder.name)) and accelerator_name == accelerator


def _compiler() -> str | None:
    """The C++ compiler torch's JIT build calls (CXX, else c++), when it is on PATH."""
    words = shlex.split(os.environ.get("CXX", "c++"))
    return shutil.which(words[0]) if words else None


def check_op(op: str, accelerator: str) -> OpVerdict:
    """Can DeepSpeed load ``op`` for ``accelerator`` here (without building it)?"""
    builder = ops.op_builder(op, accelerator)
    if builder is None or _prebuilt(builder, accelerator):
        return OpVerdict(op, accelerator)
    if op in FALLS_BACK and compatible(builder, op):
        return OpVerdict(op, accelerator)
    for probe in PROBES:
        found = probe(builder, op)
        if found:
            return OpVerdict(op, accelerator, *found)
    built = any((ops.extensions_root() / builder.name).glob(f"{builder.name}*.so"))
    if not built and not _compiler():
        cxx = os.environ.get("CXX", "c++")
        return OpVerdict(op, accelerator, "compiler", f"no C++ compiler ({cxx}) to build it")
    return OpVerdict(op, accelerator, built=built)


# ----------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Preflight:
    """The verdict over runs: scenario -> its refusal (one line), and notes."""

    host: str
    refusals: dict[str, str]
    notes: list[str]
    # scenario -> the fix of its refusal, a value that leads the excerpt of a run the runner
    # refuses (not in plan.json: its refusal line says it)
    fixes: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"host": self.host, "refusals": self.refusals, "notes": self.notes}


def machine_can_check(accelerator: str) -> bool:
    """cpu ops can be checked anywhere; cuda ops only where torch sees a CUDA device."""
    if accelerator != "cuda":
        return True
    import torch

    return torch.cuda.is_available()


def refusal_line(scenario: str, verdict: OpVerdict, host: str) -> str:
    return (
        f"scenario {scenario}: DeepSpeed op {verdict.op} cannot be built on {host}: "
        f"{verdict.detail} — {verdict.fix}"
    )


def _notes(verdicts: Iterable[OpVerdict], skipped: set[str], host: str) -> list[str]:
    notes = [
        f"preflight skipped for {acc} runs: {host} has no CUDA device to check their ops on; "
        "the runner checks them where they train"
        for acc in sorted(skipped)
    ]
    unbuilt: dict[str, list[str]] = {}
    for v in verdicts:
        if v.missing is None and not v.built:
            unbuilt.setdefault(v.accelerator, []).append(v.op)
    notes += [
        f"DeepSpeed ops not built yet on {host}: {', '.join(names)}; each compiles in the first "
        f"run that needs it (to build them now: {ops.build_command(names, acc)})"
        for acc, names in unbuilt.items()
    ]
    return notes


def check_runs(specs: Iterable[RunSpec]) -> Preflight:
    """Check every run's ops (each op once); a run is refused for the first op that cannot load."""
    host = socket.gethostname()
    verdicts: dict[tuple[str, str], OpVerdict] = {}
    refusals: dict[str, str] = {}
    fixes: dict[str, str] = {}
    skipped: set[str] = set()
    for spec in specs:
        if not machine_can_check(spec.accelerator):
            skipped.add(spec.accelerator)
            continue
        for op in ops_needed(spec):
            key = (op, spec.accelerator)
            verdict = verdicts[key] = verdicts.get(key) or check_op(op, spec.accelerator)
            if verdict.missing:
                refusals[spec.scenario] = refusal_line(spec.scenario, verdict, host)
                fixes[spec.scenario] = verdict.fix
                break
    return Preflight(host, refusals, _notes(verdicts.values(), skipped, host), fixes)


def plan_gate(specs: Iterable[RunSpec], mode: str) -> tuple[dict, list[str], bool]:
    """The plan's preflight (study key ``preflight``: refuse | warn).

    Returns (plan.json's ``preflight`` record, lines for the plan's log, whether the plan
    stops): with refuse a refused scenario stops the plan before anything trains; with warn the
    plan goes on and the runner records those runs as op_build_error without launching them.
    """
    result = check_runs(specs)
    stops = bool(result.refusals) and mode == "refuse"
    lines = [*result.refusals.values(), *result.notes]
    if result.refusals:
        where = (
            f"checked on {result.host}, where the plan runs (under SLURM the compute nodes may "
            "differ; the runner checks again on the node that trains)"
        )
        lines.append(
            f"preflight: {len(result.refusals)} scenario(s) refused, {where}; fix the machine, "
            "or set `preflight: warn` in the study to record them as op_build_error unrun"
            if stops
            else f"preflight: warn: these scenarios will be recorded as op_build_error, {where}"
        )
    return {"mode": mode, **result.to_dict()}, lines, stops


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Check the DeepSpeed ops of planned runs.")
    parser.add_argument("specs", nargs="+", help="run specs (configs/<scenario>.run.json)")
    result = check_runs(read_run_spec(p) for p in parser.parse_args(argv).specs)
    for line in [*result.refusals.values(), *result.notes]:
        print(line)
    return 1 if result.refusals else 0


if __name__ == "__main__":
    sys.exit(main())
