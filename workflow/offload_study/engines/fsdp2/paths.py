"""FSDP2's offload paths: what each does in the rank's training and in the prediction.

A path is selected by the scenario's offload keys (an :class:`offload_study.engines.OffloadPath`
whose ``parts`` is an :class:`Fsdp2Path`). FSDP2 itself has two: no offload, and
``CPUOffloadPolicy``, which moves the sharded parameters, their gradients and the optimizer states
to the host together. A folder of its own may add another (``register_path`` with engine
``fsdp2``): the trainer and the model ask the path, never its name.

Sizes are bytes per rank; ``shard`` is ceil(P / world) parameters, fp32 in FSDP2's shards.
"""

from __future__ import annotations

import math

from offload_study.core.contracts import Calibration, RunSpec
from offload_study.prediction.shared import (
    DTYPE_BYTES,
    GB,
    PARAM_FETCHES,
    ModelShape,
    fresh_host_bytes,
    page_fault_rate,
    pow2_bytes,
    step_pass_rate,
)

FP32 = 4.0


def shard_params(spec: RunSpec, shape: ModelShape) -> int:
    return math.ceil(shape.params / spec.world_size)


def pinned(spec: RunSpec) -> bool:
    """The scenario's pin_memory (null: pinned); never on a CPU cluster: pinning needs an
    accelerator (torch refuses it without one)."""
    return spec.accelerator == "cuda" and spec.pin_memory is not False


def host_adam_rate(cal: Calibration) -> float:
    """torch AdamW (foreach) on the CPU: calibrated, else DeepSpeedCPUAdam's rate."""
    return cal.torch_adam_params_per_s or cal.cpu_adam_params_per_s


