"""DeepSpeed ZeRO-3's memory and step-time model: what a run needs before anything runs.

Pure functions over a :class:`~offload_study.core.contracts.RunSpec`, its DeepSpeed config (the knobs
are read from it) and the cluster's :class:`~offload_study.core.contracts.Calibration`. Names:
P parameters, dp = world_size data-parallel ranks, P_r = ceil(P / dp) the partition a rank owns,
b the bytes of the training dtype, B micro-batch, S sequence, H hidden, F FFN width, L layers,
V vocabulary.

**Memory per GPU** (:func:`gpu_parts`): ZeRO-3 keeps on each GPU its partition of the parameters
(b·P_r, unless offload_param), of the gradients (b·P_r) and of the fp32 master weights and Adam
moments (12·P_r, plus one sub-group's fp32 gradients, unless offload_optimizer); the gathered
(all-gathered or fetched) parameters, up to ``stage3_max_live_parameters`` (only when parameters
must be gathered: dp > 1 or offloaded; what ``stage3_prefetch_bucket_size`` prefetches is part of
them: the records show ~max_live x b, not more); the reduce bucket (``reduce_bucket_size`` elements, b
each); parameters under ``stage3_param_persistence_threshold`` whole on every GPU; and the
activations: with gradient checkpointing each layer's input (L·B·S·H·b) plus the larger of one
recomputed layer (B·S·(8H + 2H·kv/heads + 4F)·b) and the loss (B·S·V·(2b + 8): the logits in
the dtype, the fp32 log-softmax that cross-entropy saves and its fp32 gradient, the gradient in
the dtype), which dominates at large vocabulary and micro-batch; without checkpointing every
layer plus the loss. Under optimizer offload the peak can instead be the first reduce bucket's
flush in the backward (:func:`first_flush_bytes`), whichever holds more.

**Host memory per node** (:func:`host_parts`): each rank's runtime (Python, torch, DeepSpeed; the
CUDA context), measured at two moments: when ``deepspeed.initialize`` returns, holding the
partition as it built the model (b·P_r), and in the steps, beside what is offloaded; the larger
moment counts. With optimizer offload the fp32
master and Adam moments (12·P_r), the fp32 gradients of each sub-group and the gradients in the
dtype (pinned); with parameter offload the parameters (pinned) and the partitions they were
copied from; NVMe offload's pinned swap buffers (``buffer_count`` x ``buffer_size``). On CUDA,
torch's caching host allocator rounds every pinned block up to a power of two. On a CPU
cluster the "GPU" memory of each rank is host memory too. **NVMe per node**: 16 B per parameter
of the optimizer (fp32 master, two moments, fp32 gradient) and b per offloaded parameter
(:data:`offload_study.core.units.PLACEMENT`, which says why 16). Sizes are bytes inside; the
plan.csv row and the budgets it compares are GiB (``cpu_mem_gb`` and the other ``_gb`` keys are
GiB, :mod:`offload_study.core.units`).

**Step time** (:func:`step_time`) adds, per optimizer step of ``gas`` micro-steps::

    gas · (Σ over forward, backward: max(FLOPs / (matmul rate · efficiency) + gradient copies,
           dispatch, collectives) + parameter fetches)
    + PCIe per step + optimizer (CPU Adam: parameters per node / calibrated rate) + NVMe

Each phase's share of the FLOPs and of the dispatch is fixed by its passes
(:func:`~offload_study.prediction.shared.forward_shares`); the pinned gradients' copies to the
host share the device's timeline with the backward's FLOPs (:func:`gradient_copy_seconds`).

FLOPs are ``devices.flops_per_token`` (6N, 8N with recompute, plus attention) x tokens; on a GPU
the efficiency and the per-layer dispatch time (Python hooks of ZeRO-3 that bound small models)
are fitted once for this engine (:data:`FITS`). Collectives: one all-gather per partitioned tensor (above
``stage3_param_persistence_threshold``) and fetch, one reduce-scatter per reduce bucket, each
its latency plus its bytes over the bandwidth. On a CPU cluster one thread per rank runs the
hooks, the blocking gloo collectives and the matmuls in turn, so they add instead of
overlapping, and every term is measured by ``offload_study.prediction.calibrate``, none fitted: dispatch is
the host time of a decoder layer under ZeRO-3 at sizes where FLOPs do not count (eager ops,
autograd, hooks; its forward again when checkpointing recomputes it) and of the rest of a
micro-step, from its probe, grown to the run's size at the rate the probe measured;
collectives its gloo latency and bandwidth; compute the calibrated matmul rate shared by the
node's ranks. Transfers are not overlapped with compute,
which is the form of the ZeRO-Infinity paper's efficiency (Rajbhandari et al., "ZeRO-Infinity:
Breaking the GPU Memory Wall for Extreme Scale Deep Learning", SC'21, sec. 4.1):
``efficiency = ait·bw / (ait·bw + peak)`` with ``ait`` the FLOPs per byte moved, i.e.
compute time / (compute time + transfer time).

**Newer modes** (offload_study.planning.modes), from DeepSpeed 0.19.8's source: partial offload
(``offload_optimizer.ratio``) keeps whole sub-groups on the GPU (:func:`optimizer_split`);
SuperOffload and ZenFlow change where and when CPU Adam runs (:func:`host_optimizer_seconds`;
SuperOffload's host step is calibrate's measurement through DeepSpeed's own worker where the
calibration has it, :func:`superoffload_seconds`) and ZenFlow adds its selected columns and
double buffers; what the model cannot know is said
in plan.csv's ``note`` (:func:`mode_note`).

**Feasibility** (:func:`refusal`): a run is refused only when a prediction passes its budget by
more than the model's own measured error (:data:`MARGINS`, docs/benchmarks.md "prediction
accuracy"), so a run that would just fit still runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from offload_study.core import units
from offload_study.core.contracts import Calibration, RunSpec
from offload_study.prediction.shared import (
    DTYPE_BYTES,
    GB,
    PARAM_FETCHES,
    CalibrationLayout,
    EngineFit,
    Memory,
    ModelShape,
    StepTime,
    activation_parts,
    dispatch_seconds,
    flops_per_micro_step,
    forward_shares,
    layer_activation_bytes,
    loss_blocks_bytes,
    model_shape,
    pow2_bytes,
    reserved_vector,
    step_pass_rate,
)

#: This engine's name in the registry and in the calibration's probes (Calibration.layer_host_s).
ENGINE_NAME = "deepspeed"

#: This engine's constants per accelerator kind. H200 records (docs/results): ZeRO-3's matmuls
#: reach ~56 % of the calibrated rate and take 0.0235 s per layer and micro-step whatever the
#: model's size (ZeRO-3's hooks per parameter), a third of it in the forward
#: (shared.forward_shares): benchmarks/prediction_accuracy.py's step fit over every committed
#: GPU record; FusedAdam updates ~3e10 parameters/s. A rank's runtime is
#: measured, not fitted: its resident memory without offload once deepspeed.initialize returns,
#: 1.44 GiB, and after the first step, 2.04 GiB (benchmarks/raw_deepspeed.py's
#: host_memory_gib_by_stage, 134M and 1.35B alike: docs/results/h200-1gpu/host-runtime-2026-12-02/).
#: CPU: the calibrated matmul rate as measured (no efficiency), the host time per layer from the
#: calibration's probe (0.004 s only for a calibration without one), ~0.55 GiB per rank before the
#: model (the default study's records on the 2-core development machine, docs/benchmarks.md).
FITS = {
    "cuda": EngineFit(0.56, 0.0235, 3e10, 2.04, runtime_at_init_gib=1.44),
    "cpu": EngineFit(1.0, 0.004, None, 0.55),
}


#: Bytes per parameter of the fp32 master weights and both Adam moments, and of fp32 gradients
#: (wherever they are: the table is core.units's).
ADAM_BYTES = float(units.state_bytes("fp32", "fp32 master weights", "Adam moments"))


FP32_GRAD_BYTES = float(units.state_bytes("fp32", "fp32 gradients"))

#: SuperOffload's CPU Adam worker (runtime/superoffload/superoffload_utils.py), a process of its
#: own beside the rank: what it holds beyond the Adam moments it steps, i.e. its own Python,
#: torch and CUDA runtime. Measured, not fitted: the rank's process tree less the rank and the
#: moments, 0.74-0.97 GiB (median 0.92) in the four runs of model A at the default sub-group
#: size (docs/results/h200-1gpu/superoffload-launch-h200/, host_peak_tree_gib).
SUPEROFFLOAD_WORKER_GIB = 0.92


#: Defaults of DeepSpeed 0.19's ZeRO-3 config for knobs a config leaves out.
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 5e8,
    "stage3_max_live_parameters": 1e9,
    "stage3_param_persistence_threshold": 1e5,
    "sub_group_size": 1e9,
    "contiguous_gradients": True,
    # None in DeepSpeedZeroConfig, made True for stage 3 by its validator overlap_comm_valid
    "overlap_comm": True,
}


ALIASES = {
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
}


#: offload block key -> DeepSpeed's default (offload_param: 5 x 1e8, offload_optimizer: 4).
OFFLOAD_DEFAULTS = {
    "buffer_count": {"param": 5, "optimizer": 4},
    "buffer_size": 1e8,
    "max_in_cpu": 1e9,
}


#: ZenFlowConfig's defaults in DeepSpeed 0.19.8 (runtime/zenflow/zenflow_config.py) for the keys
#: the model reads.
ZENFLOW_DEFAULTS = {
    "topk_ratio": 0.1,
    "update_interval": "auto",
    "overlap_step": False,
    "pt_reserved_cores_perc": 0.5,
}


#: DeepSpeed's fp16 overflow check on the host per CPU Adam's rate with the same cores, for a
#: calibration without ``fp16_check_elems_per_s``: benchmarks/fp16_check.py (docs/benchmarks.md).
FP16_CHECK_PER_ADAM = 0.24


#: SuperOffload's share of the cores for its CPU Adam worker, DeepSpeed 0.19.8's default
#: (offload_optimizer.cpuadam_cores_perc; calibrate's SuperOffload probe splits them so)
SUPEROFFLOAD_CORES_PERC = 0.8


@dataclass(frozen=True)
class Knobs:
    """The ZeRO-3 knobs memory depends on, as the generated DeepSpeed config sets them."""

    reduce_bucket: int
    max_live: int
    persistence: int
    sub_group: int
    contiguous_gradients: bool
    overlap_comm: bool  # the gradients reduced on a stream of their own (else the default one)
    param_buffers: int  # offload_param: buffer_count x buffer_size (elements)
    max_in_cpu: int  # offload_param (NVMe): parameters kept in host memory
    optimizer_buffer_count: int
    pin_memory: bool
    # the newer modes (offload_study.planning.modes), as the offload_optimizer block and zenflow set them
    ratio: float = 1.0  # offload_optimizer.ratio: the share of sub-groups on the CPU
    super_offload: bool = False
    cpuadam_cores_perc: float = SUPEROFFLOAD_CORES_PERC  # SuperOffload's worker: its share
    zenflow: dict | None = None  # zero_optimization.zenflow (None: off)
    clipping: float = 0.0  # gradient_clipping (SuperOffload steps synchronously when set)


def knobs(ds_config: dict) -> Knobs:
    zero = ds_config.get("zero_optimization", {})

    def value(key):
        short = ALIASES.get(key, key)
        return zero.get(key, zero.get(short, DEEPSPEED_DEFAULTS[key]))

    param = zero.get("offload_param") or {}
    optimizer = zero.get("offload_optimizer") or {}
    pinned = (param or optimizer).get("pin_memory", True)
    counts = OFFLOAD_DEFAULTS["buffer_count"]
    return Knobs(
        reduce_bucket=int(value("reduce_bucket_size")),
        max_live=int(value("stage3_max_live_parameters")),
        persistence=int(value("stage3_param_persistence_threshold")),
        sub_group=int(value("sub_group_size")),
        contiguous_gradients=bool(value("contiguous_gradients")),
        overlap_comm=bool(value("overlap_comm")),
        param_buffers=int(param.get("buffer_count", counts["param"]))
        * int(param.get("buffer_size", OFFLOAD_DEFAULTS["buffer_size"])),
        max_in_cpu=int(param.get("max_in_cpu", OFFLOAD_DEFAULTS["max_in_cpu"])),
        optimizer_buffer_count=int(optimizer.get("buffer_count", counts["optimizer"])),
        pin_memory=bool(pinned),
        ratio=float(optimizer.get("ratio", 1.0)),
        super_offload=bool(optimizer.get("super_offload", False)),
        cpuadam_cores_perc=float(optimizer.get("cpuadam_cores_perc", SUPEROFFLOAD_CORES_PERC)),
        zenflow=dict(zero["zenflow"]) if zero.get("zenflow") is not None else None,
        clipping=float(ds_config.get("gradient_clipping") or 0.0),
    )


def partition(spec: RunSpec, shape: ModelShape) -> int:
    return math.ceil(shape.params / spec.world_size)


def overflow_check_bytes(spec: RunSpec, part: int) -> float:
    """fp16's overflow check at the start of the optimizer step (DeepSpeed 0.19.8 stage3.py
    ``has_overflow``): ``torch.isinf(self.grad_partitions_flat_buffer).any()``, then the same
    with ``isnan``, one after the other, over the rank's whole gradient partition where that
    buffer lives (the host under optimizer offload, else the GPU). ATen's ``isinf`` of a
    floating tensor is ``self.abs() == inf``: a copy of the buffer in its dtype (the model's:
    no ``grad_accum_dtype`` is set) and a bool mask, 1 byte per element, held together.
    bf16 and fp32 steps check nothing."""
    return float(part * (DTYPE_BYTES[spec.dtype] + 1)) if spec.dtype == "fp16" else 0.0


def gpu_parts(spec: RunSpec, shape: ModelShape, k: Knobs) -> dict[str, float]:
    """Bytes per GPU at the peak, by what holds them."""
    b, part = DTYPE_BYTES[spec.dtype], partition(spec, shape)
    opt_here, params_here = spec.offload_optimizer == "none", spec.offload_param == "none"
    gathered = spec.world_size > 1 or not params_here
    small = persistent_params(shape, k)
    # a CPU rank's bucket is host memory: only the pages the gradients fill become resident
    bucket = k.reduce_bucket if spec.accelerator == "cuda" else min(k.reduce_bucket, shape.params)
    kept = optimizer_split(spec, shape, k).device_params  # sub-groups whose optimizer is here
    activations = activation_parts(spec, shape)
    # the optimizer step makes one sub-group's fp32 gradients at a time (and, in fp16, checks
    # the gradient buffer for overflow first), after the backward freed the activations and
    # the loss: only what it needs beyond those adds to the peak
    one_group = FP32_GRAD_BYTES * min(k.sub_group, part) if opt_here else 0.0
    in_the_step = max(one_group, overflow_check_bytes(spec, part) if opt_here else 0.0)
    step_beyond_freed = max(0.0, in_the_step - sum(activations.values()))
    parts = {
        "parameters (partition)": b * part if params_here else 0.0,
        "gradients (partition)": b * part if opt_here else 0.0,
        "fp32 master + Adam moments": ADAM_BYTES * kept,
        "optimizer step: one sub-group's fp32 gradients or the overflow check": step_beyond_freed,
        # partial offload: each GPU sub-group keeps its own fp32 gradient tensor
        "fp32 gradients of the GPU sub-groups": 0.0 if opt_here else FP32_GRAD_BYTES * kept,
        "gathered parameters": b * min(k.max_live, shape.params) if gathered else 0.0,
        "persistent small parameters": float(b * small),
        "reduce bucket": float(b * bucket) if k.contiguous_gradients else 0.0,
        **zenflow_gpu_parts(spec, part, k),
        **activations,
    }
    flush = first_flush_bytes(spec, shape, k, parts)
    return {**parts, FIRST_FLUSH: max(0.0, flush - sum(parts.values()))} if flush else parts


#: the part of the GPU peak that optimizer offload's first reduce-bucket flush adds
FIRST_FLUSH = "optimizer offload: the first reduce bucket's flush, beyond the loss's moment"

#: DeepSpeed 0.19.8 takes a gradient's norm in chunks of this many elements (stage3.py
#: ``_constant_buffered_norm2``), each copied to fp64 (``get_norm_dtype``) first
NORM_CHUNK = 250_000_000
NORM_BYTES = 8


def first_bucket(shape: ModelShape, k: Knobs) -> tuple[list[int], int, float]:
    """The tensors of the first reduce bucket of a backward (gradients arrive in reverse
    parameter order; a bucket is flushed when the next gradient would overflow it) in
    parameter order, the tensor whose gradient flushes it (0 when the model fits), and the
    share of that tensor's decoder layer already back-propagated when it does."""
    taken, total = [], 0
    for n in reversed(shape.tensors):
        if taken and total + n > k.reduce_bucket:
            return taken[::-1], n, layer_share_done(shape, total)
        taken.append(n)
        total += n
    return taken[::-1], 0, 0.0


