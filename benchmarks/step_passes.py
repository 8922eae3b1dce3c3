"""The host passes of DeepSpeed ZeRO-3's offloaded step in three layouts of the partition
(why the in-run step was slower than calibrate's rates).

    OMP_NUM_THREADS=$(nproc) python benchmarks/step_passes.py --params 1908523520 \\
        --sub-group 100000000 --out passes.json

For each layout, parameters per second of CPU Adam (DeepSpeedCPUAdam) and of the step's other
host passes (offload_study.prediction.calibrate.step_passes_at: the fp32 gradients' unscale,
the fp32 master's copy into a bf16 partition on the host and, with a GPU, on the GPU):

- ``flat``: one tensor of the whole partition in ordinary memory (calibrate's former layout);
- ``pinned sub-groups``: as DeepSpeed holds it with ``offload_optimizer.pin_memory`` on a GPU,
  pinned tensors of ``sub_group_size`` parameters, each pass called per sub-group (calibrate's
  layout now, from the study's sub_group_size);
- ``sub-groups``: the same in ordinary memory.

With ``--superoffload``, then SuperOffload's host step over the ``pinned sub-groups`` layout
(calibrate.superoffload_step_at: the sub-groups stepped one round trip at a time through
DeepSpeed's own CPU Adam worker, the cores split at DeepSpeed's default share), beside what
plain optimizer offload does on the host over the same layout (CPU Adam and the unscale):

    python benchmarks/step_passes.py --params 16000000 --sub-group 4000000 \
        --superoffload --out passes.json

On a machine of 4 cores or fewer DeepSpeed's split leaves the rank no core of its own
(``int(0.2 x cores)`` is 0): it and the worker share every core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from offload_study.prediction import calibrate  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, required=True, help="the rank's partition")
    p.add_argument(
        "--sub-group", type=int, default=100_000_000, help="zero_optimization.sub_group_size"
    )
    p.add_argument("--superoffload", action="store_true", help="SuperOffload's step too")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"params": a.params, "sub_group": a.sub_group, "threads": threads}
    layouts = {
        "flat": (None, False),
        "pinned sub-groups": (a.sub_group, accelerator == "cuda"),
        "sub-groups": (a.sub_group, False),
    }
    for name, (sub_group, pinned) in layouts.items():
        groups = calibrate.partition_layout(a.params, sub_group, pinned)
        rates = {
            "cpu_adam_params_per_s": calibrate.adam_rate(
                "DeepSpeedCPUAdam", a.params, threads, True, groups
            )
        }
        rates.update(calibrate.step_passes_at(a.params, threads, accelerator, groups=groups))
        del groups
        result[name] = rates
        print(f"{name}:", flush=True)
        for key, rate in rates.items():
            print(f"  {key:28s} {rate['median']:.3e} (spread {rate['spread_pct']} %)", flush=True)
    if a.superoffload:
        result["superoffload"] = superoffload(a, accelerator, result["pinned sub-groups"])
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def superoffload(a, accelerator: str, plain: dict) -> dict:
    """calibrate's SuperOffload probe over the pinned sub-groups, and the seconds of one step of
    the partition it predicts against plain offload's CPU Adam and unscale."""
    os.environ.setdefault("DS_ACCELERATOR", accelerator)
    groups = calibrate.partition_layout(a.params, a.sub_group, accelerator == "cuda")
    probe = calibrate.superoffload_step_at(a.params, accelerator, groups)
    rate, round_trip = probe["superoffload_step_params_per_s"], probe["superoffload_sub_group_s"]
    plain_s = sum(
        a.params / plain[k]["median"]
        for k in ("cpu_adam_params_per_s", "grad_unscale_params_per_s")
    )
    super_s = a.params / rate["median"] + len(groups) * round_trip["median"]
    print(
        f"superoffload: {rate['median']:.3e} params/s beyond round trips of "
        f"{round_trip['median'] * 1e3:.2f} ms; a step {super_s:.4f} s against plain offload's "
        f"CPU Adam and unscale {plain_s:.4f} s: {super_s / plain_s:.2f}x",
        flush=True,
    )
    return {**probe, "step_s": super_s, "plain_step_s": plain_s, "ratio": super_s / plain_s}


if __name__ == "__main__":
    sys.exit(main())
