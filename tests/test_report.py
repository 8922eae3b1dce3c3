"""Tests of offload_study.analysis.report on records written by builders.make_record."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from builders import (
    CLUSTER,
    H200,
    H200_REMEASURED,
    STUDY,
    assert_self_contained,
    build_report,
    h200_summary,
    make_plan,
    make_record,
    run_collect_cli,
    seed_like_records,
)

from offload_study.analysis import collect as C
from offload_study.analysis import report as R
from offload_study.analysis.report import figures, views


def assert_figures(figs: Path) -> None:
    for name in figures.FIGURES.values():
        p = figs / name
        assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def headline_cells(html: str, label: str) -> list[str]:
    """The text of each cell of the headline table's row of the scenario labelled ``label``."""
    table = html[html.index('id="headline-table"') :]
    table = table[: table.index("</table>")]
    row = next(r for r in table.split("<tr>") if f"<strong>{label}</strong>" in r)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.DOTALL)
    return [" ".join(re.sub(r"<[^>]+>", " ", c).split()) for c in cells]


def test_full_report(tmp_path):
    paths = seed_like_records(tmp_path)
    html, figs, _ = build_report(tmp_path, paths)
    assert_self_contained(html)
    assert_figures(figs)
    assert 'id="headline-table"' in html and "ZeRO-3 + Offload (4 GPU)" in html
    assert "8 GPUs × 40 GiB" in html and ">35%</td>" in html  # measured setup and seed reference
    speed = headline_cells(html, "ZeRO-3 + Offload (4 GPU)")[3]  # measured: 2800/8000 tokens/s
    assert re.fullmatch(
        r"35(\.\d)?% \[[\d.]+%–[\d.]+%\] slower 2,800 \[[\d,–]+\] tokens/s", speed
    ), speed
    # every figure but speed vs accumulation (it never varies here); the seed's among them
    assert html.count("data:image/png;base64,") == len(figures.FIGURES) - 1
    assert 'id="fig-seed_share"' in html and 'id="fig-speed_vs_gas"' not in html
    assert "ran out of host memory" in html and "Killed: host memory exceeded 512GB" in html
    assert "of baseline speed at 0.41× the GPU memory per GPU" in html  # verdict
    assert 'download="zero3-8gpu.json"' in html and "matches the run records" not in html
    assert "host node001" in html and "commit deadbeef" in html  # provenance, shared by all runs
    assert 'id="use-this"' in html


def test_escaping(tmp_path):
    evil = "<script>alert('x')</script>"
    paths = [
        make_record(tmp_path, "base", label=evil),
        make_record(tmp_path, "bad", outcome="error", error_excerpt=f"Traceback {evil} & more"),
    ]
    html, figs, _ = build_report(tmp_path, paths, labels={"base": evil, "bad": "B & <b>"})
    assert "<script>" not in html
    assert "&lt;script&gt;" in html
    assert "B &amp; &lt;b&gt;" in html
    assert_self_contained(html)


def test_one_scenario(tmp_path):
    html, figs, _ = build_report(tmp_path, [make_record(tmp_path, "solo", label="Solo run")])
    cell = headline_cells(html, "Solo run")[3]  # its own baseline
    assert re.fullmatch(r"100% 1,0\d\d \[[\d,]+–[\d,]+\] tokens/s", cell), cell
    assert_figures(figs)


def test_all_failed(tmp_path):
    paths = [
        make_record(tmp_path, "a", outcome="gpu_oom"),
        make_record(tmp_path, "b", outcome="timeout", offload_optimizer="cpu"),
    ]
    html, figs, _ = build_report(tmp_path, paths)
    assert "ran out of GPU memory" in html and "timed out" in html
    assert "No relative speed" in html
    assert_figures(figs)  # written for Snakemake, but a page shows no empty plot
    assert "no data" not in html and 'id="figures"' not in html


def test_missing_baseline_and_missing_records(tmp_path):
    paths = [
        make_record(tmp_path, "off", offload_optimizer="cpu", tokens_per_s=500),
        tmp_path / "results" / CLUSTER / STUDY / "off" / "rep1" / "metrics.json",
    ]
    html, figs, _ = build_report(tmp_path, paths)
    assert "No relative speed: no baseline" in html
    assert "left no record" in html and "500 [" in html
    assert_figures(figs)


def test_nans_and_no_gpu_memory(tmp_path):
    paths = [
        make_record(tmp_path, "base", peak_gpu_gib=None, breakdown={}, steps=False),
        make_record(
            tmp_path,
            "off",
            offload_optimizer="cpu",
            tokens_per_s=300,
            peak_gpu_gib=None,
            host_rss_gib=None,
        ),
    ]
    html, figs, _ = build_report(tmp_path, paths)
    off = headline_cells(html, "ZeRO-3 off")
    assert off[1:3] == [
        "8 GPUs × 40 GiB peak — GiB allocated per GPU",
        "64 GiB peak — GiB used per node",
    ]
    assert re.match(r"30(\.0)?% \[", off[3]) and "] slower 300 [" in off[3]
    assert "tokens/s vs ZeRO-3 base: 30" in off[3]
    assert_figures(figs)


