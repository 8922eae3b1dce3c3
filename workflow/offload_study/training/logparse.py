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
from dataclasses import dataclass
from typing import NamedTuple

from offload_study.admission import ops
from offload_study.core.contracts import BREAKDOWN_TIMERS, GPU_CAP_LOG_PREFIX

# ----------------------------------------------------------------------------- timers
TIMER_LINE = re.compile(r"\[Rank (?P<rank>\d+)\] time \(ms\) \|(?P<body>.*)$", re.MULTILINE)
TIMER_ITEM = re.compile(r"\s*(?P<name>[A-Za-z0-9_]+):\s*(?P<ms>[-+0-9.eE]+|nan|inf)\s*")

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

    Keys are those of metrics.json ``breakdown_ms`` (each with its DeepSpeed timer, from the
    schema); a timer that never appears gives None.
    """
    series = timer_series(text, rank)
    out: dict[str, float | None] = {}
    for key, ds_name in BREAKDOWN_TIMERS.items():
        vals = series.get(ds_name, [])
        vals = vals[skip_steps:] if len(vals) > skip_steps else vals
        out[key] = round(statistics.median(vals), 4) if vals else None
    return out


GPU_CAP_LINE = re.compile(re.escape(GPU_CAP_LOG_PREFIX) + r"(?P<gib>[0-9.]+) GiB")


def gpu_mem_cap_gib(text: str) -> float | None:
    """The per-process GPU memory cap the harness announced in its log.

    Only for a rank that died before writing its stats (they carry the cap otherwise).
    """
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


# ----------------------------------------------------------------------------- skipped steps
# DeepSpeed's own account of skipped optimizer steps (rank 0, info level), a cross-check of the
# harness's count (engine.skipped_steps). Line kind -> pattern:
#   progress: every steps_per_print steps, the running count of skipped steps
#     "[Rank 0] step=3, skipped=1, lr=[0.0001], mom=[(0.9, 0.999)]"
#   overflow: one per skipped step. fp16's dynamic scaler names the scale it tried and the next
#     one ("... Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"), or only
#     uses up hysteresis ("... Attempted loss scale: 65536, but hysteresis is 2. Reducing
#     hysteresis to 1"); a static scaler (bf16) says "[deepspeed] OVERFLOW! Skipping step.
#     Gradients are non-finite, weights were not updated."
SKIP_PATTERNS: dict[str, re.Pattern] = {
    "progress": re.compile(r"\[Rank (?P<rank>\d+)\] step=(?P<step>\d+), skipped=(?P<skipped>\d+),"),
    "overflow": re.compile(
        r"\[deepspeed\] OVERFLOW! (?:Rank (?P<rank>\d+) )?Skipping step\."
        r"(?: Attempted loss scale: (?P<attempted>\d+)"
        r"(?:, reducing to (?P<reduced>\d+)|, but hysteresis is (?P<hysteresis>\d+))?)?"
    ),
}


def skip_lines(text: str, kind: str) -> list[dict[str, int | None]]:
    """Every ``kind`` line of SKIP_PATTERNS in log order, its named numbers as ints (None: absent)."""
    return [
        {k: None if v is None else int(v) for k, v in m.groupdict().items()}
        for m in SKIP_PATTERNS[kind].finditer(text)
    ]


def ds_skipped_steps(text: str) -> int | None:
    """Skipped steps by DeepSpeed's log: the last progress line's count, else the number of
    overflow lines; None when the log has neither (DeepSpeed never reached a step)."""
    progress = skip_lines(text, "progress")
    if progress:
        return progress[-1]["skipped"]
    overflows = skip_lines(text, "overflow")
    return len(overflows) if overflows else None


# ----------------------------------------------------------------------------- outcomes
# (outcome, pattern, remedy), checked in order; the first row whose pattern matches anywhere in
# the logs wins (each outcome one of contracts.OUTCOMES). Order goes from the most specific root
# cause to the generic consequences (a rank that dies makes the other ranks fail with gloo/NCCL
# connection errors, so dist_error comes late). ``remedy`` (None: none known) is a str.format
# template over the pattern's named groups; it becomes the first line of the error excerpt.
# The op-build messages are those of DeepSpeed 0.19 (op_builder/builder.py, async_io.py),
# torch.utils.cpp_extension and the compiler; tests/fixtures/op_build/ holds real captures.
# (The runner's own preflight refusal is no log line to read back: it reaches the outcome as a
# value, Supervision.killed.)
_LIBAIO = (
    r"Unable to JIT load the async_io op due to it not being compatible|async_io requires the "
    r"dev libaio|libaio\.h: No such file|cannot find -laio|async_io \.+ \S+ \.+ \S*\[NO\]"
)
OUTCOME_PATTERNS: list[tuple[str, str, str | None]] = [
    ("gpu_oom", r"torch\.OutOfMemoryError|CUDA out of memory|torch\.cuda\.OutOfMemoryError", None),
    ("gpu_oom", r"CUBLAS_STATUS_ALLOC_FAILED|NCCL.*(?:Cuda failure 'out of memory'|OOM)", None),
    ("host_oom", r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\) received|\bMemoryError\b", None),
    ("host_oom", r"DefaultCPUAllocator: (?:can't|not enough memory)|Cannot allocate memory", None),
    ("op_build_error", _LIBAIO, ops.remedy("libaio", "async_io")),
    (
        "op_build_error",
        r"Unable to JIT load the (?P<op>\w+) op due to ninja",
        ops.remedy("ninja", "{op}"),
    ),
    ("op_build_error", r"Ninja is required to load C\+\+ ext", ops.remedy("ninja")),
    (
        "op_build_error",
        r"invalid literal for int\(\) with base 10: '\d+[a-z]'",
        ops.remedy("cuda_arch"),
    ),
    (
        "op_build_error",
        r"CUDA_HOME (?:does not exist|environment variable is not set)|Unable to run \S*nvcc",
        ops.remedy("cuda_home"),
    ),
    ("op_build_error", r"Installed CUDA version \S+ does not match", ops.remedy("cuda_mismatch")),
    (
        "op_build_error",
        r"\b(?:c\+\+|g\+\+|gcc|cc|clang\+*)(?:-\d+)?: (?:command )?not found",
        ops.remedy("compiler"),
    ),
    ("op_build_error", r"Error building extension '(?P<op>[^']+)'", ops.remedy("compile", "{op}")),
    (
        "op_build_error",
        r"Unable to JIT load the (?P<op>\w+) op due to it not being compatible",
        ops.remedy("incompatible", "{op}"),
    ),
    ("op_build_error", r"op_builder.*(?:is not compatible|failed to build)|CompileError", None),
    ("config_error", r"Check batch related parameters", None),
    ("config_error", r"\d+ validation errors? for \w+|pydantic(?:_core)?.*ValidationError", None),
    ("config_error", r"Extra inputs are not permitted|extra_forbidden", None),
    (
        "config_error",
        r"is not supported on your device|DeepSpeedConfigError|Unknown (?:config )?key",
        None,
    ),
    ("dist_error", r"EADDRINUSE|address already in use|DistNetworkError|DistStoreError", None),
    (
        "dist_error",
        r"Rendezvous\w*Error|RendezvousTimeout|rendezvous .* (?:failed|timed out)",
        None,
    ),
    (
        "dist_error",
        r"NCCL (?:error|WARN)|ncclInternalError|ncclSystemError|ncclUnhandledCudaError",
        None,
    ),
    (
        "dist_error",
        r"Gloo|gloo/transport|Connection (?:reset|closed) by peer|collective.*timeout",
        None,
    ),
]
_COMPILED = [(o, re.compile(p), remedy) for o, p, remedy in OUTCOME_PATTERNS]


@dataclass(frozen=True)
class Classified:
    """What the outcome table says of failure log text."""

    outcome: str  # "error" when no row matches
    line: str | None = None  # the whole log line of the match
    remedy: str | None = None  # "fix: ..." of the row, its groups filled in


def classify(text: str) -> Classified:
    """The first row of OUTCOME_PATTERNS that matches ``text``; Classified("error") if none."""
    for outcome, rx, remedy in _COMPILED:
        m = rx.search(text)
        if m:
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            line = text[start : end if end >= 0 else len(text)].strip()
            groups = {k: v or "" for k, v in m.groupdict().items()}
            return Classified(outcome, line, remedy.format(**groups).rstrip() if remedy else None)
    return Classified("error")


def classify_text(text: str) -> tuple[str, str | None]:
    """(outcome, matching line) for failure log text; ('error', None) if no pattern matches."""
    found = classify(text)
    return found.outcome, found.line


#: torchrun's summary of a failed launch names the first rank that failed, its host and exit
#: code (negative: the signal that killed it).
ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?(?:\bhost\s*:\s*(?P<host>\S+).*?)?"
    r"\brank\s*:\s*(?P<rank>\d+).*?\bexitcode\s*:\s*(?P<code>-?\d+)",
    re.DOTALL,
)


class RootCause(NamedTuple):
    rank: int
    exit_code: int
    host: str | None  # as torchrun names it (its fully qualified name)


def root_cause(text: str) -> RootCause | None:
    """torchrun's "Root Cause (first observed failure)" block, if any."""
    m = ROOT_CAUSE.search(text)
    return RootCause(int(m["rank"]), int(m["code"]), m["host"]) if m else None


