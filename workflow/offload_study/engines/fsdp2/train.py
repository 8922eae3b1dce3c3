"""PyTorch FSDP2 in the harness: ``fully_shard`` per decoder layer, then the root.

The model is built from the same transformers config as the DeepSpeed runs (on the CPU,
seeded), with the same activation checkpointing, then sharded over a 1-D device mesh with the
run's settings (configs/<scenario>.json, :mod:`offload_study.engines.fsdp2.config`). Precision
follows the study's dtype through a ``MixedPrecisionPolicy``: the layers compute in param_dtype;
the sharded parameters, gradients and optimizer states stay fp32. Gradients are reduced in fp32
(reduce_dtype): they are summed over micro-steps into those fp32 sharded gradients, as DeepSpeed
keeps fp32 master weights and gradients for its optimizer, so both engines make the same fp32
update; on one GPU there is no reduction traffic, so it costs nothing there. fp16 adds a
``ShardedGradScaler`` (torch.amp's GradScaler that agrees on inf/NaN across ranks, whose
gradient shards differ, and works on CPU gradients under offload).

Where the states live and who steps them is the run's offload path
(:mod:`offload_study.engines.fsdp2.paths`). No DeepSpeed is imported on this path.
"""

from __future__ import annotations

import os
import time

from offload_study.core import architecture
from offload_study.core.contracts import RankStats, RunSpec, read_json
from offload_study.engines.fsdp2.paths import path_of


def start_rank(spec: RunSpec, config_path: str | None, run_id: str) -> tuple[dict, None]:
    """The rank's FSDP2 settings; nothing goes to NVMe."""
    return read_json(config_path or spec.ds_config), None


def decoder_layers(model) -> list:
    """The decoder layers FSDP2 shards one by one (the unit the step and memory models size)."""
    layers = architecture.decoder_layers(model)
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found for fully_shard")
    return layers


def build_model(spec: RunSpec):
    """The transformers model on the CPU (fp32, seeded), activation checkpointing as DeepSpeed's."""
    import transformers

    config = architecture.transformers_config(spec.model)
    if spec.model.source == "pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec.model.name_or_path, config=config
        )
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard(model, spec: RunSpec, settings: dict, mesh) -> None:
    """fully_shard per decoder layer, then the root, with the run's precision and its offload
    path's policy."""
    fully_shard_layers(model, mesh, settings["fully_shard"], path_of(spec).offload_policy(spec))


def fully_shard_layers(model, mesh, precision: dict, offload=None) -> None:
    """fully_shard each decoder layer, then the root, with ``precision`` (the config's
    fully_shard block: param_dtype, reduce_dtype) and an offload policy (None: the default)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute = precision["param_dtype"]
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, compute) if compute else None,
        reduce_dtype=getattr(torch, precision["reduce_dtype"]),
    )
    kwargs = {"mesh": mesh, "mp_policy": policy}
    if offload is not None:
        kwargs["offload_policy"] = offload
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


#: The probe's precision: a bf16 run's (config.build_config), reduced in fp32.
PROBE_PRECISION = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def host_probe(model, device: str):
    """One micro-step of ``model`` as a bf16 run without offload trains it: sharded over the
    group's ranks, forward, backward, torch AdamW's step (fused on a GPU, foreach on a CPU) and
    zero_grad; it returns the seconds of its forward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model.config.use_cache = False
    if device == "cuda":  # the rank's own GPU, as the harness places it
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        model.to(torch.device("cuda", torch.cuda.current_device()))
    fully_shard_layers(model, init_device_mesh(device, (dist.get_world_size(),)), PROBE_PRECISION)
    impl = {"fused": True} if device == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **impl)
    target = next(model.parameters()).device

    def step(tokens) -> float:
        tokens = tokens.to(target)
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        forward = time.perf_counter() - start
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return forward

    return step


class Fsdp2Engine:
    """One rank's FSDP2 model, optimizer and grad scaler behind the harness' engine interface
    (:class:`offload_study.engines.Trainer`)."""

    def __init__(self, spec: RunSpec, settings: dict, stats: RankStats, is_cuda: bool):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world, self.spec, self.settings = stats.world_size, spec, settings
        self.path = path_of(spec)
        self.device = torch.device("cuda", stats.local_rank) if is_cuda else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if is_cuda else "gloo")
        mesh = init_device_mesh(self.device.type, (world,))
        self.model = build_model(spec)
        self.model_params = int(sum(p.numel() for p in self.model.parameters()))
        self.vocab_size = int(self.model.config.vocab_size)
        shard(self.model, spec, settings, mesh)
        self.optimizer, self.impl = self.path.optimizer(self.model, spec, on_gpu=is_cuda)
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
        return {
            **self.path.effective(self.spec),
            "param_dtype": self.settings["fully_shard"]["param_dtype"] or "float32",
            "reduce_dtype": self.settings["fully_shard"]["reduce_dtype"],
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
