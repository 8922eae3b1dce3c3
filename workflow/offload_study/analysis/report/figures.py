"""The report's figures: one function per plot, scenario views (report.views) in, a PNG out.

Every plot function returns whether it had data; without data it still writes a "no data" PNG
so that the figure files Snakemake expects always exist. Bar plots have one row per scenario up
to MAX_BARS scenarios; a larger study (a sweep of hundreds of points) gets one row per base
scenario, its fastest sweep point, with the other points drawn as dots on that row: hundreds of
bars are unreadable, and drawing them was most of the report's time.
"""

from __future__ import annotations

import base64
import json
import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from offload_study.analysis.report.views import Row, isnum  # noqa: E402
from offload_study.core import contracts, verdict  # noqa: E402

FIGURES = {
    "relative_speed": "relative_speed.png",
    "speed_vs_gpu_memory": "speed_vs_gpu_memory.png",
    "memory_tradeoff": "memory_tradeoff.png",
    "step_breakdown": "step_breakdown.png",
    "speed_vs_gas": "speed_vs_gas.png",
    "step_series": "step_series.png",
    "seed_share": "seed_share.png",
}
BREAKDOWN_PARTS = [  # (label, summary columns summed)
    ("forward", ["breakdown_ms.forward"]),
    ("backward", ["breakdown_ms.backward"]),
    ("optimizer step", ["breakdown_ms.step"]),
    ("swap in/out", ["breakdown_ms.optimizer_swap_in", "breakdown_ms.optimizer_swap_out"]),
]
PALETTE = {"none": "#4c72b0", "cpu": "#dd8452", "nvme": "#8172b3", "failed": "#c44e52"}
MAX_BARS = 30  # rows of a bar plot before it shows one row per base scenario
MAX_LABELS = 16  # labelled points of the speed/memory plot before only the front is labelled
MAX_SERIES = 24  # runs drawn as small multiples of their step times (the first ones)
# Every figure is FIG_WIDTH_IN x DPI = 1280 px wide (>= 1200: legible when the page scales it)
FIG_WIDTH_IN = 8.0
DPI = 160
LABEL_WIDTH = 30  # characters per line of a wrapped label (labels wrap, never cut)
CUT_KEY = "Labels cut"  # PNG text key: labels over the figure's edge or over each other (none)
#: PNG text key of the seed figure: each row's published and measured share as drawn (JSON), so
#: a test can hold the figure to the seed table it stands beside.
SEED_KEY = "Seed marks"


# --------------------------------------------------------------------------- shared
def _no_data(path: Path, title: str, why: str) -> None:
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 3.2))
    ax.axis("off")
    ax.text(0.5, 0.62, title, ha="center", va="center", fontsize=13, weight="bold")
    ax.text(0.5, 0.4, f"no data: {why}", ha="center", va="center", fontsize=11, color="#555")
    _save(fig, path)


def _save(fig, path: Path, extra: dict[str, str] | None = None) -> None:
    """The PNG, with every label drawn in it as its Description (PNG text): the page's alt text
    can say what the figure shows, and a test can read that no label was cut."""
    fig.draw_without_rendering()  # tick labels set by locators exist only once drawn
    texts = figure_texts(fig)
    meta = {"Description": "\n".join(t.get_text() for t in texts), **(extra or {})}
    cut = [t.get_text() for t in texts if not _inside(t, fig)]
    cut += [f"{a.get_text()} / {b.get_text()}" for a, b in _overlapping(texts)]
    if cut:  # a layout bug, not a reason to lose the figure: the test reads this
        meta[CUT_KEY] = "\n".join(cut)
    fig.savefig(path, dpi=DPI, metadata=meta)
    plt.close(fig)


def _drawn_ticks(axis) -> list:
    """Tick labels inside the view (a locator also makes ticks beyond it, never drawn)."""
    if not axis.get_visible():  # a twin's shared axis
        return []
    lo, hi = sorted(axis.get_view_interval())
    ticks = zip(axis.get_majorticklocs(), axis.get_majorticklabels(), strict=False)
    return [t for x, t in ticks if lo <= x <= hi and t.get_visible()]


