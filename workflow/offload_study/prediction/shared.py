"""What every engine's memory and step-time model shares (engines/<name>/model.py): the model's
shape, the activations, the FLOPs of a micro-step, the allocator's slack over the allocated peak
by cause, the constants fitted per accelerator kind, and the shapes of a prediction
(:class:`Memory`, :class:`StepTime`). Sizes are bytes; the calibration's rates are the
cluster's (:class:`~offload_study.core.contracts.Calibration`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from offload_study.core import architecture, devices, units
from offload_study.core.contracts import Calibration, RunSpec

GB, DTYPE_BYTES = units.GB, units.DTYPE_BYTES  # GB: transfer rates (GB/s) only


#: What torch's caching allocator keeps reserved beyond the allocated peak, by cause: what the
#: replay of traced runs found cached at their reserved peaks (offload_study.prediction.allocator;
#: docs/results/h200-1gpu/allocator-traces-*/; docs/benchmarks.md, "Reserved memory: the allocator
#: replayed"). Each is sized by :func:`reserved_features`, in bytes, and weighed by the fitted
#: ``reserved_slack``; blocks whose size is known are counted whole apart
#: (:func:`nvme_gradient_copies_bytes`).
RESERVED_CAUSES = (
    # DeepSpeed: its reduction stream's buckets, cached on that stream, where nothing else
    # reuses them: the segments of two buckets in turn (the traces hold two of a bucket's size
    # there), the first holding at most the model's gradients, the second at most the rest
    "the reduction stream's buckets",
    # DeepSpeed, fp16 with the optimizer on the GPU: the overflow check's |gradients| and mask,
    # made once per step and cached through the next backward
    "the fp16 overflow check on the GPU",
    # DeepSpeed, with parameters gathered (several ranks, or fetched from the host): split
    # blocks of the gathers, freed and re-made at every fetch
    "gathered parameters",
    # DeepSpeed: one layer's parameters: its gathers, gradients and recomputation make blocks
    # of its size that the next layer's do not fit exactly
    "one layer's parameters",
    # FSDP2: the loss's blocks (logits, their fp32 upcast, the log-softmax and its gradient)
    # are made at the loss and stay cached through the backward; where the backward's own
    # blocks outlive it (CPUOffloadPolicy's copies, gradients accumulated over micro-steps),
    # they take part of them, and less is left cached over the allocated peak
    "the loss's blocks, FSDP2, left cached",
    "the loss's blocks, FSDP2, partly reused",
    # DeepSpeed: the same loss's blocks, made at the end of the first forward; in the traces of
    # models A, C, the 0.13B and the 0.74B they are all cached at the reserved peak, in model
    # G's and the half 7B's the backward's larger blocks take most of them back
    "the loss's blocks, ZeRO-3",
    # FSDP2's CPUOffloadPolicy: blocks of the root unit's fp32 parameters' size (embeddings,
    # head), the largest its copies to the GPU make; model G's trace holds three of its head's
    # fp32 size (626 MiB), made before the first step, free at its reserved peak
    "the root unit's fp32 copies, CPUOffloadPolicy",
)


@dataclass(frozen=True)
class AcceleratorFit:
    """What an accelerator kind costs whatever the engine, fitted once against the committed
    records (benchmarks/prediction_accuracy.py prints how well they do): the start-up of a run,
    the CUDA context beside torch's allocator, and the weights of the allocator's slack over the
    allocated peak, one per :data:`RESERVED_CAUSES` (each engine's model sizes them)."""

    startup_s: float  # launch, imports, model build and engine set-up of a small model
    startup_s_per_billion: float  # more per 1e9 parameters with offload (a quarter without)
    cuda_context_gib: float = 0.0
    reserved_slack: tuple[float, ...] = (0.0,) * len(RESERVED_CAUSES)


@dataclass(frozen=True)
class EngineFit:
    """What one engine costs on one accelerator kind (each engine's model holds its own)."""

    efficiency: float  # share of the calibrated matmul rate a training layer reaches
    dispatch_s_per_layer: float  # host time per layer and micro-step (hooks, kernel launches)
    optimizer_params_per_s: float | None  # optimizer on the device (None: the CPU Adam rate)
    runtime_gib: float  # host memory of one rank beside its model in the steps (Python, torch, ...)
    # the runtime when the engine is set up, before the first step loads the rest (CUDA
    # kernels, cuBLAS); None: runtime_gib
    runtime_at_init_gib: float | None = None

    @property
    def runtime_at_init(self) -> float:
        return self.runtime_gib if self.runtime_at_init_gib is None else self.runtime_at_init_gib


#: The reserved-memory constants: offload_study.prediction.accuracy.fit_reserved's fit over every
#: committed GPU record, each setup once (benchmarks/prediction_accuracy.py prints it as "reserved
#: fit over every GPU record" and judges it leaving each model out); nvml's used memory less
#: torch's reserved peak is 1.89-1.94 GiB on one GPU (2.7 with NCCL's buffers on two).
RESERVED_FIT = {
    "cuda_context_gib": 1.894,
    "reserved_slack": (1.112, 0.5567, 0.766, 3.847, 1.16, 0.3167, 0.1846, 1.422),
}
ACCELERATOR_FITS = {
    # H200 records (docs/results): start-up 22-45 s up to 1.35B, 36 s (no offload) to 70-96 s
    # (offload) for the 7B
    "cuda": AcceleratorFit(25.0, 7.0, **RESERVED_FIT),
    # the default study's records on the 2-core development machine (docs/benchmarks.md)
    "cpu": AcceleratorFit(30.0, 7.0),
}


@dataclass(frozen=True)
class CalibrationLayout:
    """What calibrate measures at a run's sizes: the CPU optimizer over the parameters one rank
    steps, in sub-groups of that many (None: one flat tensor), and host<->GPU copies of
    ``copy_bytes`` (the engine's unit of transfer)."""

    optimizer_params: int
    sub_group_params: int | None
    copy_bytes: int


# --------------------------------------------------------------------------- inputs
#: What the models use of a model: its layout as transformers builds it.
ModelShape = architecture.Layout


def model_shape(spec: RunSpec) -> ModelShape | None:
    """The shape of the run's model as transformers builds it; None when the models cannot
    describe it (:func:`shape_note` says why)."""
    found = architecture.layout(spec.model)
    return None if isinstance(found, architecture.Unknown) else found


#: The architecture the step and memory models were fitted on (every committed record's).
FITTED_ARCHITECTURE = "llama"


def shape_note(spec: RunSpec) -> str | None:
    """What plan.csv's note says of the model itself: why nothing is predicted, or that an
    architecture other than the fitted one is predicted from its own tensors."""
    found = architecture.layout(spec.model)
    if isinstance(found, architecture.Unknown):
        return f"no memory or step-time prediction: {found.reason}"
    if found.model_type != FITTED_ARCHITECTURE:
        return (
            f"{found.model_type} predicted from its own tensors and dimensions, with constants "
            f"fitted on {FITTED_ARCHITECTURE} runs"
        )
    return None


def pow2_bytes(nbytes: float) -> float:
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 1 else nbytes


# --------------------------------------------------------------------------- memory
def loss_blocks_bytes(spec: RunSpec, shape: ModelShape) -> float:
    """The loss's blocks of one micro-batch: the logits in the compute dtype and three fp32
    tensors of their size (upcast, log-softmax, gradient)."""
    logits = spec.micro_batch * spec.seq_len * shape.vocab
    return logits * (DTYPE_BYTES[spec.dtype] + 3 * DTYPE_BYTES["fp32"])


def layer_activation_bytes(spec: RunSpec, shape: ModelShape) -> float:
    """What one decoder layer's forward saves for its backward (a recomputed layer's too)."""
    b, tokens, h = DTYPE_BYTES[spec.dtype], spec.micro_batch * spec.seq_len, shape.hidden
    return tokens * ((8 + 2 * shape.kv_heads / shape.heads) * h + 4 * shape.ffn) * b


def activation_parts(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """Activation bytes at the peak of one micro-step on one GPU."""
    b, tokens, h = DTYPE_BYTES[spec.dtype], spec.micro_batch * spec.seq_len, shape.hidden
    layer = layer_activation_bytes(spec, shape)
    # the loss: the logits (dtype), their fp32 upcast and its gradient; and what the final
    # norm and the head saved for the backward: the last layer's output, the norm's fp32 upcast
    # of it (HF's RMSNorm computes in fp32) and the normed input of the head (dtype)
    loss = tokens * shape.vocab * (2 * b + 8) + tokens * h * (2 * b + 4)
    if spec.gradient_checkpointing:
        return {
            "checkpointed layer inputs": shape.layers * tokens * h * b,
            "loss or one recomputed layer": max(loss, layer),
        }
    return {"activations of every layer": shape.layers * layer, "logits and loss": loss}


@dataclass(frozen=True)
class Memory:
    """Predicted peaks: part -> bytes (per GPU, per node on the host, per node on NVMe)."""

    gpu: dict[str, float]
    host: dict[str, float]
    nvme: dict[str, float]

    @property
    def gpu_gib(self) -> float:
        return units.bytes_to_gib(sum(self.gpu.values()))

    @property
    def host_gib(self) -> float:
        return units.bytes_to_gib(sum(self.host.values()))

    @property
    def nvme_gib(self) -> float:
        return units.bytes_to_gib(sum(self.nvme.values()))


def reserved_vector(sizes: dict[str, float]) -> tuple[float, ...]:
    """``sizes`` (cause -> bytes) in the order of :data:`RESERVED_CAUSES`, 0 for the others."""
    unknown = set(sizes) - set(RESERVED_CAUSES)
    if unknown:
        raise ValueError(f"reserved_vector: not in RESERVED_CAUSES: {sorted(unknown)}")
    return tuple(float(sizes.get(cause, 0.0)) for cause in RESERVED_CAUSES)


def allocator_slack_bytes(weights: tuple[float, ...], features: tuple[float, ...]) -> float:
    """The allocator's slack: each cause's size (:func:`reserved_features`) by its weight, never
    below 0."""
    return max(0.0, sum(c * f for c, f in zip(weights, features, strict=True)))


# --------------------------------------------------------------------------- step time
#: Host <-> device copies per micro-step of offloaded parameters: fetched for the forward and
#: again for the backward (a recomputed layer reuses what its backward fetches).
PARAM_FETCHES = 2


@dataclass(frozen=True)
class ForwardShares:
    """The forward's share of a micro-step's FLOPs, of its host dispatch and collectives, and
    of the copies its device waits for; the backward holds the rest (:func:`micro_steps_s`)."""

    flops: float
    dispatch: float
    wait: float


#: one phase: the whole micro-step bound by the longest of its parts
ONE_PHASE = ForwardShares(1.0, 1.0, 1.0)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by part; ``total`` adds them as :mod:`predict` explains."""

    flops_s: float  # gas x model FLOPs / (calibrated rate x efficiency)
    dispatch_s: float  # gas x host time per micro-step beyond FLOPs (ZeRO-3 hooks, eager ops)
    comm_s: float  # gas x collectives between the ranks
    pcie_s: float
    optimizer_s: float  # CPU Adam when offloaded, else the optimizer on the device
    nvme_s: float
    serial: bool = False  # one thread runs compute, hooks and collectives in turn (CPU ranks)
    # gas x copies the device's compute waits for, on its own timeline (FSDP2's copy-in of
    # offloaded shards before each all-gather): they add to the FLOPs, the host's dispatch
    # overlaps both
    device_wait_s: float = 0.0
    # the forward's share of the FLOPs, of the host's dispatch (and collectives) and of the
    # device's waits (:class:`ForwardShares`); the backward holds the rest. 1: one phase.
    forward: ForwardShares = ONE_PHASE

    @property
    def compute_s(self) -> float:
        return micro_steps_s(
            self.flops_s,
            self.dispatch_s,
            self.comm_s,
            self.serial,
            self.device_wait_s,
            self.forward,
        )

    @property
    def total(self) -> float:
        return self.compute_s + self.pcie_s + self.optimizer_s + self.nvme_s

    @property
    def bound(self) -> str:
        """What takes longest: compute, dispatch, interconnect, pcie, optimizer or nvme."""
        parts = [
            ("compute", self.flops_s),
            ("dispatch", self.dispatch_s),
            ("interconnect", self.comm_s),
            ("pcie", self.pcie_s + self.device_wait_s),
            ("optimizer", self.optimizer_s),
            ("nvme", self.nvme_s),
        ]
        return max(parts, key=lambda part: part[1])[0]


def micro_steps_s(
    flops_s: float,
    dispatch_s: float,
    comm_s: float,
    serial: bool = False,
    wait_s: float = 0.0,
    forward: ForwardShares = ONE_PHASE,
) -> float:
    """The micro-steps of a step. On a GPU the host's dispatch and the collectives overlap the
    device's work (FLOPs and the copies it waits for), phase by phase: the forward and the
    backward each take the longest of the three, since the backward cannot start before the
    forward's loss (a forward bound by dispatch and a backward bound by FLOPs add). On a CPU
    rank (``serial``: one thread runs them in turn) their sum."""
    if serial:
        return flops_s + wait_s + dispatch_s + comm_s
    total = 0.0
    for flops, host, wait in (
        (forward.flops, forward.dispatch, forward.wait),
        (1 - forward.flops, 1 - forward.dispatch, 1 - forward.wait),
    ):
        total += max(flops * flops_s + wait * wait_s, host * dispatch_s, host * comm_s)
    return total


def forward_shares(spec: RunSpec, wait: float = 0.0) -> ForwardShares:
    """The forward's shares of a micro-step, fixed by the passes over the layers: its FLOPs are
    a third of the forward's and backward's (the backward computes two products per one of the
    forward), a quarter with gradient checkpointing (the backward recomputes the forward);
    the host's work per layer is about the same in each pass (forward, recomputed forward,
    backward: the records' forward timers hold 0.30-0.38 of a ZeRO-3 micro-step with
    checkpointing), so a half, a third with checkpointing. ``wait``: the forward's share of
    the device's waits (the engine's copies)."""
    if spec.gradient_checkpointing:
        return ForwardShares(1 / 4, 1 / 3, wait)
    return ForwardShares(1 / 3, 1 / 2, wait)


def flops_per_micro_step(spec: RunSpec, shape: ModelShape) -> float:
    per_token = devices.flops_per_token(
        shape.params,
        spec.gradient_checkpointing,
        attention=True,
        layers=shape.layers,
        hidden=shape.hidden,
        seq_len=spec.seq_len,
    )
    return per_token * spec.micro_batch * spec.seq_len


#: The host passes of DeepSpeed's ZeRO-3 step beside CPU Adam (calibrate.step_passes_at; FSDP2's
#: gradient accumulation on the host is such a pass too) per CPU Adam's rate with the same cores,
#: for a calibration without them: measured together by calibrate over the sweep's
#: 1.91e9-parameter partition in pinned 1e8-parameter sub-groups on an H200 lease's 16 cores
#: (docs/results/h200-1gpu/step-phases-2026-12-02/): Adam 4.53e9/s, the gradients' unscale
#: 1.67e10/s, the master's copy into the bf16 partition 1.30e10/s.
STEP_PASS_PER_ADAM = {"grad_unscale_params_per_s": 3.70, "master_copy_params_per_s": 2.87}


def step_pass_rate(cal: Calibration, name: str) -> float:
    """A host pass's rate (:data:`STEP_PASS_PER_ADAM`'s names) from the calibration, else as
    the multiple of CPU Adam's rate measured on an H200 lease."""
    return getattr(cal, name) or STEP_PASS_PER_ADAM[name] * cal.cpu_adam_params_per_s


