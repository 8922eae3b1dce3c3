"""Memory units: the one conversion between the config's sizes and bytes, and the one table of
bytes per parameter for what ZeRO-3 keeps where.

Every config key ending in ``_gb`` (a scenario's ``gpu_mem_gb`` and ``cpu_mem_gb``, the cluster's
``gpu_mem_gb``, ``mem_gb_per_node`` and ``nvme_capacity_gb``, ``recommend.gpu_mem_gb``) and the
record fields that copy them (run.json, plan.json, metrics.json, runs.csv keep those names) hold
**GiB** (2**30 bytes): GPU cards are sold as "80GB" when they hold 80 GiB (an "A100 40GB" has
40960 MiB), and SLURM reads ``--mem=<N>G`` as GiB. Inside the library a size becomes bytes once,
where it enters (:class:`~offload_study.core.contracts.RunSpec`'s ``*_bytes`` properties, the
SLURM request, NVML and torch report bytes already), and names say the unit: ``*_bytes``,
``*_gib``, ``*_mib``. Transfer rates (``*_gb_s``) are the one exception: decimal GB/s
(:data:`GB`), as bandwidths are quoted.
"""

from __future__ import annotations

import math

GIB = 2**30
MIB = 2**20
#: bytes in a decimal GB: transfer rates (``h2d_gb_s``, ``disk_read_gb_s``, ...) only
GB = 10**9
#: The largest signed 64-bit integer: sizes and counts past it overflow (torch, DeepSpeed, SLURM).
MAX_INT64 = 2**63 - 1


def gib_to_bytes(gib: float) -> int:
    """GiB -> whole bytes (rounded down), exact for any finite size (Python integers do not
    overflow, ``gib * 2**30`` as a float would past 1.6e299 GiB); ValueError for inf or NaN."""
    if not math.isfinite(gib):
        raise ValueError(f"{gib!r} GiB is not a size in bytes")
    whole = math.floor(gib)
    return whole * GIB + math.floor((gib - whole) * GIB)


def gib_to_bytes_or_none(gib: float | None) -> int | None:
    """:func:`gib_to_bytes` of a size that may be unset (None or 0: no size)."""
    return gib_to_bytes(gib) if gib else None


def bytes_to_gib(nbytes: float) -> float:
    return nbytes / GIB


def bytes_to_mib_ceil(nbytes: int) -> int:
    """Whole MiB holding at least ``nbytes``: a request (SLURM reads ``--mem=<N>`` as MiB)."""
    return -(-int(nbytes) // MIB)


def bytes_to_mib_floor(nbytes: int) -> int:
    """Whole MiB within ``nbytes``: a ceiling not to pass (a node's memory)."""
    return int(nbytes) // MIB


# --------------------------------------------------------------------------- bytes per parameter
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}

#: Bytes per parameter of each state of mixed-precision Adam/AdamW training (the study's
#: optimizers); "dtype": the training dtype's :data:`DTYPE_BYTES`.
STATE_BYTES_PER_PARAM: dict[str, int | str] = {
    "parameters": "dtype",
    "gradients": "dtype",
    "fp32 master weights": 4,
    "Adam moments": 8,  # exp_avg and exp_avg_sq, fp32
    "fp32 gradients": 4,
}

#: Where ZeRO-3 (DeepSpeed 0.19.8) keeps a rank's whole partition of each state, by offload
#: setting: (offload key, its device) -> {"gpu" | "cpu" | "nvme": states}. Sub-group buffers, swap
#: buffers and the pinned allocator's rounding come on top (prediction.predict adds them).
#: NVMe optimizer offload writes 16 B per parameter, not 12: besides the fp32 master weights and
#: both Adam moments (``OptimizerStateSwapInfo``: the parameter, then its state tensors, one
#: ``<id>.tensor.swp`` file each) it swaps each sub-group's fp32 gradients out to
#: ``<id>_gradient_<offset>_<length>.tensor.swp`` (stage3 ``_swap_out_offload_fp32_gradients`` ->
#: ``OptimizerSwapper._swap_out_gradients``, in ``master_weights_and_grads_dtype``, fp32), and
#: those files stay. The committed records agree: nvme_bytes_used is 16.0 B per parameter for
#: optimizer offload and 18.0 with bf16 parameter offload too (docs/results/h200-1gpu/model-b-nvme).
PLACEMENT: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {
    ("offload_optimizer", "none"): {"gpu": ("gradients", "fp32 master weights", "Adam moments")},
    ("offload_optimizer", "cpu"): {
        "cpu": ("gradients", "fp32 master weights", "Adam moments", "fp32 gradients"),
    },
    ("offload_optimizer", "nvme"): {
        "cpu": ("gradients",),
        "nvme": ("fp32 master weights", "Adam moments", "fp32 gradients"),
    },
    ("offload_param", "none"): {"gpu": ("parameters",)},
    ("offload_param", "cpu"): {"cpu": ("parameters",)},
    ("offload_param", "nvme"): {"nvme": ("parameters",)},
}


def state_bytes(dtype: str, *states: str) -> int:
    """Bytes per parameter of ``states`` (names of :data:`STATE_BYTES_PER_PARAM`) together."""
    sizes = (STATE_BYTES_PER_PARAM[s] for s in states)
    return sum(DTYPE_BYTES[dtype] if size == "dtype" else int(size) for size in sizes)


def bytes_per_param(
    where: str, dtype: str, offload_optimizer: str = "none", offload_param: str = "none"
) -> int:
    """Bytes per parameter of a rank's partition that ``where`` ("gpu", "cpu", "nvme") holds
    under this offload (:data:`PLACEMENT`); leave a key out to count the other one alone."""
    optimizer = PLACEMENT["offload_optimizer", offload_optimizer].get(where, ())
    params = PLACEMENT["offload_param", offload_param].get(where, ())
    return state_bytes(dtype, *optimizer, *params)