def layer_share_done(shape: ModelShape, from_the_end: int) -> float:
    """The share of a decoder layer's elements back-propagated when the gradients of the last
    ``from_the_end`` elements (in parameter order) have arrived: the layers are the run of
    ``layers`` groups of ``layer_params`` elements found walking back from the end, after the
    head's tensors (the final norm, an untied head)."""
    tensors, stack = shape.tensors, shape.layers * shape.layer_params
    for tail in range(len(tensors)):
        tail_elems = sum(tensors[len(tensors) - tail :])
        ends, walked = set(), 0
        for n in reversed(tensors[: len(tensors) - tail]):
            walked += n
            ends.add(walked)
            if walked >= stack:
                break
        if all(i * shape.layer_params in ends for i in range(1, shape.layers + 1)):
            inside = from_the_end - tail_elems
            return (inside % shape.layer_params) / shape.layer_params if 0 < inside < stack else 0.0
    return 0.0


def first_flush_bytes(spec: RunSpec, shape: ModelShape, k: Knobs, parts: dict) -> float:
    """What the GPU holds while the first reduce bucket of a backward is flushed under
    optimizer offload (0 without). At the gradient boundary DeepSpeed 0.19.8 (stage3.py
    ``partition_grads`` -> ``_offload_grad_partition_at_boundary``) brings each reduced
    gradient of the bucket, in parameter order, back to the GPU from its host buffer and takes
    its norm through an fp64 copy (:data:`NORM_CHUNK` elements at a time), beside the reduced
    bucket; with NVMe it also keeps an fp32 copy of each until the bucket is swapped out. The
    first flush comes in the backward, with the output head's gradient (the largest) in it,
    the checkpointed inputs, what is left of the layer being recomputed and the gradient that
    flushed it live too: with wide layers or a large head this moment, not the loss's, is the
    allocated peak (the allocator traces of model G and of ``fidelity-h100-order``'s NVMe run:
    docs/benchmarks.md)."""
    if spec.offload_optimizer == "none":
        return 0.0
    b, ranks = DTYPE_BYTES[spec.dtype], spec.world_size
    bucket, trigger, done = first_bucket(shape, k)
    keeps_fp32 = FP32_GRAD_BYTES if spec.offload_optimizer == "nvme" else 0.0
    in_flight, before = 0.0, 0.0
    for n in bucket:  # the fp32 copies of the earlier ones, this one's copy and fp64 norm
        here = b * n / ranks + NORM_BYTES * min(n / ranks, NORM_CHUNK)
        in_flight = max(in_flight, keeps_fp32 * before / ranks + here)
        before += n
    held = ("parameters (partition)", "gathered parameters", "persistent small parameters")
    checkpoints = parts.get(
        "checkpointed layer inputs", parts.get("activations of every layer", 0.0)
    )
    # what the recomputed layer saved is freed as its backward goes (taken here in proportion
    # to its parameters' gradients already made)
    layer = layer_activation_bytes(spec, shape) * (1 - done) if spec.gradient_checkpointing else 0.0
    return (
        sum(parts[name] for name in held)
        + parts["reduce bucket"]
        + b * sum(bucket) / ranks  # the reduced bucket
        + b * trigger  # the gradient that flushed it
        + checkpoints
        + layer
        + in_flight
    )


