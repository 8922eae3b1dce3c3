"""offload_study.prediction.accuracy: errors, clearly different pairs, Kendall tau, bands, the
fit that leaves one model out; the reserved-memory prediction and the gate that uses it."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload_study.engines.deepspeed import model as ds_model
from offload_study.prediction import accuracy, predict, shared

ROOT = Path(__file__).resolve().parents[1]


def test_rel_error_skips_what_was_not_measured():
    assert accuracy.rel_error(1.1, 1.0) == pytest.approx(0.1)
    assert accuracy.rel_error(None, 1.0) is None
    assert accuracy.rel_error(1.0, float("nan")) is None
    assert accuracy.rel_error(1.0, 0) is None


def speed(name, predicted, measured, half_ci=1.0):
    return accuracy.Speed(name, predicted, measured, measured - half_ci, measured + half_ci)


def test_clear_pairs_counts_only_pairs_beyond_their_cis_and_names_the_wrong_ones():
    speeds = [speed("a", 10, 100), speed("b", 20, 90), speed("c", 30, 99.5)]
    right, total, wrong = accuracy.clear_pairs(speeds)
    # a-c overlap (99-101 vs 98.5-100.5): not counted; a > b measured, predicted the other
    # way; c > b measured and predicted
    assert (right, total) == (1, 2)
    assert wrong == [("a", "b")]
    right, total, _ = accuracy.clear_pairs([speed("a", 2, 100), speed("b", 1, 90)])
    assert (right, total) == (1, 1)


def test_clear_pairs_more_than_a_share_apart():
    # 100 vs 90: 11 % apart, not clear at 15 %; 100 vs 80 (25 %) and 90 vs 75 (20 %) are
    speeds = [speed("a", 3, 100), speed("b", 1, 90), speed("c", 2, 80), speed("d", 0, 75)]
    pairs = accuracy.judged_pairs(speeds, apart=0.15)
    assert {(p.fast.name, p.slow.name) for p in pairs} == {("a", "c"), ("a", "d"), ("b", "d")}
    assert accuracy.clear_pairs(speeds, apart=0.15) == (3, 3, [])
    assert accuracy.clear_pairs(speeds[:3], apart=0.15) == (1, 1, [])
    assert accuracy.clear_pairs([speed("b", 1, 90), speed("c", 2, 70)], 0.15)[2] == [("b", "c")]


def test_kendall_tau():
    assert accuracy.kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert accuracy.kendall_tau([3, 2, 1], [10, 20, 30]) == pytest.approx(-1.0)
    assert accuracy.kendall_tau([1, 3, 2, 4], [1, 2, 3, 4]) == pytest.approx(4 / 6)
    assert accuracy.kendall_tau([1, 1], [1, 2]) is None
    with pytest.raises(ValueError):
        accuracy.kendall_tau([1], [1, 2])


def test_band_is_the_largest_absolute_error_or_a_quantile():
    assert accuracy.band([0.01, -0.2, None, 0.05]) == pytest.approx(0.2)
    assert accuracy.band([0.0, 0.1, 0.2], quantile=0.5) == pytest.approx(0.1)
    assert accuracy.band([None]) is None


def test_folds_never_fit_on_the_judged_model_whatever_study_holds_it():
    rows = [
        {"study": "s1", "model": "a", "y": 1.0},
        {"study": "s2", "model": "a", "y": 2.0},
        {"study": "s2", "model": "b", "y": 3.0},
        {"study": "s3", "model": "c", "y": 5.0},
    ]
    fit = lambda rs: sum(r["y"] for r in rs) / len(rs)  # noqa: E731
    assert accuracy.folds(rows, fit, "model") == {"a": 4.0, "b": 8 / 3, "c": 2.0}


def test_noise_floor_counts_what_one_value_per_setup_can_meet_at_best():
    # b spreads 0.50 to 0.91 (+82 %): no one value is within 10 % of both ends; 0.55 meets
    # the two low ones; a's three lie within 10 % of ~1.0
    floor = accuracy.noise_floor({"a": [1.0, 1.05, 0.95], "b": [0.5, 0.52, 0.91]}, 0.10)
    assert (floor.hits, floor.records) == (5, 6)
    assert floor.widest[0] == "b" and floor.widest[1] == pytest.approx(0.82)
    assert accuracy.noise_floor({"c": [2.0]}, 0.1).hits == 1  # measured once: always met
    assert accuracy.within_spread(0.56, [0.5, 0.91], 0.10)  # inside the measured range
    assert accuracy.within_spread(0.455, [0.5, 0.91], 0.10)  # 9 % under its low end
    assert not accuracy.within_spread(1.01, [0.5, 0.91], 0.10)  # 11 % over its high end


def test_fit_reserved_recovers_a_linear_slack_and_fit_context_its_median():
    samples = [((1.0, x, 2 * x + 1, 0.0), 5.0 + 0.5 * x) for x in (1.0, 2.0, 4.0, 8.0)]
    coef = accuracy.fit_reserved(samples)
    assert coef[3] == 0.0  # an all-zero column
    assert [sum(c * f for c, f in zip(coef, x, strict=True)) for x, _ in samples] == pytest.approx(
        [y for _, y in samples]
    )
    assert accuracy.fit_context([(3.0, 1.0), (4.0, 1.0), (0.5, 1.0), (3.5, 1.0)]) == 2.5


def test_reserved_prediction_adds_the_allocator_slack_and_the_context(gpu_spec):
    spec, ds = gpu_spec
    memory = predict.predict_memory(spec, ds)
    reserved = predict.gpu_reserved_bytes(spec, memory, ds)
    context = 2**30 * shared.ACCELERATOR_FITS["cuda"].cuda_context_gib
    assert reserved > sum(memory.gpu.values()) + context * 0.99
    row = predict.predict(spec, ds, None)
    assert row.gpu_reserved_with_context_gib == pytest.approx(reserved / 2**30, abs=1e-3)
    assert row.gpu_reserved_gib == pytest.approx((reserved - context) / 2**30, abs=1e-3)
    # the gate refuses on the reserved prediction: a budget the allocated peak fits in, but
    # not what the allocator reserves, refuses the run
    allocated = row.gpu_gib
    tight = dataclasses.replace(row, gpu_budget_gib=allocated * 1.05)
    assert predict.refusal(dataclasses.replace(spec, force=False), tight) is not None
    older = dataclasses.replace(
        tight,
        gpu_reserved_gib=None,  # a plan.csv before the columns
        gpu_reserved_with_context_gib=None,
    )
    assert predict.refusal(dataclasses.replace(spec, force=False), older) is None


def causes(features):
    return dict(zip(shared.RESERVED_CAUSES, features, strict=True))


def test_reserved_slack_sizes_each_cause_from_the_config(gpu_spec):
    spec, ds = gpu_spec  # 1.91B, bf16, one GPU, CPU optimizer offload, 5e8-element buckets
    shape = shared.model_shape(spec)
    got = causes(predict.reserved_features(spec, ds))
    # two buckets in turn on the reduction stream, 2 bytes a gradient
    assert got["the reduction stream's buckets"] == 2 * (5e8 + 5e8)
    assert got["one layer's parameters"] == pytest.approx(2 * shape.params / shape.layers)
    assert got["gathered parameters"] == got["the fp16 overflow check on the GPU"] == 0.0
    # the loss's blocks: bf16 logits and three fp32 tensors of their size, as FSDP2 counts them
    loss = spec.micro_batch * spec.seq_len * shape.vocab * (2 + 12)
    assert got["the loss's blocks, ZeRO-3"] == loss

    # a bucket larger than the model holds only its gradients (default-gpu's 134M model), and
    # leaves no second one
    def buckets(reduce_bucket_size):
        zero = {**ds["zero_optimization"], "reduce_bucket_size": reduce_bucket_size}
        return causes(predict.reserved_features(spec, {**ds, "zero_optimization": zero}))[
            "the reduction stream's buckets"
        ]

    assert buckets(1e11) == 2 * shape.params
    # the second bucket holds the rest (model H: 502M gradients, 5e8-element buckets)
    assert buckets(0.75 * shape.params) == pytest.approx(2 * shape.params)
    assert buckets(0.25 * shape.params) == pytest.approx(2 * 0.5 * shape.params)
    # without overlap_comm the reduction runs on the default stream: its blocks are reused
    zero = ds["zero_optimization"]
    serial = {**ds, "zero_optimization": {**zero, "overlap_comm": False}}
    assert causes(predict.reserved_features(spec, serial))["the reduction stream's buckets"] == 0
    default = {**ds, "zero_optimization": {k: v for k, v in zero.items() if k != "overlap_comm"}}
    assert causes(predict.reserved_features(spec, default)) == got  # stage 3's default: True
    # parameter offload gathers; fp16 with the optimizer on the GPU checks for overflow there
    fetched = dataclasses.replace(spec, offload_param="cpu")
    assert causes(predict.reserved_features(fetched, ds))["gathered parameters"] == 2 * 1e9
    fp16 = dataclasses.replace(spec, dtype="fp16", offload_optimizer="none")
    part = ds_model.partition(fp16, shape)
    assert causes(predict.reserved_features(fp16, ds))["the fp16 overflow check on the GPU"] == (
        3 * part
    )


def test_nvme_optimizer_offload_reserves_a_buckets_fp32_gradient_copies(gpu_spec):
    """Counted at their size, beside the fitted causes: 4 bytes x the rank's share of a bucket
    (model-b's NVMe traces); nothing without NVMe optimizer offload."""
    spec, ds = gpu_spec  # CPU optimizer offload, 5e8-element buckets, one GPU
    assert ds_model.known_reserved_bytes(spec, ds) == 0.0
    nvme = dataclasses.replace(spec, offload_optimizer="nvme", nvme_path="/tmp/nvme")
    assert ds_model.known_reserved_bytes(nvme, ds) == 4 * 5e8
    two_ranks = dataclasses.replace(nvme, gpus_per_node=2, world_size=2)
    assert ds_model.known_reserved_bytes(two_ranks, ds) == 4 * 5e8 / 2
    memory = predict.predict_memory(nvme, ds)
    cpu_reserved = predict.gpu_reserved_bytes(nvme, memory, ds) - 4 * 5e8
    assert cpu_reserved == pytest.approx(
        predict.gpu_reserved_bytes(spec, predict.predict_memory(spec, ds), ds), abs=1
    )


def test_fsdp2_reserved_slack_is_the_loss_blocks_by_offload(gpu_spec):
    spec, _ = gpu_spec
    shape = shared.model_shape(spec)
    loss = spec.micro_batch * spec.seq_len * shape.vocab * (2 + 12)
    plain = dataclasses.replace(spec, engine="fsdp2", offload_optimizer="none")
    offloaded = dataclasses.replace(spec, engine="fsdp2", offload_param="cpu")
    assert causes(predict.reserved_features(plain, {})) == {
        **causes(shared.reserved_vector({})),
        "the loss's blocks, FSDP2, left cached": loss,
    }
    got = causes(predict.reserved_features(offloaded, {}))
    assert got["the loss's blocks, FSDP2, partly reused"] == loss
    # CPUOffloadPolicy copies the root unit's fp32 parameters (embeddings, head) to the GPU
    root = shape.params - shape.layers * shape.layer_params
    assert got["the root unit's fp32 copies, CPUOffloadPolicy"] == 4 * root
    assert root == 2 * shape.vocab * shape.hidden + shape.hidden  # untied head, final norm


@pytest.mark.parametrize("offload_optimizer", ["none", "cpu"])
def test_fsdp2_gradients_accumulated_on_the_gpu_reuse_the_loss_blocks(gpu_spec, offload_optimizer):
    """With gas > 1 the gradients stay on the device between micro-steps, in blocks the first
    loss freed: no offload and torchao's path take CPUOffloadPolicy's cause, at gas 1 not."""
    spec, _ = gpu_spec
    base = dataclasses.replace(spec, engine="fsdp2", offload_optimizer=offload_optimizer)
    once = causes(predict.reserved_features(base, {}))
    accumulated = dataclasses.replace(base, gradient_accumulation_steps=4)
    four = causes(predict.reserved_features(accumulated, {}))
    assert once["the loss's blocks, FSDP2, left cached"] > 0
    assert once["the loss's blocks, FSDP2, partly reused"] == 0
    assert (
        four["the loss's blocks, FSDP2, partly reused"]
        == once["the loss's blocks, FSDP2, left cached"]
    )
    assert four["the loss's blocks, FSDP2, left cached"] == 0


def test_reserved_vector_refuses_a_cause_it_does_not_know():
    with pytest.raises(ValueError, match="not in RESERVED_CAUSES: \\['fragmentation'\\]"):
        shared.reserved_vector({"fragmentation": 1.0})


@pytest.fixture
def gpu_spec():
    from offload_study.core.contracts import read_json
    from offload_study.planning.plan import Plan

    folder = ROOT / "docs/results/h200-1gpu/sweep-h200-1gpu-24g"
    plan = Plan(
        str(ROOT / "config/studies/sweep-h200-1gpu-24g.yaml"), cluster_dir=ROOT / "config/clusters"
    )
    name = "opt__mb-8__rbs-5e8"
    return plan.by_name[name], read_json(folder / "configs" / f"{name}.json")


def test_accuracy_report_over_the_committed_gpu_records(tmp_path):
    """The benchmark over docs/results, leaving one model out: the models by shape, every
    target with its verdict, the ranking as the docs state it, bands written."""
    out = tmp_path / "bands.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/prediction_accuracy.py"), "--bands-out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hang, not a speed check: a loaded 2-core run takes minutes
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    models = next(line for line in lines if line.startswith("Models found (by shape): "))
    assert int(models.rsplit(" ", 1)[1]) >= 8
    assert any(line.startswith("  1.35B: hidden 2048, 24 layers") for line in lines)
    targets = [line for line in lines if line.startswith("GPU model left out, ")]
    for name in ("step time", "GPU allocated", "GPU reserved", "host per node", "clear pairs"):
        line = next(line for line in targets if line.startswith(f"GPU model left out, {name}:"))
        assert re.search(r"\(\d+(\.\d)?%, target >= \d+%\) -> (met|MISSED)", line), line
    machines = next(line for line in lines if line.startswith("GPU step time by machine"))
    assert re.search(r"(\d+)/(\d+) as predicted, (\d+)/\2 if each machine's median", machines)
    pairs = next(line for line in targets if "clear pairs" in line)
    right, total = (int(x) for x in pairs.split(": ")[1].split(" ")[0].split("/"))
    assert right / total >= 0.9
    bands = json.loads(out.read_text())
    assert set(bands["calibrated"]) == {"step_time", "gpu_allocated", "gpu_reserved", "host"}
    assert bands["records"] > 50 and bands["measured_by"].startswith("python benchmarks/")


