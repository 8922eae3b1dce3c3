"""FSDP2's memory and step-time model (scenario key ``engine: fsdp2``).

What FSDP2 (offload_study.engines.fsdp2.train) keeps where, per rank of a world of W, beside what
its offload path keeps (:mod:`offload_study.engines.fsdp2.paths`: the fp32 shards of the
parameters, their gradients and the Adam moments, on the device or the host):

- on the GPU: the unsharded parameters, in the compute dtype, of the layer being computed and of
  the next one (FSDP2 prefetches one layer's all-gather); the root unit's (embeddings, final
  norm, LM head), which the root keeps unsharded from its forward to its backward; one layer's
  unsharded gradients in the compute dtype and their fp32 copy for the reduce-scatter; the
  activations (as for DeepSpeed: :func:`offload_study.prediction.shared.activation_parts`).
- host: FSDP2's runtime (:data:`FITS`), and the model as built (fp32, on the CPU, before it is
  sharded: the peak of a run whose offloaded states are smaller), with the path's states.

Step time: the same FLOPs as a DeepSpeed run at this engine's own matmul efficiency and host
time per layer (:data:`FITS`), forward and backward each bound by the longer of the device's
work and the host's (:func:`~offload_study.prediction.shared.micro_steps_s`); on a CPU cluster
the host time per layer is the calibration's probe of FSDP2 and the parts add; collectives of a
world above 1 (all-gather each unit twice per micro-step, reduce-scatter fp32 gradients once);
the path's copies (those the device waits for inside the micro-steps, and those after) and
optimizer step.
"""

from __future__ import annotations

from offload_study.core import units
from offload_study.core.contracts import Calibration, RunSpec
from offload_study.engines.fsdp2.paths import FP32, path_of, shard_params
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
    reserved_vector,
)

#: This engine's name in the registry and in the calibration's probes (Calibration.layer_host_s).
ENGINE_NAME = "fsdp2"

#: This engine's constants per accelerator kind. On a GPU: its matmuls reach ~67 % of the
#: calibrated rate (fitted on the FSDP2 records by benchmarks/prediction_accuracy.py, against
#: ZeRO-3's 56 %: FSDP2 runs whole layers with no hooks per parameter); its host time per decoder layer and
#: micro-step (a pre- and post-forward and -backward hook per layer, one all-gather and one
#: reduce-scatter, not ZeRO-3's hooks per parameter), fitted by benchmarks/prediction_accuracy.py
#: on the FSDP2 records: 0.0100 s, under half ZeRO-3's 0.0235; a rank's host runtime before its
#: model (the interpreter, torch, CUDA's host side; no DeepSpeed and its ops), fitted on the same
#: records: 0.93 GiB against DeepSpeed's 1.48 fitted the same way; fused AdamW at the device rate
#: DeepSpeed's FusedAdam reaches. On a CPU rank: the calibrated matmul rate as measured, the host
#: time per layer from the calibration's probe of FSDP2 (0.004 s only for a calibration without
#: one), 0.55 GiB per rank before the model.
FITS = {
    "cuda": EngineFit(0.67, 0.0100, 3e10, 0.93),
    "cpu": EngineFit(1.0, 0.004, None, 0.55),
}


def layer_params(shape: ModelShape) -> int:
    """Elements of one decoder layer (FSDP2 shards and gathers each as one unit)."""
    return shape.layer_params


def root_params(shape: ModelShape) -> int:
    return shape.params - shape.layers * layer_params(shape)