def persistent_params(shape: ModelShape, k: Knobs) -> int:
    """Elements of the tensors ZeRO-3 keeps whole on every rank: DeepSpeed 0.19.8
    (parameter_offload.py, ``mark_persistent_parameters``) persists each tensor of at most
    ``stage3_param_persistence_threshold`` elements (a Llama's norms, a Qwen2's biases)."""
    return sum(n for n in shape.tensors if n <= k.persistence)


def zenflow_gpu_parts(spec: RunSpec, part: int, k: Knobs) -> dict[str, float]:
    """ZenFlow's selective optimizer on the GPU: for the top-k share of the partition its Adam
    moments (the dtype, ``zenflow_torch_adam``: zeros_like of the selected columns; on the host
    with ``zenflow.offload``), the selected gradient and the copy of the selected parameters."""
    if k.zenflow is None:
        return {}
    b, selected = DTYPE_BYTES[spec.dtype], zenflow_topk(k) * part
    moments = 0.0 if k.zenflow.get("offload") else 2.0 * b * selected
    return {
        "ZenFlow selected columns: Adam moments": moments,
        "ZenFlow selected columns: gradient + parameter copy": 2.0 * b * selected,
    }


def zenflow_topk(k: Knobs) -> float:
    return float((k.zenflow or {}).get("topk_ratio", ZENFLOW_DEFAULTS["topk_ratio"]))


