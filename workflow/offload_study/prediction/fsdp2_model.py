"""The memory and step-time model of an fsdp2 run (scenario key ``engine: fsdp2``).

What FSDP2 (offload_study.training.fsdp2) keeps where, per rank of a world of W:

- no offload, on the GPU: the fp32 shards of the parameters, of their gradients (reduced in fp32)
  and of the Adam moments (16 bytes per parameter / W); the unsharded parameters, in the compute
  dtype, of the layer being computed and of the next one (FSDP2 prefetches one layer's
  all-gather); the root unit's (embeddings, final norm, LM head), which the root keeps unsharded
  from its forward to its backward; one layer's unsharded gradients in the compute dtype and
  their fp32 copy for the reduce-scatter; the activations (as for DeepSpeed:
  :func:`offload_study.prediction.predict.activation_parts`).
- CPUOffloadPolicy: the shards of parameters and gradients (pinned when pin_memory: torch's
  pinned allocator rounds every tensor up to a power of two) and the Adam moments live in host
  memory; the GPU holds the unsharded layers, the root, one layer's gradients, the
  activations, and the fp32 shards of the two layers in flight copied up for their all-gather.
- host: FSDP2's runtime (:data:`RUNTIME_GIB`), and the model as built (fp32, on the CPU, before
  it is sharded: the peak of a run whose offloaded states are smaller); with CPUOffloadPolicy
  the offloaded states and, in the step, foreach AdamW's fp32 temporary
  (:func:`foreach_adam_temporary_bytes`).

Step time: the same FLOPs as a DeepSpeed run, FSDP2's own host time per layer
(:data:`DISPATCH_S_PER_LAYER`); collectives of a world
above 1 (all-gather each unit twice per micro-step, reduce-scatter fp32 gradients once); with
offload the fp32 shards go up twice per micro-step and the fp32 gradients come down once; the
optimizer step is torch AdamW: fused on the GPU (the device rate of :data:`predict.FITS`),
foreach on the CPU at the calibrated ``torch_adam_params_per_s`` (older calibrations: the
DeepSpeedCPUAdam rate stands in).
"""

from __future__ import annotations

import math
import sys

from offload_study.core import units
from offload_study.core.contracts import Calibration, RunSpec
from offload_study.prediction import predict
from offload_study.prediction.predict import (
    DTYPE_BYTES,
    FITS,
    GB,
    PARAM_FETCHES,
    Memory,
    ModelShape,
    StepTime,
    activation_parts,
    flops_per_micro_step,
    layer_activation_bytes,
    model_shape,
    reserved_vector,
)

FP32 = 4.0
#: fp32 shard of a parameter, of its gradient, and the two Adam moments.
STATE_BYTES = {"parameters": FP32, "gradients": FP32, "Adam moments": 2 * FP32}


def offloads(spec: RunSpec) -> bool:
    return spec.offload_optimizer == "cpu" or spec.offload_param == "cpu"


def layer_params(shape: ModelShape) -> int:
    """Elements of one decoder layer (its 4 attention and 3 MLP projections and 2 norms)."""
    per_layer = (len(shape.tensors) - 2 - (0 if shape.tied_embeddings else 1)) // shape.layers
    return sum(shape.tensors[1 : 1 + per_layer])


def root_params(shape: ModelShape) -> int:
    return shape.params - shape.layers * layer_params(shape)


