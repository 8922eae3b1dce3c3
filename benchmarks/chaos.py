"""Chaos run: a CPU study through `snakemake --profile slurm` on a private local
SLURM while faults of every kind in tests/chaos.py's FAULTS table are injected at random.

    sudo PYTHONPATH=workflow .venv/bin/python benchmarks/chaos.py [--runs 40] [--faults 8]
        [--seed N] [--jobs 2] [--calibration results/local-cpu/calibration.json]

The same machinery as tests/test_chaos.py (tests/chaos.py: the study, the fault table, the
injector, the verdict), at any size. Needs root (the SLURM daemons, the results tmpfs) and
`apt-get install slurm-wlm munge`. Without --calibration the machine is measured first (~1 min,
not counted in the chaos wall time). Prints the seed, each fault as it is injected, then
`N runs, F faults injected, R retried, L lost` and the wall time; each run's outcome counts.

Exit status 0 when nothing was lost and every planned run has one current record, else 1.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from chaos import SLURM, chaos_run  # noqa: E402
from conftest import measure_calibration  # noqa: E402
from slurm_cluster import slurm_cluster  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--faults", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    p.add_argument("--jobs", type=int, default=4, help="SLURM jobs at once (the profile's jobs)")
    p.add_argument("--calibration", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the chaos phase")
    p.add_argument("--keep", action="store_true", help="keep the temp folder (logs)")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    try:
        calibration = a.calibration or Path(measure_calibration(tmp))
        with slurm_cluster(**SLURM) as cluster:
            chaos, verdict, codes, _ = chaos_run(
                cluster,
                tmp,
                calibration,
                runs=a.runs,
                faults=a.faults,
                seed=seed,
                jobs=a.jobs,
                timeout_s=a.timeout,
            )
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    kinds = collections.Counter(f.kind for f in chaos.faults)
    print("faults by kind:", dict(sorted(kinds.items())))
    print("current outcomes:", dict(collections.Counter(verdict.outcomes.values())))
    print(
        f"retried runs: {verdict.retried}; retryable left: {verdict.retry_left}; missing {verdict.missing}; extra "
        f"{verdict.extra}; lost {verdict.lost}; unreported {verdict.unreported}"
    )
    ok = not (verdict.lost or verdict.missing or verdict.extra) and codes[-1] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
