"""Steady state and adaptive stop: when a run's warm-up is over, and when it has measured enough.

Pure functions over step times and one small state machine (:class:`Tracker`). The harness feeds
the tracker on rank 0 after every optimizer step and broadcasts its :class:`Decision` to all ranks
(every rank must run the same number of steps, or DeepSpeed's collectives hang). The parameters
are the study's ``measure`` block (:class:`~offload_study.core.contracts.MeasureSpec`).

**Warm-up (adaptive mode).** After step i (counted from 1) the warm-up is over when

1. i >= ``min_warmup_steps`` and i >= 2k (k = ``settle_window``),
2. the step times have settled: the median of the last k steps is within ``settle_tol_pct`` % of
   the median of the k steps before them, ``|med(last k) - med(k before)| <= tol/100 * med(k before)``
   (medians, so one odd step does not decide),
3. none of the last k steps was skipped: with fp16, DeepSpeed skips the optimizer step while its
   dynamic loss scale comes down after an overflow, and such steps are not steady ones.

At i = ``max_warmup_steps`` it is over anyway (``warmup_settled`` false).

**Measurement (adaptive mode).** After each measured step, the first that holds stops the run:

- ``target_met``: at least ``min_steps`` timed steps, and the 95 % CI of their median step time has
  a half-width within ``target_ci_pct`` % of the median,
- ``max_steps``: ``max_steps`` steps were measured,
- ``max_time``: the measured steps' times add up to ``max_measure_s`` (a sum of step times, not a
  clock, so the decision is a pure function of the steps),
- ``target_unreachable``: after 2 x ``min_steps`` timed steps the CI is still wide, and its
  projection to the target (half-width ~ 1/sqrt(n): n x (half/target)^2 steps at the median step
  time) needs more steps than ``max_steps`` or more time than ``max_measure_s``. On a machine whose
  step times wander +-10 % the 2 % target needs hundreds of steps; spending the whole budget
  would not make the number trustworthy, only expensive (benchmarks/adaptive_vs_fixed.py, H200:
  +-9 % after 30 steps). The record keeps its CI, and the sanity check ``ci-target-missed`` flags it.

Timed steps are measured steps whose optimizer step was applied: a skipped step is counted but
neither timed nor used for the CI (nor for the speed, :mod:`offload_study.training.metrics`).

**Fixed mode.** Exactly ``warmup_steps`` then ``steps`` (stop reason ``fixed``).

**CI of the median.** Distribution-free, from order statistics: for sorted times
x(1) <= ... <= x(n), the interval [x(j), x(n+1-j)] holds the population median with probability
1 - 2 P(B <= j-1), B ~ Binomial(n, 1/2); j is the largest index whose coverage is still >= 95 %.
No normality assumption, no resampling, hence no seed: the same steps give the same interval in the
harness (the stop decision) and in metrics.json. Below 6 steps no 95 % interval exists (None).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from offload_study.core.contracts import STOP_REASONS, MeasureSpec, RunSpec

PHASES = ("warmup", "measured")
CI_LEVEL = 0.95


# --------------------------------------------------------------------------- CI of the median
def order_statistic_rank(n: int, level: float = CI_LEVEL) -> int | None:
    """j (1-based) of the median's CI [x(j), x(n+1-j)] with coverage >= level; None if none has."""
    alpha_half = (1 - level) / 2
    tail, best = 0.0, None  # tail = P(B <= j-1)
    for j in range(1, n // 2 + 1):
        tail += math.comb(n, j - 1) / 2**n
        if tail > alpha_half:
            break
        best = j
    return best


@dataclass(frozen=True)
class MedianCI:
    median: float
    lo: float
    hi: float

    @property
    def half_pct(self) -> float:
        """Half-width in % of the median."""
        return 100 * (self.hi - self.lo) / 2 / self.median if self.median else math.inf


def median_ci(times: Sequence[float], level: float = CI_LEVEL) -> MedianCI | None:
    """The order-statistic CI of the median of ``times`` (None below 6 values at 95 %)."""
    xs = sorted(t for t in times if math.isfinite(t))
    j = order_statistic_rank(len(xs), level)
    if j is None:
        return None
    return MedianCI(statistics.median(xs), xs[j - 1], xs[len(xs) - j])


# --------------------------------------------------------------------------- the two rules
def settled(times: Sequence[float], skipped: Sequence[bool], k: int, tol_pct: float) -> bool:
    """Rules 2 and 3 of the warm-up: the last k steps' median is within tol_pct % of the k
    before, and none of the last k steps was skipped."""
    if len(times) < 2 * k or any(skipped[-k:]):
        return False
    last, before = statistics.median(times[-k:]), statistics.median(times[-2 * k : -k])
    return abs(last - before) <= tol_pct / 100 * before


def stop_reason(
    times: Sequence[float], skipped: Sequence[bool], measure: MeasureSpec
) -> str | None:
    """Why the adaptive measurement stops after these measured steps (None: go on)."""
    timed = [t for t, s in zip(times, skipped, strict=True) if not s]
    if len(timed) >= measure.min_steps:
        ci = median_ci(timed)
        if ci is not None and ci.half_pct <= measure.target_ci_pct:
            return "target_met"
    if len(times) >= measure.max_steps:
        return "max_steps"
    if sum(times) >= measure.max_measure_s:
        return "max_time"
    if len(timed) >= 2 * measure.min_steps and _unreachable(timed, times, measure):
        return "target_unreachable"
    return None


def _unreachable(timed: Sequence[float], times: Sequence[float], measure: MeasureSpec) -> bool:
    """The CI target, projected from the CI so far (half-width ~ 1/sqrt(n)), is out of budget."""
    ci = median_ci(timed)
    if ci is None or not math.isfinite(ci.half_pct):
        return False
    needed = len(timed) * (ci.half_pct / measure.target_ci_pct) ** 2
    more = needed - len(timed)
    return needed > measure.max_steps or sum(times) + more * ci.median > measure.max_measure_s


# --------------------------------------------------------------------------- the state machine
@dataclass(frozen=True)
class Decision:
    """What rank 0 decided after a step: the phase of the next step, and whether to stop."""

    phase: str  # warmup | measured
    stop: str | None = None  # one of STOP_REASONS; None: run another step

    def encode(self) -> list[int]:
        """Two small ints for a broadcast tensor."""
        stop = 0 if self.stop is None else 1 + STOP_REASONS.index(self.stop)
        return [PHASES.index(self.phase), stop]

    @classmethod
    def decode(cls, codes: Sequence[int]) -> Decision:
        phase, stop = (int(c) for c in codes)
        return cls(PHASES[phase], None if stop == 0 else STOP_REASONS[stop - 1])


class Tracker:
    """Step times in, decisions out (module docstring); rank 0 holds the one that counts."""

    def __init__(self, spec: RunSpec):
        self.measure = spec.measure
        self.fixed = spec.measure.mode == "fixed"
        if self.fixed:
            self.warmup_budget, self.steps_budget = spec.warmup_steps, spec.steps
        else:
            self.warmup_budget, self.steps_budget = (
                spec.measure.max_warmup_steps,
                spec.measure.max_steps,
            )
        self.phase = "warmup" if self.warmup_budget > 0 else "measured"
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}
        self.skipped: dict[str, list[bool]] = {p: [] for p in PHASES}
        self.warmup_settled: bool | None = None

    @property
    def budget(self) -> int:
        """The most steps the run can take (progress.json's total)."""
        return self.warmup_budget + self.steps_budget

    def observe(self, seconds: float, skipped: bool) -> Decision:
        """Record the step just run (in the current phase); the decision for the next one."""
        self.times[self.phase].append(seconds)
        self.skipped[self.phase].append(bool(skipped))
        if self.phase == "warmup":
            if self._warmup_over():
                self.phase = "measured"
            return Decision(self.phase)
        return Decision(self.phase, self._stop())

    def _warmup_over(self) -> bool:
        times, skipped, m = self.times["warmup"], self.skipped["warmup"], self.measure
        if self.fixed:
            return len(times) >= self.warmup_budget
        if len(times) >= m.min_warmup_steps and settled(
            times, skipped, m.settle_window, m.settle_tol_pct
        ):
            self.warmup_settled = True
        elif len(times) >= self.warmup_budget:
            self.warmup_settled = False
        return self.warmup_settled is not None

    def _stop(self) -> str | None:
        times, skipped = self.times["measured"], self.skipped["measured"]
        if self.fixed:
            return "fixed" if len(times) >= self.steps_budget else None
        return stop_reason(times, skipped, self.measure)