def _overlapping(texts: list) -> list[tuple]:
    """Pairs of labels drawn over each other (one hides part of the other)."""
    boxes = [(t, Text.get_window_extent(t)) for t in texts]  # an annotation: its text only
    return [
        (a, b)
        for i, (a, box) in enumerate(boxes)
        for b, other in boxes[i + 1 :]
        if box.overlaps(other) and box.width and other.width
    ]


def _inside(text, fig, slack_px: float = 2.0) -> bool:
    box, frame = text.get_window_extent(), fig.bbox
    return (
        box.x0 >= frame.x0 - slack_px
        and box.x1 <= frame.x1 + slack_px
        and box.y0 >= frame.y0 - slack_px
        and box.y1 <= frame.y1 + slack_px
    )


def figure_texts(fig) -> list:
    """Every title, axis label, tick label, legend entry and annotation with text."""
    texts = [*fig.texts, *(t for leg in fig.legends for t in leg.get_texts())]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        texts += [*_drawn_ticks(ax.xaxis), *_drawn_ticks(ax.yaxis)] if ax.axison else []
        legend = ax.get_legend()
        texts += [*legend.get_texts(), legend.get_title()] if legend else []
    return [t for t in texts if t is not None and t.get_visible() and t.get_text()]


def _wrap(label: str, width: int = LABEL_WIDTH) -> str:
    """The whole label on as many lines as it needs: a cut label ("paramete…") can name two
    scenarios alike; tight_layout makes room for the lines. A '$' is drawn as itself: labels
    are data (a bundle's), never matplotlib's math text (an unmatched '$\\frac' loses the figure)."""
    text = textwrap.fill(str(label), width, break_on_hyphens=False) or str(label)
    return text.replace("$", r"\$")


def _tick_label(v: Row) -> str:
    """Label, and the sweep point below it (where sweeps differ, so it must show)."""
    label = _wrap(v["label"])
    return f"{label}\n{_wrap(v['sweep_text'])}" if v["sweep_text"] else label


def _bars_height(labels: list[str], extra: float) -> float:
    """Inches for a bar plot with these tick labels: each row as tall as its wrapped label's
    lines, plus ``extra`` for the title, axis label and legend."""
    return sum(max(0.55, 0.19 * (t.count("\n") + 1) + 0.12) for t in labels) + extra


def _speed(v: Row) -> float:
    """Sort key: relative speed, else tokens/s (comparable within one study); -1 if failed."""
    for key in ("relative_speed", "tokens_per_s"):
        if v[key] is not None:
            return v[key]
    return -1.0


def bar_rows(views: list[Row]) -> tuple[list[tuple[Row, list[Row]]], str | None]:
    """(row scenario, the scenarios it stands for) per bar, and a note when condensed."""
    if len(views) <= MAX_BARS:
        return [(v, [v]) for v in views], None
    groups: dict[str, list[Row]] = {}
    for v in views:
        groups.setdefault(v["base_scenario"] or v["scenario"], []).append(v)
    rows = [(max(g, key=_speed), g) for g in groups.values()]
    note = f"fastest sweep point of each configuration; {len(views)} scenarios"
    if len(rows) > MAX_BARS:
        rows = sorted(rows, key=lambda r: _speed(r[0]), reverse=True)[:MAX_BARS]
        note = f"the {MAX_BARS} fastest of {len(groups)} configurations; {len(views)} scenarios"
    return rows, note


