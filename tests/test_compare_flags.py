"""compare.py and the sanity flags' severity, fast (no bundle, no DeepSpeed): two sides collected
from builders.make_record's records. A caution leaves a cross-cluster ratio standing, with the caution
named; an implausible flag on either side blocks it; mixed flags block."""

from __future__ import annotations

import dataclasses

import pytest
from builders import make_record

from offload_study.across import compare
from offload_study.analysis import collect

SCENARIOS = ("zero3", "offload-opt")


def side(root, label: str, speed: float, seed: int) -> compare.Side:
    """One cluster's study: each scenario twice, collected as compare.load_side does."""
    paths = [
        make_record(
            root / label,
            name,
            k,
            tokens_per_s=speed * share,
            seed=seed + 10 * i + k,
            offload_optimizer="cpu" if name == "offload-opt" else "none",
        )
        for i, (name, share) in enumerate(zip(SCENARIOS, (1.0, 0.4), strict=True))
        for k in range(2)
    ]
    runs, summary = collect.collect(paths, baseline="zero3", n_boot=200)
    plan = {"scenarios": [{"name": n} for n in SCENARIOS], "repeats": 2}
    return compare.Side(label, None, plan, runs, summary, {}, compare._draws(runs, seed, 200), {})


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    root = tmp_path_factory.mktemp("sides")
    return side(root, "cpu-a", 1000, 0), side(root, "cpu-b", 700, 100)


def with_flags(s: compare.Side, flags: str) -> compare.Side:
    return dataclasses.replace(s, summary=s.summary.assign(flags=flags))


def test_a_caution_leaves_the_ratio_standing_with_the_caution_named(sides):
    a, b = sides
    view = compare.comparison([with_flags(a, ""), with_flags(b, "ci-target-missed")])
    (verdict,) = view["verdicts"]
    assert "not a finding" not in verdict and "caution: ci-target-missed" in verdict
    assert "0.70× the tokens/s of cpu-a" in verdict
    against = view["rows"][0]["against"][0]
    assert against["flags"] == ["ci-target-missed"] and against["blocking"] == []
    assert view["rows"][0]["cells"][1]["blocking"] == []


@pytest.mark.parametrize(
    "ref_flags,flags,blocked",
    [
        ("", "gpu-over-cap", "gpu-over-cap"),
        ("", "ci-target-missed;non-finite-loss", "non-finite-loss"),  # mixed: blocks
        ("loss-parity", "many-skipped-steps", "loss-parity"),  # the reference side's flag
    ],
)
def test_an_implausible_flag_on_either_side_blocks_the_ratio(sides, ref_flags, flags, blocked):
    a, b = sides
    view = compare.comparison([with_flags(a, ref_flags), with_flags(b, flags)])
    (verdict,) = view["verdicts"]
    assert f"flagged ({blocked}): not a finding" in verdict and "caution" not in verdict
    assert all(r["against"][0]["blocking"] == [blocked] for r in view["rows"])


def test_no_flag_states_the_ratio_plainly(sides):
    view = compare.comparison([with_flags(s, "") for s in sides])
    (verdict,) = view["verdicts"]
    assert "0.70× the tokens/s of cpu-a" in verdict
    assert "not a finding" not in verdict and "caution" not in verdict
