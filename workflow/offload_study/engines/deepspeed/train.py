"""DeepSpeed ZeRO-3 in the harness: one rank's engine behind the step loop.

The model is built inside ``deepspeed.zero.Init`` (partitioned as it is made) and wrapped by
``deepspeed.initialize`` with the run's DeepSpeed config. NVMe swap files go to a run-private
folder (``contracts.nvme_run_dir``; the DS config's nvme_path is rewritten) that is sampled in
the background for its peak size and removed at the end (:meth:`ZeroEngine.close`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil

from offload_study.core.architecture import transformers_config
from offload_study.core.contracts import RankStats, RunSpec, nvme_run_dir, read_json
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.planning import modes
from offload_study.training import probes


def private_nvme_dir(spec: RunSpec, ds_config: dict, run_id: str) -> str | None:
    """This run's NVMe folder, written into the DS config; None when nothing goes to NVMe."""
    if not spec.nvme_path:
        return None
    nvme_dir = nvme_run_dir(spec.nvme_path, run_id)
    return nvme_dir if dsconfig.rewrite_nvme_path(ds_config, nvme_dir) else None


def start_rank(spec: RunSpec, config_path: str | None, run_id: str) -> tuple[dict, str | None]:
    """The rank's DeepSpeed config (``config_path``, else the spec's) and its private NVMe
    folder, written into that config (None when nothing goes to NVMe)."""
    ds_config = read_json(config_path or spec.ds_config)
    return ds_config, private_nvme_dir(spec, ds_config, run_id)


def ask_cpu_once() -> None:
    """DeepSpeed asks py-cpuinfo about this CPU for every op it loads (its -march, its SIMD
    width) and again in its CPU Adam, and each ask starts a Python process of its own (~1.2
    CPU-seconds on a 2-core machine; five asks in an NVMe run): each rank asks once."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu itself
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def build_model(spec: RunSpec, ds_config: dict):
    import deepspeed
    import transformers

    pretrained = spec.model.source == "pretrained"
    config = transformers_config(spec.model)
    # Resolve (import) the model class *before* zero.Init: zero.Init patches torch.Tensor.__new__,
    # and transformers' lazy module import then pulls in torch._dynamo, which fails with
    # "TypeError: Signature mismatch between <function get_new_tensor_fn_for_dtype...>".
    import torch._dynamo  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if pretrained:
        model = from_pretrained_zero3(model_cls, spec.model.name_or_path, config, ds_config)
    else:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = transformers.AutoModelForCausalLM.from_config(config)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


#: transformers reads its ZeRO-3 settings through a weak reference: the object lives as long
#: as the rank (transformers' HfDeepSpeedConfig docstring).
_HF_DEEPSPEED_CONFIG = []


def from_pretrained_zero3(model_cls, name_or_path: str, config, ds_config: dict):
    """A checkpoint loaded the way transformers documents for ZeRO-3: with an HfDeepSpeedConfig
    alive, from_pretrained builds the model under zero.Init and loads each module's weights
    gathered. A from_pretrained inside a zero.Init of ours finds every parameter partitioned to
    size 0 and refuses the checkpoint ("MISMATCH ... vs model: torch.Size([0])")."""
    from transformers.integrations import HfDeepSpeedConfig

    _HF_DEEPSPEED_CONFIG[:] = [HfDeepSpeedConfig(ds_config)]
    return model_cls.from_pretrained(name_or_path, config=config)


def count_params(model) -> int:
    # under ZeRO-3 each parameter keeps its full size in ds_numel
    return int(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))


def loss_scale(engine) -> float | None:
    """The ZeRO optimizer's current loss scale (fp16: dynamic; bf16/fp32: 1.0), None if absent."""
    for name in ("cur_scale", "loss_scale"):
        value = getattr(engine.optimizer, name, None)
        if value is not None:
            try:
                return float(value)
            except (TypeError, ValueError):
                continue
    return None


class ZeroEngine:
    """One rank's DeepSpeed engine behind the harness' engine interface
    (:class:`offload_study.engines.Trainer`)."""

    def __init__(self, spec: RunSpec, ds_config: dict, stats: RankStats, is_cuda: bool):
        del is_cuda  # DeepSpeed's accelerator decides (DS_ACCELERATOR, else what it finds)
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        ask_cpu_once()
        deepspeed.utils.set_log_level_from_string("info")
        self._acc = get_accelerator()
        deepspeed.init_distributed()
        self._nvme_dir, self._sampler = stats.nvme_dir, None
        if stats.nvme_dir and stats.local_rank == 0:
            os.makedirs(stats.nvme_dir, exist_ok=True)
            self._sampler = probes.DirSizeSampler(stats.nvme_dir).start()
        model = build_model(spec, ds_config)
        self.model_params = count_params(model)
        self.engine, self._optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
        self.device = self.engine.device
        self.vocab_size = int(self.engine.module.config.vocab_size)

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def synchronize(self) -> None:
        self._acc.synchronize()

    def train(self) -> None:
        self.engine.train()

    def forward(self, ids):
        return self.engine(input_ids=ids, labels=ids).loss

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self, boundary: bool) -> None:
        del boundary  # DeepSpeed counts the micro-steps itself: step() after each one
        self.engine.step()

    def loss_scale(self) -> float | None:
        return loss_scale(self.engine)

    def effective_modes(self) -> dict:
        return modes.effective(self.engine)

    def versions(self) -> dict:
        import deepspeed

        return {"deepspeed_version": deepspeed.__version__, "engine_version": deepspeed.__version__}

    def close(self, stats: RankStats) -> RankStats:
        """Let go of the NVMe swap buffers, then (every rank done) remove the run's folder."""
        import torch

        del self.engine, self._optimizer
        if self._sampler is not None:
            stats = dataclasses.replace(stats, nvme_bytes_used=self._sampler.stop())
        if stats.world_size > 1:
            torch.distributed.barrier()
        if stats.nvme_dir and stats.local_rank == 0:
            shutil.rmtree(stats.nvme_dir, ignore_errors=True)
            stats = dataclasses.replace(stats, nvme_cleaned=not os.path.exists(stats.nvme_dir))
        return stats