def gpu_parts(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """Bytes per GPU at the peak, by what holds them: the largest of the moments of a step (the
    states held all step long are in each)."""
    moments = [
        at_the_loss(spec, shape),
        in_the_first_layers_backward(spec, shape),
        in_a_foreach_optimizer_step(spec, shape),
    ]
    return max(moments, key=lambda parts: sum(parts.values()))


def in_a_foreach_optimizer_step(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """The optimizer step where foreach AdamW runs on the rank's device (a CPU rank whose path
    steps the shards where they live; a GPU runs the fused kernel): the held states, every fp32
    gradient shard and foreach's temporary. Empty elsewhere."""
    path = path_of(spec)
    if not path.steps_on_device or spec.accelerator != "cpu":
        return {}
    return {
        **path.gpu_held(spec, shape),
        **path.gpu_gradients(spec, shape, layer_params(shape)),
        "foreach AdamW's temporary (fp32, in the step)": foreach_adam_temporary_bytes(spec, shape),
    }


def at_the_loss(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """The forward done: every activation saved, the logits and the loss; the root unsharded
    and the last layer's parameters not resharded yet; from the second micro-step of an
    accumulation on, the gradients of the ones before."""
    b, path = DTYPE_BYTES[spec.dtype], path_of(spec)
    accumulating = spec.gradient_accumulation_steps > 1
    return {
        **path.gpu_held(spec, shape),
        **(path.accumulated_gradients(spec, shape) if accumulating else {}),
        "unsharded parameters: root (embeddings, norm, LM head)": float(b * root_params(shape)),
        "unsharded parameters: the last layer": float(b * layer_params(shape)),
        **activation_parts(spec, shape),
    }


def in_the_first_layers_backward(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """The backward's end, where the gradients have grown faster than the saved activations
    shrank (a layer's fp32 gradient shard outweighs its saved input): every layer's gradient
    shard made (the path says which exist), the first layer computing and the next unit
    prefetched, one layer's gradients in flight, one layer's activations (recomputed under
    checkpointing)."""
    b, layer, path = DTYPE_BYTES[spec.dtype], layer_params(shape), path_of(spec)
    return {
        **path.gpu_held(spec, shape),
        "unsharded parameters: two layers (computing, prefetched)": 2.0 * b * layer,
        "unsharded parameters: root (embeddings, norm, LM head)": float(b * root_params(shape)),
        "one layer's gradients (compute dtype + fp32 for the reduce-scatter)": (b + FP32) * layer,
        "one layer's activations": layer_activation_bytes(spec, shape),
        **path.gpu_gradients(spec, shape, layer),
    }


def foreach_adam_temporary_bytes(spec: RunSpec, shape: ModelShape) -> float:
    """torch's foreach Adam/AdamW (torch/optim/adam.py, ``_multi_tensor_adam``) makes
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``: an fp32 tensor the size of every
    parameter shard it steps, alive until the parameters are updated (the fused GPU kernel makes
    none)."""
    return FP32 * shard_params(spec, shape)


def rank_host_parts(spec: RunSpec, shape: ModelShape) -> dict[str, float]:
    """Host bytes of one rank (device memory of a CPU rank not included)."""
    runtime = float(units.gib_to_bytes(FITS[spec.accelerator].runtime_gib))
    # the whole model, fp32, before fully_shard; with tied embeddings transformers builds the
    # output head whole and only then ties it, so the build peaks at the untied size (a 1.5 B
    # Qwen2 on this machine: 6.96 GiB at its peak, 6.09 once tied)
    built = FP32 * (shape.params + shape.tied_head)
    states = path_of(spec).host_states(spec, shape)
    if not states:
        return {"runtime": runtime, "model as built (fp32, before sharding)": built}
    # the model as built is freed once sharded: it only counts where it is the larger peak
    beyond = max(0.0, built - sum(states.values()))
    return {"runtime": runtime, **states, "model as built, beyond the offloaded states": beyond}


def predict_memory(spec: RunSpec, config: dict, cal: Calibration | None = None) -> Memory | None:
    shape = model_shape(spec)
    if shape is None:
        return None
    gpu = gpu_parts(spec, shape)
    rank = rank_host_parts(spec, shape)
    if spec.accelerator == "cpu":  # a CPU rank's "GPU" memory is host memory too
        rank = {**rank, **{f"device: {name}": v for name, v in gpu.items()}}
    host = {name: v * spec.gpus_per_node for name, v in rank.items()}
    return Memory(gpu=gpu, host=host, nvme={})


def reserved_features(spec: RunSpec, config: dict) -> tuple[float, ...]:
    """The allocator's slack causes (:data:`offload_study.prediction.shared.RESERVED_CAUSES`)
    of an FSDP2 run, bytes: the loss's blocks under the cause its offload path names for the run
    (how much of them the backward's blocks reuse), and the path's own blocks."""
    shape = model_shape(spec)
    if shape is None:
        return reserved_vector({})
    path = path_of(spec)
    loss = {path.reserved_cause(spec): loss_blocks_bytes(spec, shape)}
    return reserved_vector({**loss, **path.own_reserved_causes(spec, shape)})


def known_reserved_bytes(spec: RunSpec, config: dict) -> float:
    """No blocks of known size beyond the allocator's slack."""
    return 0.0


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


def step_time(spec: RunSpec, config: dict, cal: Calibration) -> StepTime | None:
    """The predicted optimizer-step time of a run (None when the model's shape is unknown). On a
    CPU rank whose calibration probed FSDP2, one thread runs the matmuls, the hooks and gloo's
    blocking collectives in turn: they add (``serial``), as for ZeRO-3."""
    shape = model_shape(spec)
    if shape is None:
        return None
    fit, gas, path = FITS[spec.accelerator], spec.gradient_accumulation_steps, path_of(spec)
    sharing = spec.gpus_per_node if spec.accelerator == "cpu" else 1
    rate = cal.matmul_tflops * 1e12 * fit.efficiency
    dispatch_s, probed = dispatch_seconds(spec, shape, cal, ENGINE_NAME, fit.dispatch_s_per_layer)
    return StepTime(
        flops_s=gas * sharing * flops_per_micro_step(spec, shape) / rate,
        dispatch_s=gas * dispatch_s,
        serial=probed,
        comm_s=comm_seconds(spec, shape, cal),
        pcie_s=path.pcie_seconds(spec, shape, cal),
        optimizer_s=path.optimizer_seconds(spec, shape, cal, fit.optimizer_params_per_s),
        nvme_s=0.0,
        device_wait_s=path.device_wait_seconds(spec, shape, cal),
        forward=forward_shares(spec, path.forward_wait_share(spec, cal)),
    )


def note(spec: RunSpec, config: dict, cal: Calibration | None = None) -> str | None:
    return None


def own_estimate(spec: RunSpec) -> tuple[float, float] | None:
    """FSDP2 has no estimator of its own."""
    return None


def calibration_layout(spec: RunSpec, config: dict) -> CalibrationLayout | None:
    """What calibrate measures for the run: the optimizer over the rank's fp32 shard (no
    sub-groups), copies of one decoder layer's fp32 shards."""
    shape = model_shape(spec)
    if shape is None:
        return None
    copy = int(FP32 * layer_params(shape) / spec.world_size)
    return CalibrationLayout(shard_params(spec, shape), None, copy)
