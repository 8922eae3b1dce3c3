"""Shared test helpers: run specs come from the real planner, never written by hand."""

from __future__ import annotations

from offload_study.contracts import RunSpec
from offload_study.plan import expand_plan
from offload_study.study import CLUSTER_DIR, load_cluster, load_study, validate

#: A Llama small enough for a 2-core CPU run in seconds (the runner tests train it).
SMALL_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
    "max_position_embeddings": 128,
}  # fmt: skip


def make_cluster(cluster: dict | str = "local-cpu") -> dict:
    """A validated cluster (schema defaults filled in): a shipped one by name, or a dict."""
    if isinstance(cluster, str):
        return load_cluster(cluster, cluster_dir=CLUSTER_DIR)
    return validate(cluster, "cluster", f"test cluster {cluster.get('name')!r}")


def make_spec(cluster: dict | str = "local-cpu", scenario: dict | None = None, **study) -> RunSpec:
    """The one run of a one-scenario study, planned by the real planner on ``cluster``.

    ``scenario`` keys replace those of the default scenario (``gpus_per_node`` ranks of the
    cluster up to 2, gradient accumulation 2: the global batch is 2 x 2 x world_size);
    ``study`` keys replace those of the small default study (SMALL_LLAMA, seq_len 64, 1 warm-up +
    3 measured steps, 5 min timeout).
    """
    cluster = make_cluster(cluster)
    scenario = {
        "name": "test-scenario",
        "gpus_per_node": min(2, cluster["gpus_per_node"]),
        "gradient_accumulation_steps": 2,
        **(scenario or {}),
    }
    config = {
        "study": "test", "cluster": cluster["name"], "model": {"config": dict(SMALL_LLAMA)},
        "seq_len": 64, "dtype": "bf16", "micro_batch": 2, "gradient_checkpointing": False,
        "steps": 3, "warmup_steps": 1, "seed": 1234, "timeout_min": 5, "scenarios": [scenario],
        **study,
    }  # fmt: skip
    (run,) = expand_plan(load_study(config, source="test study"), cluster)
    return run
