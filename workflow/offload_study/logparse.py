"""Pure functions over log text (ReFrame-style sanity/performance patterns).

Strings checked against DeepSpeed 0.19.8 (CPU accelerator, torch 2.13) output:

- ``wall_clock_breakdown: true`` prints, on rank 0, per micro-step
  ``[Rank 0] time (ms) | fwd_microstep: 5.72 | bwd_microstep: 7.65 | bwd_inner_microstep: 5.52 |
  bwd_allreduce_microstep: 2.11 | step_microstep: 0.01``,
  at every optimizer step ``[Rank 0] time (ms) | optimizer_step: 0.39`` (NVMe offload adds
  ``optimizer_swap_in_state`` / ``optimizer_swap_out_state`` lines the same way), and per optimizer
  step ``[Rank 0] time (ms) | fwd: 11.05 | bwd: 15.69 | bwd_inner: 10.75 | bwd_allreduce: 4.90 |
  step: 5.00`` (sums over the micro-steps).
- The throughput timer (skips the first steps):
  ``[timer.py:264:stop] epoch=0/micro_step=6/global_step=3, RunningAvgSamplesPerSec=93.99,
  CurrSamplesPerSec=93.99, MemAllocated=0.48GB, MaxMemAllocated=0.48GB``.
"""

from __future__ import annotations

import re
import statistics

# ----------------------------------------------------------------------------- timers
TIMER_LINE = re.compile(r"\[Rank (?P<rank>\d+)\] time \(ms\) \|(?P<body>.*)$", re.MULTILINE)
TIMER_ITEM = re.compile(r"\s*(?P<name>[A-Za-z0-9_]+):\s*(?P<ms>[-+0-9.eE]+|nan|inf)\s*")

# DeepSpeed timer name -> metrics.json breakdown_ms key
BREAKDOWN_KEYS = {
    "fwd": "forward",
    "bwd": "backward",
    "bwd_inner": "backward_inner",
    "bwd_allreduce": "backward_allreduce",
    "step": "step",
    "optimizer_swap_in_state": "optimizer_swap_in",
    "optimizer_swap_out_state": "optimizer_swap_out",
}

THROUGHPUT_LINE = re.compile(
    r"epoch=(?P<epoch>\d+)/micro_step=(?P<micro_step>\d+)/global_step=(?P<global_step>\d+), "
    r"RunningAvgSamplesPerSec=(?P<running_avg>[-+0-9.eE]+|nan|inf), "
    r"CurrSamplesPerSec=(?P<curr>[-+0-9.eE]+|nan|inf)"
    r"(?:, MemAllocated=(?P<mem_alloc>[0-9.]+)GB, MaxMemAllocated=(?P<max_mem_alloc>[0-9.]+)GB)?"
)


def parse_timer_lines(text: str, rank: int | None = 0) -> list[dict[str, float]]:
    """Every ``[Rank r] time (ms) | name: value | ...`` line as a dict name -> ms, in order."""
    out = []
    for m in TIMER_LINE.finditer(text):
        if rank is not None and int(m.group("rank")) != rank:
            continue
        items = {}
        for part in m.group("body").split("|"):
            im = TIMER_ITEM.fullmatch(part)
            if im:
                items[im.group("name")] = float(im.group("ms"))
        if items:
            out.append(items)
    return out


def timer_series(text: str, rank: int | None = 0) -> dict[str, list[float]]:
    """Timer name -> values in log order (one value per occurrence)."""
    series: dict[str, list[float]] = {}
    for items in parse_timer_lines(text, rank):
        for name, ms in items.items():
            series.setdefault(name, []).append(ms)
    return series


def breakdown_ms(text: str, skip_steps: int = 0, rank: int | None = 0) -> dict[str, float | None]:
    """Median ms per optimizer step of the breakdown timers, skipping the first skip_steps.

    Keys are those of metrics.json ``breakdown_ms``; a timer that never appears gives None.
    """
    series = timer_series(text, rank)
    out: dict[str, float | None] = {}
    for ds_name, key in BREAKDOWN_KEYS.items():
        vals = series.get(ds_name, [])
        vals = vals[skip_steps:] if len(vals) > skip_steps else vals
        out[key] = round(statistics.median(vals), 4) if vals else None
    return out


GPU_CAP_LINE = re.compile(r"\[harness\] GPU memory capped to (?P<gib>[0-9.]+) GiB")


