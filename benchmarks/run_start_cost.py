"""Seconds one tiny CPU run takes through the runner, per engine (what a chaos run's 40 runs cost).

    PYTHONPATH=workflow python benchmarks/run_start_cost.py [WORKDIR]

The tests' tiny Llama, 1 rank, fixed 1 warm-up + 2 steps, seq 64, micro-batch 2, planned and
written as the plan rules do (tests/runs.py make_run) and run by ``offload_study.training.runner``
as the train rule runs it, once with ``engine: deepspeed`` and once with ``engine: fsdp2``. Most
of it is start-up (imports, process group, engine set-up), not training. The first DeepSpeed run
of a fresh venv also builds the CPU ops: run it twice.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from runs import make_run, run_runner  # noqa: E402


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="run-start-"))
    for engine in ("deepspeed", "fsdp2"):
        spec_path, outdir, _ = make_run(
            work / engine,
            scenario={"engine": engine},
            measure={"mode": "fixed"},
            steps=2,
            warmup_steps=1,
            seq_len=64,
            micro_batch=2,
        )
        started = time.monotonic()
        done = run_runner(spec_path, outdir)
        print(f"{engine}: rc {done.returncode}, {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
