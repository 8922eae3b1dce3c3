"""Model architecture presets: real dimensions, random init (throughput and memory depend on
the architecture, not on the weights)."""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import re
from pathlib import Path

from offload_study.core import architecture
from offload_study.core.study import StudyError, shown

_LLAMA_COMMON = {
    "model_type": "llama",
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict] = {
    # meta-llama/Llama-2-7b-hf config.json
    "llama2-7b": {
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    # meta-llama/Llama-2-13b-hf config.json
    "llama2-13b": {
        **_LLAMA_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
    },
    # meta-llama/Llama-2-70b-hf config.json (grouped-query attention, 8 KV heads)
    "llama2-70b": {
        **_LLAMA_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    # A few-million-parameter Llama that trains in seconds on 2 CPU cores (default study, tests).
    "tiny-llama": {
        **_LLAMA_COMMON,
        "vocab_size": 8192,  # big enough that NVMe offload swaps real tensors (min_aio_bytes 1 MiB)
        "max_position_embeddings": 512,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
}


# --------------------------------------------------------------------------- plan-time checks
# The study's model is built as a transformers config (no weights, no network) when the plan is
# made, so that an architecture transformers cannot build is refused before any run starts.


def _config_class(model_type, where: str):
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise StudyError(
            f"{where}: {shown(model_type)} is not a model type of the installed transformers{hint}"
        )
    return CONFIG_MAPPING[model_type]


@functools.cache
def config_keys(config_class) -> frozenset[str]:
    """Keys a transformers config class takes: its and PretrainedConfig's parameters, what its
    default instance writes to config.json, and the aliases of its attribute_map."""
    params = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    return frozenset(params | set(config_class().to_dict()) | set(config_class.attribute_map))


def _defaults(config_class) -> dict:
    """The class's parameter defaults as written (None where __init__ derives the value, e.g.
    num_key_value_heads = num_attention_heads), not what a default instance computed."""
    params = inspect.signature(config_class.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _root_message(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _check_heads(values: dict, key_of) -> None:
    """Attention heads that cannot split the hidden size (or the KV heads the heads)."""
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    kv_heads = values.get("num_key_value_heads") or heads
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (hidden, heads, kv_heads))
    if not ints or min(hidden, heads, kv_heads) < 1:
        return
    if not values.get("head_dim") and hidden % heads:
        raise StudyError(
            f"{key_of('num_attention_heads')}: {heads} heads do not divide hidden_size {hidden}; "
            "allowed: a divisor of hidden_size (or set head_dim)"
        )
    if heads % kv_heads:
        raise StudyError(
            f"{key_of('num_key_value_heads')}: {kv_heads} KV heads do not divide "
            f"num_attention_heads {heads}; allowed: a divisor of num_attention_heads"
        )


def build_config(base: dict, base_where: str, overrides: dict, overrides_where="model.overrides"):
    """The transformers config of ``base`` (with model_type) updated by ``overrides``; every
    refusal (unknown model type or key, heads that do not divide, a value transformers refuses)
    is a StudyError naming the key path."""
    merged = architecture.overridden(base, overrides)

    def key_of(key: str) -> str:
        return f"{overrides_where if key in overrides else base_where}.{key}"

    config_class = _config_class(merged.get("model_type"), key_of("model_type"))
    known = config_keys(config_class)
    for key in merged:
        if key != "model_type" and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise StudyError(
                f"{key_of(key)}: not a key of transformers' {config_class.__name__}{hint}"
            )
    kwargs = {k: v for k, v in merged.items() if k != "model_type"}
    written = {v: k for k, v in config_class.attribute_map.items()}  # n_head -> num_attention_heads
    values = {written.get(k, k): v for k, v in {**_defaults(config_class), **kwargs}.items()}
    # errors name the key as the study wrote it (gpt2: n_head, not num_attention_heads)
    _check_heads(
        values,
        lambda k: key_of(
            config_class.attribute_map.get(k, k)
            if config_class.attribute_map.get(k) in merged
            else k
        ),
    )
    try:
        config = config_class(**kwargs)
    except Exception as exc:  # TypeError, ValueError or transformers' own validation errors
        message = _root_message(exc)
        named = _named_key(message, merged)
        where = key_of(named) if named else base_where
        raise StudyError(f"{where}: transformers cannot build this config: {message}") from None
    _check_pad_token(config, merged, key_of)
    try:  # the model itself, as the runs build it (on the meta device: no weights)
        architecture.build_on_meta(config)
    except Exception as exc:
        raise StudyError(
            f"{base_where}: transformers cannot build a {config.model_type} causal LM from this "
            f"config: {_root_message(exc)}"
        ) from None
    return config


def _named_key(message: str, written: dict) -> str | None:
    """The config key a transformers error names (pydantic's "Field 'x'", or the first `x` in
    backticks that the study's model block sets)."""
    field = re.search(r"[Ff]ield '(\w+)'", message)
    if field:
        return field.group(1)
    return next((k for k in re.findall(r"`(\w+)`", message) if k in written), None)


def _check_pad_token(config, written: dict, key_of) -> None:
    """A padding token past the vocabulary (a class default made for its own vocabulary, phi3's
    32000) fails the model's embedding; name the key, written or not."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if not (isinstance(pad, int) and isinstance(vocab, int)) or pad < vocab:
        return
    how = "" if "pad_token_id" in written else f" ({type(config).__name__}'s default)"
    raise StudyError(
        f"{key_of('pad_token_id')}: {pad}{how} is past vocab_size {vocab}; allowed: a token id "
        "below vocab_size, or null"
    )


#: What a check builds (a marker remembers a success of these checks only): the config, then
#: the model on the meta device.
CHECKS = ("config", "model on the meta device")


def checked_marker(model: dict) -> Path:
    """Where a model block that built once is remembered: its content and the transformers
    version, hashed. Building it imports transformers (and torch), ~3 s on every Snakemake
    invocation, dry runs included (benchmarks/dryrun_overhead.py); the block decides the outcome,
    so one success per content is enough. Only successes are remembered."""
    version = importlib.metadata.version("transformers")
    preset = PRESETS.get(model.get("preset"))  # a preset's dimensions live in this module
    content = json.dumps([model, preset, version, CHECKS], sort_keys=True, default=str)
    key = hashlib.sha256(content.encode()).hexdigest()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "offload-study" / "model-checks" / key


def check_model(model: dict) -> int | None:
    """A preset or config model of a validated study, built without weights (StudyError);
    a block that built before (:func:`checked_marker`) is not built again. Returns the model's
    max_position_embeddings (None when its config has none), remembered with the marker."""
    return _built_once(model, lambda: _build_model(model))


def _built_once(content: dict, build) -> int | None:
    """The positions of the config ``build`` returns, built once per ``content``
    (:func:`checked_marker`; a StudyError is never remembered)."""
    marker = checked_marker(content)
    remembered = marker.read_text().strip() if marker.exists() else ""
    if remembered:  # an older, empty marker: build again to learn the positions
        return json.loads(remembered)["max_position_embeddings"]
    positions = _positions(build())
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"max_position_embeddings": positions}))
    except OSError:  # a read-only home: build again next time
        pass
    return positions


def _positions(config) -> int | None:
    """max_position_embeddings of a transformers config (gpt2 maps it to n_positions)."""
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _build_model(model: dict):
    overrides = model.get("overrides", {})
    if "preset" in model:
        if model["preset"] not in PRESETS:
            known = ", ".join(sorted(PRESETS))
            raise StudyError(
                f"model.preset: {model['preset']!r} is unknown; known presets: {known}"
            )
        return build_config(PRESETS[model["preset"]], "model.preset", overrides)
    if "config" in model:
        return build_config(model["config"], "model.config", overrides)
    return None


def check_pretrained(name_or_path: str, overrides: dict) -> int | None:
    """A pretrained model's config.json must be on this machine: a local folder, or a model the
    local Hugging Face cache holds (the plan and the runs do not download). Returns its
    max_position_embeddings (None when its config has none). Its config and model are built once
    per content (:func:`checked_marker`), as a preset's or a config's are."""
    from transformers import AutoConfig

    where = f"model.name_or_path: {shown(name_or_path)}"
    if name_or_path.startswith(("/", "./", "../", "~")) and not Path(name_or_path).is_dir():
        raise StudyError(f"{where}: no such folder on this machine; allowed: a local model folder")
    try:
        config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except Exception as exc:  # OSError (not there), ValueError (no model_type), JSON errors
        if Path(name_or_path).is_dir():
            raise StudyError(
                f"{where}: the folder has no usable config.json ({_root_message(exc)[:200]})"
            ) from None
        raise StudyError(
            f"{where}: not a local folder and not in the local Hugging Face cache; the plan does "
            "not download models (no network is assumed); allowed: a local model folder or a "
            "cached model id (download it first)"
        ) from None
    values = config.to_dict()  # its content decides, wherever the folder lies
    return _built_once(
        {"config": values, "overrides": overrides},
        lambda: build_config(values, "model.name_or_path", overrides),
    )