def short_host(host: str) -> str:
    return host.split(".", 1)[0]


def same_host(host: str, other: str | None) -> bool:
    """Whether two names are one machine (short names compared; an unknown other: assume so)."""
    return other is None or short_host(host) == short_host(other) or host == "localhost"


#: The line each node's launch wrapper prints when its torchrun ends (launch.NODE_OOM_WRAPPER):
#: that node's kernel OOM kills before and after.
NODE_OOM = re.compile(r"^node (?P<host>\S+) oom_kill (?P<before>\d+) -> (?P<after>\d+)$", re.M)


def node_oom_kills(text: str) -> dict[str, int]:
    """Short host name -> OOM kills its kernel counted while its torchrun ran."""
    return {
        short_host(m["host"]): int(m["after"]) - int(m["before"]) for m in NODE_OOM.finditer(text)
    }


#: A full disk under the NVMe path: DeepSpeed's aio writes of a swap file fail without an error
#: and its read-back asserts on the short file (DeepSpeed 0.19.8); or a plain ENOSPC.
DISK_FULL = re.compile(
    r"(?P<file>\S+\.swp): file_offset \+ buffer nbytes > file bytes (?P<want>\d+) > (?P<got>\d+)"
    r"|No space left on device"
)


def disk_full(text: str) -> str | None:
    """What says that a disk filled up (a short swap file, in words, or the ENOSPC line)."""
    m = DISK_FULL.search(text)
    if m is None:
        return None
    if m["file"]:
        return f"swap file {m['file']} came out short ({m['got']} of {m['want']} bytes)"
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    return text[start : end if end >= 0 else len(text)].strip()


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
