"""FSDP2's settings of one run (configs/<scenario>.json): what the rank applies, written once by
the plan so that the record says what trained, as a DeepSpeed run's config does."""

from __future__ import annotations

from offload_study.core.contracts import RunSpec

#: The study's dtype -> the torch dtype the layers compute in (None: fp32, no casting).
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": None}


def build_config(spec: RunSpec) -> dict:
    """fully_shard's units and precision, the offload path, the optimizer and the scaler."""
    from offload_study import engines

    path = engines.get(spec.engine).path(spec.offload_optimizer, spec.offload_param)
    offload = {
        "path": path.name if path else None,
        "offload_optimizer": spec.offload_optimizer,
        "offload_param": spec.offload_param,
        "pin_memory": spec.pin_memory,
    }
    if "offload_optimizer_ratio" in spec.modes:
        offload["ratio"] = spec.modes["offload_optimizer_ratio"]
    return {
        "fully_shard": {
            "units": "each decoder layer, then the root (embeddings, final norm, LM head)",
            "mesh": [spec.world_size],
            "param_dtype": COMPUTE_DTYPES[spec.dtype],
            "reduce_dtype": "float32",
        },
        "offload": offload,
        "optimizer": {
            "type": spec.optimizer.type,
            "lr": spec.optimizer.lr,
            "weight_decay": spec.optimizer.weight_decay,
        },
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "micro_batch": spec.micro_batch,
        "grad_scaler": "ShardedGradScaler" if spec.dtype == "fp16" else None,
    }
