"""Launch command lines (pure functions, no processes)."""

from __future__ import annotations

import shlex
import subprocess

import pytest
from conftest import make_spec

from offload_study.training import launch

SPEC = make_spec("local-cpu", {"gpus_per_node": 2})
GPU_CLUSTER = {"name": "gpus", "accelerator": "cuda", "gpus_per_node": 4, "nodes": 2}
FIXED = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def test_single_node_command_line():
    lch = launch.build_launch(
        SPEC,
        "cfg/run.json",
        "out/rep0.tmp-1",
        cores=8,
        run_id="r1",
        port=29555,
        torchrun=["torchrun"],
    )
    assert lch.argv == shlex.split(
        "torchrun --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29555 "
        "-m offload_study.training.harness --spec cfg/run.json --out out/rep0.tmp-1 --run-id r1"
    )
    assert lch.port == 29555 and lch.rdzv_host == "127.0.0.1"
    assert lch.env["OMP_NUM_THREADS"] == "4"  # 8 granted cores / 2 ranks
    assert lch.env["DS_ACCELERATOR"] == "cpu"
    assert FIXED.items() <= lch.env.items()


def test_single_node_free_port_and_default_torchrun():
    lch = launch.build_launch(SPEC, "s.json", "o", cores=1)
    assert 1024 < lch.port < 65536
    assert lch.argv[1:3] == ["-m", "torch.distributed.run"]
    assert lch.argv[lch.argv.index("--master_port") + 1] == str(lch.port)
    assert lch.env["OMP_NUM_THREADS"] == "1"  # never below 1


def test_cuda_has_no_ds_accelerator():
    spec = make_spec(GPU_CLUSTER, {"gpus_per_node": 2})
    lch = launch.build_launch(spec, "s", "o", cores=16, port=1234)
    assert "DS_ACCELERATOR" not in lch.env
    assert lch.env["OMP_NUM_THREADS"] == "8"
    assert FIXED.items() <= lch.env.items()


def test_multi_node_command_line():
    calls = []

    def fake_scontrol(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="gpu-a01\ngpu-a02\n", stderr="")

    spec = make_spec(GPU_CLUSTER, {"nodes": 2, "gpus_per_node": 4})
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NTASKS": "1"}
    lch = launch.build_launch(
        spec,
        "run.json",
        "out",
        cores=64,
        run_id="r",
        environ=env,
        torchrun=["torchrun"],
        hostname_resolver=lambda nl: launch.first_slurm_host(nl, runner=fake_scontrol),
    )
    assert calls == [["scontrol", "show", "hostnames", "gpu-a[01-02]"]]
    port = launch.slurm_port("4242")
    assert 20000 <= port < 40000 and port == launch.slurm_port(4242)
    wrapper = ["sh", "-c", launch.NODE_OOM_WRAPPER, "node-oom"]
    assert lch.argv[:9] + lch.argv[13:] == shlex.split(
        "srun --nodes 2 --ntasks 2 --ntasks-per-node 1 --overlap --kill-on-bad-exit=1 "
        "torchrun --nnodes 2 "
        f"--nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint gpu-a01:{port} --rdzv-id 4242 "
        "-m offload_study.training.harness --spec run.json --out out --run-id r"
    )
    assert lch.argv[9:13] == wrapper
    assert lch.port == port and lch.rdzv_host == "gpu-a01"
    # the runner's job step variables stay behind, the job's identity goes along
    assert lch.environ({**env, "HOME": "/root"}) == {
        "SLURM_JOB_ID": "4242",
        "HOME": "/root",
        **lch.env,
    }
    assert lch.env["OMP_NUM_THREADS"] == "16"
    assert FIXED.items() <= lch.env.items()


def test_multi_node_outside_slurm_fails():
    with pytest.raises(RuntimeError, match="SLURM"):
        spec = make_spec(GPU_CLUSTER, {"nodes": 2, "gpus_per_node": 1})
        launch.build_launch(spec, "s", "o", cores=4, environ={})


def test_threads_per_rank():
    assert launch.threads_per_rank(16, 2) == 8
    assert launch.threads_per_rank(3, 2) == 1
    assert launch.threads_per_rank(1, 8) == 1


def test_seed_study_launch_lines_on_8_4_2_gpus():
    """The seed's 8/4/2-GPU scenarios as they would start on one 8-GPU host (issue: multi-GPU)."""
    import yaml
    from conftest import REPO as REPO_ROOT

    from offload_study.planning.plan import Plan
    from offload_study.planning.resources import train_resources

    plan = Plan(yaml.safe_load((REPO_ROOT / "config/studies/seed.yaml").read_text()))
    gpus = {
        "zero3-8gpu-40gb": 8,
        "offload-4gpu-40gb": 4,
        "offload-2gpu-80gb": 2,
        "nvme-2gpu-80gb": 2,
    }
    for name, n in gpus.items():
        spec = plan.by_name[name]
        lch = launch.build_launch(spec, "s.json", "o", cores=128, port=29500, torchrun=["torchrun"])
        assert lch.argv[lch.argv.index("--nproc_per_node") + 1] == str(n)
        assert FIXED.items() <= lch.env.items()  # NVLink multicast stays off
        assert lch.env["OMP_NUM_THREADS"] == str(128 // n)
        assert spec.global_batch == 128
        assert spec.micro_batch * spec.gradient_accumulation_steps * n == 128
        slurm_cluster = dict(plan.cluster, scheduler="slurm", slurm={"gres_type": "h200"})
        assert train_resources(spec, slurm_cluster)["gres"] == f"gpu:h200:{n}"
