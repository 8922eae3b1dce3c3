"""Device peaks, model FLOPs and MFU.

Peaks are vendor datasheet *dense* (no 2:4 sparsity) bf16/fp16 tensor-core TFLOP/s of one device,
from the one GPU catalog (``data/gpu_catalog.yaml``: :func:`gpu_spec`).

Model FLOPs per token (training, forward + backward), N = parameter count:

- ``6 N``: forward 2N + backward 4N (Kaplan et al. 2020; the usual MFU convention).
- ``8 N`` with activation (gradient) checkpointing: the forward runs a second time during the
  backward pass (+2N). Strictly that is *hardware* FLOPs (HFU); the design's ``tflops_per_gpu``
  counts it, as the contract in docs/design.md says.
- optional attention term ``12 · layers · hidden · seq`` per token (the QK^T and AV products,
  forward + backward, which 6N misses; Narayanan et al. 2021 / PaLM appendix B use
  ``6N + 12·L·H·S``). Off by default; pass ``attention=True``.
"""

from __future__ import annotations

import functools
import platform
import re
import socket
from importlib import resources
from pathlib import Path

import yaml

#: The one catalog of GPU models (datasheet peaks, memory, host link, NVLink): package data.
GPU_CATALOG = "data/gpu_catalog.yaml"
_GPU_KEYS = {"aliases", "peak_tflops", "memory_gib", "host_link_gb_s", "interconnect_gb_s"}


@functools.lru_cache(maxsize=1)
def catalog() -> dict:
    """The GPU catalog ({"gpus": {model: entry}, "cpu": defaults}), checked once: every entry
    has exactly the catalog's keys (a wrong one is named)."""
    text = resources.files("offload_study").joinpath(GPU_CATALOG).read_text()
    data = yaml.safe_load(text)
    for model, entry in data["gpus"].items():
        if set(entry) != _GPU_KEYS:
            raise ValueError(
                f"{GPU_CATALOG}: {model}: keys {sorted(entry)}, not {sorted(_GPU_KEYS)}"
            )
    return data


def gpu_spec(device_name: str | None) -> tuple[str, dict] | None:
    """(catalog model, its entry) for a device name such as "NVIDIA H200" or "NVIDIA
    A100-SXM4-80GB"; None if no alias matches. The longest alias contained in the name wins
    ("H100 PCIE" before "H100")."""
    if not device_name:
        return None
    name = device_name.upper().replace("-", " ")
    aliases = [
        (alias.upper(), model)
        for model, entry in catalog()["gpus"].items()
        for alias in entry["aliases"]
    ]
    for alias, model in sorted(aliases, key=lambda am: len(am[0]), reverse=True):
        if alias in name:
            return model, catalog()["gpus"][model]
    return None


def card_names_in(text: str) -> str:
    """``text`` with each device name that states its memory in the vendor's GB ("H100 80GB
    HBM3", as nvidia-smi names the card) replaced by the catalog's card ("H100 SXM"): pages
    state memory in GiB, beside the card."""
    for pattern, model in _sized_aliases():
        text = pattern.sub(model, text)
    return text


@functools.lru_cache(maxsize=1)
def _sized_aliases() -> list[tuple[re.Pattern, str]]:
    """(pattern, card) for each catalog alias that names a size in GB where its card does not,
    the longest first; spaces and hyphens alike."""
    sized = [
        (alias, model)
        for model, entry in catalog()["gpus"].items()
        for alias in entry["aliases"]
        if "GB" in alias.upper() and "GB" not in model.upper()
    ]
    sized.sort(key=lambda am: len(am[0]), reverse=True)
    words = {alias: r"[\s-]".join(map(re.escape, alias.split())) for alias, _ in sized}
    return [(re.compile(rf"\b{words[a]}\b", re.IGNORECASE), model) for a, model in sized]


@functools.cache  # a study names a few devices; pages and checks ask for each run's
def card_name(device_name: str | None) -> str | None:
    """The card a device name stands for, in the catalog's words ("NVIDIA H100 80GB HBM3" is an
    "H100 SXM", "NVIDIA H100 NVL" another card: a page states the card's memory in GiB beside
    it); the name itself where the catalog does not know it; None for no name."""
    if not isinstance(device_name, str) or not device_name.strip():
        return None
    known = gpu_spec(device_name)
    return known[0] if known else device_name.strip()


def peak_tflops(device_name: str | None, override: float | None = None) -> float | None:
    """Peak for a device name (:func:`gpu_spec`); ``override`` (the cluster's) wins; None if
    unknown."""
    if override:
        return float(override)
    spec = gpu_spec(device_name)
    return float(spec[1]["peak_tflops"]) if spec else None


def flops_per_token(
    n_params: int,
    gradient_checkpointing: bool = False,
    *,
    attention: bool = False,
    layers: int | None = None,
    hidden: int | None = None,
    seq_len: int | None = None,
) -> float:
    """Training FLOPs per token: 6N (8N with checkpointing) [+ 12·layers·hidden·seq]."""
    f = (8.0 if gradient_checkpointing else 6.0) * n_params
    if attention:
        if not (layers and hidden and seq_len):
            raise ValueError("attention term needs layers, hidden and seq_len")
        f += 12.0 * layers * hidden * seq_len * (4.0 / 3.0 if gradient_checkpointing else 1.0)
    return f


def tflops_per_device(
    n_params: int, tokens_per_s: float, world_size: int, gradient_checkpointing: bool = False, **kw
) -> float:
    """Achieved model TFLOP/s per device."""
    return (
        flops_per_token(n_params, gradient_checkpointing, **kw) * tokens_per_s / world_size / 1e12
    )


def mfu(tflops: float | None, peak: float | None) -> float | None:
    if tflops is None or not peak:
        return None
    return tflops / peak


def cpu_model() -> str | None:
    """The CPU model name (/proc/cpuinfo), for provenance and CPU-only device names."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (bind to port 0). Small race window; recorded per run.

    The one free-port helper (the launcher's and the calibration's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]