#: glibc's largest mmap threshold on a 64-bit host (DEFAULT_MMAP_THRESHOLD_MAX): malloc maps an
#: allocation this large or larger from the OS afresh, its pages faulted in by its first write,
#: and unmaps it when freed, however often the same size comes back; smaller ones come from the
#: heap's pages once a free has raised the (dynamic) threshold.
MMAP_THRESHOLD_BYTES = 32 * 2**20


def page_fault_rate(cal: Calibration) -> float:
    """Bytes/s of fresh host pages mapped on their first write: calibrated, else the catalog's
    CPU default (measured on the GPU hosts the records ran on)."""
    gb_s = cal.page_fault_gb_s or devices.catalog()["cpu"]["page_fault_gb_s"]
    return gb_s * GB


def fresh_host_bytes(tensor_bytes: Iterable[float]) -> float:
    """Of host tensors allocated anew each time, the bytes that get fresh pages: those at or
    over the mmap threshold (smaller ones reuse the heap's pages)."""
    return sum(b for b in tensor_bytes if b >= MMAP_THRESHOLD_BYTES)


#: The probe's keys for how a layer's host time grows with its size (calibrate._size_costs).
GROWTH_KEYS = (
    "layer_elements",
    "tokens",
    "forward_per_element",
    "backward_per_element",
    "rest_per_token",
)


