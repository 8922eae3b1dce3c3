"""The FSDP2 engine of the harness (scenario key ``engine: fsdp2``): PyTorch's ``fully_shard``.

The model is built from the same transformers config as the DeepSpeed runs (on the CPU,
seeded), with the same activation checkpointing, then sharded over a 1-D device mesh: each
decoder layer its own ``fully_shard`` unit (all-gathered for its forward and backward only),
then the root (embeddings, final norm, LM head). Precision follows the study's dtype through a
``MixedPrecisionPolicy``: the layers compute in param_dtype; the sharded parameters, gradients
and optimizer states stay fp32. Gradients are reduced in fp32 (reduce_dtype): they are summed
over micro-steps into those fp32 sharded gradients, as DeepSpeed keeps fp32 master weights and
gradients for its optimizer, so both engines make the same fp32 update; on one GPU there is no
reduction traffic, so it costs nothing there. fp16 adds a ``ShardedGradScaler`` (torch.amp's
GradScaler that agrees on inf/NaN across ranks, whose gradient shards differ, and works on CPU
gradients under offload).

Offload (both offload keys cpu: admission allows nothing else, as FSDP2 has one policy) is
``CPUOffloadPolicy(pin_memory=...)``: sharded parameters, gradients and the optimizer states
live in host memory, each unit is copied to the GPU for its all-gather, and the optimizer step
runs on CPU tensors. Optimizer: torch AdamW (or Adam), fused where the parameters are on the
GPU, foreach on the CPU.

No DeepSpeed is imported on this path: the op preflight asks nothing of an fsdp2 run.
"""

from __future__ import annotations

import os

from offload_study.core.contracts import RunSpec

#: The study's dtype -> the torch dtype the layers compute in (None: fp32, no casting).
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": None}


def offloads(spec: RunSpec) -> bool:
    """Whether the run offloads (admission: both offload keys cpu, or neither)."""
    return spec.offload_optimizer == "cpu" or spec.offload_param == "cpu"


def pin_memory(spec: RunSpec) -> bool:
    """The scenario's pin_memory (null: CPUOffloadPolicy's default, True); never on a CPU
    cluster: pinning needs an accelerator (torch refuses it without one)."""
    return spec.accelerator == "cuda" and spec.pin_memory is not False


def decoder_layers(model) -> list:
    """The decoder layers of a transformers causal LM (Llama and alike: model.model.layers)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found for fully_shard")
    return list(layers)


def build_model(spec: RunSpec):
    """The transformers model on the CPU (fp32, seeded), activation checkpointing as DeepSpeed's."""
    import transformers

    if spec.model.source == "pretrained":
        config = transformers.AutoConfig.from_pretrained(spec.model.name_or_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec.model.name_or_path, config=config
        )
    else:
        cfg = dict(spec.model.config)
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        config.use_cache = False
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard(model, spec: RunSpec, mesh) -> None:
    """fully_shard per decoder layer, then the root, with the study's precision and offload."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    compute = COMPUTE_DTYPES[spec.dtype]
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, compute) if compute else None, reduce_dtype=torch.float32
    )
    kwargs = {"mesh": mesh, "mp_policy": policy}
    if offloads(spec):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory(spec))
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def make_optimizer(model, spec: RunSpec, on_gpu: bool):
    """torch AdamW (or Adam) over the sharded parameters: fused on the GPU, foreach on the CPU."""
    import torch

    cls = torch.optim.AdamW if spec.optimizer.type == "AdamW" else torch.optim.Adam
    impl = {"fused": True} if on_gpu else {"foreach": True}
    opt = cls(model.parameters(), lr=spec.optimizer.lr, weight_decay=spec.optimizer.weight_decay,
              **impl)  # fmt: skip
    return opt, next(iter(impl))


class Fsdp2Engine:
    """One rank's FSDP2 model, optimizer and grad scaler behind the harness' engine interface
    (:class:`offload_study.training.harness.Engine`)."""

    name = "fsdp2"

    def __init__(self, spec: RunSpec, is_cuda: bool, local_rank: int, world: int):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.spec, self.world = spec, world
        self.device = torch.device("cuda", local_rank) if is_cuda else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if is_cuda else "gloo")
        mesh = init_device_mesh(self.device.type, (world,))
        self.model = build_model(spec)
        self.model_params = int(sum(p.numel() for p in self.model.parameters()))
        self.vocab_size = int(self.model.config.vocab_size)
        shard(self.model, spec, mesh)
        on_gpu = is_cuda and not offloads(spec)
        self.optimizer, self.impl = make_optimizer(self.model, spec, on_gpu)
        self.scaler = self._scaler()
        self.skipped_steps = 0
        self._is_cuda = is_cuda

    def _scaler(self):
        if self.spec.dtype != "fp16":
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=self.device.type)

    def synchronize(self) -> None:
        if self._is_cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def train(self) -> None:
        self.model.train()

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def backward(self, loss) -> None:
        # the mean over micro-steps, as DeepSpeed divides the loss by gas
        scaled = loss / self.spec.gradient_accumulation_steps
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()

    def step(self, boundary: bool) -> None:
        """The optimizer step at the accumulation boundary (grads are reduce-scattered and
        summed into the fp32 shards every micro-step, as ZeRO-3 does)."""
        if not boundary:
            return
        if self.scaler is None:
            self.optimizer.step()
        else:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.skipped_steps += int(self.scaler.get_scale() < before)
        self.optimizer.zero_grad(set_to_none=True)

    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler else None

    def effective_modes(self) -> dict:
        """What this engine used (metrics.json modes.effective)."""
        offloaded = offloads(self.spec)
        return {
            "pin_memory_optimizer": pin_memory(self.spec) if offloaded else None,
            "pin_memory_param": pin_memory(self.spec) if offloaded else None,
            "offload_policy": "CPUOffloadPolicy" if offloaded else "OffloadPolicy",
            "param_dtype": COMPUTE_DTYPES[self.spec.dtype] or "float32",
            "reduce_dtype": "float32",
            "optimizer_class": f"{type(self.optimizer).__name__} ({self.impl})",
            "grad_scaler": type(self.scaler).__name__ if self.scaler else None,
            "cores": sorted(os.sched_getaffinity(0)),
        }

    def versions(self) -> dict:
        import torch

        return {"engine_version": torch.__version__}

    def close(self, stats):
        del self.optimizer, self.model
        return stats
