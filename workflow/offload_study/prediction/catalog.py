"""Predict before the cluster is calibrated: an *uncalibrated* calibration from the GPU catalog.

    python -m offload_study.prediction.catalog --cluster NAME [--cluster-dir config/clusters] \\
        [--cpu here|catalog] --out results/<cluster>/calibration.uncalibrated.json

A CUDA cluster that has neither a measured calibration (``snakemake calibrate``, on a node with
its GPU) nor a shipped one (config/calibration/<cluster>.json) is still planned, on any machine
(a laptop, a login node without a GPU): its rates are the GPU model's datasheet values from the
one catalog (``offload_study/data/gpu_catalog.yaml``, :func:`offload_study.core.devices.gpu_spec`):

- matmul: the model's dense bf16 peak (or the cluster's ``peak_tflops``);
- pinned host<->device copies: the host link's rate per direction; unpinned copies are not in a
  datasheet and go at the same rate (the model then prices them at the pinned rate);
- collectives between GPUs: the model's NVLink rate per direction, where it has one;
- CPU Adam and the disk are the node's, not the GPU's: measured on the machine at hand when it is
  a node of the cluster (``scheduler: local``), else the catalog's CPU default per core times
  the cluster's cores, and the source says which.

The result is a :class:`~offload_study.core.contracts.Calibration` with ``calibrated: false``;
the plan labels every prediction made from it *uncalibrated* and gives it the wider error band
(offload_study.prediction.error_bands).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from offload_study.core import devices
from offload_study.core.contracts import Calibration, write_calibration
from offload_study.core.study import CLUSTER_DIR, StudyError, load_cluster


def gpu_entry(cluster: dict) -> tuple[str, dict]:
    """(catalog model, entry) of the cluster's ``gpu_model``, or one error naming the key."""
    if cluster["accelerator"] != "cuda":
        raise StudyError(
            f"cluster {cluster['name']!r}: accelerator {cluster['accelerator']!r} has no GPU "
            "catalog entry (a CPU cluster is calibrated where it runs: snakemake calibrate)"
        )
    spec = devices.gpu_spec(cluster.get("gpu_model"))
    if spec is None:
        known = ", ".join(devices.catalog()["gpus"])
        raise StudyError(
            f"cluster {cluster['name']!r}: gpu_model {cluster.get('gpu_model')!r} is not in the "
            f"GPU catalog ({devices.GPU_CATALOG}: {known}); set gpu_model to one of them, or "
            "measure the cluster: snakemake calibrate (on a node with its GPU)"
        )
    return spec


def catalog_cpu(cluster: dict) -> tuple[float, int, str]:
    """(CPU Adam parameters/s, threads, where from): the catalog's default per core times the
    cluster's cores per node (the catalog's count when the cluster does not say)."""
    cpu = devices.catalog()["cpu"]
    cores = cluster.get("cpu_cores_per_node") or cpu["cores_when_unknown"]
    rate = cpu["cpu_adam_params_per_s_per_core"] * cores
    return rate, cores, f"catalog default {rate:.3g}/s ({cores} cores x {cpu['source']})"


def measured_cpu(cluster: dict) -> tuple[dict, str]:
    """CPU Adam (and the disk at ``nvme_path``) measured on this machine, a node of a local
    cluster: calibrate's own probes at its sizes. Raises what DeepSpeed's op build raises."""
    from offload_study.prediction import calibrate

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the CPU op, on a machine without the GPU
    cores = len(os.sched_getaffinity(0))
    size = calibrate.sizes("cpu", calibrate.last_level_cache_bytes())
    rate = calibrate.cpu_adam_params_per_s(size["adam"], cores)["median"]
    values = {"cpu_adam_params_per_s": rate, "cpu_adam_threads": cores}
    if cluster.get("nvme_path"):
        disk = calibrate.disk_gb_s(cluster["nvme_path"], size["disk"])
        values |= {k: disk[k] for k in ("disk_read_gb_s", "disk_write_gb_s")}
    return values, f"measured here on {platform.node()} ({cores} cores)"


def node_values(cluster: dict, cpu: str) -> tuple[dict, str]:
    """The node's rates: measured here (``cpu == "here"``, falling back to the catalog with the
    reason when the measurement fails) or the catalog's default."""
    if cpu == "here":
        try:
            return measured_cpu(cluster)
        except (ImportError, RuntimeError, OSError) as err:
            rate, cores, said = catalog_cpu(cluster)
            why = f"{said}; measuring here failed: {str(err)[-300:]}"
            return {"cpu_adam_params_per_s": rate, "cpu_adam_threads": cores}, why
    rate, cores, said = catalog_cpu(cluster)
    why = (
        "a SLURM cluster's node is not this machine"
        if cluster["scheduler"] == "slurm"
        else ("asked for (--cpu catalog)")
    )
    where = f"{said}; not measured here: {why}"
    return {"cpu_adam_params_per_s": rate, "cpu_adam_threads": cores}, where


def catalog_calibration(cluster: dict, cpu: str) -> Calibration:
    """The uncalibrated calibration of a CUDA ``cluster`` (a validated description)."""
    model, entry = gpu_entry(cluster)
    peak = devices.peak_tflops(model, cluster.get("peak_tflops"))
    node, cpu_source = node_values(cluster, cpu)
    source = (
        f"uncalibrated: GPU catalog values for {model} ({devices.GPU_CATALOG}: {peak:g} TFLOP/s "
        f"peak, host link {entry['host_link_gb_s']:g} GB/s, NVLink "
        f"{entry['interconnect_gb_s'] or 'none'}); CPU Adam {cpu_source}"
        + ("" if "disk_read_gb_s" in node else "; disk not measured (NVMe time not predicted)")
    )
    return Calibration(
        cluster=cluster["name"],
        accelerator="cuda",
        source=source,
        matmul_tflops=peak,
        matmul_dtype="bf16",
        h2d_gb_s=entry["host_link_gb_s"],
        d2h_gb_s=entry["host_link_gb_s"],
        interconnect_gb_s=entry["interconnect_gb_s"] if cluster["gpus_per_node"] > 1 else None,
        calibrated=False,
        provenance={"catalog_model": model, "catalog_entry": entry, "cpu": cpu_source},
        **node,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", required=True, help="cluster name (config/clusters/<name>.yaml)")
    p.add_argument("--cluster-dir", default=str(CLUSTER_DIR))
    p.add_argument(
        "--cpu",
        choices=("here", "catalog"),
        help="CPU Adam measured here or the catalog's default (default: here for a local "
        "cluster, else catalog)",
    )
    p.add_argument("--out", required=True, help="calibration.uncalibrated.json to write")
    a = p.parse_args(argv)
    try:
        cluster = load_cluster(a.cluster, a.cluster_dir)
        cpu = a.cpu or ("here" if cluster["scheduler"] == "local" else "catalog")
        calibration = catalog_calibration(cluster, cpu)
    except StudyError as err:
        print(f"catalog: {err}", file=sys.stderr)
        return 2
    write_calibration(a.out, calibration)
    print(f"catalog: {a.out}: {calibration.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
