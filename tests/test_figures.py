"""The report's figures (offload_study.analysis.report.figures) from records written by
builders.make_record, as tests/test_report.py builds them: every PNG wide enough, no label cut,
the step breakdown per 1,000 tokens, the memory tradeoff and the per-run step series."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pandas as pd
import pytest
from builders import build_report, make_record, seed_like_records
from PIL import Image

from offload_study.analysis.report import figures, views

MIN_WIDTH_PX = 1200


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, the first after the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def labels_of(path: Path) -> tuple[list[str], list[str]]:
    """(every label drawn, the labels overflowing the figure) from the PNG's text chunks."""
    text = Image.open(path).text
    cut = text.get(figures.CUT_KEY, "")
    return text.get("Description", "").splitlines(), cut.splitlines() if cut else []


LONG = "ZeRO-3 + optimizer and parameter offload to CPU, pinned, overlap_comm on (2 GPU)"


@pytest.fixture(scope="module")
def report_figures(tmp_path_factory) -> Path:
    """The figures of a seed-like study plus a scenario with a label longer than any line."""
    root = tmp_path_factory.mktemp("figures")
    paths = seed_like_records(root)
    paths.append(
        make_record(
            root,
            "long-label",
            tokens_per_s=900,
            offload_optimizer="cpu",
            offload_param="cpu",
            peak_gpu_gib=9,
            host_rss_gib=300,
        )
    )
    _, figs, _ = build_report(root, paths, labels={"long-label": LONG})
    return figs


def test_every_figure_is_at_least_1200_px_wide(report_figures):
    for name in figures.FIGURES.values():
        width, _ = png_size(report_figures / name)
        assert width >= MIN_WIDTH_PX, (name, width)


def test_no_label_is_cut_or_ellipsized(report_figures):
    for name in figures.FIGURES.values():
        drawn, cut = labels_of(report_figures / name)
        assert drawn, name
        assert cut == [], (name, cut)
        assert not [t for t in drawn if t.rstrip().endswith(("…", "..."))], name
    # the long label is drawn whole, on several lines
    drawn, _ = labels_of(report_figures / figures.FIGURES["relative_speed"])
    assert " ".join(" ".join(drawn).split()).count(LONG) == 1


def test_the_new_figures_have_data(report_figures):
    drawn, _ = labels_of(report_figures / figures.FIGURES["memory_tradeoff"])
    assert "peak host memory per node (GiB)" in drawn
    assert "peak GPU memory allocated per GPU (GiB)" in drawn
    assert "% of baseline speed" in drawn and "100%" in drawn  # size and colour: the speed
    drawn, _ = labels_of(report_figures / figures.FIGURES["step_series"])
    assert "step time (s)" in drawn
    assert any(t.startswith("ZeRO-3 + Offload (4 GPU) · rep 1") for t in drawn)


def test_a_figure_without_data_is_still_wide_enough(tmp_path):
    path = tmp_path / "none.png"
    assert figures.plot_step_series(pd.DataFrame(), [], path) is False
    assert png_size(path)[0] >= MIN_WIDTH_PX


def breakdown_view(gas: int, step_time_s: float) -> views.Row:
    """A scenario at micro-batch 4 x gas on 2 ranks, seq 1024, its timers 60 % of the step."""
    ms = 1000 * step_time_s
    return views.Row(
        {
            "global_batch": 4 * gas * 2,
            "seq_len": 1024,
            "step_time_s": step_time_s,
            "breakdown_ms.forward": 0.2 * ms,
            "breakdown_ms.backward": 0.4 * ms,
        }
    )


def test_the_breakdown_is_per_1k_tokens_so_gas_compares():
    """Four times the accumulation takes four times as long per step and trains four times the
    tokens: the same time per 1,000 tokens, part by part."""
    gas4, gas16 = breakdown_view(4, 2.0), breakdown_view(16, 8.0)
    per_step4, per_step16 = figures.breakdown_parts(gas4), figures.breakdown_parts(gas16)
    assert per_step16["forward"] == pytest.approx(4 * per_step4["forward"])
    a, b = figures.breakdown_per_1k_tokens(gas4), figures.breakdown_per_1k_tokens(gas16)
    assert a == pytest.approx(b)
    tokens = 4 * 4 * 2 * 1024
    assert a["forward"] == pytest.approx(0.2 * 2000 * 1000 / tokens)
    assert sum(a.values()) == pytest.approx(2000 * 1000 / tokens)  # the whole step, per 1k