def sub_groups(spec: RunSpec, shape: ModelShape, k: Knobs) -> list[int]:
    """Elements of each optimizer sub-group of a rank, as DeepSpeed 0.19.8's
    ``_create_fp16_sub_groups`` forms them: parameter partitions (ceil(n / dp) each) in module
    order, a group closed once it reaches ``sub_group_size`` (so groups overshoot it)."""
    dp, groups, current = spec.world_size, [], 0
    for numel in shape.tensors:
        current += math.ceil(numel / dp)
        if current >= k.sub_group:
            groups.append(current)
            current = 0
    return groups + ([current] if current else [])


@dataclass(frozen=True)
class OptimizerSplit:
    """A rank's sub-groups by where their optimizer runs: ``device`` keeps fp32 master, Adam
    moments and fp32 gradients on the GPU (torch AdamW there), ``host`` is offloaded."""

    device: tuple[int, ...]
    host: tuple[int, ...]

    @property
    def device_params(self) -> int:
        return sum(self.device)

    @property
    def host_params(self) -> int:
        return sum(self.host)


def optimizer_split(spec: RunSpec, shape: ModelShape, k: Knobs) -> OptimizerSplit:
    """Partial offload (``offload_optimizer.ratio``) assigns whole sub-groups by count:
    DeepSpeed 0.19.8 (stage3.py ``_create_fp32_partitions``) sends sub-group i of n to the
    CPU when i >= int((1 - ratio) x n); the first ones stay on the GPU."""
    groups = sub_groups(spec, shape, k)
    if spec.offload_optimizer == "none":
        return OptimizerSplit(tuple(groups), ())
    if spec.offload_optimizer == "nvme":
        return OptimizerSplit((), tuple(groups))
    first_host = int((1 - k.ratio) * len(groups))
    return OptimizerSplit(tuple(groups[:first_host]), tuple(groups[first_host:]))


def pinned_host(spec: RunSpec, k: Knobs) -> bool:
    """Offloaded buffers are pinned (torch's caching host allocator, power-of-two blocks)."""
    return spec.accelerator == "cuda" and bool(k.pin_memory)


def runtime_bytes(spec: RunSpec, cal: Calibration | None = None) -> tuple[int, int]:
    """A rank's host memory beside its model, (when deepspeed.initialize returns, in the
    steps): as the cluster's calibration measured it on its machine, else :data:`FITS`'s."""
    fit = FITS[spec.accelerator]
    at_init, steps = fit.runtime_at_init, fit.runtime_gib
    if cal is not None and cal.runtime_gib is not None and cal.accelerator == spec.accelerator:
        steps = cal.runtime_gib
        at_init = steps if cal.runtime_at_init_gib is None else cal.runtime_at_init_gib
    return units.gib_to_bytes(at_init), units.gib_to_bytes(steps)


def rank_host_parts(
    spec: RunSpec, shape: ModelShape, k: Knobs, cal: Calibration | None = None
) -> dict[str, float]:
    """Host bytes of one rank by what holds them (device memory of a CPU rank not included)."""
    b, part = DTYPE_BYTES[spec.dtype], partition(spec, shape)
    buf = pow2_bytes if pinned_host(spec, k) else float
    runtime_at_init, runtime = runtime_bytes(spec, cal)
    parts = {"runtime": float(runtime)}
    if spec.offload_optimizer == "cpu":
        parts.update(offloaded_optimizer_host_parts(spec, shape, k, buf))
    if spec.offload_optimizer == "nvme":
        largest = max(sub_groups(spec, shape, k))
        parts["fp32 gradient buffer"] = FP32_GRAD_BYTES * largest
        # each swap buffer holds one fp32 tensor of the largest sub-group
        parts["optimizer swap buffers (locked)"] = 4.0 * largest * k.optimizer_buffer_count
    if spec.offload_optimizer != "none":
        parts["gradients (pinned)"] = buf(float(b * part))
        # the gradient buffer lives on the host: so do the overflow check's copy and mask
        parts["fp16 overflow check (|gradients| and a bool mask, in the step)"] = (
            overflow_check_bytes(spec, part)
        )
    if spec.offload_param != "none":
        # the flat buffer the partitions are copied into (for NVMe up to max_in_cpu), while the
        # memory they were built in stays with the process
        in_cpu = part if spec.offload_param == "cpu" else min(part, k.max_in_cpu)
        parts["parameters (pinned flat buffer)"] = buf(float(b * in_cpu))
        parts["parameters as first placed"] = float(b * part)
    if spec.offload_param == "nvme":
        parts["parameter swap buffers (pinned)"] = float(b * k.param_buffers)
    # Two moments: deepspeed.initialize holds the partition as zero.Init built it (it moves
    # the partitions to the host to defragment the GPU) beside the runtime of that moment;
    # the steps hold the offloaded states beside the runtime the first step grew to. The
    # first counts only where it is the larger.
    beyond = max(0.0, runtime_at_init + b * part - sum(parts.values()))
    parts["model as built (partition) at initialization, beyond the steps"] = beyond
    return parts