def gpu_mem_cap_gib(text: str) -> float | None:
    """The per-process GPU memory cap the harness announced (also known when a run died later)."""
    match = GPU_CAP_LINE.search(text)
    return float(match["gib"]) if match else None


def parse_throughput(text: str) -> list[dict[str, float]]:
    """DeepSpeed throughput-timer lines -> list of dicts (global_step, running_avg, curr, ...)."""
    out = []
    for m in THROUGHPUT_LINE.finditer(text):
        d = {k: float(v) for k, v in m.groupdict().items() if v is not None}
        for k in ("epoch", "micro_step", "global_step"):
            d[k] = int(d[k])
        out.append(d)
    return out


def last_running_avg_samples_per_s(text: str) -> float | None:
    rows = parse_throughput(text)
    return rows[-1]["running_avg"] if rows else None


# ----------------------------------------------------------------------------- outcomes
# Checked in order; the first outcome whose pattern matches anywhere in the logs wins. Order goes
# from the most specific root cause to the generic consequences (a rank that dies makes the other
# ranks fail with gloo/NCCL connection errors, so dist_error comes late).
OUTCOME_PATTERNS: list[tuple[str, str]] = [
    ("gpu_oom", r"torch\.OutOfMemoryError|CUDA out of memory|torch\.cuda\.OutOfMemoryError"),
    ("gpu_oom", r"CUBLAS_STATUS_ALLOC_FAILED|NCCL.*(?:Cuda failure 'out of memory'|OOM)"),
    ("host_oom", r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\) received|\bMemoryError\b"),
    ("host_oom", r"DefaultCPUAllocator: (?:can't|not enough memory)|Cannot allocate memory"),
    ("op_build_error", r"Error building extension '[^']+'"),
    ("op_build_error", r"async_io requires the dev libaio|Ninja is required to load C\+\+ ext"),
    ("op_build_error", r"op_builder.*(?:is not compatible|failed to build)|CompileError"),
    ("config_error", r"Check batch related parameters"),
    ("config_error", r"\d+ validation errors? for \w+|pydantic(?:_core)?.*ValidationError"),
    ("config_error", r"Extra inputs are not permitted|extra_forbidden"),
    (
        "config_error",
        r"is not supported on your device|DeepSpeedConfigError|Unknown (?:config )?key",
    ),
    ("dist_error", r"EADDRINUSE|address already in use|DistNetworkError|DistStoreError"),
    ("dist_error", r"Rendezvous\w*Error|RendezvousTimeout|rendezvous .* (?:failed|timed out)"),
    ("dist_error", r"NCCL (?:error|WARN)|ncclInternalError|ncclSystemError|ncclUnhandledCudaError"),
    ("dist_error", r"Gloo|gloo/transport|Connection (?:reset|closed) by peer|collective.*timeout"),
]
_COMPILED = [(o, re.compile(p)) for o, p in OUTCOME_PATTERNS]


def classify_text(text: str) -> tuple[str, str | None]:
    """(outcome, matching line) for failure log text; ('error', None) if no pattern matches."""
    for outcome, rx in _COMPILED:
        m = rx.search(text)
        if m:
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            return outcome, text[start : end if end >= 0 else len(text)].strip()
    return "error", None


EXCERPT_PATTERN = re.compile(
    r"Error|error|Traceback|Exception|FAILED|failed|Killed|exitcode|OOM|out of memory|"
    r"Signal \d+|Check batch|validation|not supported|\[rank\d+\]:",
)
NOISE = re.compile(r"FutureWarning|return func\(\*args|UserWarning|DeprecationWarning")


def error_excerpt(text: str, max_lines: int = 40, max_chars: int = 6000) -> str | None:
    """The last ~max_lines relevant lines of log text (error-looking lines and their traceback).

    Falls back to the plain tail when nothing looks like an error.
    """
    lines = [ln for ln in text.splitlines() if ln.strip() and not NOISE.search(ln)]
    if not lines:
        return None
    # start at the first line of the last traceback block if there is one
    idx = [i for i, ln in enumerate(lines) if EXCERPT_PATTERN.search(ln)]
    if idx:
        first_err = idx[0]
        tail = lines[max(first_err, len(lines) - max_lines) :]
        # keep only relevant lines if still too many
        if len(tail) > max_lines:
            tail = [ln for ln in tail if EXCERPT_PATTERN.search(ln)][-max_lines:]
    else:
        tail = lines[-max_lines:]
    out = "\n".join(tail)
    return out[-max_chars:]