def test_gas_sweep_and_other_cluster(tmp_path):
    paths = []
    for gas in (1, 2, 4, 8):
        name = f"off-sw-gas{gas}"
        paths.append(
            make_record(
                tmp_path,
                name,
                gas=gas,
                offload_optimizer="cpu",
                tokens_per_s=200 * gas**0.5,
                sweep={"gradient_accumulation_steps": gas},
            )
        )
    paths.insert(0, make_record(tmp_path, "base", tokens_per_s=1000))
    other = tmp_path / "other" / "summary.csv"
    other.parent.mkdir()
    _, s2 = C.collect(paths[:2], n_boot=50)
    s2["cluster"] = "big-gpu-cluster"
    s2.to_csv(other, index=False)
    html, figs, _ = build_report(tmp_path, paths, others=[other])
    assert 'id="clusters-table"' in html and "big-gpu-cluster" in html
    assert "no data" not in html
    assert_figures(figs)


def test_empty_inputs(tmp_path):
    (tmp_path / "runs.csv").write_text("")
    (tmp_path / "summary.csv").write_text("")
    (tmp_path / "plan.json").write_text(json.dumps({"study": "s", "cluster": "c", "scenarios": []}))
    out = tmp_path / "r" / "report.html"
    R.main(
        [
            "--runs",
            str(tmp_path / "runs.csv"),
            "--summary",
            str(tmp_path / "summary.csv"),
            "--plan",
            str(tmp_path / "plan.json"),
            "--out",
            str(out),
            "--figures-dir",
            str(tmp_path / "f"),
        ]
    )
    assert out.exists()
    assert_figures(tmp_path / "f")


def test_pareto_front():
    pts = [(10, 100), (5, 40), (6, 30), (20, 90), (2, 10)]
    assert figures.pareto_front(pts) == [4, 1, 0]


@pytest.mark.parametrize(
    "v,exp", [(None, "—"), (float("nan"), "—"), (1.234, "1.2"), (12345, "12,345")]
)
def test_fmt(v, exp):
    assert views.fmt(v) == exp


LLAMA_135B = {  # the model of config/studies/h200-1gpu.yaml, as plan.json carries it
    "source": "config",
    "preset": None,
    "name_or_path": None,
    "config": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 24},
}


def test_header_names_the_model_and_counts_one_gpu(tmp_path):
    paths = [
        make_record(tmp_path, "base", world_size=1, gpus_per_node=1, label="No offload"),
        make_record(tmp_path, "off", world_size=2, gpus_per_node=2, offload_optimizer="cpu"),
    ]
    _, _, html_path = build_report(tmp_path, paths)
    plan_path = tmp_path / "plan.json"
    plan = {**json.loads(plan_path.read_text()), "model": LLAMA_135B, "model_params": 1345423360}
    plan_path.write_text(json.dumps(plan))
    out = tmp_path / "out"
    R.main(
        [
            "--runs",
            str(out / "runs.csv"),
            "--summary",
            str(out / "summary.csv"),
            "--plan",
            str(plan_path),
            "--out",
            str(html_path),
            "--figures-dir",
            str(tmp_path / "f"),
        ]
    )
    html = html_path.read_text()
    assert "model Llama 1.35B" in html and "model ?" not in html
    assert "tokens/s on 1 GPU," in html and "1 GPUs" not in html
    assert "on 2 instead of 1 GPU." in html


@pytest.mark.parametrize(
    "model,params,name",
    [
        (LLAMA_135B, 1345423360, "Llama 1.35B"),
        ({"preset": "llama2-7b"}, 6738415616, "llama2-7b (6.74B params)"),
        ({"source": "pretrained", "name_or_path": "org/model"}, None, "org/model"),
        (None, 134105856, "of 134M parameters"),
        ({"config": {"model_type": "gpt2"}}, None, "Gpt2"),
    ],
)
def test_model_name(model, params, name):
    assert views.model_name(model, params) == name


def test_a_records_text_names_cards_as_the_catalog_does_and_tools_by_their_name():
    """A calibration's source as its author wrote it (nvidia-smi's "H100 80GB HBM3"): the page
    names the card ("H100 SXM") and states memory in GiB elsewhere; module paths become tools."""
    text = "measured by offload_study.prediction.calibrate on one H100 80GB HBM3 machine"
    assert views.plain(text) == "measured by calibrate on one H100 SXM machine"
    assert (
        views.plain("NVIDIA H100-80GB-HBM3, then an NVIDIA H200")
        == "NVIDIA H100 SXM, then an NVIDIA H200"
    )
    assert views.plain(None) == ""


