"""The FSDP2 engine (scenario key engine: fsdp2): real runs on the CPU accelerator over 2 gloo
ranks through the runner, the same records as DeepSpeed's; the engine's planning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import make_spec
from runs import load_record, make_run, run_runner

from offload_study.admission import preflight
from offload_study.core import contracts, units
from offload_study.core.contracts import RunSpec, read_steps, sha256_file


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_fsdp2_trains_over_two_gloo_ranks(tmp_path, offload):
    """torchrun -> harness -> Fsdp2Engine (fully_shard per layer on a CPU mesh, gloo), the same
    records as a DeepSpeed run: steps.csv with the step's parts, metrics and provenance that
    name the engine and its version (torch's), the effective offload policy."""
    spec_path, outdir, spec = make_run(tmp_path, offload, offload, 2, scenario={"engine": "fsdp2"})
    assert spec.engine == "fsdp2" and preflight.ops_needed(spec) == []
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stdout + res.stderr
    m = load_record(outdir)
    assert m["outcome"] == "ok", m["error_excerpt"]
    assert m["steps_measured"] == 3 and m["tokens_per_s"] > 0
    assert 2 < m["loss_first"] < 12 and math.isfinite(m["loss_last"])
    assert m["model_params"] > 100_000 and len(m["host_peak_rss_gib_per_rank"]) == 2
    import torch

    assert (m["engine"], m["engine_version"]) == ("fsdp2", torch.__version__)
    # the record names the settings FSDP2 trained with (configs/<scenario>.json), as DeepSpeed's
    settings = json.loads(Path(spec.ds_config).read_text())
    assert settings["offload"]["path"] == ("cpu-offload-policy" if offload == "cpu" else "none")
    assert m["deepspeed_version"] is None and m["ds_config_sha256"] == sha256_file(spec.ds_config)
    rows = read_steps(outdir / "steps.csv")
    assert [r.phase for r in rows] == ["warmup"] + ["measured"] * 3
    for r in rows:  # the parts add up to the step (each ended by a synchronization)
        parts = r.forward_s + r.backward_s + r.optimizer_s
        assert r.forward_s > 0 and r.backward_s > 0 and parts == pytest.approx(r.step_time_s, 1e-3)
    parts = m["step_breakdown_ms"]
    assert parts["optimizer"] > 0 and m["breakdown_ms"]["forward"] == parts["forward"]
    effective = m["modes"]["effective"]
    assert effective["offload_policy"] == (
        "CPUOffloadPolicy" if offload == "cpu" else "OffloadPolicy"
    )
    assert effective["optimizer_class"] == "AdamW (foreach)"
    # pin_memory true (the default) cannot pin without an accelerator: not on a CPU cluster
    assert effective["pin_memory_param"] is (False if offload == "cpu" else None)
    prov = json.loads((outdir / "provenance.json").read_text())
    assert (prov["engine"], prov["engine_version"], prov["deepspeed_version"]) == (
        "fsdp2",
        torch.__version__,
        None,
    )
    assert prov["ds_config"] == str(spec.ds_config)
    assert "offload_study.training.harness" in prov["launch_command"]
    stats = json.loads((outdir / "rank1.stats.json").read_text())
    assert stats["finished"] and stats["engine"] == "fsdp2"


def test_engine_in_the_run_spec():
    """engine travels in the run spec; a DeepSpeed spec is written as before (no engine key)."""
    ds = make_spec()
    assert ds.engine == "deepspeed" and "engine" not in ds.to_dict()
    fsdp = make_spec(scenario={"engine": "fsdp2"})
    assert fsdp.to_dict()["engine"] == "fsdp2"
    assert RunSpec.from_dict(fsdp.to_dict()).engine == "fsdp2"
    assert contracts.engine_of(ds.to_dict()) == "deepspeed"


def test_fsdp2_prediction_knows_what_the_engine_keeps_where():
    """No offload: the fp32 shards of parameters, gradients and Adam on the GPU; CPUOffloadPolicy:
    on the host (pinned shards rounded per tensor), the GPU keeps the layers in flight; the CPU
    step priced at torch AdamW's rate; no DeepSpeed estimate for an FSDP2 run."""
    import dataclasses

    from builders import gpu_calibration

    from offload_study import engines
    from offload_study.engines.fsdp2 import model as fsdp2_model
    from offload_study.prediction import predict

    model = {
        "config": {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 5504,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
        }
    }
    study = {"model": model, "seq_len": 2048, "micro_batch": 4, "gradient_checkpointing": True}
    cal = gpu_calibration()
    rows = {}
    for engine, off in [("fsdp2", "none"), ("fsdp2", "cpu"), ("deepspeed", "cpu")]:
        spec = make_spec(
            "h200-1gpu",
            {
                "name": f"{engine}-{off}",
                "engine": engine,
                "gpus_per_node": 1,
                "offload_optimizer": off,
                "offload_param": off,
                "gradient_accumulation_steps": 1,
            },
            **study,
        )
        config = engines.of(spec).build_config(spec)
        rows[engine, off] = predict.predict(spec, config, cal, 1, True)
    none, offload, zero3 = rows["fsdp2", "none"], rows["fsdp2", "cpu"], rows["deepspeed", "cpu"]
    assert none.gpu_gib > 16 * 1.3e9 / 2**30 > offload.gpu_gib  # 16 bytes a parameter on the GPU
    assert offload.host_gib > 16 * 1.3e9 / 2**30 > none.host_gib
    assert none.ds_gpu_gib is None and zero3.ds_gpu_gib is not None
    params = spec.model_params
    assert offload.optimizer_s == pytest.approx(params / 1e9, rel=1e-3)  # torch AdamW's rate
    older = dataclasses.replace(cal, torch_adam_params_per_s=None)  # a file from before the rate
    fsdp_spec = make_spec(
        "h200-1gpu",
        {
            "name": "f",
            "engine": "fsdp2",
            "gpus_per_node": 1,
            "offload_optimizer": "cpu",
            "offload_param": "cpu",
            "gradient_accumulation_steps": 1,
        },
        **study,
    )
    assert fsdp2_model.step_time(fsdp_spec, {}, older).optimizer_s == pytest.approx(
        params / 2e9, 1e-3
    )


def test_cpu_offload_policy_pays_its_host_accumulation_after_the_first_micro_step():
    """CPUOffloadPolicy at accumulation 4: three micro-steps copy their fp32 gradient shards
    down blocking (pageable) and add them on the CPU, both on the step; accumulation 1 has none,
    and neither has FSDP2 without offload."""
    import dataclasses

    from builders import gpu_calibration

    from offload_study.engines.fsdp2 import model as fsdp2_model

    cal = gpu_calibration(pageable_h2d_gb_s=10.0, grad_unscale_params_per_s=1e10)

    def step(gas: int, offload: str = "cpu"):
        scenario = {"engine": "fsdp2", "gpus_per_node": 1, "gradient_accumulation_steps": gas}
        scenario |= {"offload_optimizer": offload, "offload_param": offload}
        spec = make_spec("h200-1gpu", scenario)
        return spec, fsdp2_model.step_time(spec, {}, cal)

    spec, four = step(4)
    params = spec.model_params
    assert four.pcie_s == pytest.approx(3 * (4 * params / 10e9 + params / 1e10), rel=1e-6)
    assert step(1)[1].pcie_s == step(4, "none")[1].pcie_s == 0
    # without the calibrated add rate, CPU Adam's times the lease's measured ratio
    older = dataclasses.replace(cal, grad_unscale_params_per_s=None)
    adds = fsdp2_model.step_time(spec, {}, older).pcie_s - 3 * 4 * params / 10e9
    assert adds == pytest.approx(3 * params / (3.70 * 2e9), rel=1e-6)


def test_cpu_offload_policys_gradient_copies_into_fresh_pages_wait_for_the_os():
    """A gradient shard at or over glibc's mmap threshold (32 MiB) lands in pages the OS maps
    afresh every micro-step: its bytes add at the calibrated page-fault rate, else the
    catalog's; smaller shards reuse the heap's pages and add nothing."""
    import dataclasses

    from builders import gpu_calibration
    from conftest import SMALL_LLAMA

    from offload_study.core import devices
    from offload_study.engines.fsdp2 import model as fsdp2_model
    from offload_study.prediction.shared import model_shape

    cal = gpu_calibration(
        pageable_h2d_gb_s=10.0, grad_unscale_params_per_s=1e10, page_fault_gb_s=2.0
    )

    def step(vocab: int, calibration=cal):
        scenario = {"engine": "fsdp2", "gpus_per_node": 1, "gradient_accumulation_steps": 3}
        scenario |= {"offload_optimizer": "cpu", "offload_param": "cpu"}
        model = {"config": {**SMALL_LLAMA, "hidden_size": 512, "vocab_size": vocab}}
        spec = make_spec("h200-1gpu", scenario, model=model)
        return spec, fsdp2_model.step_time(spec, {}, calibration).pcie_s

    def without_fresh_pages(spec) -> float:
        params = spec.model_params
        return 2 * (4 * params / 10e9 + params / 1e10)

    spec, pcie = step(8_000)  # embeddings and head of 8,000 x 512 fp32: 16 MB each
    assert pcie == pytest.approx(without_fresh_pages(spec), rel=1e-9)
    spec, pcie = step(20_000)  # 41 MB each: both fresh, the layers' tensors not
    fresh = sum(4 * t for t in model_shape(spec).tensors if 4 * t >= 32 * 2**20)
    assert fresh == 2 * 4 * 20_000 * 512
    assert pcie == pytest.approx(without_fresh_pages(spec) + 2 * fresh / 2e9, rel=1e-9)
    older = dataclasses.replace(cal, page_fault_gb_s=None)  # a file from before the probe
    default = devices.catalog()["cpu"]["page_fault_gb_s"]
    expected = without_fresh_pages(spec) + 2 * fresh / (default * 1e9)
    assert step(20_000, older)[1] == pytest.approx(expected, rel=1e-9)


def test_the_report_puts_engines_side_by_side(tmp_path):
    """A study with two engines: every engine x offload path in words with its CI, memory and
    step parts; at each GPU memory level the fastest engine against the next engine's best, by
    the paired ratio; one engine: no such block."""
    from builders import build_report, make_record

    parts = {
        "deepspeed": {"forward": 100.0, "backward": 200.0, "optimizer": 400.0},
        "fsdp2": {"forward": 90.0, "backward": 180.0, "optimizer": 900.0},
    }
    paths = []
    for k in range(2):
        for engine, opt, param, speed, gib in [
            ("deepspeed", "none", "none", 1000, 30.0),
            ("fsdp2", "none", "none", 1050, 31.0),
            ("deepspeed", "cpu", "cpu", 600, 8.0),
            ("fsdp2", "cpu", "cpu", 400, 9.0),
        ]:
            name = f"{engine}-{opt}-{param}"
            extra = {
                "engine": engine,
                "step_breakdown_ms": parts[engine],
                "peak_gpu_reserved_gib": gib + 1,
            }
            paths.append(
                make_record(
                    tmp_path,
                    name,
                    k,
                    tokens_per_s=speed * (1 + k / 100),
                    offload_optimizer=opt,
                    offload_param=param,
                    seed=k,
                    peak_gpu_gib=gib,
                    label=name,
                    extra=extra,
                )
            )
    html, _, _ = build_report(tmp_path, paths)
    block = html[html.index('id="engines"') : html.index('id="figures"')]
    assert "CPUOffloadPolicy" in block and "optimizer and parameter offload to the CPU" in block
    levels = block[block.index('id="engine-levels"') : block.index('id="engines-all"')]
    # within 9 GiB only ZeRO-3's offload ran; within 10 both engines' offload: ZeRO-3 faster
    assert "Within 9.0 GiB" in levels and "no other engine ran within it" in levels
    assert "Within 10.0 GiB" in levels and "against FSDP2" in levels and "150% [" in levels
    assert "optimizer step: 500 ms less per step" in levels
    # with the whole card FSDP2 without offload is the fastest, against ZeRO-3 without offload
    assert "Within 32.0 GiB" in levels and "<b>FSDP2</b>, no offload" in levels
    single, _, _ = build_report(tmp_path / "one", paths[:1] + paths[2:3])
    assert 'id="engines"' not in single


@pytest.mark.parametrize("cluster", ["h200-2gpu", "local-cpu"])
def test_foreach_adams_temporary_is_held_where_foreach_steps(cluster):
    """torch's foreach AdamW makes an fp32 sqrt of the second moments the size of the shards it
    steps: on the host under CPUOffloadPolicy, in the device parts of a CPU rank without offload
    (a moment of its step), nowhere on a GPU (the fused kernel makes none). FSDP2's
    runtime memory is its own."""
    from offload_study.engines.fsdp2 import model as fsdp2_model
    from offload_study.prediction import shared

    temp = "foreach AdamW's temporary (fp32, in the step)"
    spec = {
        off: make_spec(
            cluster,
            {
                "name": off,
                "engine": "fsdp2",
                "gpus_per_node": 2,
                "offload_optimizer": off,
                "offload_param": off,
            },
        )
        for off in ("none", "cpu")
    }
    shape = shared.model_shape(spec["none"])
    shard = 4.0 * math.ceil(shape.params / 2)
    host = fsdp2_model.rank_host_parts(spec["cpu"], shape)
    assert host[temp] == shard
    step = fsdp2_model.in_a_foreach_optimizer_step(spec["none"], shape)
    assert step.get(temp) == (shard if cluster == "local-cpu" else None)
    peak = sum(fsdp2_model.gpu_parts(spec["none"], shape).values())
    assert peak >= sum(step.values()) and peak > 0
    assert temp not in fsdp2_model.rank_host_parts(spec["none"], shape)
    runtime = units.bytes_to_gib(fsdp2_model.rank_host_parts(spec["none"], shape)["runtime"])
    assert runtime == pytest.approx(fsdp2_model.FITS[spec["none"].accelerator].runtime_gib)


@pytest.mark.parametrize("calibration", ["calibration.json", "calibration.lab-box.json"])
def test_fsdp2s_cpu_step_follows_its_probe_on_the_committed_cpu_records(calibration):
    """The README's two CPU studies (docs/results/local-cpu): FSDP2's step predicted from its
    own probe is within a factor 1.6 of every record with either calibration of that machine
    (measured 18 minutes apart; the second's all-gather bandwidth is 5x lower); with a fitted
    0.004 s per layer and its parts overlapped as on a GPU it was 0.24-0.43x of them."""
    from conftest import REPO

    from offload_study.prediction import predict

    root = REPO / "docs" / "results" / "local-cpu"
    cal = contracts.read_calibration(root / calibration)
    ratios = []
    for metrics in sorted(root.glob("*/fsdp2*/rep*/metrics.json")) + sorted(
        root.glob("what-to-run/rec-fsdp2*/rep*/metrics.json")
    ):
        configs = metrics.parents[2] / "configs"
        scenario = metrics.parents[1].name
        spec = contracts.read_run_spec(configs / f"{scenario}.run.json")
        settings = contracts.read_json(configs / f"{scenario}.json")
        predicted = predict.step_time(spec, settings, cal)
        assert predicted.serial  # one thread per CPU rank: its parts add
        ratios.append(predicted.total / contracts.read_json(metrics)["step_time_s"])
    assert len(ratios) == 5
    assert all(1 / 1.6 < r < 1.6 for r in ratios), ratios