def offloaded_optimizer_host_parts(spec: RunSpec, shape: ModelShape, k: Knobs, buf) -> dict:
    """Host bytes of a CPU-offloaded optimizer: its sub-groups' fp32 master and Adam moments and
    their pinned fp32 gradients; with partial offload the GPU sub-groups' fp32 gradients are
    made in a pinned host buffer first and moved (:func:`cached_staging_bytes`); ZenFlow's
    extra buffers; SuperOffload's worker process (the rank's process tree holds it)."""
    split, b = optimizer_split(spec, shape, k), DTYPE_BYTES[spec.dtype]
    staging = cached_staging_bytes(split) if pinned_host(spec, k) else 0.0
    parts = {
        "fp32 master + Adam moments": ADAM_BYTES * split.host_params,
        "fp32 gradients (pinned, per sub-group)": sum(buf(FP32_GRAD_BYTES * g) for g in split.host),
        "fp32 gradient staging of the GPU sub-groups (pinned, cached)": staging,
    }
    if k.super_offload:
        # Each sub-group's fp32 gradients go to the worker through a multiprocessing queue, in
        # shared memory: measured, the rank holds 4 bytes per offloaded parameter beyond plain
        # offload's rank less the moments (docs/benchmarks.md). The moments move to the worker,
        # so the tree holds them once, as counted above.
        parts["SuperOffload: fp32 gradients shared with its worker"] = (
            FP32_GRAD_BYTES * split.host_params
        )
        parts["SuperOffload: its CPU Adam worker's runtime"] = units.gib_to_bytes(
            SUPEROFFLOAD_WORKER_GIB
        )
    zf = k.zenflow
    if zf is not None and zf.get("overlap_step", ZENFLOW_DEFAULTS["overlap_step"]):
        # engine_stage3.initialize_optimizer_states: two fp32 gradient buffers per sub-group
        # (the step of one overlaps the next); zenflow_utils: a stale fp32 copy in shared memory
        parts["ZenFlow second fp32 gradient buffer"] = 4.0 * split.host_params
        parts["ZenFlow stale fp32 parameters (shared)"] = 4.0 * split.host_params
    if zf is not None and zf.get("offload"):
        parts["ZenFlow selected Adam moments (pinned)"] = buf(
            2.0 * b * zenflow_topk(k) * partition(spec, shape)
        )
    return parts


def cached_staging_bytes(split: OptimizerSplit) -> float:
    """Pinned staging that torch's caching host allocator still holds at the step. Each GPU
    sub-group's fp32 gradients are made in a pinned host buffer and moved (DeepSpeed 0.19.8
    stage3.py ``_create_fp32_partitions``); the freed block stays cached in the free list of
    its power-of-two size (ATen ``CachingHostAllocator``: one list per log2 size, a request
    takes a block of its own size only). The host sub-groups' pinned fp32 gradients, made after
    the GPU ones, take those blocks first: what is left is one block per size of the GPU
    sub-groups that no host sub-group takes. Pageable staging is freed to the OS (0 here)."""
    cached = {pow2_bytes(FP32_GRAD_BYTES * g) for g in split.device}
    taken = {pow2_bytes(FP32_GRAD_BYTES * g) for g in split.host}
    return sum(cached - taken)


def nvme_parts(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """Swap-file bytes per node (every rank of the node swaps its partition), per parameter as
    :func:`offload_study.core.units.bytes_per_param` counts them on NVMe."""
    ranks, part = spec.gpus_per_node, partition(spec, shape)
    optimizer = units.bytes_per_param("nvme", spec.dtype, offload_optimizer=spec.offload_optimizer)
    params = units.bytes_per_param("nvme", spec.dtype, offload_param=spec.offload_param)
    parts = {}
    if optimizer:
        parts["optimizer states + fp32 gradients"] = float(optimizer * part * ranks)
    if params:
        parts["parameters"] = float(params * part * ranks)
    return parts


def predict_memory(spec: RunSpec, ds_config: dict, cal: Calibration | None = None) -> Memory | None:
    """The memory prediction of a run (None when the model's shape is unknown); ``cal`` gives
    the host runtime its machine measured (:func:`runtime_bytes`)."""
    shape = model_shape(spec)
    if shape is None:
        return None
    k = knobs(ds_config)
    gpu = gpu_parts(spec, shape, k)
    rank = rank_host_parts(spec, shape, k, cal)
    if spec.accelerator == "cpu":  # a CPU rank's "GPU" memory is host memory too
        rank = {**rank, **{f"device: {name}": v for name, v in gpu.items()}}
    host = {name: v * spec.gpus_per_node for name, v in rank.items()}
    return Memory(gpu=gpu, host=host, nvme=nvme_parts(spec, shape))


def reserved_features(spec: RunSpec, ds_config: dict) -> tuple[float, ...]:
    """The size of each of :data:`RESERVED_CAUSES` for a run, bytes (0 for a cause that is not
    its engine's or mode's; all 0 when the model's shape is unknown)."""
    shape = model_shape(spec)
    if shape is None:
        return reserved_vector({})
    b, k, part = DTYPE_BYTES[spec.dtype], knobs(ds_config), partition(spec, shape)
    gathered = spec.world_size > 1 or spec.offload_param != "none"
    # with overlap_comm the reduction has a stream of its own, whose cached blocks no other
    # allocation reuses; without, it runs on the default stream (stage3.py
    # reduce_and_partition_stream), whose freed blocks the next allocations take
    on_its_stream = k.contiguous_gradients and k.overlap_comm
    first = min(k.reduce_bucket, shape.params)
    second = min(k.reduce_bucket, shape.params - first)
    buckets = b * (first + second) if on_its_stream else 0.0
    overflow = overflow_check_bytes(spec, part) if spec.offload_optimizer == "none" else 0.0
    return reserved_vector(
        {
            "the reduction stream's buckets": buckets,
            "the fp16 overflow check on the GPU": overflow,
            "gathered parameters": b * min(k.max_live, shape.params) if gathered else 0.0,
            "one layer's parameters": b * shape.params / shape.layers,
            "the loss's blocks, ZeRO-3": loss_blocks_bytes(spec, shape),
        }
    )


def known_reserved_bytes(spec: RunSpec, ds_config: dict) -> float:
    """Reserved beyond the allocated peak by blocks whose size is known, counted whole (not
    weighed by a fitted weight): under NVMe optimizer offload DeepSpeed 0.19.8 makes an fp32 copy
    of each gradient of a reduce bucket (stage3.py ``partition_grads`` ->
    ``_offload_grad_partition_at_boundary``: ``grad_buffer.to(master dtype)``) and holds them
    all until the bucket is swapped out: 4 bytes x the rank's share of a bucket. They live in
    the backward, where the reserved peak falls (the traces of model-b's NVMe and CPU optimizer
    offload: docs/benchmarks.md, "the NVMe rows"); what of them the allocated peak already holds
    (:func:`first_flush_bytes`) is not counted twice."""
    shape = model_shape(spec)
    if spec.offload_optimizer != "nvme" or shape is None:
        return 0.0
    k = knobs(ds_config)
    bucket = min(k.reduce_bucket, shape.params)
    # where the flush is the allocated peak, part of the copies is in it already
    in_allocated = gpu_parts(spec, shape, k).get(FIRST_FLUSH, 0.0)
    return max(0.0, FP32_GRAD_BYTES * bucket / spec.world_size - in_allocated)


def own_estimate(spec: RunSpec) -> tuple[float, float] | None:
    """(GiB per GPU, GiB per node) from DeepSpeed's own estimator for this offload (model states
    only; NVMe counted as CPU offload): ``estimate_zero3_model_states_mem_needs``, the function
    ``estimate_zero3_model_states_mem_needs_all_cold`` prints its table from."""
    shape = model_shape(spec)
    if shape is None:
        return None
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=shape.params,
        largest_layer_params=shape.largest_layer_params,
        num_gpus_per_node=spec.gpus_per_node,
        num_nodes=spec.nodes,
        cpu_offload=spec.offload_optimizer != "none",
        cpu_offload_params=spec.offload_param != "none",
        zero_init=True,
    )
    return units.bytes_to_gib(gpu), units.bytes_to_gib(cpu)


