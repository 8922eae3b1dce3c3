"""Would another way of combining the host's dispatch with the device's work in a phase predict
the step better, leaving one model out?

    PYTHONPATH=workflow python benchmarks/step_overlap_forms.py

The step model takes, in the forward and in the backward, the longest of the device's work
(FLOPs and the copies it waits for) and the host's dispatch (``shared.micro_steps_s``): they
overlap fully. Two forms that let them overlap less are tried, each with the efficiency and the
time per layer refitted per engine and leaving each model out, as ``prediction_accuracy.py``
does (its ``add_out_of_sample_errors``, on the same grids):

- a p-norm, (device^p + host^p)^(1/p): p large is the max, p = 1 the sum;
- the max plus a share alpha of the shorter one: alpha = 0 is the max, 1 the sum.

Prints, per form, the records within 10 % and the clear pairs ordered right. Deterministic,
about 4 minutes (each form refits every fold).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager

import prediction_accuracy as pa

from offload_study.prediction import shared

STEP_TARGET = 0.10
P_NORMS = (8, 6, 4, 3, 2)
ALPHAS = (0.25, 0.5, 0.75, 1.0)
Combine = Callable[[float, float], float]


def phases(flops_s, dispatch_s, comm_s, wait_s, forward) -> list[tuple[float, float]]:
    """(device, host) seconds of the forward and of the backward, as micro_steps_s splits them."""
    return [
        (flops * flops_s + wait * wait_s, max(host * dispatch_s, host * comm_s))
        for flops, host, wait in (
            (forward.flops, forward.dispatch, forward.wait),
            (1 - forward.flops, 1 - forward.dispatch, 1 - forward.wait),
        )
    ]


@contextmanager
def combined_by(combine: Combine | None):
    """shared.micro_steps_s with each phase's device and host time combined by ``combine``
    (None: as committed); a CPU rank's serial sum is left as it is."""
    committed = shared.micro_steps_s

    def micro_steps_s(flops_s, dispatch_s, comm_s, serial=False, wait_s=0.0, forward=None):
        forward = forward or shared.ONE_PHASE
        if combine is None or serial:
            return committed(flops_s, dispatch_s, comm_s, serial, wait_s, forward)
        return sum(combine(d, h) for d, h in phases(flops_s, dispatch_s, comm_s, wait_s, forward))

    shared.micro_steps_s = micro_steps_s
    try:
        yield
    finally:
        shared.micro_steps_s = committed


def p_norm(p: float) -> Combine:
    return lambda d, h: (d**p + h**p) ** (1 / p)


def max_plus(alpha: float) -> Combine:
    return lambda d, h: max(d, h) + alpha * min(d, h)


def judged(rows: list[dict], combine: Combine | None) -> tuple[int, int, int, int]:
    """(records within the target, records, clear pairs right, clear pairs), model left out."""
    rows = copy.deepcopy(rows)
    with combined_by(combine):
        pa.add_out_of_sample_errors(rows)
    ok = [r for r in rows if r["kind"] == "GPU" and r["outcome"] == "ok"]
    errors = [r["step_error"] for r in ok if r.get("step_error") is not None]
    pairs = pa.judged_pairs(ok)
    hits = sum(abs(e) <= STEP_TARGET for e in errors)
    return hits, len(errors), sum(p.right for p, _ in pairs), len(pairs)


def main() -> int:
    rows = []
    for folder, study in pa.GPU_RECORDS.items():
        shipped = pa._shipped(folder)
        rows += pa.record_rows(pa.REPO_ROOT / folder, pa.REPO_ROOT / study, shipped)
    forms: list[tuple[str, Combine | None]] = [("the longest of the two (committed)", None)]
    forms += [(f"p-norm, p = {p}", p_norm(p)) for p in P_NORMS]
    forms += [(f"the longest plus {a:g} x the shorter", max_plus(a)) for a in ALPHAS]
    print("| how a phase's device and host time combine | step within 10 % | clear pairs right |")
    print("|---|---|---|")
    for name, combine in forms:
        hits, n, right, pairs = judged(rows, combine)
        print(f"| {name} | {hits}/{n} | {right}/{pairs} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