# --------------------------------------------------------------------------- relative speed
def plot_relative_speed(views: list[Row], baseline: str | None, path: Path) -> bool:
    """Bars of % of baseline speed (tokens/s without a baseline), CI whiskers. The seed's
    published figures are on another basis (a share of its own 100 % row): their own figure,
    :func:`plot_seed_share`."""
    use_rel = any(v["relative_speed"] is not None for v in views)
    key, scale = ("relative_speed", 100.0) if use_rel else ("tokens_per_s", 1.0)
    rows, note = bar_rows(views)
    if not any(v[key] is not None for v, _ in rows):
        _no_data(path, "Training speed", "no successful run")
        return False
    fig, ax = plt.subplots(
        figsize=(FIG_WIDTH_IN, _bars_height([_tick_label(v) for v, _ in rows], 1.4))
    )
    y = np.arange(len(rows))
    vals = np.array([scale * (v[key] or 0.0) for v, _ in rows])
    colors = [PALETTE["failed"] if v["n_ok"] == 0 else PALETTE[v["offload_kind"]] for v, _ in rows]
    flagged = _hatch_flagged(ax, ax.barh(y, vals, color=colors, height=0.6), [v for v, _ in rows])
    ends = _whiskers(ax, [v for v, _ in rows], y, scale) if use_rel else vals
    if note:
        _sweep_dots(ax, rows, key, scale)
    for i, (v, _) in enumerate(rows):
        if v["n_ok"] == 0:
            ax.text(1, i, f" failed: {v['outcomes']}", va="center", color=PALETTE["failed"])
        elif vals[i]:
            txt = f" {vals[i]:.0f}%" if use_rel else f" {vals[i]:,.0f}"
            ax.text(max(ends[i], vals[i]), i, txt, va="center", ha="left", fontsize=9)
    if note or flagged:
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(y, [_tick_label(v) for v, _ in rows], fontsize=9)
    ax.invert_yaxis()
    base = next((v["plot_label"] for v in views if v["scenario"] == baseline), baseline)
    if use_rel:
        xlabel = f"training speed, % of baseline\n(baseline: {_wrap(base or '?', 60)})"
    else:
        xlabel = "tokens/s (no baseline measured)"
    ax.set_xlabel(xlabel, fontsize=10)
    top = max([*ends, *vals])
    ax.set_xlim(0, top * 1.25)
    ax.set_title("Training speed per scenario" + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return True


def _hatch_flagged(ax, bars, views: list[Row]) -> bool:
    """Hatch the bars of scenarios with a blocking sanity flag (implausible: not a finding); a
    caution leaves the bar as it is (the number stands, its CI is the whisker)."""
    flagged = [bool(v["blocking"]) for v in views]
    for bar, is_flagged in zip(bars, flagged, strict=True):
        if is_flagged:
            bar.set(hatch="///", edgecolor="#c62828", alpha=0.6)
    if any(flagged):
        swatch = {"color": "white", "hatch": "///", "edgecolor": "#c62828"}
        ax.barh([0], [0], label="flagged: not a finding", **swatch)  # zero width: legend only
    return any(flagged)


def _sweep_dots(ax, rows: list[tuple[Row, list[Row]]], key: str, scale: float) -> None:
    """The other sweep points of each condensed row, as small dots on it."""
    dots = [
        (scale * g[key], i) for i, (_, grp) in enumerate(rows) for g in grp if g[key] is not None
    ]
    xs, ys = zip(*dots, strict=True)
    ax.scatter(xs, ys, s=9, color="black", alpha=0.35, zorder=4, lw=0, label="other sweep points")


# --------------------------------------------------------------------------- seed share
def _finite_end(end, instead: float) -> float:
    """A CI's upper end to draw: ``instead`` where it is missing or unbounded (a prediction's
    band of 100 % or more; the table says "no upper bound")."""
    finite = verdict.finite_or_none(end)
    return instead if finite is None else finite


def plot_seed_share(seed: dict | None, path: Path) -> bool:
    """The seed table as a figure, on the seed's own basis (a share of its 100 % row's total
    throughput): this cluster's share with its CI (hatched where predicted), the published
    figure as a white diamond, the tolerance band shaded. Its PNG text (SEED_KEY) lists what
    was drawn, row by row."""
    rows = [r for r in (seed or {}).get("rows", []) if r["scenario"] != seed.get("basis")]
    if not rows:
        _no_data(path, "Seed vs this cluster", "no published row other than the 100 % one")
        return False
    labels = [_wrap(r["label"]) for r in rows]
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, _bars_height(labels, 1.6)))
    marks = []
    for i, r in enumerate(rows):
        lo, hi = r["band"]
        ax.fill_betweenx([i - 0.4, i + 0.4], 100 * lo, 100 * hi, color="#d9e7d9", zorder=1)
        share = r["share"]
        if share is not None:
            bar = ax.barh(i, 100 * share, height=0.5, color=PALETTE["cpu"], zorder=2)
            if r["how"] == "predicted":
                bar[0].set(hatch="///", alpha=0.5)
            high = _finite_end(r["ci"][1], share)
            ci = [100 * share - 100 * r["ci"][0], 100 * high - 100 * share]
            ax.errorbar(
                100 * share,
                i,
                xerr=[[max(ci[0], 0)], [max(ci[1], 0)]],
                fmt="none",
                color="black",
                capsize=3,
                lw=1,
                zorder=3,
            )
        ax.plot(float(r["seed_pct"]), i, marker="D", color="black", ms=7, mfc="white", zorder=5)
        marks.append(
            {
                "scenario": r["scenario"],
                "seed_pct": float(r["seed_pct"]),
                "share_pct": None if share is None else round(100 * share, 3),
            }
        )
    ax.plot([], [], marker="D", color="black", mfc="white", ls="", label="seed (published)")
    ax.fill_between([], [], color="#d9e7d9", label="tolerance band")
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.invert_yaxis()
    basis = _wrap(seed.get("basis_label") or "the seed's 100 % row", 60)
    ax.set_xlabel(f"share of the total throughput of {basis} (%)", fontsize=10)
    ax.set_xlim(
        0,
        100
        * max(
            [r["seed_pct"] / 100 for r in rows]
            + [_finite_end(r["ci"][1], 0) for r in rows]
            + [r["band"][1] for r in rows]
        )
        * 1.2,
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Seed vs this cluster, on the seed's basis (hatched: predicted)", fontsize=10)
    fig.tight_layout()
    _save(fig, path, {SEED_KEY: json.dumps(marks)})
    return True


def _whiskers(ax, views: list[Row], y: np.ndarray, scale: float) -> np.ndarray:
    """95% CI whiskers of the relative speed (one errorbar call); returns each row's right end."""
    mid, lo, hi = (_column(views, f"relative_speed{s}") for s in ("", "_ci_low", "_ci_high"))
    has = np.isfinite(mid) & np.isfinite(lo) & np.isfinite(hi)
    if has.any():
        xerr = np.clip([scale * (mid - lo)[has], scale * (hi - mid)[has]], 0, None)
        ax.errorbar(scale * mid[has], y[has], xerr=xerr, fmt="none", color="black", capsize=3, lw=1)
    return np.nan_to_num(scale * np.where(has, hi, mid), nan=0.0)


def _column(views: list[Row], key: str) -> np.ndarray:
    return np.array([np.nan if v[key] is None else float(v[key]) for v in views])


# --------------------------------------------------------------------------- speed vs memory
def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated when minimising x (memory) and maximising y (speed)."""
    idx = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 <= x and y2 >= y) and (x2 < x or y2 > y)
            for j, (x2, y2) in enumerate(points)
            if j != i
        )
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: points[i][0])


def plot_speed_vs_memory(views: list[Row], path: Path) -> bool:
    """Speed against peak GPU memory per GPU (host memory per node when no GPU memory was
    measured), the Pareto front ringed and joined; labels placed so that none overlap."""
    use_rel = any(v["relative_speed"] is not None for v in views)
    ykey, scale = ("relative_speed", 100.0) if use_rel else ("tokens_per_s", 1.0)
    xkey, xlabel = "peak_gpu_allocated_gib", "peak GPU memory allocated per GPU (GiB)"
    if not any(v[xkey] is not None and v[ykey] is not None for v in views):
        xkey, xlabel = (
            "host_memory_gib",
            "peak host memory per node (GiB) — no GPU memory measured",
        )
    pts = [v for v in views if v[xkey] is not None and v[ykey] is not None]
    if not pts:
        _no_data(path, "Speed vs memory", "no successful run with memory measured")
        return False
    xs, ys = [v[xkey] for v in pts], [scale * v[ykey] for v in pts]
    front = pareto_front(list(zip(xs, ys, strict=True)))
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 5.2))
    if len(front) > 1:
        ax.step(
            [xs[i] for i in front],
            [ys[i] for i in front],
            where="post",
            color="#999",
            ls="--",
            lw=1.2,
            label="Pareto front",
        )
    on_front = np.isin(np.arange(len(pts)), front)
    ax.scatter(
        xs,
        ys,
        s=np.where(on_front, 110, 60),
        c=[PALETTE[v["offload_kind"]] for v in pts],
        edgecolors=np.where(on_front, "black", "none"),
        zorder=3,
    )
    for kind in dict.fromkeys(v["offload_kind"] for v in pts):
        ax.scatter([], [], color=PALETTE[kind], label=f"offload: {kind}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training speed (% of baseline)" if use_rel else "tokens/s")
    ax.set_xlim(0, max(xs) * 1.35)
    ax.set_ylim(0, max(ys) * 1.18)
    labelled = range(len(pts)) if len(pts) <= MAX_LABELS else front
    ax.set_title(
        "Speed vs memory (up-left is better; ringed = Pareto-optimal)"
        + ("" if len(pts) <= MAX_LABELS else "\nlabels: Pareto-optimal scenarios only"),
        fontsize=11,
    )
    fig.tight_layout()
    points = list(zip(xs, ys, strict=True))
    texts = [_tick_label(pts[i]) for i in labelled]
    note_left_out(ax, place_labels(ax, [points[i] for i in labelled], texts, points))
    _save(fig, path)
    return True


def place_labels(ax, points, texts, obstacles, fontsize: float = 8) -> int:
    """Annotate points so that no label overlaps another label or any marker (``obstacles``);
    returns how many labels found no free place and were left out (never drawn over another:
    the report's tables name every scenario).

    Each label tries, in order, right of its point then left of it, at its own height, then one
    line lower, one higher, ... up to three lines away; a label that had to move gets a thin leader line.
    Call once the layout is final (after tight_layout): boxes are measured in display pixels.
    """
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    taken = [_marker_box(ax, p) for p in obstacles]
    # at most 3 lines away: a longer leader line reads worse than a label left out
    shifts = [0, *(s * k for k in range(1, 4) for s in (-1, 1))]
    left_out = 0
    for i in sorted(range(len(points)), key=lambda i: -points[i][1]):
        sides = [
            (dx, _label_box(ax, points[i], texts[i], dx, fontsize, renderer)) for dx in (7, -7)
        ]
        spots = [(dx, k, box.translated(0, k * box.height)) for k in shifts for dx, box in sides]
        free = next((s for s in spots if _is_free(s[2], frame, taken)), None)
        if free is None:
            left_out += 1
            continue
        dx, k, box = free
        taken.append(box)
        leader = {"arrowstyle": "-", "lw": 0.5, "color": "#888"} if k else None
        dy = k * box.height * 72 / ax.figure.dpi  # pixels -> points
        ax.annotate(texts[i], points[i], **_label_style(dx, dy, fontsize), arrowprops=leader)
    return left_out


def note_left_out(ax, left_out: int) -> None:
    """Say on the figure how many labels had no room (their points are still drawn)."""
    if left_out:
        ax.text(
            0.99,
            0.01,
            f"{left_out} label(s) left out: no room beside their points",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=7,
            color="#666",
        )


def _label_style(dx: float, dy: float, fontsize: float) -> dict:
    """A label dx, dy points from its point, on a faint white ground (legible over grid lines)."""
    ground = {"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8}
    return {
        "xytext": (dx, dy),
        "textcoords": "offset points",
        "fontsize": fontsize,
        "va": "center",
        "ha": "left" if dx > 0 else "right",
        "bbox": ground,
    }


def _label_box(ax, point, text, dx, fontsize, renderer) -> Bbox:
    probe = ax.annotate(text, point, **_label_style(dx, 0, fontsize))
    box = probe.get_window_extent(renderer)
    probe.remove()
    return box


def _is_free(box: Bbox, frame: Bbox, taken: list[Bbox]) -> bool:
    box = box.padded(3)  # pixels of air, so that two labels never touch
    inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
    return inside and not any(box.overlaps(t) for t in taken)


def _marker_box(ax, point, radius_px: float = 6) -> Bbox:
    x, y = ax.transData.transform(point)
    return Bbox.from_extents(x - radius_px, y - radius_px, x + radius_px, y + radius_px)


# --------------------------------------------------------------------------- step breakdown
def breakdown_parts(v: Row) -> dict[str, float] | None:
    """Median ms per optimizer step by DeepSpeed timer, plus what no timer accounts for; None
    when the scenario has neither a step time nor any timer."""
    total = 1000 * v["step_time_s"] if v["step_time_s"] is not None else math.nan
    parts = {}
    for name, cols in BREAKDOWN_PARTS:
        vals = [v[c] for c in cols if v[c] is not None]
        if name == "backward" and not vals:  # older DeepSpeed: only the inner timers
            vals = [
                v[c]
                for c in ("breakdown_ms.backward_inner", "breakdown_ms.backward_allreduce")
                if v[c] is not None
            ]
        parts[name] = float(sum(vals))
    known = sum(parts.values())
    if math.isnan(total) and known == 0:
        return None
    parts["other / unattributed"] = 0.0 if math.isnan(total) else max(total - known, 0.0)
    return parts


def tokens_per_step(v: Row) -> float | None:
    """Tokens one optimizer step trains (global batch x sequence length; else tokens/s x step
    time); None when neither is known."""
    if isnum(v["global_batch"]) and isnum(v["seq_len"]):
        return float(v["global_batch"]) * float(v["seq_len"])
    if isnum(v["tokens_per_s"]) and isnum(v["step_time_s"]):
        return float(v["tokens_per_s"]) * float(v["step_time_s"])
    return None


def breakdown_per_1k_tokens(v: Row) -> dict[str, float] | None:
    """breakdown_parts in ms per 1,000 tokens trained: a step at gas 16 trains 4x the tokens
    of one at gas 4, so only per-token times compare across gradient accumulation."""
    parts, tokens = breakdown_parts(v), tokens_per_step(v)
    if parts is None or not tokens:
        return None
    return {name: ms * 1000.0 / tokens for name, ms in parts.items()}


def plot_breakdown(views: list[Row], path: Path) -> bool:
    rows, note = bar_rows(views)
    bars = [(_tick_label(v), p) for v, _ in rows if (p := breakdown_per_1k_tokens(v)) is not None]
    if not bars:
        _no_data(path, "Step-time breakdown", "no step time or DeepSpeed timers recorded")
        return False
    labels = [label for label, _ in bars]
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, _bars_height(labels, 2.0)))
    colors = [*sns.color_palette("Set2", len(BREAKDOWN_PARTS)), (0.8, 0.8, 0.8)]
    left = np.zeros(len(bars))
    for k, name in enumerate([n for n, _ in BREAKDOWN_PARTS] + ["other / unattributed"]):
        vals = np.array([p[name] for _, p in bars])
        ax.barh(range(len(bars)), vals, left=left, color=colors[k], label=name, height=0.6)
        left += vals
    ax.set_yticks(range(len(bars)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(
        "median ms per 1,000 tokens trained\n(step time ÷ tokens per step; rank 0's timers)"
    )
    ax.xaxis.set_major_locator(MaxNLocator(5))
    # whole numbers once the scale is large ("1,500", never "1.5e+03": wide labels collide)
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda x, _: f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}")
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(
        "Where the time goes, per 1,000 tokens (compares across gradient accumulation)"
        + (f"\n{note}" if note else ""),
        fontsize=10,
    )
    fig.tight_layout()
    _save(fig, path)
    return True


# --------------------------------------------------------------------------- speed vs gas
def plot_speed_vs_gas(runs: pd.DataFrame, views: list[Row], path: Path) -> bool:
    """tokens/s of every ok run against gradient accumulation, one line per configuration."""
    title = "Speed vs gradient accumulation"
    need = {"gradient_accumulation_steps", "tokens_per_s", "outcome", "scenario"}
    if runs.empty or not need <= set(runs.columns):
        _no_data(path, title, "no runs")
        return False
    ok = runs[runs["outcome"] == "ok"].copy()
    ok["gas"] = pd.to_numeric(ok["gradient_accumulation_steps"], errors="coerce")
    ok["tokens/s"] = pd.to_numeric(ok["tokens_per_s"], errors="coerce")
    ok = ok.dropna(subset=["gas", "tokens/s"])
    if ok["gas"].nunique() < 2:
        _no_data(path, title, "gradient_accumulation_steps never varies")
        return False
    by_base = "base_scenario" in ok and ok["base_scenario"].notna().all()
    labels = {v["base_scenario" if by_base else "scenario"]: v["label"] for v in views}
    key = "base_scenario" if by_base else "scenario"
    ok["configuration"] = ok[key].map(lambda n: _wrap(labels.get(n) or str(n), 40))
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 5.2))
    sns.lineplot(
        data=ok, x="gas", y="tokens/s", hue="configuration", marker="o", errorbar=None, ax=ax
    )
    sns.scatterplot(
        data=ok, x="gas", y="tokens/s", hue="configuration", legend=False, alpha=0.5, ax=ax
    )
    gas = sorted(ok["gas"].unique())
    ax.set_xscale("log", base=2)
    ax.set_xticks(gas, [f"{g:g}" for g in gas])
    ax.set_xlabel("gradient accumulation steps")
    ax.set_ylim(bottom=0)
    within = ok.groupby("configuration")["gas"].nunique().max() > 1
    why = (
        "seed: ≥ 8 hides offload transfers" if within else "gas differs only between configurations"
    )
    ax.set_title(f"{title} ({why})", fontsize=10)
    ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.tight_layout()
    _save(fig, path)
    return True


# --------------------------------------------------------------------------- memory tradeoff
def _speed_axis(views: list[Row]) -> tuple[str, float, str]:
    """(column, scale, its words): % of baseline when measured, else tokens/s."""
    if any(v["relative_speed"] is not None for v in views):
        return "relative_speed", 100.0, "% of baseline speed"
    return "tokens_per_s", 1.0, "tokens/s"


def plot_memory_tradeoff(views: list[Row], path: Path) -> bool:
    """The tradeoff itself: peak GPU memory per GPU against peak host memory per node, each
    scenario a labelled point whose size and colour are its speed (offload moves memory from
    the GPU to the host and costs speed: down-right is the price paid for left)."""
    key, scale, words = _speed_axis(views)
    pts = [
        v
        for v in views
        if all(isnum(v[k]) for k in ("peak_gpu_allocated_gib", "host_memory_gib", key))
    ]
    if not pts:
        _no_data(path, "GPU vs host memory", "no successful run with GPU and host memory measured")
        return False
    pts.sort(key=lambda v: -float(v[key]))  # the slow (small) points drawn over the fast
    data = pd.DataFrame(
        {
            "gpu": [float(v["peak_gpu_allocated_gib"]) for v in pts],
            "host": [float(v["host_memory_gib"]) for v in pts],
            words: [scale * float(v[key]) for v in pts],
        }
    )
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 5.6))
    sns.scatterplot(
        data=data,
        x="gpu",
        y="host",
        hue=words,
        size=words,
        sizes=(60, 420),
        palette="viridis",
        edgecolor="black",
        linewidth=0.5,
        ax=ax,
        zorder=3,
    )
    ax.set_xlabel("peak GPU memory allocated per GPU (GiB)")
    ax.set_ylabel("peak host memory per node (GiB)")
    ax.set_xlim(0, data["gpu"].max() * 1.4 + 1)
    ax.set_ylim(0, data["host"].max() * 1.25 + 1)
    legend = ax.legend(
        title=words,
        fontsize=8,
        title_fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )
    fmt = "{:.0f}%" if scale == 100.0 else "{:,.0f} tok/s"
    for t in legend.get_texts():  # seaborn writes the raw floats
        t.set_text(fmt.format(float(t.get_text())))
    fastest = sorted(range(len(pts)), key=lambda i: -data[words].iloc[i])[:MAX_LABELS]
    more = "" if len(pts) <= MAX_LABELS else f"\nlabels: the {MAX_LABELS} fastest scenarios"
    ax.set_title(f"GPU memory vs host memory (size and colour: speed){more}", fontsize=11)
    fig.tight_layout()
    xy = list(zip(data["gpu"], data["host"], strict=True))
    texts = [f"{_tick_label(pts[i])}\n{fmt.format(data[words].iloc[i])}" for i in fastest]
    note_left_out(ax, place_labels(ax, [xy[i] for i in fastest], texts, xy))
    _save(fig, path)
    return True


# --------------------------------------------------------------------------- step series
def run_series(runs: pd.DataFrame, views: list[Row]) -> list[tuple[str, list]]:
    """(title, steps.csv rows) of each run with steps, in the order of the views, up to one
    more than MAX_SERIES (enough to say that some were left out): the small multiples' panels."""
    if runs.empty or not {"scenario", "record_dir"} <= set(runs.columns):
        return []
    order = {v["scenario"]: i for i, v in enumerate(views)}
    labels = {v["scenario"]: v["plot_label"] or v["label"] for v in views}
    rows = sorted(
        runs.to_dict("records"), key=lambda r: (order.get(r["scenario"], 1e9), str(r.get("repeat")))
    )
    out = []
    for r in rows:
        if not isinstance(r["record_dir"], str) or not r["record_dir"]:
            continue
        steps = contracts.read_steps(Path(r["record_dir"]) / contracts.STEPS_FILE)
        if steps:
            rep = r.get("repeat")
            title = labels.get(r["scenario"]) or str(r["scenario"])
            out.append((_wrap(f"{title} · rep {rep}" if isnum(rep) else title, 36), steps))
        if len(out) > MAX_SERIES:
            break
    return out


def plot_step_series(runs: pd.DataFrame, views: list[Row], path: Path) -> bool:
    """Small multiples, one per run: step time of every step (warm-up grey, measured blue),
    steps DeepSpeed skipped (fp16 overflow) as red crosses, the loss scale on the right axis."""
    series = run_series(runs, views)
    more = f" (the first {MAX_SERIES} runs)" if len(series) > MAX_SERIES else ""
    series = series[:MAX_SERIES]
    if not series:
        _no_data(path, "Step time per run", "no run wrote steps.csv")
        return False
    ncol = min(3, len(series))
    nrow = math.ceil(len(series) / ncol)
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(FIG_WIDTH_IN, 2.4 * nrow + 0.9), squeeze=False, layout="constrained"
    )
    for ax, (title, steps) in zip(axes.flat, series, strict=False):
        _draw_series(ax, steps)
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(series) :]:
        ax.axis("off")
    fig.supylabel("step time (s)", fontsize=9)
    handles = [
        plt.Line2D([], [], color=c, marker=m, ls=ls, label=lb)
        for c, m, ls, lb in (
            ("#999", ".", "-", "warm-up step"),
            (PALETTE["none"], ".", "-", "measured step"),
            ("#c44e52", "x", "", "skipped (fp16 overflow)"),
            ("#dd8452", "", "--", "loss scale (right)"),
        )
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"Step time, loss scale and skipped steps per run{more}", fontsize=11)
    _save(fig, path)
    return True


