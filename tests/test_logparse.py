"""Log parsing and outcome classification on strings captured from DeepSpeed 0.19.8 (CPU)."""

from __future__ import annotations

import pytest

from offload_study.core import devices
from offload_study.training import logparse

# lines copied from real runs (rank0.log of the runner tests)
LOG = """\
[Rank 0] time (ms) | fwd_microstep: 47.83 | bwd_microstep: 20.19 | bwd_inner_microstep: 17.02 | bwd_allreduce_microstep: 3.13 | step_microstep: 0.02
[Rank 0] time (ms) | optimizer_step: 1.83
[2026-11-29 10:48:39,768] [INFO] [logging.py:123:log_dist] [Rank 0] step=1, skipped=0, lr=[0.0001], mom=[(0.9, 0.999)]
[Rank 0] time (ms) | fwd: 59.75 | bwd: 30.76 | bwd_inner: 24.38 | bwd_allreduce: 6.30 | step: 3.55
[harness] step 1/4 warmup time 0.096 s tokens/s 2672.8 loss 6.4758 ETA 0:00:00
[Rank 0] time (ms) | swap_in_param: 8.44 | swap_in_gradient: 1.13 | swap_out_gradient: 1.75 | swap_out_param: 2.24 | async_swap_gradient_wait: 1.25
[Rank 0] time (ms) | optimizer_step: 14.12 | optimizer_swap_in_state: 11.07 | optimizer_swap_out_state: 2.26
[Rank 0] time (ms) | fwd: 11.05 | bwd: 15.69 | bwd_inner: 10.75 | bwd_allreduce: 4.90 | step: 5.00
[2026-11-29 10:48:39,846] [INFO] [timer.py:264:stop] epoch=0/micro_step=6/global_step=3, RunningAvgSamplesPerSec=93.99527144377836, CurrSamplesPerSec=93.99306271791735, MemAllocated=0.48GB, MaxMemAllocated=0.48GB
[Rank 0] time (ms) | optimizer_step: 12.0 | optimizer_swap_in_state: 9.0 | optimizer_swap_out_state: 3.0
[Rank 0] time (ms) | fwd: 16.43 | bwd: 18.29 | bwd_inner: 11.21 | bwd_allreduce: 7.03 | step: 6.96
[Rank 1] time (ms) | fwd: 999.0 | bwd: 999.0 | bwd_inner: 1.0 | bwd_allreduce: 1.0 | step: 1.0
"""


def test_timer_lines():
    rows = logparse.parse_timer_lines(LOG)
    assert rows[0]["fwd_microstep"] == 47.83 and rows[1] == {"optimizer_step": 1.83}
    assert len(rows) == 8  # rank 1 excluded
    assert len(logparse.parse_timer_lines(LOG, rank=None)) == 9


def test_breakdown_skips_warmup_and_takes_median():
    bd = logparse.breakdown_ms(LOG, skip_steps=1)
    assert bd["forward"] == pytest.approx((11.05 + 16.43) / 2)
    assert bd["backward"] == pytest.approx((15.69 + 18.29) / 2)
    assert bd["backward_allreduce"] == pytest.approx((4.90 + 7.03) / 2)
    assert bd["step"] == pytest.approx((5.00 + 6.96) / 2)
    # swap timers only appear in the measured steps here; skip_steps=1 drops the first of them
    assert bd["optimizer_swap_in"] == 9.0 and bd["optimizer_swap_out"] == 3.0
    assert set(bd) == {
        "forward",
        "backward",
        "backward_inner",
        "backward_allreduce",
        "step",
        "optimizer_swap_in",
        "optimizer_swap_out",
    }


def test_breakdown_missing_timers_are_none():
    bd = logparse.breakdown_ms("no timers here\n")
    assert all(v is None for v in bd.values())


def test_throughput():
    rows = logparse.parse_throughput(LOG)
    assert rows == [
        {
            "epoch": 0,
            "micro_step": 6,
            "global_step": 3,
            "running_avg": pytest.approx(93.995271),
            "curr": pytest.approx(93.993063),
            "mem_alloc": 0.48,
            "max_mem_alloc": 0.48,
        }
    ]
    assert logparse.last_running_avg_samples_per_s(LOG) == pytest.approx(93.995, 1e-4)
    assert logparse.last_running_avg_samples_per_s("") is None


