"""A model as transformers builds it (offload_study.core.architecture): the layout the step and
memory models read off the meta-device build, for the Llama every record measured and for the
architectures users bring (Qwen2, GPT-2, a mixture of experts, a local checkpoint with
overrides), and the plan's note where a model cannot be predicted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO, SMALL_LLAMA, make_spec
from runs import load_record, make_run, run_runner

from offload_study.core import architecture
from offload_study.core.contracts import ModelSpec
from offload_study.core.study import StudyError
from offload_study.engines.deepspeed import config as dsconfig
from offload_study.engines.deepspeed import model as ds_model
from offload_study.engines.fsdp2 import model as fsdp2_model
from offload_study.engines.fsdp2 import train as fsdp2_train
from offload_study.planning import presets
from offload_study.prediction import predict, shared
from offload_study.training.tokens import Batches

#: A Qwen2 wide enough that its projections pass DeepSpeed's persistence threshold (1e5
#: elements) while its biases and norms stay under it; tied embeddings, grouped-query attention.
QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
    "max_position_embeddings": 128,
}


def config_model(config: dict) -> ModelSpec:
    return ModelSpec("config", None, dict(config), None)


def test_a_llamas_layout_is_its_hand_count_in_parameter_order():
    found = architecture.layout(config_model(SMALL_LLAMA))
    h, f, v = 64, 128, 512
    layer = [h * h] * 4 + [h * f] * 3 + [h, h]  # q k v o, gate up down, two RMSNorms
    assert found.tensors == tuple([v * h] + layer * 2 + [h] + [v * h])
    assert (found.layers, found.layer_params, found.hidden, found.ffn) == (2, sum(layer), h, f)
    assert (found.heads, found.kv_heads, found.vocab) == (4, 4, v)


def test_qwen2s_biases_and_tied_embeddings_come_from_its_own_build():
    found = architecture.layout(config_model(QWEN2))
    h, kv, f, v = 512, 512 * 4 // 8, 1024, 1000
    layer = [h * h, h, h * kv, kv, h * kv, kv, h * h, h * f, h * f, f * h, h, h]
    assert found.tensors == tuple([v * h] + layer * 2 + [h])  # the head is the embedding
    assert found.layer_params == sum(layer) and found.kv_heads == 4
    spec = make_spec("local-cpu", {"gpus_per_node": 2}, model={"config": dict(QWEN2)}, seq_len=64)
    shape, k = shared.model_shape(spec), ds_model.knobs(dsconfig.build_ds_config(spec))
    # ZeRO-3 keeps every tensor of at most 1e5 elements whole: norms and biases, not the rest
    assert ds_model.persistent_params(shape, k) == 2 * (3 * h + 2 * kv) + h
    assert fsdp2_model.root_params(shape) == v * h + h


#: A tied model whose head is large enough (64,000 x 384 fp32: 94 MiB) that glibc maps it apart
#: and gives it back when tie_weights drops it, so the build's peak RSS shows it.
TIED_BIG_HEAD = {**QWEN2, "hidden_size": 384, "intermediate_size": 768, "vocab_size": 64000}
TIED_BIG_HEAD |= {"num_attention_heads": 6, "num_key_value_heads": 2}


@pytest.mark.alone  # RSS freed: under the other workers' load a build freed 32 MiB more
def test_a_tied_head_is_built_whole_before_it_is_tied_and_fsdp2s_host_counts_it(tmp_path):
    """transformers builds a tied model's output head whole, then ties it to the embeddings:
    the build's peak RSS (/proc) is above the tied model by that head, which the layout names
    and FSDP2's host memory (the model as built, before sharding) counts."""
    found = architecture.layout(config_model(TIED_BIG_HEAD))
    assert found.tied_head == 64000 * 384
    assert architecture.layout(config_model(SMALL_LLAMA)).tied_head == 0
    study = tmp_path / "tied.yaml"
    study.write_text(json.dumps({"model": {"config": TIED_BIG_HEAD}}))  # YAML reads JSON
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tied_head_rss.py"), str(study)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "workflow")},
    ).stdout
    freed = json.loads(out.splitlines()[-1])["freed_bytes"]
    assert freed == pytest.approx(4 * found.tied_head, rel=0.25)
    spec = make_spec(
        "local-cpu", {"engine": "fsdp2"}, model={"config": dict(TIED_BIG_HEAD)}, seq_len=64
    )
    built = fsdp2_model.rank_host_parts(spec, shared.model_shape(spec))
    assert built["model as built (fp32, before sharding)"] == 4 * (found.params + found.tied_head)


