"""The one verdict rule (offload_study.core.verdict): speed ratios and tolerance bands."""

from __future__ import annotations

import pytest

from offload_study.core import verdict


@pytest.mark.parametrize(
    ("ratio", "lo", "hi", "expected"),
    [
        # cases from committed reports: a CI that settles nothing is not "within noise"
        (0.48, 0.14, 3.30, "inconclusive"),  # NVMe report: straddles 1, far wider than ±20 %
        (0.70, 0.64, 1.10, "inconclusive"),  # straddles 1, reaches 36 % below it
        (0.74, 0.68, 0.82, "slower"),  # its paired ratio: the whole CI below 1
        (1.00, 0.97, 1.03, "no difference shown"),  # narrow and contains 1
        (1.30, 1.12, 1.50, "faster"),
        (0.40, 0.10, 0.90, "slower"),  # wide, but wholly below 1: decided
        (1.00, 0.80, 1.20, "no difference shown"),  # the edges of the ±20 % band count in
        (1.00, 0.79, 1.05, "inconclusive"),  # one edge past it
        (1.00, None, None, "inconclusive"),  # no CI: nothing shown either way
        (float("nan"), 0.9, 1.1, "inconclusive"),
    ],
)
def test_speed_verdict(ratio, lo, hi, expected):
    assert verdict.speed(ratio, lo, hi) == expected


def test_the_equivalence_threshold_is_data():
    assert verdict.THRESHOLDS["equivalence"] == 0.20
    wide = {"equivalence": 0.40}
    assert verdict.speed(0.70, 0.64, 1.10) == "inconclusive"
    assert verdict.speed(0.70, 0.64, 1.10, wide) == "no difference shown"


@pytest.mark.parametrize(
    ("value", "lo", "hi", "expected"),
    [
        (0.20, 0.18, 0.22, "reproduced"),  # seed ~20 %, band 15-25 %
        (0.158, 0.13, 0.18, "inconclusive"),  # straddles the band's lower edge
        (0.63, 0.52, 0.71, "not reproduced"),  # wholly above the band
        (0.10, 0.08, 0.12, "not reproduced"),  # wholly below
        (0.20, None, None, "reproduced"),  # no CI: the point alone
        (0.30, None, None, "not reproduced"),
        (None, None, None, "not measured"),
    ],
)
def test_band_verdict(value, lo, hi, expected):
    assert verdict.band(value, lo, hi, 0.15, 0.25) == expected


def test_an_unbounded_band_side_never_fails():
    assert verdict.band(5.0, 4.0, 6.0, 1.0, None) == "reproduced"
    assert verdict.band(0.5, 0.4, 0.6, 1.0, None) == "not reproduced"


def test_ratio_text():
    assert verdict.ratio_text(0.74, 0.68, 0.82) == "74% [68%–82%]"
    assert verdict.ratio_text(0.74, None, None) == "74%"
    assert verdict.ratio_text(None, 0.1, 0.2) == "—"


def test_the_report_words_each_ratio_by_its_verdict():
    from offload_study.analysis.report.views import worded_ratio

    of = "baseline speed"
    assert worded_ratio("slower", "74% [68%–82%]", of) == "slower: 74% [68%–82%] of baseline speed"
    assert worded_ratio("no difference shown", "100% [97%–103%]", of) == (
        "no difference shown from baseline speed: 100% [97%–103%]"
    )
    assert worded_ratio("inconclusive", "70% [64%–110%]", of).endswith(
        "(the CI is too wide to decide)"
    )
    assert worded_ratio("inconclusive", "70%", of) == "inconclusive: 70% of baseline speed (no CI)"