def test_the_breakdown_falls_back_to_tokens_per_s_times_step_time():
    v = views.Row({"tokens_per_s": 4096.0, "step_time_s": 2.0, "breakdown_ms.forward": 500.0})
    assert figures.tokens_per_step(v) == 8192.0
    assert figures.breakdown_per_1k_tokens(v)["forward"] == pytest.approx(500 / 8.192)
    assert figures.breakdown_per_1k_tokens(views.Row({"breakdown_ms.forward": 5.0})) is None


def test_the_report_embeds_every_figure_with_data_and_no_empty_one(report_figures):
    """Each figure file is written (Snakemake's outputs); the page shows those with data: here
    all but speed vs accumulation, which never varies in this study."""
    html = (report_figures.parent / "report.html").read_text()
    shown = set(re.findall(r'<figure id="fig-(\w+)"><img src="data:image/png;base64,', html))
    assert shown == set(figures.FIGURES) - {"speed_vs_gas"}
    assert "no data" not in html


def test_the_seed_figure_is_on_the_seeds_basis_and_the_speed_figure_draws_no_seed(
    report_figures,
):
    import json

    marks = json.loads(Image.open(report_figures / "seed_share.png").text[figures.SEED_KEY])
    assert [(m["scenario"], m["seed_pct"]) for m in marks] == [
        ("zero3-offload-4gpu", 35.0),
        ("zero3-offload-2gpu", 20.0),
    ]
    assert marks[0]["share_pct"] == pytest.approx(35.0, abs=1)  # 2,800 of 8,000 tokens/s
    drawn, _ = labels_of(report_figures / "relative_speed.png")
    assert "seed (published)" not in drawn


def test_the_step_series_draws_the_loss_scale_only_where_it_moves(tmp_path):
    """fp16: the loss scale halves at a skipped step (its own axis, log2); bf16 keeps 1 and
    draws no second axis."""
    from offload_study.core import contracts

    fp16 = make_record(tmp_path, "fp16", label="fp16 run").parent
    bf16 = make_record(tmp_path, "bf16", label="bf16 run").parent
    contracts.write_steps(
        fp16 / contracts.STEPS_FILE,
        [
            contracts.StepRow(1, "warmup", 2.0, 1000.0, 8.0, 10.0, 0, 65536.0),
            contracts.StepRow(2, "measured", 1.9, 1050.0, 8.4, 9.9, 1, 32768.0),
            contracts.StepRow(3, "measured", 1.0, 2000.0, 16.0, 9.8, 0, 32768.0),
        ],
    )
    contracts.write_steps(
        bf16 / contracts.STEPS_FILE,
        [contracts.StepRow(k, "measured", 1.0, 2000.0, 16.0, 9.8, 0, 1.0) for k in (1, 2, 3)],
    )
    runs = pd.DataFrame(
        {"scenario": ["fp16", "bf16"], "repeat": [0, 0], "record_dir": [str(fp16), str(bf16)]}
    )
    scenarios = [
        views.Row(scenario=n, label=f"{n} run", plot_label=f"{n} run") for n in ("fp16", "bf16")
    ]
    path = tmp_path / "series.png"
    assert figures.plot_step_series(runs, scenarios, path) is True
    drawn, cut = labels_of(path)
    assert cut == [] and "fp16 run · rep 0" in drawn and "bf16 run · rep 0" in drawn
    powers = [t for t in drawn if "2^{" in t]  # the loss-scale axis' ticks: one panel only
    assert {"$\\mathdefault{2^{15}}$", "$\\mathdefault{2^{16}}$"} <= set(powers)
    exponents = [int(re.search(r"2\^\{(-?\d+)\}", t).group(1)) for t in powers]
    assert min(exponents) >= 14, powers  # no bf16 axis around 2^0
