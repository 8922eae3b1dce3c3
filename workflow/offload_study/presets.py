"""Model architecture presets: real dimensions, random init (throughput and memory depend on
the architecture, not on the weights)."""

from __future__ import annotations

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