def pcie_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration, k: Knobs) -> float:
    """Host <-> device copies of one optimizer step on one GPU that add after its micro-steps
    (none on a CPU cluster; the pinned gradients' copies are on the device's timeline:
    :func:`gradient_copy_seconds`).

    Optimizer offload: without parameter offload the updated fp32 master of the offloaded sub-groups is copied into the
    GPU's partition once per step (:func:`master_upload_seconds`; with ZenFlow once per update
    interval; the step copies it on the host when the parameters live there). Parameter offload: each fetch
    of a micro-step copies the rank's partition to the GPU. With ``pin_memory`` off the copies
    cannot overlap anything and go at the pageable rate (the calibration's host-to-device one;
    device-to-host from pageable memory is not measured apart): each micro-step's gradients to
    the host buffer and back to the GPU to be added, and the fp32 gradients of the offloaded
    sub-groups to the host at the boundary.
    """
    if spec.accelerator != "cuda" or not cal.h2d_gb_s:
        return 0.0
    b, part, gas = DTYPE_BYTES[spec.dtype], partition(spec, shape), spec.gradient_accumulation_steps
    seconds = 0.0
    pageable = (cal.pageable_h2d_gb_s or cal.h2d_gb_s) * GB
    if spec.offload_optimizer != "none":
        offloaded = optimizer_split(spec, shape, k).host_params
        # unpinned: every copy waits for the CPU to stage it (stage3.partition_grads)
        if not k.pin_memory:
            seconds += (gas * 2 * b * part + 4 * offloaded) / pageable
        if spec.offload_param == "none":
            seconds += master_upload_seconds(offloaded, cal) / zenflow_update_interval(k)
    if spec.offload_param != "none":
        seconds += gas * PARAM_FETCHES * b * part / (cal.h2d_gb_s * GB)
    return seconds


def gradient_copy_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration, k: Knobs) -> float:
    """Optimizer offload, pinned: every micro-step the gradients of every parameter go to the
    host (DeepSpeed 0.19.8 stages all of them in one host buffer, whatever the ratio),
    asynchronously on the device's copy engine as each bucket is reduced. The backward's
    compute and these copies share the device's timeline (the bucket is reused only once its
    copy is done), while the host's dispatch overlaps both: the records show a dispatch-bound
    backward as long with them as without, a FLOPs-bound one longer by about their time
    (:attr:`StepTime.device_wait_s`). Unpinned copies wait for the CPU (:func:`pcie_seconds`)."""
    if spec.accelerator != "cuda" or not cal.h2d_gb_s or spec.offload_optimizer == "none":
        return 0.0
    if not k.pin_memory:
        return 0.0
    b, part = DTYPE_BYTES[spec.dtype], partition(spec, shape)
    return spec.gradient_accumulation_steps * b * part / ((cal.d2h_gb_s or cal.h2d_gb_s) * GB)


def nvme_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration, k: Knobs) -> float:
    """Swap traffic of one step per node (the node's ranks share its disk).

    Optimizer: the fp32 master and both moments (12 B per parameter) read and written.
    Parameters: the first ``max_in_cpu`` of the partition stay in the host's flat buffer
    (stage3.py ``_create_fp16_partitions_with_defragmentation`` keeps each sub-group there
    while it fits; the fetches copy them over PCIe, :func:`pcie_seconds`); only the rest is
    swapped: written once after the step, read once per fetch, or once per step when the swap
    buffers hold it whole. The records agree: model B's forward takes as long with its
    parameters on NVMe as with them on the GPU.
    """
    if not (spec.uses_nvme and cal.disk_read_gb_s and cal.disk_write_gb_s):
        return 0.0
    ranks, part, b = spec.gpus_per_node, partition(spec, shape), DTYPE_BYTES[spec.dtype]
    read = write = 0.0
    if spec.offload_optimizer == "nvme":
        read += ADAM_BYTES * part
        write += ADAM_BYTES * part
    swapped = max(0, part - k.max_in_cpu) if spec.offload_param == "nvme" else 0
    if swapped:
        fetches = (
            1 if swapped <= k.param_buffers else PARAM_FETCHES * spec.gradient_accumulation_steps
        )
        read += fetches * b * swapped
        write += b * swapped
    return ranks * (read / (cal.disk_read_gb_s * GB) + write / (cal.disk_write_gb_s * GB))


def optimizer_seconds(
    spec: RunSpec, shape: ModelShape, cal: Calibration, k: Knobs, compute_s: float = 0.0
) -> float:
    """The optimizer of one step. On a CPU cluster every sub-group runs on the node's cores at
    the CPU Adam rate (all ranks share them). On a GPU: the sub-groups kept on the GPU at the
    device rate (:data:`FITS`; partial offload steps them with torch's AdamW, not calibrated
    apart), plus CPU Adam over the offloaded sub-groups of every rank of the node (they share
    its cores and memory bandwidth); ZenFlow and SuperOffload change the CPU part
    (:func:`host_optimizer_seconds`). ``compute_s`` is the step's micro-steps, which ZenFlow's
    overlap_step hides CPU Adam behind."""
    split = optimizer_split(spec, shape, k)
    device_rate = FITS[spec.accelerator].optimizer_params_per_s
    check_s = overflow_check_seconds(spec, shape, cal)
    if device_rate is None:
        return check_s + partition(spec, shape) * spec.gpus_per_node / cal.cpu_adam_params_per_s
    device_s = split.device_params / device_rate
    if k.zenflow is not None:  # the GPU also steps the top-k columns of every parameter
        device_s += zenflow_topk(k) * partition(spec, shape) / device_rate
    if k.super_offload and cal.superoffload_step_params_per_s:
        host_s, last_s = superoffload_seconds(spec, cal, k, split.host)
        return check_s + device_s + superoffload_exposed(k, host_s, last_s, compute_s)
    per_param_s = host_step_seconds_per_param(spec, cal)
    host_s = split.host_params * spec.gpus_per_node * per_param_s
    largest = max(split.host, default=0) * spec.gpus_per_node * per_param_s
    return check_s + device_s + host_optimizer_seconds(spec, k, host_s, largest, compute_s)