def test_gpt2_is_read_through_its_attribute_map():
    config = {"model_type": "gpt2", "n_embd": 128, "n_layer": 3, "n_head": 4, "vocab_size": 500}
    found = architecture.layout(config_model(config))
    block = 2 * 128 + (128 * 384 + 384) + (128 * 128 + 128) + 2 * 128 + 2 * (4 * 128 * 128) + 640
    assert (found.hidden, found.heads, found.kv_heads, found.layers) == (128, 4, 4, 3)
    assert found.ffn == 4 * 128  # n_inner unset: GPT-2's 4 x n_embd
    assert found.layer_params == block
    assert found.params == 500 * 128 + 1024 * 128 + 3 * block + 2 * 128


def test_an_opts_layers_are_found_where_it_keeps_them_and_fsdp2_shards_those():
    config = {
        "model_type": "opt",
        "vocab_size": 1000,
        "hidden_size": 128,
        "ffn_dim": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "word_embed_proj_dim": 128,
    }
    found = architecture.layout(config_model(config))
    built = architecture.build_on_meta(architecture.transformers_config(config_model(config)))
    layers = fsdp2_train.decoder_layers(built)  # model.decoder.layers, not model.layers
    assert len(layers) == found.layers == 2 and found.ffn == 1024
    assert found.layer_params == sum(p.numel() for p in layers[0].parameters())


