"""The step model with partial overlap of FLOPs, dispatch and collectives, for comparison.

    python benchmarks/overlap_trial.py P       # P > 0; P = inf is the committed model

Runs benchmarks/prediction_accuracy.py with the micro-steps' time as the p-norm of FLOPs,
dispatch and collectives in each phase (p = 1: their sum, p = inf: the longest, as
`offload_study.prediction.shared.micro_steps_s` takes it), in the prediction and in the leave-one-model-out fit alike. A trial, not a model:
docs/benchmarks.md ("Partial overlap ...") says what it found and why it was left out.
"""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "workflow"))

from offload_study.prediction import shared  # noqa: E402


def p_norm(parts: tuple[float, ...], p: float) -> float:
    return max(parts) if math.isinf(p) else sum(x**p for x in parts) ** (1 / p)


def with_overlap(p: float) -> None:
    """Patch the one rule both the prediction and the fit call (this process only)."""

    def micro_steps_s(
        flops_s, dispatch_s, comm_s, serial=False, wait_s=0.0, forward=shared.ONE_PHASE
    ) -> float:
        if serial:
            return flops_s + wait_s + dispatch_s + comm_s
        phases = (
            (forward.flops, forward.dispatch, forward.wait),
            (1 - forward.flops, 1 - forward.dispatch, 1 - forward.wait),
        )
        return sum(
            p_norm((flops * flops_s + wait * wait_s, host * dispatch_s, host * comm_s), p)
            for flops, host, wait in phases
        )

    shared.micro_steps_s = micro_steps_s


if __name__ == "__main__":
    with_overlap(float(sys.argv[1]))
    sys.argv = [str(HERE / "prediction_accuracy.py")]
    runpy.run_path(sys.argv[0], run_name="__main__")