def gpu_parts(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """Bytes per GPU at the peak, by what holds them: the largest of the moments of a step (the
    states held all step long are in each)."""
    moments = [at_the_loss(spec, shape), in_the_first_layers_backward(spec, shape),
               in_a_foreach_optimizer_step(spec, shape)]  # fmt: skip
    return max(moments, key=lambda parts: sum(parts.values()))


def in_a_foreach_optimizer_step(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """The optimizer step where foreach AdamW runs on the rank's device (a CPU rank without
    offload; a GPU runs the fused kernel, and offloaded states step on the host): the held
    states, every fp32 gradient shard and foreach's temporary. Empty elsewhere."""
    if offloads(spec) or spec.accelerator != "cpu":
        return {}
    shard = math.ceil(shape.params / spec.world_size)
    return {
        **held_states(spec, shape),
        "gradients (fp32 shard)": STATE_BYTES["gradients"] * shard,
        "foreach AdamW's temporary (fp32, in the step)": foreach_adam_temporary_bytes(spec, shape),
    }


def held_states(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """On the GPU all step long without offload: the fp32 shards of the parameters and of the
    Adam moments (the gradients' are made in the backward and freed by zero_grad)."""
    if offloads(spec):
        return {}
    shard = math.ceil(shape.params / spec.world_size)
    return {f"{name} (fp32 shard)": STATE_BYTES[name] * shard
            for name in ("parameters", "Adam moments")}  # fmt: skip


def at_the_loss(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """The forward done: every activation saved, the logits and the loss; the root unsharded
    and the last layer's parameters not resharded yet."""
    b = DTYPE_BYTES[spec.dtype]
    return {
        **held_states(spec, shape),
        "unsharded parameters: root (embeddings, norm, LM head)": float(b * root_params(shape)),
        "unsharded parameters: the last layer": float(b * layer_params(shape)),
        **activation_parts(spec, shape),
    }


def in_the_first_layers_backward(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """The backward's end, where the gradients have grown faster than the saved activations
    shrank (a layer's fp32 gradient shard outweighs its saved input): every gradient shard made,
    the first layer computing and the next unit prefetched, one layer's gradients in flight, one
    layer's activations (recomputed under checkpointing)."""
    b, world, layer = DTYPE_BYTES[spec.dtype], spec.world_size, layer_params(shape)
    parts = {
        **held_states(spec, shape),
        "unsharded parameters: two layers (computing, prefetched)": 2.0 * b * layer,
        "unsharded parameters: root (embeddings, norm, LM head)": float(b * root_params(shape)),
        "one layer's gradients (compute dtype + fp32 for the reduce-scatter)": (b + FP32) * layer,
        "one layer's activations": layer_activation_bytes(spec, shape),
    }
    if offloads(spec):
        parts["fp32 shards of two layers copied up for their all-gather"] = 2 * FP32 * layer / world
    else:
        parts["gradients (fp32 shard)"] = STATE_BYTES["gradients"] * math.ceil(shape.params / world)
    return parts


#: A rank's host memory before its model (the interpreter, torch, CUDA's host side), GiB, where
#: it differs from DeepSpeed's (:data:`predict.FITS` ``runtime_gib``, which loads DeepSpeed and
#: its ops too). Fitted by benchmarks/prediction_accuracy.py on the FSDP2 records of
#: engines-h200 and engines-h200-model-c (out of sample each study is judged with the other's):
#: 0.93 GiB against DeepSpeed's 1.48 fitted the same way.
RUNTIME_GIB = {"cuda": 0.93}


def runtime_gib(spec: RunSpec) -> float:
    return RUNTIME_GIB.get(spec.accelerator, FITS[spec.accelerator].runtime_gib)


def foreach_adam_temporary_bytes(spec: RunSpec, shape: ModelShape) -> float:
    """torch's foreach Adam/AdamW (torch/optim/adam.py, ``_multi_tensor_adam``) makes
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``: an fp32 tensor the size of every
    parameter shard it steps, alive until the parameters are updated (the fused GPU kernel makes
    none)."""
    return FP32 * math.ceil(shape.params / spec.world_size)


def rank_host_parts(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """Host bytes of one rank (device memory of a CPU rank not included)."""
    runtime = float(units.gib_to_bytes(runtime_gib(spec)))
    built = FP32 * shape.params  # the whole model, fp32, before fully_shard
    if not offloads(spec):
        return {"runtime": runtime, "model as built (fp32, before sharding)": built}
    pinned = spec.accelerator == "cuda" and spec.pin_memory is not False
    shards = [FP32 * n / spec.world_size for n in shape.tensors]  # bytes of each fp32 shard
    per_tensor = predict._pow2 if pinned else float
    states = {
        "parameters (fp32 shards" + (", pinned)" if pinned else ")"): sum(map(per_tensor, shards)),
        "gradients (fp32 shards" + (", pinned)" if pinned else ")"): sum(map(per_tensor, shards)),
        "Adam moments (fp32)": 2.0 * sum(shards),
        "foreach AdamW's temporary (fp32, in the step)": foreach_adam_temporary_bytes(spec, shape),
    }
    # the model as built is freed once sharded: it only counts where it is the larger peak
    beyond = max(0.0, built - sum(states.values()))
    return {"runtime": runtime, **states, "model as built, beyond the offloaded states": beyond}


def predict_memory(spec: RunSpec) -> Memory | None:
    shape = model_shape(spec)
    if shape is None:
        return None
    gpu = gpu_parts(spec, shape)
    rank = rank_host_parts(spec, shape)
    if spec.accelerator == "cpu":  # a CPU rank's "GPU" memory is host memory too
        rank = {**rank, **{f"device: {name}": v for name, v in gpu.items()}}
    host = {name: v * spec.gpus_per_node for name, v in rank.items()}
    return Memory(gpu=gpu, host=host, nvme={})


def reserved_features(spec: RunSpec) -> tuple[float, ...]:
    """The allocator's slack causes (:data:`predict.RESERVED_CAUSES`) of an FSDP2 run, bytes: the
    loss's blocks, the logits in the compute dtype and three fp32 tensors of their size (upcast,
    log-softmax, gradient), per micro-batch; with and without CPUOffloadPolicy apart, as the
    backward reuses a different share of them."""
    shape = model_shape(spec)
    if shape is None:
        return reserved_vector({})
    loss = spec.micro_batch * spec.seq_len * shape.vocab * (DTYPE_BYTES[spec.dtype] + 3 * FP32)
    mode = "with offload" if offloads(spec) else "without offload"
    return reserved_vector({f"the loss's blocks, FSDP2 {mode}": loss})


def host_adam_rate(cal: Calibration) -> float:
    """torch AdamW (foreach) on the CPU: calibrated, else DeepSpeedCPUAdam's rate."""
    return cal.torch_adam_params_per_s or cal.cpu_adam_params_per_s


def optimizer_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
    """fused AdamW on the GPU at the device rate; foreach AdamW on the node's cores, which its
    ranks share, when the states are on the CPU (offload, or a CPU cluster)."""
    shard = math.ceil(shape.params / spec.world_size)
    device_rate = FITS[spec.accelerator].optimizer_params_per_s
    if offloads(spec) or device_rate is None:
        return shard * spec.gpus_per_node / host_adam_rate(cal)
    return shard / device_rate


def pcie_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
    """CPUOffloadPolicy: every micro-step the fp32 shards go up per fetch, the fp32 gradient
    shards come down once."""
    if not offloads(spec) or spec.accelerator != "cuda" or not cal.h2d_gb_s:
        return 0.0
    shard = FP32 * shape.params / spec.world_size
    pinned = spec.pin_memory is not False
    up = (cal.h2d_gb_s if pinned else cal.pageable_h2d_gb_s or cal.h2d_gb_s) * GB
    down = (cal.d2h_gb_s or cal.h2d_gb_s) * GB
    return spec.gradient_accumulation_steps * (PARAM_FETCHES * shard / up + shard / down)


def comm_seconds(spec: RunSpec, shape: ModelShape, cal: Calibration) -> float:
    """All-gather of every unit per fetch (compute dtype), reduce-scatter of fp32 gradients."""
    dp = spec.world_size
    if dp == 1:
        return 0.0
    units_ = shape.layers + 1
    moved = (PARAM_FETCHES * DTYPE_BYTES[spec.dtype] + FP32) * shape.params * (dp - 1) / dp
    seconds = (PARAM_FETCHES + 1) * units_ * (cal.collective_latency_s or 0.0)
    if cal.interconnect_gb_s:
        seconds += moved / (cal.interconnect_gb_s * GB)
    return spec.gradient_accumulation_steps * seconds


#: FSDP2's host time per decoder layer and micro-step on a GPU: a pre- and post-forward and
#: -backward hook per layer (one all-gather, one reduce-scatter), not ZeRO-3's hooks per
#: parameter. Fitted by benchmarks/prediction_accuracy.py on the FSDP2 records of engines-h200
#: (model A) and engines-h200-model-c (model C) at DeepSpeed's matmul efficiency: 0.0115 s,
#: about half ZeRO-3's 0.020-0.022. Without offload both models run bound by their FLOPs
#: (model C: 0.63 s a step at micro-batch 8, ZeRO-3 0.73-0.75 s). Elsewhere (a CPU rank)
#: DeepSpeed's constant of :data:`predict.FITS` stands.
DISPATCH_S_PER_LAYER = {"cuda": 0.0115}


def dispatch_s_per_layer(spec: RunSpec) -> float:
    return DISPATCH_S_PER_LAYER.get(spec.accelerator, FITS[spec.accelerator].dispatch_s_per_layer)


def step_time(spec: RunSpec, cal: Calibration) -> StepTime | None:
    shape = model_shape(spec)
    if shape is None:
        return None
    fit, gas = FITS[spec.accelerator], spec.gradient_accumulation_steps
    sharing = spec.gpus_per_node if spec.accelerator == "cpu" else 1
    rate = cal.matmul_tflops * 1e12 * fit.efficiency
    return StepTime(
        flops_s=gas * sharing * flops_per_micro_step(spec, shape) / rate,
        dispatch_s=gas * shape.layers * dispatch_s_per_layer(spec),
        comm_s=comm_seconds(spec, shape, cal),
        pcie_s=pcie_seconds(spec, shape, cal),
        optimizer_s=optimizer_seconds(spec, shape, cal),
        nvme_s=0.0,
    )


predict.ENGINE_MODELS["fsdp2"] = sys.modules[__name__]
