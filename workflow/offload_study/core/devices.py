"""Device peaks, model FLOPs and MFU.

Peaks are vendor datasheet *dense* (no 2:4 sparsity) bf16/fp16 tensor-core TFLOP/s of one device.

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

import platform
import socket
from pathlib import Path

# dense bf16/fp16 peak TFLOP/s per device (datasheet, without sparsity)
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "GH200": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "B100": 1750.0,
    "GB200": 2500.0,
    "A100": 312.0,
    "A800": 312.0,
    "A40": 149.7,
    "A30": 165.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 6000 Ada": 364.0,
    "RTX A6000": 154.8,
    "V100": 125.0,
    "T4": 65.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}


def peak_tflops(device_name: str | None, override: float | None = None) -> float | None:
    """Peak for a device name such as "NVIDIA H200" or "NVIDIA H100 80GB HBM3"; None if unknown.

    The longest table key contained in the name wins ("H100 PCIe" before "H100").
    """
    if override:
        return float(override)
    if not device_name:
        return None
    name = device_name.upper().replace("-", " ")
    best = None
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.upper() in name:
            best = PEAK_TFLOPS[key]
            break
    if best is None and "H100" in name and ("PCIE" in name or "PCI" in name):
        best = PEAK_TFLOPS["H100 PCIe"]
    return best


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

    The one free-port helper (the launcher's, and DeepSpeed's one-process config check)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]
