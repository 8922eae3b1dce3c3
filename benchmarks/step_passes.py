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
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