def test_a_mixture_of_experts_is_not_predicted_and_the_plan_says_why():
    moe = {
        **SMALL_LLAMA,
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    spec = make_spec("local-cpu", model={"config": moe})
    assert shared.model_shape(spec) is None
    row = predict.predict(spec, dsconfig.build_ds_config(spec), None)
    assert row.host_gib is None and row.feasible  # launched, unpredicted
    assert row.note.startswith("no memory or step-time prediction: mixtral is a mixture of")


def test_another_architecture_is_predicted_and_says_its_constants_are_llamas():
    spec = make_spec("local-cpu", model={"config": dict(QWEN2)}, seq_len=64)
    row = predict.predict(spec, dsconfig.build_ds_config(spec), None)
    assert row.host_gib > 0
    assert "qwen2 predicted from its own tensors" in row.note and "llama runs" in row.note
    # its start-up grows with its own parameter count (the plan counts a Llama's alone: any
    # other is built on the meta device, seconds at every Snakemake start)
    assert spec.model_params is None
    fit, billions = shared.ACCELERATOR_FITS["cpu"], shared.model_shape(spec).params / 1e9
    startup = fit.startup_s + fit.startup_s_per_billion * billions * 0.25  # no offload
    steps = spec.warmup_steps + spec.steps
    assert predict.run_seconds(spec, 1.0) == pytest.approx(startup + steps)


def test_a_local_checkpoint_is_predicted_and_trained_with_its_overrides(tmp_path):
    import transformers

    folder = tmp_path / "checkpoint"
    config = transformers.AutoConfig.for_model(**QWEN2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    # its config.json lists layer_types, one per layer: fewer layers cut the list
    assert len(json.loads((folder / "config.json").read_text())["layer_types"]) == 2
    overrides = {"num_hidden_layers": 1}
    spec = make_spec("local-cpu", model={"name_or_path": str(folder), "overrides": overrides})
    assert shared.model_shape(spec).layers == 1
    assert predict.predict(spec, dsconfig.build_ds_config(spec), None).host_gib > 0
    with pytest.raises(StudyError, match=r"^model\.overrides\.num_hidden_layers: .*layer_types"):
        presets.check_pretrained(str(folder), {"num_hidden_layers": 3})  # more: nothing to cut
    # the run builds what was predicted: the checkpoint's weights, one layer of them
    built = fsdp2_train.build_model(spec)
    assert len(fsdp2_train.decoder_layers(built)) == 1
    assert sum(p.numel() for p in built.parameters()) == shared.model_shape(spec).params


def test_fewer_layers_cut_the_per_layer_lists_the_overrides_leave_alone():
    base = {"num_hidden_layers": 3, "layer_types": ["a", "b", "c"], "sizes": [1, 2]}
    assert architecture.overridden(base, {"num_hidden_layers": 2}) == {
        "num_hidden_layers": 2,
        "layer_types": ["a", "b"],
        "sizes": [1, 2],  # not one per layer
    }
    written = {"num_hidden_layers": 2, "layer_types": ["c", "c"]}
    assert architecture.overridden(base, written)["layer_types"] == ["c", "c"]
    more = architecture.overridden(base, {"num_hidden_layers": 4})  # transformers refuses it
    assert more["layer_types"] == ["a", "b", "c"]


def test_a_checkpoint_this_machine_cannot_read_says_so():
    model = ModelSpec("pretrained", None, {}, "someone/not-downloaded-model")
    found = architecture.layout(model)
    assert isinstance(found, architecture.Unknown)
    assert "someone/not-downloaded-model cannot be read here" in found.reason


def measured_models() -> dict[str, tuple[dict, int]]:
    """Each distinct model of the committed run specs, with its parameter count as a run built
    it (the record's metrics.json), else as the plan counted it."""
    by_model = {}
    for path in sorted((REPO / "docs" / "results").glob("**/configs/*.run.json")):
        spec = json.loads(path.read_text())
        records = path.parent.parent / spec["scenario"]
        built = [
            json.loads(m.read_text()).get("model_params")
            for m in sorted(records.glob("rep*/metrics.json"))
        ]
        count = next((n for n in built if n), spec["model_params"])
        key = json.dumps(spec["model"], sort_keys=True)
        if count and key not in by_model:
            by_model[key] = (spec["model"], count)
    return by_model


@pytest.mark.parametrize("model, count", list(measured_models().values()))
def test_every_measured_model_is_the_layout_the_models_read(model, count):
    assert architecture.layout(ModelSpec(**model)).params == count


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_a_checkpoint_trains_from_its_own_weights_under_each_engine(tmp_path, engine):
    """A real run of a local Qwen2 checkpoint cut to its first layer: its weights load (ZeRO-3
    through transformers' own loading), and the first step's loss is the checkpoint's."""
    import torch
    import transformers

    folder = tmp_path / "checkpoint"
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**QWEN2)
    built = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # peaked logits: a loss far from a fresh model's ln(vocab)
        built.get_input_embeddings().weight.mul_(40)
    built.save_pretrained(folder)
    model = {"name_or_path": str(folder), "overrides": {"num_hidden_layers": 1}}
    spec_path, outdir, spec = make_run(tmp_path, world=2, scenario={"engine": engine}, model=model)
    run_runner(spec_path, outdir)
    record = load_record(outdir)
    assert record["outcome"] == "ok", record["error_excerpt"]
    assert record["model_params"] == shared.model_shape(spec).params
    expected = checkpoint_loss(spec)
    assert abs(expected - math.log(QWEN2["vocab_size"])) > 3  # the checkpoint's, not a fresh one's
    first = pd.read_csv(outdir / "steps.csv")["loss"].iloc[0]
    assert first == pytest.approx(expected, rel=0.03)


def checkpoint_loss(spec) -> float:
    """The loss the run's model (its checkpoint, its overrides) makes on the run's first step:
    each rank's micro-batches (the harness's seeded tokens), their mean, in fp32."""
    import torch
    import transformers

    config = architecture.transformers_config(spec.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec.model.name_or_path, config=config
    ).float()
    losses = []
    with torch.no_grad():
        for rank in range(spec.world_size):
            batches = Batches(spec, config.vocab_size, rank)
            for _ in range(spec.gradient_accumulation_steps):
                ids = batches.next()
                losses.append(model(input_ids=ids, labels=ids).loss)
    return float(torch.stack(losses).mean())
