"""FSDP2 with only the optimizer offloaded to the CPU (``engine: fsdp2``, ``offload_optimizer:
cpu``, ``offload_param: none``): the sharded fp32 weights and their gradients stay on the GPU,
so gradient accumulation runs there; the Adam moments, an fp32 copy of each weight shard and the
optimizer step live on the host, through torchao's ``CPUOffloadOptimizer`` (torchao 0.18).

Why torchao: FSDP2 calls the post-accumulate-grad hooks of its sharded DTensor parameters itself
after each reduce-scatter, and torchao copies each gradient to its pinned host copy from that
hook, on a side stream, while the backward goes on; its host copies and fused CPU AdamW work on
FSDP2's DTensors as shipped, and it installs beside torch with no other package. Megatron-core's
``HybridDeviceOptimizer`` has a partial ``offload_fraction``, but pins a clone of each DTensor
(``NYI: aten._pin_memory``) and needs Python 3.12 and triton: so this path has no partial
fraction, and a scenario's ``offload_optimizer_ratio`` is refused naming the key.

What it needs: a CUDA GPU (torchao copies through CUDA streams and refuses to start without one)
and torchao on the node that trains (``pip install torchao==0.18.0``); bf16 or fp32, since fp16's
grad scaler would unscale the GPU gradients after torchao has already copied them to the host.
"""

from __future__ import annotations

import importlib.util

from offload_study import engines
from offload_study.core.contracts import Calibration, RunSpec
from offload_study.engines.fsdp2.paths import FP32, Fsdp2Path, host_adam_rate, shard_params
from offload_study.prediction.shared import GB, ModelShape, pow2_bytes

#: torchao keeps a tensor with fewer elements than this on the GPU, stepped there (its
#: ``minimal_size``): the norms' weights.
MINIMAL_SIZE = 4096
INSTALL = "pip install torchao==0.18.0"
#: seconds of torchao's own work per offloaded tensor in its step (a Python loop over the
#: tensors). Fitted on the H200 records of two models (docs/benchmarks.md): model A's alone
#: predicts model F's optimizer part within 8 %, model F's alone model A's within 3 %.
SECONDS_PER_TENSOR = 0.0005


def shards(spec: RunSpec, shape: ModelShape) -> list[int]:
    """Elements of each tensor's shard on one rank."""
    return [-(-n // spec.world_size) for n in shape.tensors]


def offloaded(spec: RunSpec, shape: ModelShape) -> list[int]:
    """Elements of the shards torchao steps on the host (the others stay on the GPU)."""
    return [n for n in shards(spec, shape) if n >= MINIMAL_SIZE]


def small_tensors(spec: RunSpec, shape: ModelShape) -> int:
    """Elements of the shards torchao keeps on the GPU."""
    return sum(n for n in shards(spec, shape) if n < MINIMAL_SIZE)


class CpuOptimizerPath(Fsdp2Path):
    """torchao's CPUOffloadOptimizer over FSDP2's sharded parameters."""

    steps_on_device = False

    def optimizer(self, model, spec: RunSpec, on_gpu: bool):
        import torch
        from torchao.optim import CPUOffloadOptimizer

        cls = torch.optim.AdamW if spec.optimizer.type == "AdamW" else torch.optim.Adam
        opt = CPUOffloadOptimizer(
            model.parameters(),
            cls,
            minimal_size=MINIMAL_SIZE,
            lr=spec.optimizer.lr,
            weight_decay=spec.optimizer.weight_decay,
            fused=True,
        )
        return opt, f"torchao CPUOffloadOptimizer, fused CPU {cls.__name__}"

    def effective(self, spec: RunSpec) -> dict:
        return {
            "pin_memory_optimizer": True,
            "pin_memory_param": None,
            "offload_policy": "OffloadPolicy",
            "optimizer_offload": "torchao CPUOffloadOptimizer",
        }

    def gpu_held(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """The fp32 weight shards, and the Adam moments of the tensors kept on the GPU."""
        return {
            "parameters (fp32 shard)": FP32 * shard_params(spec, shape),
            "Adam moments of the small tensors (fp32)": 2 * FP32 * small_tensors(spec, shape),
        }

    def host_states(self, spec: RunSpec, shape: ModelShape) -> dict[str, float]:
        """Per offloaded tensor a pinned fp32 copy of its shard and of its gradient (torch's
        pinned allocator rounds each up to a power of two) and the Adam moments (pageable)."""
        copies = [FP32 * n for n in offloaded(spec, shape)]
        return {
            "parameters (fp32 copy, pinned)": sum(map(pow2_bytes, copies)),
            "gradients (fp32 copy, pinned)": sum(map(pow2_bytes, copies)),
            "Adam moments (fp32)": 2.0 * sum(copies),
        }

    def optimizer_seconds(
        self, spec: RunSpec, shape: ModelShape, cal: Calibration, device_rate: float | None
    ) -> float:
        """Fused CPU AdamW over every offloaded shard on the node's cores, one tensor after
        another: the vectorized kernel at the rate calibrated for DeepSpeed's CPU Adam (the
        same kind of kernel; torch's foreach rate is 4x slower), and per tensor torchao's own
        work (wait for its gradient's copy, a one-tensor optimizer, queue the weight back)."""
        rate = cal.cpu_adam_params_per_s or host_adam_rate(cal)
        stepped = offloaded(spec, shape)
        return spec.gpus_per_node * (sum(stepped) / rate + len(stepped) * SECONDS_PER_TENSOR)

    def pcie_seconds(self, spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
        """The updated weights back to the GPU once per step, each tensor's copy overlapping
        the next one's CPU step: only the largest one's shows; the gradients' copies to the
        host overlap the backward."""
        if not cal.h2d_gb_s:
            return 0.0
        largest = FP32 * max(shards(spec, shape))
        return largest / (cal.h2d_gb_s * GB)


def problems(study: dict, scenario: dict, cluster: dict, where: str) -> list[str]:
    """Where the path cannot run: no CUDA GPU, no torchao on a machine that trains here, fp16
    (its grad scaler would unscale gradients torchao copies to the host at the same time)."""
    key, errors = f"{where}.offload_optimizer", []
    if cluster["accelerator"] != "cuda":
        errors.append(
            f"{key}: optimizer-only CPU offload on engine fsdp2 needs a CUDA GPU (torchao's "
            f"CPUOffloadOptimizer copies through CUDA streams); cluster {cluster['name']} has "
            f"accelerator {cluster['accelerator']}: set offload_param: cpu too (CPUOffloadPolicy), "
            "or use engine deepspeed"
        )
    elif cluster["scheduler"] == "local" and importlib.util.find_spec("torchao") is None:
        errors.append(
            f"{key}: optimizer-only CPU offload on engine fsdp2 needs torchao on this "
            f"machine: {INSTALL}"
        )
    if study["dtype"] == "fp16":
        errors.append(
            f"{key}: optimizer-only CPU offload on engine fsdp2 takes dtype bf16 or "
            "fp32, not fp16 (the grad scaler would unscale gradients while torchao "
            "copies them to the host)"
        )
    return errors


PATH = engines.register_path(
    engines.OffloadPath(
        engine="fsdp2",
        name="cpu-optimizer",
        label="optimizer offload to the CPU, weights and gradients on the GPU (torchao)",
        devices=("cpu", "none"),
        problems=problems,
        parts=CpuOptimizerPath(),
        grid=({},),  # a recommendation tries it as it is
    )
)