def layer_costs(spec: RunSpec, cal: Calibration, engine: str) -> dict[str, float] | None:
    """Host seconds of a decoder layer's forward and backward and of the rest of a micro-step
    under ``engine`` that the calibration's probe measured with as many ranks on a node as this
    run has (else with the most it tried below that), and how they grow with the size
    (:data:`GROWTH_KEYS`) as the one-rank probe measured it: the work of larger activations is
    the rank's own, and in a group the gloo waits of the peers swamp the difference between two
    sizes (2 ranks: 0.3-3.1e-7 s per element and backward in calibrations minutes apart). None
    without a probe of the engine (a GPU cluster, an older calibration)."""
    by_ranks = (cal.layer_host_s or {}).get(engine) or {}
    probed = {int(ranks): costs for ranks, costs in by_ranks.items()}
    fitting = [ranks for ranks in probed if ranks <= spec.gpus_per_node]
    if not fitting or spec.accelerator != "cpu":
        return None
    lone = probed[min(probed)]
    return {**probed[max(fitting)], **{k: lone[k] for k in GROWTH_KEYS if k in lone}}


def probed_dispatch_seconds(spec: RunSpec, shape: ModelShape, costs: dict[str, float]) -> float:
    """Host time of one micro-step beyond its FLOPs from a probe's ``costs``
    (:func:`layer_costs`): each layer's forward (twice with gradient checkpointing: the backward
    recomputes it) and backward, plus the rest (embeddings, head, loss, step), each grown from
    the probe's size to the run's as the probe measured it grow (a layer per element of its
    activations, micro-batch x sequence x hidden; the rest per token)."""
    tokens = spec.micro_batch * spec.seq_len
    more_elements = tokens * shape.hidden - costs.get("layer_elements", 0)
    forward = costs["forward"] + costs.get("forward_per_element", 0.0) * more_elements
    backward = costs["backward"] + costs.get("backward_per_element", 0.0) * more_elements
    rest = costs["rest"] + costs.get("rest_per_token", 0.0) * (tokens - costs.get("tokens", 0))
    forwards = 2 if spec.gradient_checkpointing else 1
    return max(0.0, shape.layers * (forwards * forward + backward) + rest)


def dispatch_seconds(
    spec: RunSpec, shape: ModelShape, cal: Calibration, engine: str, fitted_s_per_layer: float
) -> tuple[float, bool]:
    """(Host time of one micro-step beyond its FLOPs, whether a probe measured it): with the
    calibration's probe of ``engine`` (:func:`probed_dispatch_seconds`), else the engine's
    fitted time per layer. A probed run is a CPU rank's, whose one thread runs the FLOPs, the
    hooks and gloo's blocking collectives in turn: its parts add (StepTime.serial)."""
    costs = layer_costs(spec, cal, engine)
    if costs is None:
        return shape.layers * fitted_s_per_layer, False
    return probed_dispatch_seconds(spec, shape, costs), True
