"""DeepSpeed's part of calibrate's host-time probe (:attr:`offload_study.engines.Engine.host_probe`):
a tiny model under ZeRO-3, stepped as the harness steps it."""

from __future__ import annotations

import time

#: Micro-batch of every probe micro-step (calibrate.PROBE_BATCH gives its tokens).
PROBE_MICRO_BATCH = 2


def probe_config() -> dict:
    """The probe engine's DeepSpeed config: ZeRO-3, no offload. Offloading the optimizer, or it
    and the parameters, changed nothing the probe could tell at its size (one rank: forward /
    backward 2.1 / 2.8 ms per layer plain, 2.1 / 2.8 and 2.2 / 3.1 offloaded; two ranks: 2.4 /
    10.1, 2.3 / 11.7 and 2.5 / 11.1): the optimizer's own time is CPU Adam's, counted apart."""
    return {
        "train_micro_batch_size_per_gpu": PROBE_MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }


def host_probe(model, device: str):
    """One micro-step of ``model`` under ZeRO-3 (forward, backward, and the step, which keeps
    ZeRO-3's fetch trace valid); it returns the seconds of its forward. DeepSpeed's accelerator
    places the model (``device`` is its kind)."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=probe_config())

    def step(tokens) -> float:
        tokens = tokens.to(engine.device)
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        forward = time.perf_counter() - start
        engine.backward(loss)
        engine.step()
        return forward

    return step
