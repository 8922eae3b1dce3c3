"""How well predictions match measured runs: small pure functions over (predicted, measured)
pairs, used by benchmarks/prediction_accuracy.py and its tests.

- :func:`rel_error`: predicted / measured - 1.
- :func:`clear_pairs`: of the pairs of configs whose measured speeds clearly differ (beyond their
  confidence intervals, or more than a given share apart), how many the prediction orders the
  same way; :func:`judged_pairs`: each such pair and whether it was ordered right.
- :func:`kendall_tau`: rank agreement of predicted and measured speeds (tau-b: ties count
  neither way).
- :func:`band`: the error band, the largest absolute relative error (or a quantile of them).
- :func:`folds`: constants fitted without each group's records (a model's: every record of the
  judged model leaves the fit), what that group's rows are judged with.
- :func:`fit_reserved`, :func:`fit_context`: the constants of predict.gpu_reserved_bytes.
- :func:`noise_floor`: how many records any one prediction per setup could meet at best, when
  the same setup measured more than once (repeats, other leases) spreads; :func:`within_spread`:
  a prediction judged against its setup's measured range.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from offload_study.prediction import shared

T = TypeVar("T")


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1; None when either is missing, NaN or the measurement is 0."""
    if predicted is None or measured is None or measured != measured or measured == 0:
        return None
    if predicted != predicted:
        return None
    return predicted / measured - 1


@dataclass(frozen=True)
class Speed:
    """One config's speed: predicted, and measured with its confidence interval (tokens/s)."""

    name: str
    predicted: float
    measured: float
    low: float
    high: float


def clearly_different(a: Speed, b: Speed, apart: float | None = None) -> bool:
    """Their measured intervals do not overlap (``apart`` None), else the faster measured more
    than ``apart`` (a share: 0.15 = 15 %) above the slower."""
    if apart is not None:
        return max(a.measured, b.measured) > (1 + apart) * min(a.measured, b.measured)
    return a.high < b.low or b.high < a.low


@dataclass(frozen=True)
class Pair:
    """Two clearly different configs, the one measured faster first."""

    fast: Speed
    slow: Speed

    @property
    def right(self) -> bool:
        return self.fast.predicted > self.slow.predicted


def judged_pairs(speeds: Sequence[Speed], apart: float | None = None) -> list[Pair]:
    """Every pair of ``speeds`` that is :func:`clearly_different`."""
    pairs = []
    for i, a in enumerate(speeds):
        for b in speeds[i + 1 :]:
            if clearly_different(a, b, apart):
                pairs.append(Pair(*((a, b) if a.measured > b.measured else (b, a))))
    return pairs


def clear_pairs(
    speeds: Sequence[Speed], apart: float | None = None
) -> tuple[int, int, list[tuple[str, str]]]:
    """(pairs ordered right, clearly different pairs, the wrong ones as (measured faster,
    measured slower)) over the :func:`judged_pairs` of ``speeds``."""
    pairs = judged_pairs(speeds, apart)
    wrong = [(p.fast.name, p.slow.name) for p in pairs if not p.right]
    return len(pairs) - len(wrong), len(pairs), wrong


def kendall_tau(predicted: Sequence[float], measured: Sequence[float]) -> float | None:
    """Kendall's tau-b of two equally long sequences; None for fewer than two items or when
    either has no two different values."""
    if len(predicted) != len(measured):
        raise ValueError("kendall_tau: sequences of different lengths")
    concordant = discordant = ties_p = ties_m = 0
    n = len(predicted)
    for i in range(n):
        for j in range(i + 1, n):
            dp = _sign(predicted[i] - predicted[j])
            dm = _sign(measured[i] - measured[j])
            if dp == 0 and dm == 0:
                continue
            if dp == 0:
                ties_p += 1
            elif dm == 0:
                ties_m += 1
            elif dp == dm:
                concordant += 1
            else:
                discordant += 1
    pairs_p = concordant + discordant + ties_m  # pairs the prediction does not tie
    pairs_m = concordant + discordant + ties_p
    if pairs_p == 0 or pairs_m == 0:
        return None
    return (concordant - discordant) / math.sqrt(pairs_p * pairs_m)


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def band(errors: Iterable[float | None], quantile: float | None = None) -> float | None:
    """The largest absolute relative error (``quantile`` None), else that quantile of the
    absolute errors (linear interpolation); None without any error."""
    values = sorted(abs(e) for e in errors if e is not None)
    if not values:
        return None
    if quantile is None:
        return values[-1]
    position = quantile * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


@dataclass(frozen=True)
class NoiseFloor:
    """The best any predictor of one value per setup can do against records that spread."""

    hits: int  # records within the tolerance of the best single value for their setup
    records: int
    widest: tuple[str, float]  # (setup, max / min - 1) of the setup that spread most


def noise_floor(measured: dict[str, Sequence[float]], tol: float) -> NoiseFloor:
    """For setups measured more than once (``measured``: setup -> its records' values), the
    records within ``tol`` (relative) of the one value per setup that meets the most of them:
    an upper bound on the records any deterministic prediction meets. The candidates are the
    values that put a record at the edge of the band, the only places the count can change."""
    hits = records = 0
    widest = ("", 0.0)
    for setup, values in measured.items():
        records += len(values)
        spread = max(values) / min(values) - 1
        widest = max(widest, (setup, spread), key=lambda w: w[1])
        edges = [v * (1 + side * tol) for v in values for side in (-1, 1)]
        hits += max(sum(abs(p / v - 1) <= tol + 1e-12 for v in values) for p in edges)
    return NoiseFloor(hits, records, widest)