class Fsdp2Path:
    """No offload: every fp32 shard (parameters, gradients, Adam moments) on the rank's device,
    torch AdamW stepping there (fused on a GPU, foreach on a CPU rank)."""

    #: the optimizer steps the shards where they live (False: it steps host copies)
    steps_on_device = True

    # ----------------------------------------------------------------- training
    def offload_policy(self, spec: RunSpec):
        """fully_shard's offload_policy (None: its default, nothing offloaded)."""
        return None

    def optimizer(self, model, spec: RunSpec, on_gpu: bool):
        """(optimizer over the model's sharded parameters, what implementation it is)."""
        import torch

        cls = torch.optim.AdamW if spec.optimizer.type == "AdamW" else torch.optim.Adam
        impl = {"fused": True} if on_gpu else {"foreach": True}
        opt = cls(
            model.parameters(),
            lr=spec.optimizer.lr,
            weight_decay=spec.optimizer.weight_decay,
            **impl,
        )
        return opt, next(iter(impl))

    def effective(self, spec: RunSpec) -> dict:
        """What metrics.json's ``modes.effective`` says of the path."""
        return {
            "pin_memory_optimizer": None,
            "pin_memory_param": None,
            "offload_policy": "OffloadPolicy",
        }

    # ----------------------------------------------------------------- model
    def reserved_cause(self, spec: RunSpec) -> str:
        """The allocator's slack cause (offload_study.prediction.shared.RESERVED_CAUSES) of the
        loss's blocks. With gradient accumulation the gradients the first backward makes stay on
        the device through the later micro-steps, partly in blocks the first loss freed: the
        H200 records of torchao's path at gas 4 leave 0.55 and 0.43 of the loss's blocks cached
        over their allocated peak (models A and F), as CPUOffloadPolicy's leave 0.33-0.52,
        against 1.09-1.17 at gas 1."""
        if spec.gradient_accumulation_steps > 1:
            return "the loss's blocks, FSDP2, partly reused"
        return "the loss's blocks, FSDP2, left cached"

    def own_reserved_causes(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """The allocator's slack causes of this path's own blocks beside the loss's, cause ->
        bytes (none)."""
        return {}

    def gpu_held(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """On the device all step long: the fp32 shards of the parameters and of the Adam
        moments (the gradients' are made in the backward and freed by zero_grad)."""
        shard = shard_params(spec, shape)
        return {
            "parameters (fp32 shard)": FP32 * shard,
            "Adam moments (fp32 shard)": 2 * FP32 * shard,
        }

    def gpu_gradients(self, spec: RunSpec, shape: ModelShape, layer: int) -> dict[str, float]:
        """In the first layer's backward: the fp32 gradient shards of every decoder layer. The
        root unit's (embeddings, final norm, head) are reduced only when the whole backward
        ends, so of the root only the head's gradient exists yet, unsharded in the compute
        dtype (model G's allocator trace: ten layers' fp32 shards and the head's bf16
        gradient at its peak). With gradient accumulation every shard exists already, summed
        into since the first micro-step."""
        if spec.gradient_accumulation_steps > 1:
            return {"gradients (fp32 shard)": FP32 * shard_params(spec, shape)}
        return {
            "gradients (fp32 shard)": FP32 * shape.layers * layer / spec.world_size,
            "the head's gradient (compute dtype, unsharded)": float(
                DTYPE_BYTES[spec.dtype] * shape.vocab * shape.hidden
            ),
        }

    def accumulated_gradients(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """Held on the device from one micro-step's backward to the next one's (gas > 1):
        every fp32 gradient shard, summed into from micro-step to micro-step."""
        return {"gradients being accumulated (fp32 shard)": FP32 * shard_params(spec, shape)}

    def host_states(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """Host bytes of the states the path keeps there (none)."""
        return {}

    def optimizer_seconds(
        self, spec: RunSpec, shape: ModelShape, cal: Calibration, device_rate: float | None
    ) -> float:
        """fused AdamW at the device rate; foreach AdamW on a CPU rank's cores."""
        shard = shard_params(spec, shape)
        if device_rate is None:
            return shard * spec.gpus_per_node / host_adam_rate(cal)
        return shard / device_rate

    def pcie_seconds(self, spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
        """Copies of a step that add after its micro-steps."""
        return 0.0

    def device_wait_seconds(self, spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
        """Copies of a step that the device's compute waits for inside its micro-steps."""
        return 0.0

    def forward_wait_share(self, spec: RunSpec, cal: Calibration) -> float:
        """The forward's share of :meth:`device_wait_seconds`."""
        return 0.0


class OffloadPolicyPath(Fsdp2Path):
    """``CPUOffloadPolicy(pin_memory=...)``: sharded parameters, gradients and the optimizer
    states live in host memory; each unit's fp32 shards are copied to the GPU for its
    all-gather, the fp32 gradient shards come back, and torch AdamW (foreach) steps on the CPU."""

    steps_on_device = False

    def reserved_cause(self, spec: RunSpec) -> str:
        """The backward's copies of the parameters and gradients take part of the loss's
        blocks, whatever the accumulation."""
        return "the loss's blocks, FSDP2, partly reused"

    def own_reserved_causes(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """Blocks of the root unit's (embeddings, head) fp32 parameters' size, the largest the
        policy's copies to the GPU make, left cached (model G's allocator trace)."""
        root = shape.params - shape.layers * shape.layer_params
        return {"the root unit's fp32 copies, CPUOffloadPolicy": FP32 * root}

    def offload_policy(self, spec: RunSpec):
        from torch.distributed.fsdp import CPUOffloadPolicy

        return CPUOffloadPolicy(pin_memory=pinned(spec))

    def optimizer(self, model, spec: RunSpec, on_gpu: bool):
        return super().optimizer(model, spec, on_gpu=False)

    def effective(self, spec: RunSpec) -> dict:
        return {
            "pin_memory_optimizer": pinned(spec),
            "pin_memory_param": pinned(spec),
            "offload_policy": "CPUOffloadPolicy",
        }

    def gpu_held(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        return {}

    def gpu_gradients(self, spec: RunSpec, shape: ModelShape, layer: int) -> dict[str, float]:
        """The fp32 shards of two layers copied up for their all-gather (no gradient shards:
        they go to the host)."""
        shards = 2 * FP32 * layer / spec.world_size
        return {"fp32 shards of two layers copied up for their all-gather": shards}

    def accumulated_gradients(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """None on the device: the gradient shards accumulate on the host."""
        return {}

    def host_states(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """The parameter and gradient shards (pinned: torch's pinned allocator rounds every
        tensor up to a power of two), the Adam moments, and foreach AdamW's temporary."""
        pin = pinned(spec)
        shards = [FP32 * n / spec.world_size for n in shape.tensors]
        per_tensor = pow2_bytes if pin else float
        pinned_text = ", pinned)" if pin else ")"
        return {
            "parameters (fp32 shards" + pinned_text: sum(map(per_tensor, shards)),
            "gradients (fp32 shards" + pinned_text: sum(map(per_tensor, shards)),
            "Adam moments (fp32)": 2.0 * sum(shards),
            "foreach AdamW's temporary (fp32, in the step)": FP32 * shard_params(spec, shape),
        }

    def optimizer_seconds(
        self, spec: RunSpec, shape: ModelShape, cal: Calibration, device_rate: float | None
    ) -> float:
        """foreach AdamW on the node's cores, which its ranks share."""
        return shard_params(spec, shape) * spec.gpus_per_node / host_adam_rate(cal)

    def pcie_seconds(self, spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
        """Gradient accumulation on the host. A micro-step whose gradient shards add to those
        already there copies them down blocking, into new pageable tensors, then adds them on
        the CPU (torch's FSDP2 ``foreach_reduce``: a copy that a CPU add depends on cannot
        overlap). The host waits for both, so every micro-step after the first adds them to
        the step: the copy at the pageable rate, the add as fast as DeepSpeed's unscale of its
        fp32 gradients, the host pass calibrate measures over the same bytes. A new tensor of
        a parameter at or over glibc's mmap threshold gets fresh pages every time: the copy
        also waits for the OS to map them (a 1.2B Llama's 67 MB FFN matrices and 1 GB tied
        embedding: 3.5 s of its 5.5 s step on an H100, docs/results/h100-1gpu/host-pages/)."""
        if spec.accelerator != "cuda" or not cal.h2d_gb_s:
            return 0.0
        shard = shard_params(spec, shape)
        pageable = (cal.pageable_h2d_gb_s or cal.h2d_gb_s) * GB
        add_rate = step_pass_rate(cal, "grad_unscale_params_per_s")
        fresh = fresh_host_bytes(FP32 * math.ceil(t / spec.world_size) for t in shape.tensors)
        per_micro_step = FP32 * shard / pageable + fresh / page_fault_rate(cal) + shard / add_rate
        return (spec.gradient_accumulation_steps - 1) * per_micro_step

    def device_wait_seconds(self, spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
        """Every micro-step the fp32 shards go up per fetch and the fp32 gradient shards come
        down once. A unit's all-gather waits for its shards' copy-in, and its compute for the
        all-gather: the copies add to the FLOPs (FSDP2 prefetches one unit, whose copy takes
        longer than a layer's compute). The gradients go down on the other copy engine while
        the backward's shards come up (PCIe is full duplex): the backward waits for the
        longer of the two."""
        if spec.accelerator != "cuda" or not cal.h2d_gb_s:
            return 0.0
        shard = FP32 * shape.params / spec.world_size
        up, down = self._rates(spec, cal)
        fetches = (PARAM_FETCHES - 1) * shard / up + max(shard / up, shard / down)
        return spec.gradient_accumulation_steps * fetches

    def forward_wait_share(self, spec: RunSpec, cal: Calibration) -> float:
        """The forward fetches once of the PARAM_FETCHES (the backward's fetch beside the
        gradients' way down)."""
        if spec.accelerator != "cuda" or not cal.h2d_gb_s:
            return 0.0
        up, down = self._rates(spec, cal)
        return (1 / up) / ((PARAM_FETCHES - 1) / up + max(1 / up, 1 / down))

    @staticmethod
    def _rates(spec: RunSpec, cal: Calibration) -> tuple[float, float]:
        """(host-to-device, device-to-host) bytes/s of the shards' copies."""
        up = (cal.h2d_gb_s if pinned(spec) else cal.pageable_h2d_gb_s or cal.h2d_gb_s) * GB
        return up, (cal.d2h_gb_s or cal.h2d_gb_s) * GB


def path_of(spec: RunSpec) -> Fsdp2Path:
    """The offload path of an fsdp2 run (admission refused runs that have none)."""
    from offload_study import engines

    path = engines.get(spec.engine).path(spec.offload_optimizer, spec.offload_param)
    if path is None:
        raise ValueError(
            f"scenario {spec.scenario}: engine {spec.engine} has no offload path for "
            f"offload_optimizer {spec.offload_optimizer}, offload_param "
            f"{spec.offload_param}"
        )
    return path.parts
