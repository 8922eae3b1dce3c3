"""Compile DeepSpeed's ops ahead of the first run (they build just in time otherwise, which on a
2-core machine costs ~50 s for cpu_adam and ~3 min for async_io inside the first timed run)."""

from __future__ import annotations

import argparse
import sys
import time

# Op name -> DeepSpeed op-builder class name (the accelerator picks its own implementation).
OP_BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "fused_adam": "FusedAdamBuilder",
    "async_io": "AsyncIOBuilder",
    "shm_comm": "ShareMemCommBuilder",
}


def build_ops(names: list[str]) -> dict[str, float]:
    from deepspeed.accelerator import get_accelerator

    seconds = {}
    for name in names:
        builder = get_accelerator().create_op_builder(OP_BUILDERS[name])
        if builder is None:  # this accelerator has no such op (e.g. shm_comm on CUDA)
            continue
        start = time.perf_counter()
        builder.load()
        seconds[name] = time.perf_counter() - start
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("ops", nargs="*", choices=sorted(OP_BUILDERS), default=sorted(OP_BUILDERS))
    args = parser.parse_args(argv)
    for name, secs in build_ops(args.ops).items():
        print(f"{name}: ready in {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