def superoffload_seconds(
    spec: RunSpec, cal: Calibration, k: Knobs, host_groups: tuple[int, ...]
) -> tuple[float, float]:
    """SuperOffload's host step over the offloaded sub-groups, all of them and the last one,
    from calibrate's probe through DeepSpeed's own worker (``superoffload_step_params_per_s``):
    each sub-group's round trip plus its parameters at the probe's rate, which a worker given
    another share of the cores than the probe's (:data:`SUPEROFFLOAD_CORES_PERC`) scales in
    proportion; the node's ranks each feed a worker on the same cores."""
    per_param = SUPEROFFLOAD_CORES_PERC / k.cpuadam_cores_perc / cal.superoffload_step_params_per_s
    if spec.offload_param != "none":  # the master's copy into the bf16 partition on the host
        per_param += 1 / step_pass_rate(cal, "master_copy_params_per_s")
    round_trip = cal.superoffload_sub_group_s or 0.0
    ranks = spec.gpus_per_node
    host_s = ranks * (sum(host_groups) * per_param + len(host_groups) * round_trip)
    last_s = ranks * (max(host_groups, default=0) * per_param + round_trip)
    return host_s, last_s


def superoffload_exposed(k: Knobs, host_s: float, last_s: float, compute_s: float) -> float:
    """What of SuperOffload's host step shows: with ``gradient_clipping`` (our dsconfig sets
    1.0) every sub-group waits for the global norm and steps at the step (superoffload_stage3
    ``_step_with_clipping``); without, each starts when the backward completes its gradients,
    so all but the last overlap the backward (2/3 of the compute)."""
    return host_s if k.clipping else max(last_s, host_s - 2 / 3 * compute_s)


def host_step_seconds_per_param(spec: RunSpec, cal: Calibration) -> float:
    """Host seconds per offloaded parameter of a GPU rank's ZeRO-3 step, one pass after another
    over each sub-group (stage3.py ``step``): the unscale of its fp32 gradient, CPU Adam, and
    with the parameters offloaded the copy of the fp32 master into the bf16 partition on the
    host (without, that copy goes to the GPU: :func:`master_upload_seconds`)."""
    passes = ["grad_unscale_params_per_s"]
    if spec.offload_param != "none":
        passes.append("master_copy_params_per_s")
    return 1 / cal.cpu_adam_params_per_s + sum(1 / step_pass_rate(cal, p) for p in passes)


def master_upload_seconds(offloaded: int, cal: Calibration) -> float:
    """The updated fp32 master of ``offloaded`` parameters copied into their bf16 partition on
    the GPU, at the calibrated rate of that copy (calibrate.step_passes_at: torch converts on
    the host, then copies unpinned); a calibration without it: 4 B per parameter at the
    unpinned host-to-device rate."""
    if cal.master_upload_params_per_s:
        return offloaded / cal.master_upload_params_per_s
    return 4 * offloaded / ((cal.pageable_h2d_gb_s or cal.h2d_gb_s) * GB)


def optimizer_step_seconds(spec: RunSpec, ds_config: dict, cal: Calibration) -> float | None:
    """What DeepSpeed's step timer holds on a GPU rank with CPU optimizer offload, predicted
    from the calibration alone (no fitted constant): the optimizer and, without parameter
    offload, the fp32 master's upload. SuperOffload counts where it steps at the step
    (``gradient_clipping``) and the calibration has calibrate's probe of it; ZenFlow, whose CPU
    step overlaps the micro-steps, and other runs: None."""
    shape, k = model_shape(spec), knobs(ds_config)
    probed = bool(k.clipping and cal.superoffload_step_params_per_s)
    plain = k.zenflow is None and (not k.super_offload or probed)
    if not (shape and plain and spec.accelerator == "cuda" and spec.offload_optimizer == "cpu"):
        return None
    seconds = optimizer_seconds(spec, shape, cal, k)
    if spec.offload_param == "none":
        seconds += master_upload_seconds(optimizer_split(spec, shape, k).host_params, cal)
    return seconds


def overflow_check_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
    """fp16's overflow check (:func:`overflow_check_bytes`) where the gradient buffer lives on
    the host (optimizer offload, or a CPU rank): every rank of the node checks its partition
    on the cores they share, at the calibrated rate (a calibration from before it: CPU Adam's
    rate x :data:`FP16_CHECK_PER_ADAM`). On a GPU it runs at memory speed: left out."""
    on_host = spec.offload_optimizer != "none" or spec.accelerator == "cpu"
    if spec.dtype != "fp16" or not on_host:
        return 0.0
    rate = cal.fp16_check_elems_per_s or FP16_CHECK_PER_ADAM * cal.cpu_adam_params_per_s
    return partition(spec, shape) * spec.gpus_per_node / rate


def zenflow_update_interval(k: Knobs) -> int:
    """Steps between ZenFlow's CPU updates; "auto" adapts at run time (a loss-curve test), so
    the model takes its bound, 1 (the note says so); 1 without ZenFlow."""
    interval = (k.zenflow or {}).get("update_interval", ZENFLOW_DEFAULTS["update_interval"])
    return interval if isinstance(interval, int) else 1


def host_optimizer_seconds(
    spec: RunSpec, k: Knobs, host_s: float, largest_s: float, compute_s: float
) -> float:
    """CPU Adam per step of ``host_s`` seconds at the calibrated rate (``largest_s`` for the
    largest offloaded sub-group), by mode:

    - ZenFlow: once per ``update_interval`` steps; with ``overlap_step`` in a worker process on
      the cores pytorch does not keep (1 - ``pt_reserved_cores_perc``), behind the next
      interval's micro-steps: only what outlasts them shows.
    - SuperOffload, with a calibration from before calibrate's probe of it
      (:func:`superoffload_seconds` has one): the same passes in a worker on
      ``cpuadam_cores_perc`` of the cores, shown as :func:`superoffload_exposed` says.
    Core shares scale the rate in proportion (CPU Adam was calibrated on all the cores).
    """
    if k.zenflow is not None:
        interval = zenflow_update_interval(k)
        if not k.zenflow.get("overlap_step", ZENFLOW_DEFAULTS["overlap_step"]):
            return host_s / interval
        kept = k.zenflow.get("pt_reserved_cores_perc", ZENFLOW_DEFAULTS["pt_reserved_cores_perc"])
        worker_s = host_s / max(1 - kept, 1e-3)
        return max(0.0, worker_s - interval * compute_s) / interval
    if k.super_offload:  # a calibration from before calibrate's SuperOffload probe
        worker_s, last_s = host_s / k.cpuadam_cores_perc, largest_s / k.cpuadam_cores_perc
        return superoffload_exposed(k, worker_s, last_s, compute_s)
    return host_s


