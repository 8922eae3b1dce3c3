"""DeepSpeed's ops: which builder makes each, what fixes a missing piece, and building them ahead.

DeepSpeed compiles its C++ ops just in time otherwise, which on a 2-core machine costs ~50 s
for cpu_adam and ~3 min for async_io inside the first timed run. :data:`FIXES` is the one place
that says how to repair a machine; the preflight's refusals and the outcome table's remedies
(:data:`offload_study.logparse.OUTCOME_PATTERNS`) both quote it.

    python -m offload_study.ops [--accelerator cpu|cuda] [OP ...]     (default: every op)
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Iterable

#: Op name -> DeepSpeed op-builder class name (each accelerator has its own implementation).
OP_BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "fused_adam": "FusedAdamBuilder",
    "async_io": "AsyncIOBuilder",
    "shm_comm": "ShareMemCommBuilder",
    "pin_memory": "PinMemoryBuilder",
}
#: DeepSpeed's own name of an op where it differs from ours (the name its logs use).
DEEPSPEED_NAMES = {"shm_comm": "deepspeed_shm_comm"}
#: Accelerator -> its DeepSpeed accelerator class (module, class name).
ACCELERATORS = {
    "cpu": ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator"),
    "cuda": ("deepspeed.accelerator.cuda_accelerator", "CUDA_Accelerator"),
}

#: The missing piece -> how to get it (each remedy ends by building the op ahead).
FIXES = {
    "libaio": "apt-get install libaio-dev (or conda install libaio; a private copy: "
    "CFLAGS=-I<dir>/include LDFLAGS=-L<dir>/lib)",
    "ninja": "pip install ninja (into the environment that trains)",
    "compiler": "apt-get install g++ (or set CXX to a C++ compiler)",
    "cuda_home": "install the CUDA toolkit (nvcc) of torch's CUDA version and set CUDA_HOME "
    "(e.g. module load cuda)",
    "cuda_mismatch": "use the CUDA toolkit of torch's CUDA version (or DS_SKIP_CUDA_CHECK=1)",
    "cuda_arch": "set TORCH_CUDA_ARCH_LIST to the GPUs' compute capability as X.Y without a "
    "suffix, e.g. TORCH_CUDA_ARCH_LIST=9.0 for H100/H200, where the runs start",
    "compile": "the first compiler error above names what is missing (a header: install its "
    "-dev package)",
    "incompatible": "run ds_report to see what DeepSpeed needs for it",
}


def our_name(deepspeed_name: str) -> str:
    """Our op name for the name DeepSpeed prints (deepspeed_shm_comm -> shm_comm)."""
    return next((k for k, v in DEEPSPEED_NAMES.items() if v == deepspeed_name), deepspeed_name)


def build_command(names: Iterable[str] = (), accelerator: str | None = None) -> str:
    """The command that builds the ops ``names`` ahead (every op when there are none)."""
    words = ["python -m offload_study.ops"]
    words += [f"--accelerator {accelerator}"] if accelerator else []
    return " ".join(words + [our_name(n) for n in names if n])


def remedy(piece: str, op: str | None = None, accelerator: str | None = None) -> str:
    """``fix: <FIXES[piece]>, then <build command>``."""
    return f"fix: {FIXES[piece]}, then {build_command([op] if op else [], accelerator)}"


def op_builder(name: str, accelerator: str | None = None):
    """DeepSpeed's builder of op ``name`` for ``accelerator`` (None: the one DeepSpeed detects);
    None when that accelerator has no such op (shm_comm on CUDA)."""
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().create_op_builder(OP_BUILDERS[name])
    module, cls = ACCELERATORS[accelerator]
    return getattr(importlib.import_module(module), cls)().create_op_builder(OP_BUILDERS[name])


def build_ops(names: list[str], accelerator: str | None = None) -> dict[str, float]:
    """Load (JIT-build when needed) each op; seconds it took, per op this accelerator has."""
    seconds = {}
    for name in names:
        builder = op_builder(name, accelerator)
        if builder is None:
            continue
        start = time.perf_counter()
        builder.load()
        seconds[name] = time.perf_counter() - start
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--accelerator", choices=sorted(ACCELERATORS), default=None,
        help="whose ops to build (default: the one DeepSpeed detects, or DS_ACCELERATOR)",
    )  # fmt: skip
    names = sorted(OP_BUILDERS) + sorted(DEEPSPEED_NAMES.values())
    parser.add_argument("ops", nargs="*", choices=names, default=sorted(OP_BUILDERS))
    args = parser.parse_args(argv)
    for name, secs in build_ops([our_name(o) for o in args.ops], args.accelerator).items():
        print(f"{name}: ready in {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