# failure messages as printed by torch / DeepSpeed / torchrun (first three captured on this box)
CASES = [
    ("config_error", "[rank0]: pydantic_core._pydantic_core.ValidationError: 1 validation error for DeepSpeedZeroConfig"),
    ("config_error", "[rank0]: AssertionError: Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 7 != 2 * 2 * 1"),
    ("config_error", "bogus_knob\n  Extra inputs are not permitted [type=extra_forbidden, input_value=1, input_type=int]"),
    ("config_error", "ValueError: Type fp16 is not supported on your device."),
    ("gpu_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1 GiB is free. 20.00 GiB allowed"),
    ("host_oom", "  exitcode  : -9 (pid: 1234)\n  traceback : Signal 9 (SIGKILL) received by PID 1234"),
    ("op_build_error", "RuntimeError: Error building extension 'async_io'"),
    ("op_build_error", "[WARNING] async_io requires the dev libaio .so object and headers but these were not found."),
    ("dist_error", "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: 29500, useIPv6: False, code: -98, name: EADDRINUSE, message: address already in use"),
    ("dist_error", "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"),
    ("dist_error", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
    ("dist_error", "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
    ("error", "ZeroDivisionError: division by zero"),
]  # fmt: skip


@pytest.mark.parametrize("expected,text", CASES)
def test_classify(expected, text):
    outcome, line = logparse.classify_text("some preamble\n" + text + "\ntrailer")
    assert outcome == expected
    assert (line is None) == (expected == "error")


def test_root_cause_beats_consequence():
    # rank 1 ran out of GPU memory, rank 0 then lost its gloo peer
    text = (
        "[rank0]: RuntimeError: Connection closed by peer\n"
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory.\n"
    )
    assert logparse.classify_text(text)[0] == "gpu_oom"


def test_patterns_are_a_table():
    rows = logparse.OUTCOME_PATTERNS  # (outcome, pattern, remedy or None)
    assert all(isinstance(o, str) and isinstance(p, str) for o, p, _ in rows)
    outcomes = {o for o, _, _ in rows}
    assert outcomes == {"gpu_oom", "host_oom", "op_build_error", "config_error", "dist_error"}


def test_error_excerpt():
    text = "\n".join(f"ok line {i}" for i in range(100))
    text += "\nTraceback (most recent call last):\n  File x\nValueError: boom\n"
    ex = logparse.error_excerpt(text)
    assert ex.startswith("Traceback") and ex.endswith("ValueError: boom")
    assert (
        len(logparse.error_excerpt("\n".join(f"E{i} Error" for i in range(500))).splitlines()) <= 40
    )
    assert logparse.error_excerpt("") is None


def test_devices():
    assert devices.peak_tflops("NVIDIA H200") == 989.0
    assert devices.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert devices.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert devices.peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
    assert devices.peak_tflops("AMD EPYC") is None
    assert devices.peak_tflops("whatever", override=100) == 100.0
    assert devices.flops_per_token(1000) == 6000
    assert devices.flops_per_token(1000, gradient_checkpointing=True) == 8000
    assert devices.flops_per_token(1000, attention=True, layers=2, hidden=64, seq_len=128) == (
        6000 + 12 * 2 * 64 * 128
    )
    tf = devices.tflops_per_device(7e9, 1e4, 8)
    assert tf == pytest.approx(6 * 7e9 * 1e4 / 8 / 1e12)
    assert devices.mfu(tf, 989.0) == pytest.approx(tf / 989.0)
    assert devices.mfu(1.0, None) is None


def test_gpu_mem_cap_from_log():
    text = "noise\n[harness] GPU memory capped to 40.00 GiB of 139.80 GiB\nTraceback ..."
    assert logparse.gpu_mem_cap_gib(text) == 40.0
    assert logparse.gpu_mem_cap_gib("no cap here") is None