def test_a_record_the_study_no_longer_plans_is_predicted_from_the_spec_it_ran_with():
    """Candidates of an older recommend search keep their run specs (configs/<name>.run.json):
    they are judged from those, at the setup they ran; a host figure of the rank alone, where
    the run kept memory in a worker process, is not judged."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import prediction_accuracy as pa

    folder = "docs/results/h200-1gpu/recommend-h200-1gpu-16g"
    rows = pa.record_rows(ROOT / folder, ROOT / pa.GPU_RECORDS[folder], pa._shipped(folder))
    by_config = {r["config"]: r for r in rows}
    super_offload = by_config["rec-super__mb-8__rbs-5e8"]
    assert super_offload["setup"].split("/")[2:4] == ["8", "4"]  # micro-batch 8, accumulation 4
    assert super_offload["host"][0] > 30 and super_offload["host"][1] is None
    plain = by_config["rec-opt__mb-8__rbs-5e8"]
    assert plain["host"][1] == pytest.approx(27.80, abs=0.01) and plain["step"][0] > 0


def test_records_a_study_made_on_another_cluster_are_predicted_on_that_cluster():
    """An H200 study run on an H100 (``--config cluster=h100-1gpu``) is judged with the H100's
    cluster file and shipped calibration, which its plan.json names, not its study file's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import prediction_accuracy as pa

    folder = "docs/results/h100-1gpu/holdout-h200-qwen2"
    study = ROOT / pa.GPU_RECORDS[folder]
    assert pa.Plan(str(study)).cluster["name"] == "h200-1gpu"
    assert pa.record_plan(ROOT / folder, study).cluster["name"] == "h100-1gpu"
    assert pa._shipped(folder).name == "h100-1gpu.json"
    rows = pa.record_rows(ROOT / folder, study, pa._shipped(folder))
    assert {r["study"] for r in rows} == {"holdout-h200-qwen2 on h100-1gpu"}  # judged apart