def _draw_series(ax, steps: list) -> None:
    for phase, color in (("warmup", "#999"), ("measured", PALETTE["none"])):
        mine = [s for s in steps if s.phase == phase]
        ax.plot([s.step for s in mine], [s.step_time_s for s in mine], ".-", color=color, lw=1)
    skipped = [s for s in steps if s.skipped]
    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
    ax.plot(
        [s.step for s in skipped],
        [s.step_time_s for s in skipped],
        "x",
        color="#c44e52",
        ms=7,
        mew=2,
    )
    ax.set_ylim(bottom=0)
    scaled = [s for s in steps if s.loss_scale]
    if any(s.loss_scale != 1 for s in scaled):  # bf16 and fp32 keep 1: nothing to show
        twin = ax.twinx()
        twin.plot([s.step for s in scaled], [s.loss_scale for s in scaled], "--", color="#dd8452")
        twin.set_yscale("log", base=2)
        twin.tick_params(labelsize=7, colors="#dd8452")
        twin.grid(False)


# --------------------------------------------------------------------------- all figures
def make_figures(
    runs: pd.DataFrame, views: list[Row], figdir: Path, baseline, seed: dict | None = None
) -> list[dict]:
    """Every figure as a PNG under figdir (fixed names, FIGURES) and as a data: URI; ``seed``:
    the page's seed table (report.seed.seed_view), drawn by plot_seed_share."""
    figdir.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="notebook")
    specs = [
        ("seed_share", "Seed vs this cluster", plot_seed_share, (seed,)),
        ("relative_speed", "Relative training speed", plot_relative_speed, (views, baseline)),
        ("speed_vs_gpu_memory", "Speed vs memory tradeoff", plot_speed_vs_memory, (views,)),
        ("memory_tradeoff", "GPU vs host memory, with speed", plot_memory_tradeoff, (views,)),
        ("step_breakdown", "Step-time breakdown per 1k tokens", plot_breakdown, (views,)),
        ("speed_vs_gas", "Speed vs gradient accumulation", plot_speed_vs_gas, (runs, views)),
        ("step_series", "Step time per run", plot_step_series, (runs, views)),
    ]
    out = []
    for key, title, plot, args in specs:
        path = figdir / FIGURES[key]
        try:
            has = plot(*args, path)
        except Exception as e:  # a plotting bug must not lose the whole report
            plt.close("all")
            _no_data(path, title, f"plot failed ({type(e).__name__}: {e})"[:90])
            has = False
        uri = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
        out.append({"key": key, "title": title, "file": path.name, "uri": uri, "has": has})
    return out
