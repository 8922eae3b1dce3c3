"""One verdict rule for every comparison the project words (report, compare, check, recommend).

Two questions, each answered from a ratio's point estimate and its 95 % CI:

- :func:`speed` — is A faster than B? ``faster`` / ``slower`` when the whole CI lies on one side
  of 1; ``no difference shown`` only when the CI contains 1 *and* lies inside the equivalence
  band of :data:`THRESHOLDS` (any difference is smaller than that); ``inconclusive`` otherwise
  (the CI contains 1 but is too wide to say the two are alike, or there is no CI at all).
- :func:`band` — does a measured figure reproduce a published one within its tolerance band?
  ``reproduced`` when the whole CI lies inside the band, ``not reproduced`` when it lies wholly
  outside, ``inconclusive`` when it straddles an edge of the band, ``not measured`` without a
  figure.

The thresholds are data, not code: change :data:`THRESHOLDS` and every page follows.
"""

from __future__ import annotations

import math

FASTER, SLOWER, NO_DIFFERENCE, INCONCLUSIVE = (
    "faster",
    "slower",
    "no difference shown",
    "inconclusive",
)
REPRODUCED, NOT_REPRODUCED, NOT_MEASURED = "reproduced", "not reproduced", "not measured"
#: a prediction is judged against a band in words of its own: it reproduces nothing
PREDICTED_IN, PREDICTED_OUT, PREDICTED_ACROSS = (
    "predicted inside the band",
    "predicted outside the band",
    "predicted across the band's edge",
)

#: equivalence: a CI that contains 1 says "no difference shown" only when it lies within
#: [1 - equivalence, 1 + equivalence]: ±20 % is the smallest speed change a user of these
#: reports acts on (a study's repeats on one machine spread by up to ~15 %, docs/results), so a
#: CI wider than that around 1 cannot tell "alike" from "a fifth slower".
THRESHOLDS = {"equivalence": 0.20}


def bound_or_none(v) -> float | None:
    """A CI's end as a float, None when it is missing, not a number or NaN; an infinite end
    stays infinite (an interval unbounded on that side, as a prediction's whose error band
    passes 100 %)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def finite_or_none(v) -> float | None:
    """``v`` as a float, None when it is missing, not a number, NaN or infinite (table cells)."""
    x = bound_or_none(v)
    return x if x is not None and math.isfinite(x) else None


def speed(ratio, ci_low, ci_high, thresholds: dict = THRESHOLDS) -> str:
    """The verdict on a ratio (A over B, e.g. tokens/s) with its 95 % CI: faster / slower /
    no difference shown / inconclusive (see the module docstring)."""
    r, lo, hi = finite_or_none(ratio), finite_or_none(ci_low), finite_or_none(ci_high)
    if r is None or lo is None or hi is None:
        return INCONCLUSIVE
    if lo > 1:
        return FASTER
    if hi < 1:
        return SLOWER
    eq = thresholds["equivalence"]
    return NO_DIFFERENCE if lo >= 1 - eq and hi <= 1 + eq else INCONCLUSIVE


def band(value, ci_low, ci_high, band_low, band_high) -> str:
    """The verdict on a measured figure against a published tolerance band [band_low,
    band_high] (None: unbounded on that side). Without a CI the point estimate is all the
    evidence there is, and is judged alone."""
    v = finite_or_none(value)
    if v is None:
        return NOT_MEASURED
    lo, hi = bound_or_none(ci_low), bound_or_none(ci_high)
    lo, hi = (v, v) if lo is None or hi is None else (min(lo, v), max(hi, v))
    b_lo = -math.inf if finite_or_none(band_low) is None else float(band_low)
    b_hi = math.inf if finite_or_none(band_high) is None else float(band_high)
    if hi < b_lo or lo > b_hi:
        return NOT_REPRODUCED
    if lo >= b_lo and hi <= b_hi:
        return REPRODUCED
    return INCONCLUSIVE


def predicted(value, ci_low, ci_high, band_low, band_high) -> str:
    """:func:`band` for a predicted figure (its CI = its error band), in a prediction's words."""
    said = band(value, ci_low, ci_high, band_low, band_high)
    words = {
        REPRODUCED: PREDICTED_IN,
        NOT_REPRODUCED: PREDICTED_OUT,
        INCONCLUSIVE: PREDICTED_ACROSS,
    }
    return words.get(said, said)


def ci_unit(half_width: float) -> float:
    """The rounding unit a 95 % CI of this half-width supports: its first significant digit,
    one digit finer when that digit is 1 or 2 (a CI of ±635 keeps hundreds: 13,900; ±11 keeps
    ones: 88). Digits past it are noise of the measurement, not information."""
    exponent = math.floor(math.log10(half_width))
    return 10.0 ** (exponent - 1 if half_width / 10.0**exponent < 3 else exponent)


def rounded(x: float, unit: float) -> str:
    """``x`` rounded to ``unit`` (a power of ten), thousands separated: 13941, 100 -> '13,900'."""
    decimals = max(0, -math.floor(math.log10(unit) + 1e-9))
    return f"{round(x / unit) * unit:,.{decimals}f}"


def ratio_text(ratio, ci_low, ci_high) -> str:
    """'74% [68%–82%]' (no CI: '74%'): whole percents, finer only where the CI is narrower than
    ±3 points (:func:`ci_unit`)."""
    r, lo, hi = finite_or_none(ratio), finite_or_none(ci_low), finite_or_none(ci_high)
    if r is None:
        return "—"
    if lo is not None and hi is None and bound_or_none(ci_high) == math.inf:
        return f"{100 * r:.0f}% [{100 * lo:.0f}%–no upper bound]"
    if lo is None or hi is None:
        return f"{100 * r:.0f}%"
    unit = min(1.0, ci_unit(50 * (hi - lo))) if hi > lo else 1.0
    return f"{rounded(100 * r, unit)}% [{rounded(100 * lo, unit)}%–{rounded(100 * hi, unit)}%]"