def test_count_of():
    assert [views.count_of(n, "GPU") for n in (1, 2, None)] == ["1 GPU", "2 GPUs", "? GPUs"]


def _overlapping_pairs(boxes) -> int:
    return sum(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_speed_memory_labels_do_not_overlap():
    """Points as close as the H200 study's (offload at 6.7 and 7.3 GiB): the labels written
    where they would go unplaced overlap; placed, none overlaps another or a marker."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    pts = [(6.7, 62.0), (7.3, 59.0), (6.7, 37.0), (7.3, 26.0), (24.9, 100.0), (24.9, 78.0)]
    texts = [f"ZeRO-3 + CPU optimizer offload\ngas-{i}" for i in range(len(pts))]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.set_xlim(0, 34)
    ax.set_ylim(0, 118)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    naive = [
        ax.annotate(t, p, xytext=(7, 0), textcoords="offset points", fontsize=8, va="center")
        for p, t in zip(pts, texts, strict=True)
    ]
    assert _overlapping_pairs([a.get_window_extent(renderer) for a in naive]) > 0
    for a in naive:
        a.remove()
    figures.place_labels(ax, pts, texts, pts)
    for t in ax.texts:
        t.update_positions(renderer)
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the text, not its leader
    assert len(boxes) == len(pts) and _overlapping_pairs(boxes) == 0
    markers = [figures._marker_box(ax, p) for p in pts]
    assert not any(b.overlaps(m) for b in boxes for m in markers)
    plt.close(fig)


def test_large_study_plots_one_bar_per_configuration():
    def view(base, gas, rel):
        return views.Row(scenario=f"{base}__gas-{gas}", base_scenario=base, relative_speed=rel)

    many = [
        view(b, g, r)
        for b, f in (("a", 1.0), ("b", 0.5))
        for g, r in ((g, f * g / (g + 1)) for g in range(1, 21))
    ]
    rows, note = figures.bar_rows(many)
    assert [(v["scenario"], len(group)) for v, group in rows] == [
        ("a__gas-20", 20),
        ("b__gas-20", 20),
    ]
    assert "40 scenarios" in note
    assert figures.bar_rows(many[:5]) == ([(v, [v]) for v in many[:5]], None)


BLOCK_TORCH = """
import sys

class NoTorch:  # what the analysis env is like: torch and deepspeed are not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "deepspeed"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

sys.meta_path.insert(0, NoTorch())
for name in ("torch", "deepspeed"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"the blocker let {name} through")
from offload_study.analysis import collect, report

collect_args, report_args = sys.argv[1:3]
assert collect.main(collect_args.split("\\x1f")) == 0
assert report.main(report_args.split("\\x1f")) == 0
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed")]
print("ran without torch and deepspeed")
"""


def test_collect_and_report_need_neither_torch_nor_deepspeed(tmp_path):
    paths = seed_like_records(tmp_path)
    plan, out = make_plan(tmp_path, paths), tmp_path / "out"
    collect_args = [
        "--runs-csv",
        str(out / "runs.csv"),
        "--runs-parquet",
        str(out / "runs.parquet"),
        "--summary-csv",
        str(out / "summary.csv"),
        "--n-boot",
        "100",
        *map(str, paths),
    ]
    report_args = [
        "--runs",
        str(out / "runs.csv"),
        "--summary",
        str(out / "summary.csv"),
        "--plan",
        str(plan),
        "--out",
        str(out / "report.html"),
        "--figures-dir",
        str(out / "figures"),
    ]
    res = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, "\x1f".join(collect_args), "\x1f".join(report_args)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "ran without torch and deepspeed" in res.stdout
    assert (out / "report.html").exists()


# --------------------------------------------------------------------------- pairs and flags
def verdict_lines(html: str) -> list[str]:
    section = re.search(r'<section class="verdict".*?</section>', html, re.S)[0]
    return [re.sub(r"<[^>]+>", "", li) for li in re.findall(r"<li>(.*?)</li>", section, re.S)]


def test_paired_ratio_verdict_and_its_pair_are_stated(tmp_path):
    paths = []
    for k, drift in enumerate((1.0, 0.98, 1.02)):
        paths.append(make_record(tmp_path, "base", k, tokens_per_s=1000 * drift, seed=k))
        paths.append(
            make_record(
                tmp_path, "same", k, tokens_per_s=1000 * drift, offload_optimizer="cpu", seed=9 + k
            )
        )
        paths.append(
            make_record(
                tmp_path, "slow", k, tokens_per_s=500 * drift, offload_optimizer="cpu", seed=19 + k
            )
        )
    html, _, _ = build_report(tmp_path, paths)
    lines = {line.split(":")[0]: line for line in verdict_lines(html)}
    assert "no difference shown from its no-offload pair, ZeRO-3 base" in lines["ZeRO-3 same"]
    slow = lines["ZeRO-3 slow"]
    assert re.search(r"slower: 50(\.0)?% \[", slow) and "of its no-offload pair" in slow
    assert "vs ZeRO-3 base: " in html and "Sanity checks" in html
    assert 'id="sanity-table"' in html and "No scenario flagged." in html


def test_the_h200_report_states_no_implausible_number_as_a_finding(tmp_path):
    """The superseded 1-repeat study: gas 8's accumulation flag (with a caution: mixed) blocks
    its number and the paired ratios to it; the baseline's caution alone does not."""

    plan = json.loads((H200 / "plan.json").read_text())
    paths = [H200 / s["name"] / "rep0" / "metrics.json" for s in plan["scenarios"]]
    out = tmp_path / "out"
    run_collect_cli(paths, out, plan["baseline"])
    html = R.render(
        C.read_table(out / "runs.csv"),
        C.read_table(out / "summary.csv"),
        plan,
        tmp_path / "figures",
    )
    lines = {line.split(":")[0]: line for line in verdict_lines(html)}
    gas8 = lines["ZeRO-3, no offload; gradient accumulation steps 8"]
    assert gas8.startswith("ZeRO-3, no offload; gradient accumulation steps 8: flagged, not a")
    assert "slower with more accumulation" in gas8 and "of baseline speed" not in gas8
    opt8 = lines["ZeRO-3 + CPU optimizer offload; gradient accumulation steps 8"]
    assert (
        "its no-offload pair, ZeRO-3, no offload; gradient accumulation steps 8, is flagged, "
        "so no paired ratio"
    ) in opt8
    opt1 = lines["ZeRO-3 + CPU optimizer offload; gradient accumulation steps 1"]
    assert re.search(r"slower: \d+% \[\d+%–\d+%\] of baseline speed", opt1), opt1
    # the caution most rows carry is said once, under the verdicts, not on each line
    assert "CI target missed" not in opt1 and 'id="caution-ci-target-missed"' in html
    assert "flagged: slower with more accumulation" in html  # beside the number in the table
    note = html[html.index('id="caution-ci-target-missed"') :].split("</p>")[0]
    assert "the measurement stopped" in note  # said once with its reason,
    assert ">caution: CI target missed</a>" not in html  # not beside each row's number
    assert html.count('class="flagged"') == 1  # only gas 8's speed is struck through


def test_the_remeasured_h200_report_states_its_findings_with_their_caution():
    """Every ok row of the re-measured study misses its CI target (a noisy machine): a caution,
    so CPU optimizer offload at gas 1 is still ~30 % of its pair, with its CI."""

    plan = json.loads((H200_REMEASURED / "plan.json").read_text())
    summary = h200_summary(H200_REMEASURED).reset_index()
    scenarios = views.scenario_views(summary, plan, plan["baseline"])
    head, lines = views.verdicts(scenarios, plan["baseline"], None)
    assert "Flagged" not in head and "caution" not in head  # said once, for every row:
    (common,) = views.common_cautions(scenarios)
    assert common["name"] == "ci-target-missed" and common["n"] == common["of"]
    assert not any("not a finding" in line or "is flagged" in line for line in lines)
    (opt1,) = [
        line
        for line in lines
        if line.startswith("ZeRO-3 + CPU optimizer offload; gradient accumulation steps 1")
    ]
    pair = summary.set_index("scenario").loc["offload-opt__gas-1", "paired_ratio"]
    assert 0.25 < pair < 0.35
    assert f"{views.fmt_pct(pair)} [" in opt1
    assert "of its no-offload pair, ZeRO-3, no offload; gradient accumulation steps 1" in opt1
    assert "caution" not in opt1
    assert not any(v["blocking"] for v in scenarios)


def flag_views(flags: dict[str, str]) -> list[views.Row]:
    """Scenario views of a constructed summary: 'base' (no offload, the baseline), each other
    scenario an offload at 50 % [45 %, 55 %] of it and of its pair 'base', with ``flags``."""
    rows = [
        {
            "scenario": "base",
            "tokens_per_s": 1000.0,
            "relative_speed": 1.0,
            "n_ok": 2,
            "flags": flags.get("base", ""),
            "pair": "base",
            "pair_kind": "self",
        }
    ]
    rows += [
        {
            "scenario": n,
            "tokens_per_s": 500.0,
            "relative_speed": 0.5,
            "relative_speed_ci_low": 0.45,
            "relative_speed_ci_high": 0.55,
            "paired_ratio": 0.5,
            "paired_ratio_ci_low": 0.45,
            "paired_ratio_ci_high": 0.55,
            "pair": "base",
            "pair_kind": "same-settings",
            "n_ok": 2,
            "flags": f,
            "offload_optimizer": "cpu",
        }
        for n, f in flags.items()
        if n != "base"
    ]
    return views.scenario_views(pd.DataFrame(rows), {}, "base")


def test_a_caution_is_a_finding_and_an_implausible_flag_is_not():
    vs = flag_views(
        {
            "caution": "ci-target-missed",
            "implausible": "offload-faster-than-pair",
            "mixed": "many-skipped-steps;gpu-over-cap",
            "clean": "",
        }
    )
    head, lines = views.verdicts(vs, "base", None)
    by = {line.split(":")[0]: line for line in lines}
    assert by["caution"] == (
        "caution: slower: 50% [45%–55%] of baseline speed; slower: 50% "
        "[45%–55%] of its no-offload pair, base (same settings); caution: "
        "CI target missed."
    )
    assert by["clean"].endswith("of its no-offload pair, base (same settings).")
    assert by["implausible"] == (
        "implausible: flagged, not a finding: offload faster than no offload."
    )
    assert by["mixed"].startswith(
        "mixed: flagged, not a finding: many skipped steps; GPU memory over its cap"
    )
    assert [v["scenario"] for v in vs if v["blocking"]] == ["implausible", "mixed"]

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    bars = ax.barh(range(len(vs)), [1] * len(vs))
    assert figures._hatch_flagged(ax, bars, vs)
    assert [b.get_hatch() for b in bars] == [None, None, "///", "///", None]
    plt.close(fig)


def test_a_baseline_with_only_a_caution_keeps_its_ratios():
    head, lines = views.verdicts(flag_views({"base": "ci-target-missed", "off": ""}), "base", None)
    assert head.endswith("; caution: CI target missed.") and "Flagged" not in head
    assert lines == [
        "off: slower: 50% [45%–55%] of baseline speed; slower: 50% [45%–55%] of its "
        "no-offload pair, base (same settings)."
    ]
    head, lines = views.verdicts(flag_views({"base": "loss-parity", "off": ""}), "base", None)
    assert "Flagged, so no ratio to it is stated: loss differs from its pair." in head
    assert lines == [
        "off: 500 tokens/s (the baseline is flagged); its no-offload pair, base, is "
        "flagged, so no paired ratio is stated."
    ]


def test_the_report_marks_a_caution_beside_the_number_and_strikes_only_the_implausible(tmp_path):
    paths = [make_record(tmp_path, "base", k, seed=k) for k in range(2)]
    paths += [
        make_record(
            tmp_path,
            "noisy",
            k,
            offload_optimizer="cpu",
            tokens_per_s=600,
            seed=5 + k,
            extra={"ci_target_met": False},
        )
        for k in range(2)
    ]
    paths += [
        make_record(
            tmp_path,
            "capped",
            k,
            offload_optimizer="cpu",
            tokens_per_s=500,
            seed=9 + k,
            extra={"gpu_mem_cap_gib": 20.0},
        )
        for k in range(2)
    ]
    html, _, _ = build_report(tmp_path, paths, baseline="base")
    assert html.count('class="flagged"') == 1  # the capped one's speed, not the noisy one's
    assert (
        '<a href="#sanity" class="tag caution"' in html and ">caution: CI target missed</a>" in html
    )
    assert ">flagged: GPU memory over its cap</a>" in html
    lines = {line.split(":")[0]: line for line in verdict_lines(html)}
    assert "of baseline speed" in lines["ZeRO-3 noisy"] and "caution" in lines["ZeRO-3 noisy"]
    assert "flagged, not a finding: GPU memory over its cap" in lines["ZeRO-3 capped"]
    sanity_section = html[html.index('id="sanity"') : html.index('id="failures"')]
    assert "1 scenario(s) flagged implausible" in sanity_section
    assert "1 scenario(s) with a caution only" in sanity_section
    assert '>implausible</span><br><span class="small">blocks the finding' in sanity_section


def test_skipped_steps_show_when_the_records_count_them(tmp_path):
    paths = [make_record(tmp_path, "base", extra={"skipped_steps_measured": 1})]
    html, _, _ = build_report(tmp_path, paths)
    assert "skipped steps</th>" in html
    html, _, _ = build_report(tmp_path / "old", [make_record(tmp_path / "old", "base")])
    assert "skipped steps</th>" not in html


def test_flagged_bars_are_hatched(tmp_path):
    def view(name, flagged):
        return views.Row(
            scenario=name,
            label=name,
            relative_speed=0.5,
            n_ok=1,
            offload_kind="cpu",
            blocking=["non-finite-loss"] if flagged else [],
            sweep_text="",
        )

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    bars = ax.barh([0, 1], [1, 1])
    assert figures._hatch_flagged(ax, bars, [view("a", True), view("b", False)])
    assert [b.get_hatch() for b in bars] == ["///", None]
    assert "flagged: not a finding" in ax.get_legend_handles_labels()[1]
    plt.close(fig)


def test_the_runs_table_shows_what_moved_between_repeats():
    """Re-measured H200 study: one row per record in start order, with the breakdown that shows
    the GPU side moved (no offload gas 1: backward 442 ms in rep 0, ~290-305 ms after) while
    the offloaded optimizer step stayed at ~1.0-1.2 s, and which machine each run came from."""

    plan = json.loads((H200_REMEASURED / "plan.json").read_text())
    paths = [
        H200_REMEASURED / s["name"] / f"rep{k}" / "metrics.json"
        for s in plan["scenarios"]
        for k in range(plan["repeats"])
    ]
    runs, summary = C.collect(paths, baseline=plan["baseline"], n_boot=200)
    rows = views.run_rows(runs, views.scenario_views(summary, plan, plan["baseline"]))
    assert len(rows) == 21
    started = [r["started"] for r in rows if r["started"] != "—"]
    assert started == sorted(started) and rows[0]["scenario"] == "zero3__gas-1"
    by = {(r["scenario"], r["repeat"]): r for r in rows}
    backward = [by[("zero3__gas-1", k)]["breakdown"][1] for k in "012"]
    assert backward[0] > 1.4 * max(backward[1:])
    opt_step = [by[("offload-opt__gas-1", k)]["breakdown"][2] for k in "012"]
    assert max(opt_step) < 1.2 * min(opt_step)
    assert by[("zero3__gas-1", "1")]["settled"] is False
    assert by[("zero3__gas-1", "0")]["stop"] == "CI target out of reach"
    # repeat 2 of three scenarios (and the OOM) ran later, on another machine
    later = {s for s, k in by if k == "2" and by[(s, k)]["machine"] == "B"}
    assert later == {
        "offload-opt__gas-8",
        "offload-opt-param__gas-1",
        "offload-opt-param__gas-8",
        "zero3-40gb-oom",
    }
    assert {r["machine"] for r in rows} == {"A", "B"}


def test_the_report_has_the_runs_table(tmp_path):
    html, _, _ = build_report(tmp_path, seed_like_records(tmp_path))
    table = html[
        html.index('id="runs-table"') : html.index("</table>", html.index('id="runs-table"'))
    ]
    assert table.count("<tr>") - 1 == len(seed_like_records(tmp_path / "again"))
    assert "optimizer step (ms)" in table


# --------------------------------------------------------------------------- the reader's page
@pytest.mark.parametrize(
    "v,lo,hi,text",
    [
        (13941, 13203, 14474, "13,900 [13,200–14,500]"),  # ±635: hundreds
        (4083.9, 3950, 4210, "4,080 [3,950–4,210]"),  # ±130: tens (leading 1: one finer)
        (88.4, 77.8, 100.1, "88 [78–100]"),
        (2800, None, None, "2,800"),  # no CI: three significant digits
        (None, 1, 2, "—"),
    ],
)
def test_a_number_keeps_the_precision_its_ci_supports(v, lo, hi, text):
    assert views.fmt_ci(v, lo, hi) == text


def test_ratios_and_errors_never_print_noise_digits():
    from offload_study.core import verdict

    assert verdict.ratio_text(0.88, 0.778, 1.001) == "88% [78%–100%]"
    assert verdict.ratio_text(0.996, 0.991, 1.001) == "99.6% [99.1%–100.1%]"  # a tight CI
    assert [views.fmt_signed_pct(e) for e in (-0.004, 0.14, -0.04)] == ["0%", "+14%", "-4%"]
    assert views.fmt_sig(21.38) == "21.4" and views.fmt_sig(49044) == "49,000"


def test_the_planners_names_become_words():
    from offload_study.analysis.report import words

    assert words.sweep_words("rec-opt__mb-8__rbs-5e8", {}) == "micro-batch 8, reduce bucket 5e8"
    assert words.sweep_words("zero3__gas-8", {"gradient_accumulation_steps": 8}) == (
        "gradient accumulation steps 8"
    )
    assert (
        words.reader_label("candidate opt-r0.8", "x") == "partial CPU optimizer offload, ratio 0.8"
    )
    assert words.reader_label("", "rec-optparam__mb-4") == "CPU optimizer + parameter offload"
    assert words.reader_label("ZeRO-3, no offload", "zero3") == "ZeRO-3, no offload"
    assert words.outcomes("infeasible:1, missing:1") == (
        "1 predicted not to fit, not run, 1 left no record"
    )
    assert words.gpu_setup(2, 80, 140.4) == "2 GPUs × 80 GiB"
    assert words.gpu_setup(1, None, 140.4) == "1 GPU × 140.4 GiB (the whole card)"


def use_views(rows: list[dict]) -> list[views.Row]:
    base = {
        "n_ok": 2,
        "world_size": 1,
        "offload_optimizer": "none",
        "offload_param": "none",
        "micro_batch": 4,
        "gradient_accumulation_steps": 1,
        "nodes": 1,
    }
    return views.scenario_views(pd.DataFrame([{**base, **r} for r in rows]), {}, None, 140.4)


def test_use_this_picks_the_fastest_that_fits_each_memory_level_and_says_when_it_cannot():
    from offload_study.analysis.report import usethis

    vs = use_views(
        [
            {
                "scenario": "big",
                "label": "no offload",
                "tokens_per_s": 1000.0,
                "tokens_per_s_ci_low": 950.0,
                "tokens_per_s_ci_high": 1050.0,
            },
            {
                "scenario": "opt24",
                "label": "optimizer offload",
                "gpu_mem_gb": 24,
                "offload_optimizer": "cpu",
                "tokens_per_s": 700.0,
                "tokens_per_s_ci_low": 680.0,
                "tokens_per_s_ci_high": 720.0,
            },
            {
                "scenario": "par24",
                "label": "both offloaded",
                "gpu_mem_gb": 24,
                "offload_optimizer": "cpu",
                "offload_param": "cpu",
                "tokens_per_s": 690.0,
                "tokens_per_s_ci_low": 600.0,
                "tokens_per_s_ci_high": 700.0,
            },
            {
                "scenario": "flagged",
                "label": "flagged",
                "gpu_mem_gb": 16,
                "tokens_per_s": 5000.0,
                "flags": "gpu-over-cap",
            },
        ]
    )
    levels = usethis.picks(vs)
    assert [(p["level"], p["pick"]["label"]) for p in levels] == [
        ("24 GiB per GPU", "optimizer offload"),
        ("the whole card (140.4 GiB)", "no offload"),
    ]
    assert [r["label"] for r in levels[0]["rivals"]] == ["both offloaded"]  # CIs overlap
    assert levels[1]["rivals"] == []  # 950 and up: above every 24 GiB CI
    assert levels[0]["pick"]["tokens"] == "700 [680–720]"


def test_use_this_on_cpu_ranks_speaks_of_ranks_and_no_gpu_memory():
    """A CPU cluster's ranks stand in for GPUs and have no GPU memory: the block counts ranks,
    and a recommend candidate's GPU budget (never enforced on a CPU) makes no memory level."""
    from offload_study.analysis.report import html, usethis

    rows = [
        {"scenario": "two", "label": "ZeRO-3 on two ranks", "world_size": 2, "tokens_per_s": 900.0},
        {"scenario": "capped", "label": "FSDP2", "gpu_mem_gb": 1, "tokens_per_s": 2000.0},
        {"scenario": "plain", "label": "ZeRO-3", "tokens_per_s": 1000.0},
    ]
    vs = use_views([{**r, "accelerator": "cpu"} for r in rows])
    block = usethis.use_this(vs, "acme-cpu", "Mistral")
    assert [(p["gpus"], p["level"], p["pick"]["label"]) for p in block["levels"]] == [
        (1, None, "FSDP2"),
        (2, None, "ZeRO-3 on two ranks"),
    ]
    page = (
        html.environment()
        .get_template("_use_this.html.j2")
        .render(use_this=block, surprises=[], downloads={})
    )
    text = " ".join(re.sub(r"<[^>]+>", " ", page).split())
    assert "on 1 rank, FSDP2 (2,000 tokens/s)" in text, text
    assert "on 2 ranks, ZeRO-3 on two ranks" in text, text
    assert "GPU" not in text and "card" not in text, text


def test_a_result_a_reader_would_not_expect_gets_its_measured_breakdown():
    from offload_study.analysis.report import usethis

    step = {"breakdown_ms.forward": 100.0, "breakdown_ms.backward": 200.0}
    vs = use_views(
        [
            {
                "scenario": "opt",
                "label": "optimizer offload",
                "offload_optimizer": "cpu",
                "tokens_per_s": 400.0,
                "tokens_per_s_ci_low": 380.0,
                "tokens_per_s_ci_high": 420.0,
                **step,
                "breakdown_ms.step": 1700.0,
            },
            {
                "scenario": "both",
                "label": "optimizer + parameter offload",
                "offload_optimizer": "cpu",
                "offload_param": "cpu",
                "tokens_per_s": 700.0,
                "tokens_per_s_ci_low": 650.0,
                "tokens_per_s_ci_high": 720.0,
                **step,
                "breakdown_ms.step": 650.0,
            },
        ]
    )
    (said,) = usethis.surprises(vs)
    assert said.startswith("optimizer + parameter offload is faster than optimizer offload though")
    assert "the optimizer step differs most: 0.65 s against 1.7 s" in said
    vs[1]["tokens_per_s_ci_low"] = 400.0  # its CI reaches the other's: no surprise stated
    assert usethis.surprises(vs) == []


def test_parts_that_overlap_in_time_are_said_to(tmp_path):
    from offload_study.analysis.report import predicted
    from offload_study.core.contracts import PREDICTION_COLUMNS, Prediction

    empty = dict.fromkeys(PREDICTION_COLUMNS)
    row = Prediction(
        **{
            **empty,
            "scenario": "off",
            "step_time_s": 30.2,
            "compute_s": 21.3,
            "pcie_s": 3.66,
            "optimizer_s": 5.31,
            "nvme_s": 0.0,
        }
    )
    ref = Prediction(**{**empty, "scenario": "base", "step_time_s": 21.4, "compute_s": 21.3})
    planned = {"off": {"offload_optimizer": "cpu", "offload_param": "none"}}
    text = predicted.overhead_text(
        row, ref, planned, {"off": 26.66, "base": 21.52}, {"base": "no offload"}
    )
    assert text == (
        "PCIe 3.7 s and CPU Adam 5.3 s, which overlap: together more than the 5.1 s "
        "measured overhead over no offload"
    )


def test_provenance_is_what_differs_and_one_line_of_what_is_shared(tmp_path):
    from builders import set_provenance

    from offload_study.analysis.report import origin

    paths = [make_record(tmp_path, "base", k, seed=k) for k in range(2)]
    set_provenance(paths[1], git_commit="cafe" * 10, git_dirty=True)
    runs, _ = C.collect(paths, n_boot=50)
    prov = origin.provenance(runs, {"base": "no offload"})
    shared = dict(prov["shared"])
    assert shared["host"] == "node001" and shared["engine version"] == "deepspeed 0.16.4"
    assert shared["GPU memory"] == "140.4 GiB"
    assert prov["columns"] == ["commit"]  # started and config agree in these records
    assert [r["facts"] for r in prov["rows"]] == [
        ["deadbeef"],
        ["cafecafecafe with uncommitted changes"],
    ]
    assert origin.dirty(runs).startswith("1 of 2 runs ran from a working tree with uncommitted")
    assert origin.usable_gib(runs) == 140.4


def test_a_card_is_named_in_the_catalogs_words_and_its_memory_in_gib(tmp_path):
    """The device's own name carries the vendor's memory label ("80GB"): a page names the card
    as the GPU catalog does and states its memory in GiB; a card the catalog does not know keeps
    its own name."""
    from builders import set_provenance

    from offload_study.analysis.report import origin

    name = "NVIDIA H100 80GB HBM3"
    card = {"index": 0, "name": name, "memory_total_bytes": 85_520_809_984}
    path = set_provenance(make_record(tmp_path, "base", 0), gpu_model=name, gpus=[card])
    runs, _ = C.collect([path], n_boot=50)
    assert origin.hardware(runs).startswith("8 × H100 SXM (79.6 GiB each), ")
    set_provenance(path, gpu_model="Acme Tensor 9")
    runs, _ = C.collect([path], n_boot=50)
    assert origin.hardware(runs).startswith("8 × Acme Tensor 9 (79.6 GiB each), ")


def test_a_moved_plans_configs_are_found_beside_it(tmp_path):
    from offload_study.analysis.report.render import found_beside

    records = tmp_path / "docs" / "results" / "c" / "s"
    (records / "configs").mkdir(parents=True)
    (records / "configs" / "x.json").write_text("{}")
    plan = {"cluster": "c", "study": "s"}
    assert found_beside("results/c/s/configs/x.json", records, plan) == records / "configs/x.json"
    assert found_beside("elsewhere/x.json", records, plan) == records / "configs/x.json"
    assert found_beside("results/c/s/configs/y.json", records, plan) == Path(
        "results/c/s/configs/y.json"
    )


def test_a_widely_measured_baseline_is_called_out_with_its_bound():
    def view(name, median, low, high):
        return views.Row(
            scenario=name, tokens_per_s=median, tokens_per_s_ci_low=low, tokens_per_s_ci_high=high
        )

    wide = [view("base", 10_500.0, 8_800.0, 13_000.0), view("other", 4_000.0, 3_900.0, 4_100.0)]
    text = views.baseline_spread(wide, "base", "dispatch 0.48 s of 0.525 s")
    assert "reaches 24% from its median" in text
    assert "host's dispatch of kernels (dispatch 0.48 s of 0.525 s)" in text
    compute_bound = views.baseline_spread(wide, "base", "compute 0.50 s of 0.52 s")
    assert "reaches 24%" in compute_bound and "dispatch" not in compute_bound
    assert views.baseline_spread(wide, "other", None) is None  # ±2.5 %: tight enough
    assert views.baseline_spread([view("base", 1.0, None, None)], "base", None) is None