def mode_note(spec: RunSpec, shape: ModelShape, k: Knobs, probed: bool = False) -> str | None:
    """What the prediction of a newer mode assumes or leaves out (plan.csv's ``note``)."""
    notes = []
    if spec.offload_optimizer == "cpu" and k.ratio < 1:
        split = optimizer_split(spec, shape, k)
        notes.append(
            f"partial offload: {len(split.device)} of {len(split.device) + len(split.host)} "
            f"sub-groups ({split.device_params / max(1, partition(spec, shape)):.0%} of the "
            "partition) on the GPU, stepped by torch AdamW at the fitted device rate (not "
            "calibrated apart); every gradient still crosses PCIe"
        )
    if k.super_offload:
        when = (
            "synchronous at the step (gradient_clipping)"
            if k.clipping
            else "overlapping the backward"
        )
        ipc = (
            "its round trips measured through DeepSpeed's worker by calibrate"
            if probed
            else "the worker's round trips not modelled (the calibration predates "
            "calibrate's SuperOffload probe)"
        )
        notes.append(
            f"SuperOffload: CPU Adam in a worker on {k.cpuadam_cores_perc:.0%} of the cores, "
            f"{when}, {ipc}; not modelled: the slower backward of the step's last "
            "micro-step (fp32 gradient copies for the worker, a device synchronize per "
            "sub-group), measured 0.3-0.55 s per step beyond plain offload on a 1.35B model"
        )
    if k.zenflow is not None:
        auto = not isinstance(k.zenflow.get("update_interval", "auto"), int)
        interval = (
            "update_interval auto adapts at run time: predicted at its bound 1 (CPU Adam "
            "every step); "
        )
        notes.append(
            "ZenFlow: "
            + (interval if auto else "")
            + "the top-k selection (column norms, all-reduce) is not modelled; DeepSpeed "
            "0.19.8's ZeRO-3 ZenFlow transposes every 2-D parameter in place at start-up, so a "
            "model with an nn.Embedding fails its first forward (measured on CPU and H200)"
        )
    refused = refused_mode(spec, k)
    return "; ".join([refused, *notes] if refused else notes) or None


def refused_mode(spec: RunSpec, k: Knobs) -> str | None:
    """Why DeepSpeed 0.19.8 refuses the run's mode on its accelerator (None: it runs):
    SuperOffload asserts a CUDA accelerator; ZenFlow's stage-3 engine allocates its buffers
    on 'cuda' by name. The step time of such a run is not predicted."""
    if spec.accelerator == "cuda":
        return None
    if k.super_offload:
        return "DeepSpeed refuses SuperOffload on a non-CUDA accelerator: step time not predicted"
    if k.zenflow is not None:
        return "ZenFlow allocates on 'cuda' by name: it cannot run here; step time not predicted"
    return None


def comm_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration, k: Knobs) -> float:
    """ZeRO-3 collectives of one step on one GPU: every micro-step all-gathers each partitioned
    tensor per fetch (persistent ones stay whole) and reduce-scatters the gradients once per
    reduce bucket, (dp - 1)/dp of the bytes each; every call costs the calibrated latency."""
    dp = spec.world_size
    if dp == 1:
        return 0.0
    gathered = [n for n in shape.tensors if n > k.persistence]  # persistent_params stay whole
    calls = PARAM_FETCHES * len(gathered) + math.ceil(shape.params / k.reduce_bucket)
    moved = DTYPE_BYTES[spec.dtype] * (PARAM_FETCHES * sum(gathered) + shape.params) * (dp - 1) / dp
    seconds = calls * (cal.collective_latency_s or 0.0)
    if cal.interconnect_gb_s:
        seconds += moved / (cal.interconnect_gb_s * GB)
    return spec.gradient_accumulation_steps * seconds


def step_time(spec: RunSpec, ds_config: dict, cal: Calibration) -> StepTime | None:
    """The predicted optimizer-step time of a run (None when the model's shape is unknown)."""
    shape = model_shape(spec)
    if shape is None:
        return None
    fit, gas, k = FITS[spec.accelerator], spec.gradient_accumulation_steps, knobs(ds_config)
    if refused_mode(spec, k):
        return None
    rate = cal.matmul_tflops * 1e12 * fit.efficiency
    # the ranks of a CPU node share its cores (the calibrated rate is the whole node's)
    sharing = spec.gpus_per_node if spec.accelerator == "cpu" else 1
    # a calibration with the probe (CPU) measured the host time per layer: it adds to compute
    dispatch_s, probed = dispatch_seconds(spec, shape, cal, ENGINE_NAME, fit.dispatch_s_per_layer)
    times = StepTime(
        flops_s=gas * sharing * flops_per_micro_step(spec, shape) / rate,
        dispatch_s=gas * dispatch_s,
        comm_s=comm_seconds(spec, shape, cal, k),
        pcie_s=pcie_seconds(spec, shape, cal, k),
        device_wait_s=gradient_copy_seconds(spec, shape, cal, k),
        forward=forward_shares(spec, wait=0.0),  # the gradients go down in the backward
        optimizer_s=0.0,
        nvme_s=nvme_seconds(spec, shape, cal, k),
        serial=probed,
    )
    optimizer_s = optimizer_seconds(spec, shape, cal, k, times.compute_s)
    return dataclasses.replace(times, optimizer_s=optimizer_s)


def note(spec: RunSpec, ds_config: dict, cal: Calibration | None = None) -> str | None:
    """What the prediction of the run's mode assumes or leaves out (plan.csv's ``note``)."""
    shape = model_shape(spec)
    probed = bool(cal and cal.superoffload_step_params_per_s)
    return mode_note(spec, shape, knobs(ds_config), probed) if shape else None


def calibration_layout(spec: RunSpec, ds_config: dict) -> CalibrationLayout | None:
    """What calibrate measures for the run: CPU Adam over the rank's partition in the config's
    sub-groups, copies of one reduce bucket (None when the model's shape is unknown)."""
    shape = model_shape(spec)
    if shape is None:
        return None
    k = knobs(ds_config)
    bucket = int(min(k.reduce_bucket, shape.params) * DTYPE_BYTES[spec.dtype])
    return CalibrationLayout(partition(spec, shape), k.sub_group, bucket)
