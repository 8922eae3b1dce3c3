"""The host's rate of DeepSpeed's fp16 overflow check beside CPU Adam's.

A fp16 run with its optimizer offloaded checks the whole host gradient buffer for inf / nan at
every step (DeepSpeed 0.19.8 stage3.py ``has_overflow``); a bf16 run does not. On one H200 the
half-7B's fp16 offload steps spent 3.2-3.4 s more in the optimizer than its bf16 twin
(docs/results/h200-1gpu/host-h200-half7b-*). This prints, at each size, the check's rate
(offload_study.prediction.calibrate.fp16_check_elems_per_s) and DeepSpeedCPUAdam's with the same
cores, sampled until stable, one JSON line each, and their ratio (offload_study.engines.deepspeed.model.FP16_CHECK_PER_ADAM,
the fallback of a calibration without the check's rate).

    DS_ACCELERATOR=cpu python benchmarks/fp16_check.py --threads 16 --sizes 1e8 1e9 3.5e9
"""

from __future__ import annotations

import argparse
import json
import os

from offload_study.prediction import calibrate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e8], help="elements")
    a = ap.parse_args(argv)
    for n in (int(x) for x in a.sizes):
        check = calibrate.fp16_check_elems_per_s(n, a.threads, until_stable=True)
        adam = calibrate.adam_rate("DeepSpeedCPUAdam", n, a.threads, until_stable=True)
        ratio = check["median"] / adam["median"]
        print(
            json.dumps(
                {
                    "elements": n,
                    "threads": a.threads,
                    "fp16_check": check,
                    "cpu_adam": adam,
                    "check_per_adam": round(ratio, 4),
                }
            )
        )
        print(
            f"{n:.3g} elements, {a.threads} threads: check {check['median']:.3g}/s "
            f"(spread {check['spread_pct']} %), CPU Adam {adam['median']:.3g}/s "
            f"(spread {adam['spread_pct']} %), ratio {ratio:.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