#: What the CPU path meets on the CI machine (2 shared cores), as measured (docs/benchmarks.md,
#: "prediction accuracy"): in two test runs the cross_cluster records (3 steps of a tiny Llama)
#: had worst step errors +80/+90 % (cpu-a, 2 cores) and +154/+170 % (cpu-b, 1 core, this
#: machine's 2-core calibration), host memory 27 % on both; since the calibration measures the
#: host runtime (calibrate.runtime_probe) host memory 0.2-0.7 % in two test runs.
#: The step target leaves room for the shared machine's load; host takes the GPU records'
#: target, 10 % (benchmarks/prediction_accuracy.py).
CPU_TARGETS = {"step_time": 2.5, "host": 0.10}


def cpu_band_by_the_cli(study: Path, records: Path, clusters: Path, calibration, out: Path):
    """The benchmark's CLI over one CPU study: its bands file's "cpu" entry."""
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/prediction_accuracy.py"),
            "--cpu-study-dir",
            str(records),
            "--cpu-study",
            str(study),
            "--cpu-cluster-dir",
            str(clusters),
            "--cpu-calibration",
            str(calibration),
            "--bands-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hang, not a speed check
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(out.read_text())["cpu"]


def cpu_band_in_process(study: Path, records: Path, clusters: Path, calibration) -> dict:
    """The "cpu" entry the CLI writes, from the functions it writes it with (write_bands): the
    CPU rows' errors use the committed constants, none fitted on the GPU records, so the band
    is the CLI's without the whole GPU analysis each CLI run redoes (~40 s of the 2 cores)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import prediction_accuracy as pa

    rows = pa.record_rows(records, study, Path(calibration), clusters)
    ok = [r for r in rows if r["kind"] == "CPU" and r["outcome"] == "ok"]
    return {**pa.bands(rows, "CPU"), "records": len(ok)}


def cpu_inputs(cross_cluster, cluster: str, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(study file, records folder, clusters folder) of ``cluster``'s cross_cluster study."""
    import yaml
    from builders import study_config

    study = tmp_path / f"{cluster}.yaml"
    study.write_text(yaml.safe_dump(study_config(cluster)))
    records = next((cross_cluster.root / "results" / cluster).glob("*/"))
    return study, records, cross_cluster.root / "clusters"