def within_spread(predicted: float, measured: Sequence[float], tol: float) -> bool:
    """Whether a prediction lies within ``tol`` of the range its setup's records measured
    ([min x (1 - tol), max x (1 + tol)]): the step target judged against the records' noise."""
    return min(measured) * (1 - tol) <= predicted <= max(measured) * (1 + tol)


def folds(rows: Sequence[dict], fit: Callable[[list[dict]], T], group: str) -> dict[object, T]:
    """Each value of ``row[group]`` -> ``fit`` over the rows of every other value: what a
    group's rows are judged with when none of them was fitted on."""
    return {key: fit([r for r in rows if r[group] != key]) for key in {r[group] for r in rows}}


def fit_reserved(samples: Sequence[tuple[Sequence[float], float]]) -> tuple[float, ...]:
    """Least-squares coefficients c with sum(c_i x_i) ~ y over ``samples`` of (features x,
    y = measured reserved peak - predicted allocated peak), bytes (predict.reserved_features).
    Features whose column is all zero get 0."""
    if not samples:
        raise ValueError("fit_reserved: no samples")
    width = len(samples[0][0])
    used = [i for i in range(width) if any(x[i] for x, _ in samples)]
    scale = [max(abs(x[i]) for x, _ in samples) for i in used]  # well-conditioned columns
    rows = [[x[i] / s for i, s in zip(used, scale, strict=True)] for x, _ in samples]
    ys = [y for _, y in samples]
    coef = _least_squares(rows, ys)
    out = [0.0] * width
    for i, s, c in zip(used, scale, coef, strict=True):
        out[i] = c / s
    return tuple(out)


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Solve the normal equations (A^T A) c = A^T y by Gauss-Jordan with partial pivoting; a
    column that is a combination of others gets 0."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    m = [ata[i] + [aty[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(n)]


def fit_context(samples: Iterable[tuple[float, float]]) -> float:
    """The CUDA context (and whatever else nvml counts beside torch's allocator), bytes: the
    median of nvml's used memory less torch's reserved peak over samples of (nvml used,
    reserved peak); a sample where nvml read less (it is read at the end, after memory was
    freed) says nothing and is left out."""
    gaps = [used - reserved for used, reserved in samples if used >= reserved]
    if not gaps:
        raise ValueError("fit_context: no sample with nvml's reading at or above the peak")
    return statistics.median(gaps)


@dataclass(frozen=True)
class StepParts:
    """A GPU step prediction by part, seconds (offload_study.prediction.shared.StepTime), made with ``efficiency`` and
    ``dispatch_s_per_layer``: the micro-steps are the longest of FLOPs, dispatch and
    collectives, phase by phase (``forward``: shared.micro_steps_s), the rest (PCIe, optimizer,
    NVMe) adds; ``wait_s``, copies on the device's timeline, adds to the FLOPs inside the
    micro-steps (StepTime.device_wait_s)."""

    flops_s: float
    dispatch_s: float
    comm_s: float
    rest_s: float
    efficiency: float
    dispatch_s_per_layer: float
    wait_s: float = 0.0
    forward: shared.ForwardShares = shared.ONE_PHASE

    def total(self, efficiency: float, dispatch_s_per_layer: float) -> float:
        """The step with other constants: FLOPs time scales as 1 / efficiency, dispatch with
        its time per layer."""
        flops = self.flops_s * self.efficiency / efficiency
        dispatch = self.dispatch_s * dispatch_s_per_layer / self.dispatch_s_per_layer
        micro = shared.micro_steps_s(flops, dispatch, self.comm_s, False, self.wait_s, self.forward)
        return micro + self.rest_s


#: The grids :func:`fit_compute` searches: efficiency of the matmul rate, seconds per layer.
EFFICIENCIES = tuple(round(0.30 + 0.01 * i, 2) for i in range(61))
DISPATCH_S = tuple(round(0.010 + 0.0005 * i, 4) for i in range(61))


def fit_compute(
    samples: Sequence[tuple[StepParts, float]], efficiencies: Sequence[float] = EFFICIENCIES
) -> tuple[float, float]:
    """(efficiency, dispatch s per layer) minimising the squared log error of the step over
    ``samples`` of (parts, measured step seconds), on the grids above (``efficiencies``: one
    value to fit the time per layer alone, at an efficiency fitted elsewhere). Of equal losses
    the first on the grids wins: the lowest time per layer where FLOPs bound every sample."""
    if not samples:
        raise ValueError("fit_compute: no samples")

    def loss(eff: float, disp: float) -> float:
        return sum(math.log(p.total(eff, disp) / m) ** 2 for p, m in samples)

    return min(((e, d) for e in efficiencies for d in DISPATCH_S), key=lambda c: loss(*c))


def fit_runtime(samples: Iterable[tuple[float, float, int]]) -> float:
    """A rank's runtime memory before its model (bytes) that minimises the squared relative
    error of the host prediction over samples of (measured host bytes per node, predicted host
    bytes without the runtime, ranks per node): small hosts weigh as much as large ones."""
    samples = list(samples)
    if not samples:
        raise ValueError("fit_runtime: no samples")
    num = sum(n / m * (1 - base / m) for m, base, n in samples)
    return num / sum((n / m) ** 2 for m, _, n in samples)
