"""A study's model as transformers builds it: the config a run trains (one home, for the engines
that build the model and for the models that predict it) and the layout of its parameters.

The layout is what the step and memory models need of an architecture beyond a Llama config:
the size of each parameter tensor in ``model.parameters()`` order (the order DeepSpeed forms its
sub-groups in and FSDP2 shards in; tied weights count once), what one decoder layer holds, and
the dimensions by transformers' own names (``attribute_map``: gpt2's n_embd is hidden_size). It is
read off the model built on the meta device: no weights, no memory, no network; a 70B Llama
takes ~1.3 s on 2 cores, a 0.5B one ~0.03 s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from offload_study.core.contracts import ModelSpec

#: The names transformers configs give the MLP's inner size (Llama's, GPT-2's, OPT's).
FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim")


@dataclass(frozen=True)
class Layout:
    """A model's parameters as the step and memory models read them (elements, not bytes)."""

    model_type: str
    tensors: tuple[int, ...]  # elements of each parameter tensor, model.parameters() order
    layers: int  # decoder layers
    layer_params: int  # elements of one decoder layer (every layer holds the same)
    hidden: int
    ffn: int  # the MLP's inner size (4 x hidden where the config names none)
    heads: int
    kv_heads: int
    vocab: int
    # elements of an output head that transformers builds and then ties to the input
    # embeddings (post_init's tie_weights frees it): 0 for a model whose head is its own
    tied_head: int = 0

    @property
    def params(self) -> int:
        return sum(self.tensors)

    @property
    def largest_layer_params(self) -> int:
        """The largest single module (DeepSpeed's estimator's ``largest_layer_params``)."""
        return max(self.vocab * self.hidden, self.hidden * self.ffn)


@dataclass(frozen=True)
class Unknown:
    """A model the step and memory models cannot describe, and why, in the reader's words; its
    parameter count where transformers built it (a mixture of experts, unlike layers)."""

    reason: str
    params: int | None = None


def overridden(base: dict, overrides: dict) -> dict:
    """``base`` (a config's values) with the study's ``model.overrides``. Fewer layers cut each
    per-layer list of ``base`` that the overrides leave alone (transformers writes
    ``layer_types`` into a Qwen2's or a Gemma2's config.json and refuses a count that differs
    from its length): a checkpoint then loads its first layers."""
    merged = {**base, **overrides}
    layers, fewer = base.get("num_hidden_layers"), overrides.get("num_hidden_layers")
    if not (isinstance(layers, int) and isinstance(fewer, int) and 0 < fewer < layers):
        return merged
    for key, value in base.items():
        if key not in overrides and isinstance(value, list) and len(value) == layers:
            merged[key] = value[:fewer]
    return merged


def transformers_config(model: ModelSpec, local_only: bool = False):
    """The transformers config a run trains: a pretrained model's own config.json with the
    study's ``model.overrides`` applied (:func:`overridden`), else the study's config (a
    preset's written out, its overrides applied by the plan). ``local_only``: never download
    (planning assumes no network)."""
    import transformers

    if model.source == "pretrained":
        own = transformers.AutoConfig.from_pretrained(
            model.name_or_path, local_files_only=local_only
        )
        config = type(own).from_dict(overridden(own.to_dict(), model.config))
    else:
        values = dict(model.config)
        config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    config.use_cache = False
    return config


def layout(model: ModelSpec) -> Layout | Unknown:
    """The model's :class:`Layout`, or why it has none (built once per model and process)."""
    return _layout(json.dumps(dataclasses.asdict(model), sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)
def _layout(model_json: str) -> Layout | Unknown:
    model = ModelSpec(**json.loads(model_json))
    try:
        config = transformers_config(model, local_only=True)
    except Exception as exc:  # OSError (not on this machine), ValueError, JSON errors
        where = model.name_or_path or "the study's model"
        return Unknown(f"the config of {where} cannot be read here ({_first_line(exc)})")
    return layout_of_config(config)


#: What a Llama's closed-form count reads of its config.
LLAMA_DIMS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def param_count(model: ModelSpec, build: bool = True) -> int | None:
    """Elements of the model's parameters as transformers builds it, for any architecture (a
    mixture of experts too, which has no :class:`Layout`); None where its config cannot be read
    here or transformers cannot build it. A Llama given by its config is counted in closed form;
    any other model is built on the meta device, which imports torch and takes seconds: with
    ``build=False``, None instead."""
    cfg = model.config
    if model.source == "config" and cfg.get("model_type") == "llama":
        if all(k in cfg for k in LLAMA_DIMS):
            return llama_param_count({"vocab_size": 32000, **cfg})
    return layout(model).params if build else None


def llama_param_count(cfg: dict) -> int:
    """Parameters of a Llama-style decoder from its config (embeddings, attention, MLP, norms)."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = 3 * h * f
    per_layer = attn + mlp + 2 * h
    lm_head = 0 if cfg.get("tie_word_embeddings") else vocab * h
    return vocab * h + layers * per_layer + h + lm_head


def build_on_meta(config):
    """The causal LM a run builds from ``config``, on the meta device (transformers' errors
    raised as they come: the study check names them before anything runs)."""
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def layout_of_config(config) -> Layout | Unknown:
    """The layout of a causal LM built from ``config`` on the meta device."""
    kind = getattr(config, "model_type", "this model")
    try:
        built = build_on_meta(config)
    except Exception as exc:  # no causal-LM class, or one that cannot be built from the config
        return Unknown(f"transformers cannot build {kind} as a causal LM ({_first_line(exc)})")
    named = [(name, p.numel()) for name, p in built.named_parameters()]
    params = sum(n for _, n in named)
    experts = next((name for name, _ in named if "expert" in name), None)
    if experts:
        why = f"{kind} is a mixture of experts ({experts}): the models know dense decoder layers"
        return Unknown(why, params)
    stack = decoder_layers(built)
    if not stack:
        return Unknown(f"{kind} has no stack of decoder layers the models know", params)
    sizes = {sum(p.numel() for p in layer.parameters()) for layer in stack}
    if len(sizes) != 1:
        why = f"{kind}'s decoder layers differ in size: the models know alike layers"
        return Unknown(why, params)
    layout = _with_dims(config, kind, tuple(n for _, n in named), len(stack), sizes.pop())
    if isinstance(layout, Unknown):
        return layout
    return dataclasses.replace(layout, tied_head=tied_head(built))


def tied_head(built) -> int:
    """Elements of ``built``'s output head where it shares its weight with the input
    embeddings (transformers made it whole first, then tied it), else 0."""
    head, embeddings = built.get_output_embeddings(), built.get_input_embeddings()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return 0
    return head.weight.numel()


def _with_dims(config, kind: str, tensors: tuple, layers: int, layer_params: int):
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    vocab = getattr(config, "vocab_size", None)
    if not all(isinstance(v, int) for v in (hidden, heads, vocab)):
        return Unknown(f"{kind}'s config names no hidden_size, num_attention_heads or vocab_size")
    ffn = next((getattr(config, k) for k in FFN_KEYS if getattr(config, k, None)), None)
    return Layout(
        model_type=kind,
        tensors=tensors,
        layers=layers,
        layer_params=layer_params,
        hidden=hidden,
        ffn=ffn if isinstance(ffn, int) else 4 * hidden,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        vocab=vocab,
    )


def decoder_layers(model) -> list:
    """The decoder layers of a causal LM: the module list holding the most parameters
    (model.layers of a Llama, transformer.h of a GPT-2, model.decoder.layers of an OPT); empty
    where the model has no module list. FSDP2 shards each as a unit, and the models size it."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