def test_accuracy_report_over_the_sessions_cpu_records(cross_cluster, cpu_calibration, tmp_path):
    """The same report over real CPU records (conftest's cross_cluster runs, this machine's
    calibration): step time and host memory within CPU_TARGETS. cpu-a's band through the CLI
    (its --cpu-* options end to end), cpu-b's from the same functions in this process."""
    a = cpu_inputs(cross_cluster, "cpu-a", tmp_path)
    b = cpu_inputs(cross_cluster, "cpu-b", tmp_path)
    bands = {
        "cpu-a": cpu_band_by_the_cli(*a, cpu_calibration, tmp_path / "cpu-a.bands.json"),
        "cpu-b": cpu_band_in_process(*b, cpu_calibration),
    }
    print(bands)
    for cluster, band in bands.items():
        assert band["records"] >= 1
        for key, target in CPU_TARGETS.items():
            assert band[key] <= target, (cluster, key, band)


def test_fit_compute_recovers_the_constants_the_steps_were_made_with():
    parts = [
        accuracy.StepParts(1.0, 0.5, 0.0, 0.2, 0.5, 0.02),  # FLOPs-bound
        accuracy.StepParts(0.1, 0.8, 0.0, 0.1, 0.5, 0.02),  # dispatch-bound
    ]
    measured = [p.total(0.6, 0.025) for p in parts]
    assert accuracy.fit_compute(list(zip(parts, measured, strict=True))) == (0.6, 0.025)


def test_fit_runtime_minimises_the_relative_error():
    # two one-rank nodes whose prediction lacks exactly 2 bytes of runtime
    assert accuracy.fit_runtime([(10.0, 8.0, 1), (100.0, 98.0, 1)]) == pytest.approx(2.0)


def test_the_reserved_fit_counts_a_setup_once_however_often_it_ran():
    """A setup's reserved peak is one observation of the allocator: its repeats are fitted as
    one sample (their median), so a config run four times does not outweigh the others."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import prediction_accuracy as pa

    def row(setup, features, unexplained):
        return {"setup": setup, "features": features, "slack": unexplained}

    rows = [row("a", (1.0, 0.0), 2.0)] * 3 + [row("a", (1.0, 0.0), 9.0), row("b", (0.0, 1.0), 5.0)]
    samples = pa.per_setup(rows, lambda r: r["slack"])
    assert sorted(samples) == [((0.0, 1.0), 5.0), ((1.0, 0.0), 2.0)]
    # fitted once per setup, the weight is setup a's median, not pulled toward the repeats' mean
    assert accuracy.fit_reserved(samples) == pytest.approx((2.0, 5.0))
